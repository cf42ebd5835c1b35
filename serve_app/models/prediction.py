"""What a classifier answers: the softmax and top label the router's v2 codecs write, and the plain
`Prediction` a model deployment gives any `DeploymentHandle` caller for one input. One module so
the two answers are the same numbers."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Up to this many logits in an answer, its softmax runs on Python floats: numpy's cost per call is
# fixed, and on the one-row answers that most requests get it is most of the work.
SMALL_ANSWER = 64


@dataclass(frozen=True)
class Prediction:
    """One input's answer: its most probable label, and every class's logit and probability in
    the manifest's label order."""

    label: str
    logits: list[float]
    probabilities: list[float]

    @classmethod
    def of(cls, logits: np.ndarray, labels: list[str]) -> Prediction:
        """From one row of (C,) logits, as the router's codecs answer it."""
        row = np.asarray(logits, dtype=np.float32).reshape(1, -1)
        probs, best = softmax_rows(row)
        return cls(labels[best[0]], row[0].tolist(), probs[0].tolist())


def softmax_rows(logits: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """(N, C) float32 logits -> their softmax in float32, and each row's most probable class."""
    table = logits.tolist() if logits.size <= SMALL_ANSWER else None
    # NaN or an infinity (a sum is finite only when every value is) takes numpy's path, which
    # answers them as before.
    if table is not None and all(math.isfinite(sum(row)) for row in table):
        rows, best = [], []
        for row in table:
            top = max(row)
            e = [math.exp(v - top) for v in row]
            total = sum(e)
            rows.append([v / total for v in e])
            best.append(row.index(top))  # exp is monotonic: the top logit is the top probability
        return np.array(rows, dtype=np.float32).reshape(logits.shape), best
    # The softmax in place, in the answer's float32: every temporary saved counts.
    probs = logits - logits.max(axis=1, keepdims=True)
    np.exp(probs, out=probs)
    probs /= probs.sum(axis=1, keepdims=True)
    return probs, probs.argmax(axis=1).tolist()
