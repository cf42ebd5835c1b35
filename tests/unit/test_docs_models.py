"""docs/models.md works as written: its shell commands run, in order, on checkpoints made the way
its reader has them, and the config it shows passes the checks `serve run` makes at start."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from serve_app.exports import load_problem
from serve_app.tools.catalog_build import load_app_args
from tests.guide import blocks, reader_dir, run_block


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The reader's directory (tests/guide.py)."""
    monkeypatch.chdir(reader_dir(tmp_path))
    return tmp_path


def test_the_guide_runs_as_written(workdir: Path):
    (config,) = blocks("yaml")
    (workdir / "my-models.yaml").write_text(config)
    groups = [[line for line in block.splitlines() if line.strip()] for block in blocks("bash")]
    commands = [c for group in groups for c in group]
    assert any(c.startswith("optimum-cli export") for c in commands) and commands[-1] == "serve run my-models.yaml"
    outputs = {}
    # Block after block, as the reader goes; all but `serve run`, which
    # tests/integration/test_guide_serves.py runs on a cluster with room for the guide's resources.
    for group in groups:
        outputs.update(run_block([c for c in group if c != commands[-1]], workdir))
    imported = [c for c in commands if c.startswith("serve-app models import")]
    assert len(imported) == 3 and all("add to your config" in outputs[c] for c in imported)
    # The guide's `deployments:` are what the imports printed, model by model.
    printed = [yaml.safe_load(outputs[c].split("`deployments:` (its replicas' resources):\n", 1)[1]) for c in imported]
    assert yaml.safe_load(config)["applications"][0]["deployments"] == [entry for (entry,) in printed]
    listing = outputs["serve-app models list --config my-models.yaml"].splitlines()
    assert len(listing) == 3 and all(" ready " in row for row in listing), listing
    # What `serve run` checks before it binds each model: every one of the guide's loads.
    (args,) = load_app_args(workdir / "my-models.yaml")
    shown = yaml.safe_load(config)["applications"][0]["args"]["models"]
    assert {name: load_problem(args, name) for name in args.served} == dict.fromkeys(shown)
