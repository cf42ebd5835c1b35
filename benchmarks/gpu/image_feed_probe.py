"""CPU time to build one ResNet-50 sized batch from uint8 payloads: the step-by-step copies the
image replica made before 2dbfc60 against its one-pass `image_feed`. No GPU, no Ray.

    PYTHONPATH=. python benchmarks/gpu/image_feed_probe.py
"""

from __future__ import annotations

import time

import numpy as np

from serve_app.models.classifier import image_feed


def step_by_step(payloads: list[np.ndarray], size: int) -> np.ndarray:
    batch = np.concatenate([p.astype(np.float32) / 255.0 for p in payloads])
    if len(batch) < size:
        padded = np.zeros((size, *batch.shape[1:]), dtype=np.float32)
        padded[: len(batch)] = batch
        batch = padded
    return batch


def ms_per_batch(build, payloads: list[np.ndarray], size: int, reps: int = 30) -> float:
    best = []
    for _ in range(3):
        t = time.process_time()
        for _ in range(reps):
            build(payloads, size)
        best.append((time.process_time() - t) / reps * 1000)
    return min(best)


def main() -> None:
    rng = np.random.default_rng(0)
    print("| rows (one image per request) | feed rows | step by step ms | one pass ms | ratio |")
    print("|---|---|---|---|---|")
    for rows, size in ((64, 64), (40, 64), (16, 16)):
        payloads = [rng.integers(0, 256, (1, 3, 224, 224), dtype=np.uint8) for _ in range(rows)]
        assert np.array_equal(step_by_step(payloads, size), image_feed(payloads, 0, rows, size))
        old = ms_per_batch(step_by_step, payloads, size)
        new = ms_per_batch(lambda p, s: image_feed(p, 0, len(p), s), payloads, size)
        print(f"| {rows} | {size} | {old:.2f} | {new:.2f} | {new / old:.2f}x |")


if __name__ == "__main__":
    main()
