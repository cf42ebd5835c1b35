"""Closed-loop load: N concurrent clients each send one request after another.

Usage: python benchmarks/closed_loop.py --model bert-heavy --concurrency 1 32 --seconds 10
Prints one JSON line per concurrency level (throughput, p50/p99, status counts,
batch sizes the server reported).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter

import httpx
import numpy as np


def body_for(model: str) -> dict:
    if "resnet" in model or model == "image-classify":
        from serve_app.zoo.data import shapes_dataset

        img, _ = shapes_dataset(1, 0)
        return {"inputs": [{"name": "image", "shape": list(img.shape), "datatype": "FP32", "data": img.ravel().tolist()}]}
    return {
        "inputs": [
            {"name": "text", "shape": [1], "datatype": "BYTES", "data": ["the food was not bad but the service was awful"]}
        ]
    }


async def run(url: str, model: str, concurrency: int, seconds: float, warmup: float) -> dict:
    body = body_for(model)
    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    start = time.perf_counter()
    measure_from = start + warmup
    stop_at = measure_from + seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:

        async def worker() -> None:
            while (t0 := time.perf_counter()) < stop_at:
                r = await client.post(f"/v2/models/{model}/infer", json=body)
                t1 = time.perf_counter()
                if t0 >= measure_from:
                    latencies.append(t1 - t0)
                    statuses[r.status_code] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    lat = np.array(latencies) * 1000
    return {
        "model": model,
        "concurrency": concurrency,
        "seconds": seconds,
        "requests": len(lat),
        "throughput_rps": round(len(lat) / seconds, 1),
        "p50_ms": round(float(np.percentile(lat, 50)), 1),
        "p99_ms": round(float(np.percentile(lat, 99)), 1),
        "statuses": dict(statuses),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://localhost:8000")
    p.add_argument("--model", default="bert-heavy")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=2.0)
    ns = p.parse_args()
    for c in ns.concurrency:
        print(json.dumps(asyncio.run(run(ns.url, ns.model, c, ns.seconds, ns.warmup))), flush=True)


if __name__ == "__main__":
    main()
