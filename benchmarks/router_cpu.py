"""The router's own CPU per v2 infer request, in one process, without Ray, HTTP or a model.

    python -m benchmarks.router_cpu [--model bert-heavy] [--requests 20000] [--concurrency 32] [--binary]

The router's app (configs/local.yaml's args as `bench compare` deploys them: no versions, no
cache) is called as Serve's direct ingress calls it (serve_app.router.edge.direct), with bodies from
the model's held-out workload; a stand-in replica answers each batch at once with zeros. What
this measures is the Python work of the request path between the HTTP server and the model
(headers, body parse, admission, queue, batching, answer), in CPU µs per request: the part of
the router's cost that this project's code decides. uvicorn's protocol, the sockets and the
replica are not in it. Use it to compare two versions of that code on one machine, side by
side; `bench compare` says what the whole stack serves.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from benchmarks import workloads
from benchmarks.scenarios import single_versions
from serve_app.config import AppArgs
from serve_app.contract import BatchReply
from serve_app.process.gcwatch import FullCollectionSchedule, freeze_startup_heap
from serve_app.router.edge import direct
from serve_app.router.http import build_http_app
from serve_app.router.parts import build_parts

ROOT = Path(__file__).resolve().parents[1]


def router_args(config: Path, model_dir: Path) -> AppArgs:
    conf = single_versions(yaml.safe_load(config.read_text()))
    args = conf["applications"][0]["args"]
    args["model_dir"] = str(model_dir)
    args.setdefault("scheduling", {})["anonymous_max_priority"] = "high"
    return AppArgs.model_validate(args)


def stand_in_replica(classes: int) -> Any:
    """A replica that answers every batch at once: logits of zeros per payload."""

    async def send(payloads: list[Any], queued: int, lane: str, traces: list[str | None] | None) -> BatchReply:
        await asyncio.sleep(0)
        return BatchReply([np.zeros((len(p), classes), np.float32) for p in payloads], 0.0, 0.0)

    return lambda model: send


def requests_of(model_dir: Path, binary: bool, n: int = 64) -> list[tuple[bytes, list[tuple[bytes, bytes]]]]:
    out = []
    for body in workloads.bodies_for(model_dir, n):
        headers = [(b"content-type", b"application/json"), (b"host", b"127.0.0.1:8000")]
        if binary:
            raw, header_length = workloads.binary_body(body)
            headers += [(b"inference-header-content-length", str(header_length).encode())]
        else:
            raw = json.dumps(body).encode()
        out.append((raw, [*headers, (b"content-length", str(len(raw)).encode())]))
    return out


class Cycle:
    """What serve_app.router.edge.callwatch reads of uvicorn's request cycle: a receive bound to it,
    its message event and whether its client left."""

    def __init__(self, body: bytes) -> None:
        self.body: bytes | None = body
        self.message_event = asyncio.Event()
        self.disconnected = False

    async def receive(self) -> dict[str, Any]:
        if self.body is not None:
            body, self.body = self.body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self.message_event.wait()  # the client stays until answered
        return {"type": "http.disconnect"}


async def drive(
    app: Any, path: str, requests: list[tuple[bytes, list[tuple[bytes, bytes]]]], total: int, concurrency: int
) -> dict[str, Any]:
    statuses: dict[int, int] = {}
    left = total

    async def client() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            body, headers = random.choice(requests)
            cycle = Cycle(body)

            async def send(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    statuses[message["status"]] = statuses.get(message["status"], 0) + 1

            scope = {"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b"",
                     "root_path": "", "scheme": "http", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 1)}  # fmt: skip
            await app(scope, cycle.receive, send)

    started_cpu, started = time.process_time(), time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    cpu, wall = time.process_time() - started_cpu, time.perf_counter() - started
    return {"requests": total, "statuses": statuses, "cpu_us_per_request": round(cpu / total * 1e6, 1),
            "wall_s": round(wall, 2), "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}  # fmt: skip


async def run(ns: argparse.Namespace) -> dict[str, Any]:
    args = router_args(ns.config, ns.model_dir)
    classes = len(json.loads((ns.model_dir / ns.model / "manifest.json").read_text())["labels"])
    parts = build_parts(args, {}, "bench-router", stand_in_replica(classes))

    async def nothing() -> None:
        return None

    app = build_http_app(parts, nothing, nothing)
    # As the router's replica does: its v2 infer calls go straight to the app (serve_app.router.edge.direct).
    direct.APP, direct.APP_LOOP = app, asyncio.get_running_loop()
    entry = direct.DirectInfer(app.through_fastapi)
    requests = requests_of(ns.model_dir / ns.model, ns.binary)
    # The collector as the router's replica runs it (serve_app.router.startup, background.py).
    freeze_startup_heap()
    FullCollectionSchedule.take_over()
    path = f"/v2/models/{ns.model}/infer"
    await drive(entry, path, requests, min(2000, ns.requests), ns.concurrency)  # warm: manifests, estimators
    return await drive(entry, path, requests, ns.requests, ns.concurrency)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.router_cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=ROOT / "configs/local.yaml")
    p.add_argument("--model-dir", type=Path, default=ROOT / "models")
    p.add_argument("--model", default="bert-heavy")
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--binary", action="store_true", help="bodies in the binary tensor extension")
    ns = p.parse_args(argv)
    print(json.dumps(asyncio.run(run(ns))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
