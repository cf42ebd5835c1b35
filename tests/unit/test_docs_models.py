"""docs/models.md works as written: its shell commands run, in order, on checkpoints made the way
its reader has them, and the config it shows passes the checks `serve run` makes at start."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from serve_app.exports import load_problem
from serve_app.tools.catalog_build import load_app_args
from serve_app.zoo import hub

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(), re.S)


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The reader's directory: two Hugging Face checkpoints (save_pretrained) and an image export."""
    hub.hf_text_classifier(tmp_path / "scratch" / "bert", checkpoint=tmp_path / "my-bert")
    hub.hf_gpt2(tmp_path / "scratch" / "gpt2", checkpoint=tmp_path / "my-gpt2")
    hub.torchvision_resnet(tmp_path / "my-resnet", 18, num_classes=10, image_size=64)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_guide_runs_as_written(workdir: Path):
    (config,) = blocks("yaml")
    (workdir / "my-models.yaml").write_text(config)
    groups = [[line for line in block.splitlines() if line.strip()] for block in blocks("bash")]
    commands = [c for group in groups for c in group]
    assert any(c.startswith("optimum-cli export") for c in commands) and commands[-1] == "serve run my-models.yaml"
    outputs = {}
    # Block after block, as the reader goes; the lines of one block (two exports, three imports)
    # depend on no other line of it, so they run side by side.
    for group in groups:
        running = {
            c: subprocess.Popen(shlex.split(c), cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for c in group
            if c != commands[-1]  # all but `serve run`, which the integration tests do with these exports
        }
        for command, proc in running.items():
            stdout, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, f"{command}\n{stdout}\n{stderr[-3000:]}"
            outputs[command] = stdout
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
