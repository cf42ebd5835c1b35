"""benchmarks.router_cpu: the router's Python per request, in one process, answers every request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from benchmarks import router_cpu
from tests.conftest import tiny_args

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("binary", [False, True])
def test_every_request_is_answered_and_its_cost_reported(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], binary: bool
) -> None:
    # The shipped config with the tiny catalog's args: its routes carry thresholds, as the tiny
    # models are never calibrated.
    conf = yaml.safe_load((ROOT / "configs/local.yaml").read_text())
    conf["applications"][0]["args"] = tiny_args(tiny_model_dir)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(conf))
    argv = ["--config", str(config), "--model-dir", str(tiny_model_dir), "--requests", "60", "--concurrency", "4"]
    assert router_cpu.main([*argv, "--binary"] if binary else argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["statuses"] == {"200": 60}
    assert out["cpu_us_per_request"] > 0
