"""`serve-app calibrate`: fit each route's escalation threshold on held-out data.

Fitted on the validation split (VAL_SEED), reported on the test split
(TEST_SEED): neither was seen in training. The result goes into the light
model's manifest, keyed by the heavy model, with the heavy model's
fingerprint so that rebuilding either tier asks for a new calibration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from serve_app.config import AppArgs
from serve_app.manifest import Manifest
from serve_app.tools.calibrate import calibrate_threshold, score
from serve_app.zoo.data import TEST_SEED, VAL_SEED
from serve_app.zoo.evaluate import classifier_logits


def _heavy_id(args: AppArgs, heavy: str) -> str:
    m = Manifest.load(args.model_path(heavy))
    return str(m.source.get("fingerprint") or m.version)


def calibrate_route(args: AppArgs, name: str, max_drop: float = 0.005, n: int = 2000) -> dict[str, Any]:
    route = args.routes[name]
    light_dir, heavy_dir = args.model_path(route.light), args.model_path(route.heavy)
    # Each tier as it is served: a quantized tier's confidences are what the threshold must fit.
    lp, hp = _precision(args, route.light), _precision(args, route.heavy)
    light, labels = classifier_logits(light_dir, n, VAL_SEED, precision=lp)
    heavy, _ = classifier_logits(heavy_dir, n, VAL_SEED, precision=hp)
    cal = calibrate_threshold(light, heavy, labels, max_drop)
    light_t, labels_t = classifier_logits(light_dir, n, TEST_SEED, precision=lp)
    heavy_t, _ = classifier_logits(heavy_dir, n, TEST_SEED, precision=hp)
    test = score(light_t, heavy_t, labels_t, cal.signal, cal.threshold)
    record = {
        "route": name,
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
    """Calibrate every route that takes its threshold from calibration and has none for its current tiers."""
    done = []
    for name in args.routes:
        if needs_calibration(args, name):
            record = calibrate_route(args, name)
            log(describe(record))
            done.append(record)
    return done


def describe(r: dict[str, Any]) -> str:
    v, t = r["validation"], r["test"]
    return (
        f"{r['route']}: escalate when {r['signal']} < {r['threshold']:.4f} (target: at most {r['max_drop'] * 100:.1f} pp "
        f"below heavy-only). Test split (n={t['n']}): light answers {t['light_share']:.1%}; accuracy cascade "
        f"{t['cascade_acc']:.2%}, heavy-only {t['heavy_acc']:.2%}, light-only {t['light_acc']:.2%} "
        f"(validation: cascade {v['cascade_acc']:.2%}, heavy {v['heavy_acc']:.2%})"
    )
