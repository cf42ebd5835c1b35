"""`serve-app calibrate`: fit each route's escalation threshold on held-out data.

Whose data: a route whose tiers are both demo presets is calibrated on the demo's generated data,
never seen in training (fitted on the validation split, VAL_SEED; reported on the test split,
TEST_SEED). Any other route only on data its user names (`--data`, labelled inputs of its task:
the first half fits, the second reports): the demo's data says nothing about a user's model, so
such a route is never calibrated behind its user's back. The result goes into the light model's
manifest, keyed by the heavy model, with the heavy model's fingerprint and the data it was fitted
on, so that rebuilding either tier asks for a new calibration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from serve_app.config import AppArgs
from serve_app.manifest import Manifest
from serve_app.tools.calibrate import calibrate_threshold, score
from serve_app.zoo.data import TEST_SEED, VAL_SEED
from serve_app.zoo.evaluate import classifier_logits, labelled_logits


def _heavy_id(args: AppArgs, heavy: str) -> str:
    m = Manifest.load(args.model_path(heavy))
    return str(m.source.get("fingerprint") or m.version)


DEMO_DATA = "the demo's generated data"


def on_demo_presets(args: AppArgs, name: str) -> bool:
    """Whether both tiers of the route are demo presets, whose generated data calibrates them."""
    route = args.routes[name]
    return all(args.served[tier].config.preset is not None for tier in (route.light, route.heavy))


def calibrate_route(args: AppArgs, name: str, max_drop: float = 0.005, n: int = 2000, data: Path | None = None) -> dict[str, Any]:
    """Fit the route's threshold on `data` (an .npz of `inputs` and `labels`), or on the demo's
    generated data where both tiers are demo presets; ValueError for any other route without data."""
    route = args.routes[name]
    light_dir, heavy_dir = args.model_path(route.light), args.model_path(route.heavy)
    # Each tier as it is served: a quantized tier's confidences are what the threshold must fit.
    lp, hp = _precision(args, route.light), _precision(args, route.heavy)
    if data is not None:
        light_all, labels_all = labelled_logits(light_dir, data, lp)
        heavy_all, _ = labelled_logits(heavy_dir, data, hp)
        half = len(labels_all) // 2
        light, heavy, labels = light_all[:half], heavy_all[:half], labels_all[:half]
        light_t, heavy_t, labels_t = light_all[half:], heavy_all[half:], labels_all[half:]
    elif on_demo_presets(args, name):
        light, labels = classifier_logits(light_dir, n, VAL_SEED, precision=lp)
        heavy, _ = classifier_logits(heavy_dir, n, VAL_SEED, precision=hp)
        light_t, labels_t = classifier_logits(light_dir, n, TEST_SEED, precision=lp)
        heavy_t, _ = classifier_logits(heavy_dir, n, TEST_SEED, precision=hp)
    else:
        raise ValueError(f"route {name!r}: its tiers are not demo presets; calibrate it on your data (--data) or set `threshold`")
    cal = calibrate_threshold(light, heavy, labels, max_drop)
    test = score(light_t, heavy_t, labels_t, cal.signal, cal.threshold)
    record = {
        "route": name,
        "data": str(data) if data is not None else DEMO_DATA,
        "signal": cal.signal,
        "threshold": cal.threshold,
        "max_drop": max_drop,
        "heavy_fingerprint": _heavy_id(args, route.heavy),
        "precisions": {"light": lp, "heavy": hp},
        "light_share_by_signal": cal.candidates,
        "validation": asdict(cal.calibration),
        "test": asdict(test),
    }
    manifest = Manifest.load(light_dir)
    manifest.calibrations[route.heavy] = record
    manifest.save(light_dir)
    return record


def needs_calibration(args: AppArgs, name: str) -> bool:
    route = args.routes[name]
    if route.threshold is not None:
        return False  # pinned by hand
    fitted = Manifest.load(args.model_path(route.light)).calibrations.get(route.heavy)
    if fitted is None or fitted.get("heavy_fingerprint") != _heavy_id(args, route.heavy):
        return True
    served = {"light": _precision(args, route.light), "heavy": _precision(args, route.heavy)}
    return bool(fitted.get("precisions", {"light": "fp32", "heavy": "fp32"}) != served)


def _precision(args: AppArgs, deployment: str) -> str:
    return args.served[deployment].config.precision


def calibrate_missing(args: AppArgs, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Calibrate every route of demo presets that takes its threshold from calibration and has none
    for its current tiers; say which other routes wait for their user's data."""
    done = []
    for name in args.routes:
        if needs_calibration(args, name):
            if not on_demo_presets(args, name):
                log(f"{name}: not calibrated (its tiers are your models): `serve-app calibrate --route {name} --data FILE`, "
                    "or set the route's `threshold`")  # fmt: skip
                continue
            record = calibrate_route(args, name)
            log(describe(record))
            done.append(record)
    return done


def describe(r: dict[str, Any]) -> str:
    v, t = r["validation"], r["test"]
    return (
        f"{r['route']} (on {r.get('data', DEMO_DATA)}): escalate when {r['signal']} < {r['threshold']:.4f} "
        f"(target: at most {r['max_drop'] * 100:.1f} pp "
        f"below heavy-only). Test split (n={t['n']}): light answers {t['light_share']:.1%}; accuracy cascade "
        f"{t['cascade_acc']:.2%}, heavy-only {t['heavy_acc']:.2%}, light-only {t['light_acc']:.2%} "
        f"(validation: cascade {v['cascade_acc']:.2%}, heavy {v['heavy_acc']:.2%})"
    )
