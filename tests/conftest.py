"""Shared fixtures: the tiny catalog, built once per session into a temp dir."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from serve_app.presets import get_preset
from serve_app.zoo.build import build_model
from tests.exports import Exports, build_exports

# The default catalog's names, built from the tiny presets: same code paths, seconds to build.
TINY_CATALOG = {
    "bert-light": "bert-tiny",
    "bert-heavy": "bert-tiny",
    # The shipped configs serve bert-heavy in two versions, each its own deployment and model folder.
    "bert-heavy-v2": "bert-tiny",
    "resnet-light": "resnet-tiny",
    "resnet-heavy": "resnet-tiny",
    "gpt": "gpt-tiny",
}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    built: dict[str, Path] = {}
    for name, preset in TINY_CATALOG.items():
        if preset in built:  # same preset: copy instead of training again
            import shutil

            shutil.copytree(built[preset], root / name)
            continue
        build_model(name, get_preset(preset), root / name)
        built[preset] = root / name
    return root


@pytest.fixture(scope="session")
def exports(tmp_path_factory: pytest.TempPathFactory) -> Exports:
    """Ordinary exports (optimum's BERT, GPT-2 and Llama; a torchvision ResNet), tiny."""
    return build_exports(tmp_path_factory.mktemp("exports"))


def tiny_args(model_dir: Path, **batching: Any) -> dict[str, Any]:
    b = {"max_batch_size": 8, "batch_wait_timeout_s": 0.02, **batching}
    return {
        "model_dir": str(model_dir),
        "models": {
            "bert-light": {"preset": "bert-tiny", "batching": b},
            # Two threads: its bulk lane runs two single-threaded sessions side by side.
            "bert-heavy": {"preset": "bert-tiny", "batching": b, "intra_op_threads": 2},
            "resnet-light": {"preset": "resnet-tiny", "batching": b},
            # Two single-threaded sessions side by side, and an urgent lane without a session of its
            # own: its batches run next on those two (as configs/local.yaml).
            "resnet-heavy": {
                "preset": "resnet-tiny",
                "batching": b,
                "urgent_session": False,
                "intra_op_threads": 2,
                "bulk_sessions": 2,
            },
            "gpt": {
                "preset": "gpt-tiny",
                "batching": {"max_batch_size": 4, "batch_wait_timeout_s": 0.02},
                "generation": {"default_max_tokens": 8, "max_tokens_limit": 32},
            },
        },
        "routes": {
            # Thresholds that make the tiny (near-chance) light models escalate some items.
            "text-classify": {"light": "bert-light", "heavy": "bert-heavy", "threshold": 0.55},
            "image-classify": {"light": "resnet-light", "heavy": "resnet-heavy", "threshold": 0.3},
        },
    }


_exit_status: int | None = None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Exit with pytest's own status once everything is reported. A Ray client left in this
    process (a driver connection to a cluster that a later `ray stop` removed) otherwise
    kills the interpreter at exit, 60 s on, with "Failed to connect to GCS": CI saw
    "233 passed" and then rc=1."""
    if _exit_status is not None and "ray" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status)
