"""The gRPC load client, run as its own process: closed loop with Triton's own asyncio gRPC client
(`tritonclient.grpc.aio`), as a user's client would send the requests. The tensors are the ones a
`benchmarks.workloads` file holds for HTTP, so the two wires carry the same inputs.

It reports what `benchmarks.loadgen` reports for a closed loop: requests, goodput, latency
percentiles, statuses (gRPC code names), and its own CPU cost.

Usage: python -m benchmarks.grpcload --target 127.0.0.1:9000 --workload W.json \
           --concurrency 32 --seconds 10 --warmup 3 --out result.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc.aio as aio
from tritonclient.grpc import InferInput
from tritonclient.utils import InferenceServerException

from serve_app.protocols.v2 import NUMPY_DTYPES


def _inputs(body: dict[str, Any]) -> list[InferInput]:
    out = []
    for t in body["inputs"]:
        tensor = InferInput(t["name"], t["shape"], t["datatype"])
        if t["datatype"] == "BYTES":
            data = np.array([str(v).encode() for v in t["data"]], dtype=np.object_).reshape(t["shape"])
        else:
            data = np.asarray(t["data"], dtype=NUMPY_DTYPES[t["datatype"]]).reshape(t["shape"])
        tensor.set_data_from_numpy(data)
        out.append(tensor)
    return out


def load_requests(workload: Path) -> list[tuple[str, list[InferInput]]]:
    """(model, inputs) for every JSON body of the workload's streams, cycled by the clients."""
    spec = json.loads(workload.read_text())
    requests = []
    for stream in spec["streams"]:
        model = stream["path"].split("/v2/models/", 1)[1].split("/", 1)[0]
        for body in stream["bodies"]:
            if not isinstance(body, str):
                raise ValueError("the gRPC client takes a JSON workload (tensors in `data`), not a binary one")
            requests.append((model, _inputs(json.loads(body))))
    return requests


async def run(
    target: str, requests: list[tuple[str, list[InferInput]]], concurrency: int, seconds: float, warmup: float
) -> dict[str, Any]:
    client = aio.InferenceServerClient(target)
    start = time.perf_counter()
    measure_from, stop_at = start + warmup, start + warmup + seconds
    latencies: list[float] = []
    statuses: Counter[str] = Counter()
    cursor = 0

    async def one_client() -> None:
        nonlocal cursor
        while (now := time.perf_counter()) < stop_at:
            model, inputs = requests[cursor % len(requests)]
            cursor += 1
            try:
                await client.infer(model, inputs, client_timeout=30)
                status = "OK"
            except InferenceServerException as e:
                status = (e.status() or "UNKNOWN").removeprefix("StatusCode.")
            done = time.perf_counter()
            if now >= measure_from and done <= stop_at:
                statuses[status] += 1
                if status == "OK":
                    latencies.append(done - now)

    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    await client.close()
    wall = time.perf_counter() - start
    cpu_s = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    answered = sum(statuses.values())
    lat_ms = np.asarray(latencies) * 1000 if latencies else np.zeros(1)
    return {
        "requests": answered,
        "goodput_rps": round(statuses["OK"] / seconds, 2),
        "p50_ms": round(float(np.percentile(lat_ms, 50)), 2),
        "p99_ms": round(float(np.percentile(lat_ms, 99)), 2),
        "statuses": dict(statuses),
        "loadgen_cpu": {"core_share": round(cpu_s / wall, 3), "cpu_us_per_request": round(cpu_s / max(1, cursor) * 1e6, 1)},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.grpcload", description=__doc__)
    p.add_argument("--target", default="127.0.0.1:9000")
    p.add_argument("--workload", required=True, type=Path)
    p.add_argument("--concurrency", type=int, required=True)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--out", type=Path)
    ns = p.parse_args(argv)
    result = asyncio.run(run(ns.target, load_requests(ns.workload), ns.concurrency, ns.seconds, ns.warmup))
    text = json.dumps(result)
    if ns.out:
        ns.out.write_text(text)
    else:
        sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
