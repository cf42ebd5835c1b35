"""Calibrating a route's escalation threshold on held-out data.

Given the light and heavy models' logits on the same labelled items, find for
each confidence signal the threshold that lets the light model answer the
most items while the cascade stays within `max_drop` of heavy-only accuracy,
then keep the signal that sends the fewest items to the heavy model. Pure
numpy: the CLI feeds it ONNX Runtime outputs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from serve_app.router.routing.cascade import SIGNALS, Signal, confidence


@dataclass(frozen=True)
class CascadeScore:
    """How a (signal, threshold) pair does on one labelled set."""

    light_share: float  # items the light model answers alone
    light_acc: float
    heavy_acc: float
    cascade_acc: float
    n: int


@dataclass(frozen=True)
class Calibration:
    signal: Signal
    threshold: float
    max_drop: float
    calibration: CascadeScore  # on the data it was fitted on
    candidates: dict[str, float]  # light share each signal reached within the target

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def score(light: np.ndarray, heavy: np.ndarray, labels: np.ndarray, signal: Signal, threshold: float) -> CascadeScore:
    light_ok = light.argmax(axis=1) == labels
    heavy_ok = heavy.argmax(axis=1) == labels
    by_light = confidence(light, signal) >= threshold
    cascade_ok = np.where(by_light, light_ok, heavy_ok)
    return CascadeScore(
        float(by_light.mean()), float(light_ok.mean()), float(heavy_ok.mean()), float(cascade_ok.mean()), len(labels)
    )


def _best_threshold(conf: np.ndarray, light_ok: np.ndarray, heavy_ok: np.ndarray, floor: float) -> tuple[float, float]:
    """(threshold, light share): the largest light share whose cascade accuracy >= floor."""
    n = len(conf)
    order = np.argsort(-conf, kind="stable")
    c, lo, ho = conf[order], light_ok[order], heavy_ok[order]
    # The light model answers the k most confident items: accuracy for every k at once.
    correct = np.concatenate([[0], np.cumsum(lo)]) + (ho.sum() - np.concatenate([[0], np.cumsum(ho)]))
    best_k = 0
    for k in range(n, 0, -1):
        # Only cut between distinct confidences: a threshold cannot split a tie.
        if (k == n or c[k - 1] > c[k]) and correct[k] / n >= floor:
            best_k = k
            break
    if best_k == 0:
        return float(np.nextafter(c[0], np.inf)), 0.0  # nobody is sure enough: everything escalates
    return float(c[best_k - 1]), best_k / n


def calibrate_threshold(light: np.ndarray, heavy: np.ndarray, labels: np.ndarray, max_drop: float = 0.005) -> Calibration:
    """light, heavy: (N, C) logits on the same items; labels: (N,). max_drop: accuracy points (0.005 = 0.5 pp)."""
    if not (len(light) == len(heavy) == len(labels) > 0):
        raise ValueError("light, heavy and labels must describe the same, non-empty set of items")
    light_ok = light.argmax(axis=1) == labels
    heavy_ok = heavy.argmax(axis=1) == labels
    floor = heavy_ok.mean() - max_drop
    found = {sig: _best_threshold(confidence(light, sig), light_ok, heavy_ok, floor) for sig in SIGNALS}
    signal = max(SIGNALS, key=lambda sig: (found[sig][1], -SIGNALS.index(sig)))
    threshold = found[signal][0]
    return Calibration(
        signal,
        threshold,
        max_drop,
        score(light, heavy, labels, signal, threshold),
        {sig: share for sig, (_, share) in found.items()},
    )
