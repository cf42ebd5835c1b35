"""Build what a config's catalog names and is missing (idempotent)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from serve_app.config import AppArgs

BUILDER_IMPORT_PATH = "serve_app.app:build_app"


def load_app_args(config_path: str | Path) -> list[AppArgs]:
    """The args of every application in a Serve config file that this package builds."""
    doc: dict[str, Any] = yaml.safe_load(Path(config_path).read_text())
    apps = [a for a in doc.get("applications", []) if a.get("import_path") == BUILDER_IMPORT_PATH]
    if not apps:
        raise ValueError(f"{config_path} has no application with import_path {BUILDER_IMPORT_PATH}")
    return [AppArgs.model_validate(a.get("args") or {}) for a in apps]


@dataclass(frozen=True)
class BuildPlan:
    name: str
    preset: str
    path: Path
    built: bool


def plan(args: AppArgs) -> list[BuildPlan]:
    from serve_app.presets import get_preset
    from serve_app.zoo.build import is_built

    out = []
    for name, served in args.served.items():  # each version of each model
        model = served.config
        if model.preset is None:
            continue  # a user's own model directory: nothing to build
        path = args.model_path(name)
        out.append(BuildPlan(name, model.preset, path, is_built(path, get_preset(model.preset))))
    return out


def build_missing(args: AppArgs, force: bool = False, log: Callable[[str], None] = print) -> list[str]:
    """Build every preset model that is missing or stale; returns the names built."""
    from tqdm import tqdm

    from serve_app.presets import get_preset
    from serve_app.zoo.build import build_model

    todo = [p for p in plan(args) if force or not p.built]
    for p in plan(args):
        if p not in todo:
            log(f"{p.name}: up to date at {p.path}")
    built = []
    for p in todo:
        preset = get_preset(p.preset)
        with tqdm(total=preset.train.steps, desc=f"{p.name} ({p.preset})", unit="step", leave=True) as bar:
            manifest = build_model(p.name, preset, p.path, progress=bar.update)
        src = manifest.source
        log(
            f"{p.name}: built in {src.get('build_seconds')}s -> {p.path} "
            f"(accuracy {src.get('accuracy')}, val_loss {src.get('val_loss')}, parity {src.get('parity_max_abs_diff'):.1e})"
        )
        built.append(p.name)
    return built
