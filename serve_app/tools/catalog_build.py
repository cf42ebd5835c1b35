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
    built: bool  # the FP32 model is up to date
    precision: str = "fp32"
    variant_built: bool = True  # the graph of `precision` is there (always, for fp32)


def plan(args: AppArgs) -> list[BuildPlan]:
    from serve_app.presets import get_preset
    from serve_app.zoo.build import is_built

    out = []
    for name, served in args.served.items():  # each version of each model
        model = served.config
        if model.preset is None:
            continue  # a user's own model directory: nothing to build
        path = args.model_path(name)
        built = is_built(path, get_preset(model.preset))
        variant = model.precision == "fp32" or (built and _has_variant(path, model.precision))
        out.append(BuildPlan(name, model.preset, path, built, model.precision, variant))
    return out


def _has_variant(path: Path, precision: str) -> bool:
    from serve_app.manifest import Manifest

    try:
        return (path / Manifest.load(path).onnx_file_for(precision)).is_file()
    except FileNotFoundError:
        return False


def build_missing(args: AppArgs, force: bool = False, log: Callable[[str], None] = print) -> list[str]:
    """Build every preset model that is missing or stale; returns the names built."""
    from tqdm import tqdm

    from serve_app.presets import get_preset
    from serve_app.zoo.build import build_model
    from serve_app.zoo.quantize import build_variant

    todo = [p for p in plan(args) if force or not p.built]
    for p in plan(args):
        if p not in todo and p.variant_built:
            log(f"{p.name}: up to date at {p.path}")
    built = []
    for p in plan(args):
        if p not in todo and not p.variant_built:  # the FP32 model is there: only its variant is missing
            log(_describe_variant(p.name, p.precision, build_variant(p.path, p.precision)))  # type: ignore[arg-type]
            built.append(p.name)
    for p in todo:
        preset = get_preset(p.preset)
        with tqdm(total=preset.train.steps, desc=f"{p.name} ({p.preset})", unit="step", leave=True) as bar:
            manifest = build_model(p.name, preset, p.path, progress=bar.update)
        src = manifest.source
        parity = src.get("parity_max_abs_diff")
        checked = f"parity {parity:.1e}" if parity is not None else f"exported by {src.get('exported_by', 'its tool')}"
        log(
            f"{p.name}: built in {src.get('build_seconds')}s -> {p.path} "
            f"(accuracy {src.get('accuracy')}, val_loss {src.get('val_loss')}, {checked})"
        )
        if p.precision != "fp32":
            log(_describe_variant(p.name, p.precision, build_variant(p.path, p.precision)))  # type: ignore[arg-type]
        built.append(p.name)
    return built


def _describe_variant(name: str, precision: str, report: dict[str, Any]) -> str:
    size = report["size_bytes"] / report["fp32_size_bytes"]
    acc = report.get("accuracy")
    fp32 = report.get("fp32_accuracy")
    accuracy = f", test accuracy {acc['test']:.4f} (FP32 {fp32['test']:.4f})" if acc and fp32 else ""
    return (
        f"{name}: {precision} variant ({report['method']}): {size:.2f}x the FP32 size{accuracy}, "
        f"labels agree {report['label_agreement']['test']:.4f}, max logit diff {report['max_abs_logit_diff']:.2e}"
    )
