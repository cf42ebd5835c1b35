"""A PNG request's decode while the router has a text request in flight, on a machine with cores
to spare: how long the router's decoder processes wait for its urgent work
(serve_app.protocols.decoders, cpu_priority.MODEL_WORK) where nothing needs the cores they take.

Real decoder processes and the router's own flag, without Ray: each request's images are decoded
once with nothing in flight and once with MODEL_WORK held throughout, as a text request on a GPU
replica (or a replica on another node) holds it while this machine's cores are idle.

    python -m benchmarks.decoder_wait [--requests 6] [--images 4] [--px 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from contextlib import nullcontext
from typing import Any

from benchmarks.images import png_images
from serve_app.cpu_priority import LOADAVG, MODEL_WORK, runnable_tasks, usable_cores
from serve_app.protocols.decoders import DecoderPool


async def measure(requests: int, images: int, px: int, size: int) -> dict[str, Any]:
    pngs = png_images(images, px)
    pool = DecoderPool(workers=1)
    try:
        await pool.decode(pngs, size)  # the worker process starts: not timed
        out: dict[str, Any] = {}
        for name, hold in (("nothing_in_flight", nullcontext()), ("text_in_flight", MODEL_WORK.held())):
            times, runnable = [], []
            with hold:
                for _ in range(requests):
                    runnable.append(_runnable())  # how busy the machine was: the result depends on it
                    started = time.perf_counter()
                    await pool.decode(pngs, size)
                    times.append(round((time.perf_counter() - started) * 1e3, 1))
            out[name] = {"ms": times, "mean_ms": round(sum(times) / len(times), 1), "runnable_tasks_before": runnable}
        out["ratio"] = round(out["text_in_flight"]["mean_ms"] / out["nothing_in_flight"]["mean_ms"], 2)
        return out
    finally:
        pool.shutdown()


def _runnable() -> int | None:
    try:
        with open(LOADAVG, "rb") as f:
            return runnable_tasks(f.read())
    except (OSError, ValueError, IndexError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=6, help="requests per phase")
    parser.add_argument("--images", type=int, default=4, help="PNGs per request")
    parser.add_argument("--px", type=int, default=1024, help="each PNG's width and height")
    parser.add_argument("--size", type=int, default=224, help="the model input's side the images are resized to")
    ns = parser.parse_args()
    result = asyncio.run(measure(ns.requests, ns.images, ns.px, ns.size))
    print(json.dumps({"cores": os.cpu_count(), "usable_cores": usable_cores(), "settings": vars(ns), **result}))


if __name__ == "__main__":
    main()
