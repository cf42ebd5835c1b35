"""Tiered routing policy: which items the light model may answer on its own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

Signal = Literal["max_prob", "margin", "entropy"]
SIGNALS: tuple[Signal, ...] = ("max_prob", "margin", "entropy")


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def confidence(logits: np.ndarray, signal: Signal) -> np.ndarray:
    """Per-row confidence in [0, 1] from (N, C) logits; higher = surer."""
    p = softmax(logits.astype(np.float64))
    if signal == "max_prob":
        return p.max(axis=-1)
    if signal == "entropy":  # 1 - normalised entropy: 1 for one-hot, 0 for uniform
        h = -(p * np.log(np.clip(p, 1e-12, 1.0))).sum(axis=-1)
        return 1.0 - h / np.log(p.shape[-1])
    top2 = np.sort(p, axis=-1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


@dataclass(frozen=True)
class CascadePolicy:
    threshold: float
    signal: Signal = "max_prob"

    def escalate(self, light_logits: np.ndarray) -> np.ndarray:
        """Boolean mask of rows the heavy model must answer."""
        return confidence(light_logits, self.signal) < self.threshold
