"""docs/models.md as its reader meets it: the guide's blocks, and a directory with what the reader
has before the first command (two Hugging Face checkpoints saved with `save_pretrained`, and an
image export made with `torch.onnx.export`)."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

from serve_app.zoo import hub

DOC = Path(__file__).resolve().parents[1] / "docs" / "models.md"


def blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(), re.S)


def reader_dir(root: Path) -> Path:
    """`root` holding the reader's checkpoints and image export."""
    hub.hf_text_classifier(root / "scratch" / "bert", checkpoint=root / "my-bert")
    hub.hf_gpt2(root / "scratch" / "gpt2", checkpoint=root / "my-gpt2")
    hub.torchvision_resnet(root / "my-resnet", 18, num_classes=10, image_size=64)
    return root


def run_block(lines: list[str], cwd: Path, timeout_s: float = 300) -> dict[str, str]:
    """The lines of one block run side by side (none depends on another of its block); each one's
    stdout. A line that fails fails the caller with its output."""
    running = {
        c: subprocess.Popen(shlex.split(c), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in lines
    }
    outputs = {}
    for command, proc in running.items():
        stdout, stderr = proc.communicate(timeout=timeout_s)
        assert proc.returncode == 0, f"{command}\n{stdout}\n{stderr[-3000:]}"
        outputs[command] = stdout
    return outputs
