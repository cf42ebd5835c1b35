"""*limit*: ONNX Runtime in-process, no server, inputs decoded in advance.

What the hardware gives this model: for each batch size, back-to-back
`session.run` calls on held-out items for a fixed time; the best items/s is the
ceiling every served setup is compared with.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.baselines.runner import ModelRunner


def measure_limit(
    model_dir: str | Path,
    bodies: list[dict[str, Any]],
    batch_sizes: list[int],
    seconds: float,
    threads: int,
    gpu_ids: list[str] | None = None,
) -> dict[str, Any]:
    runner = ModelRunner(model_dir, threads=threads, gpu_ids=gpu_ids)
    items = [item for body in bodies for item in runner.decode(body)]
    runner.run(items[:1])  # lazy init out of the figures
    points = []
    for bs in batch_sizes:
        batches = [[items[(i * bs + j) % len(items)] for j in range(bs)] for i in range(max(1, len(items) // bs))]
        latencies: list[float] = []
        start = time.perf_counter()
        n = 0
        while time.perf_counter() - start < seconds:
            t0 = time.perf_counter()
            runner.run(batches[n % len(batches)])
            latencies.append((time.perf_counter() - t0) * 1000)
            n += 1
        elapsed = time.perf_counter() - start
        p50, p90, p99 = np.percentile(latencies, [50, 90, 99])
        points.append(
            {
                "batch_size": bs,
                "items_per_s": round(n * bs / elapsed, 1),
                "p50_ms": round(float(p50), 2),
                "p90_ms": round(float(p90), 2),
                "p99_ms": round(float(p99), 2),
            }
        )
    best = max(points, key=lambda p: p["items_per_s"])
    return {"threads": threads, "providers": runner.providers, "points": points, "best": best}
