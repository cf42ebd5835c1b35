"""benchmarks.router_cpu: the router's Python per request, in one process, answers every request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import router_cpu


@pytest.mark.parametrize("binary", [False, True])
def test_every_request_is_answered_and_its_cost_reported(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], binary: bool
) -> None:
    argv = ["--model-dir", str(tiny_model_dir), "--requests", "60", "--concurrency", "4"]
    assert router_cpu.main([*argv, "--binary"] if binary else argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["statuses"] == {"200": 60}
    assert out["cpu_us_per_request"] > 0
