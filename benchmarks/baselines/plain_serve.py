"""Plain Ray Serve, as its documentation's batching example does it: the model
deployment is its own HTTP ingress, `@serve.batch` gathers requests, no router.
It reads v2 JSON bodies and the binary tensor extension's, and answers in JSON.

Deployed with `serve run`/`serve deploy` from a config whose import_path is
`benchmarks.baselines.plain_serve:build` and whose args name the model.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

import numpy as np
import ray
from ray import serve
from starlette.requests import Request

from benchmarks.baselines.runner import ModelRunner
from serve_app.models.runtime import intra_op_threads


@serve.deployment
class PlainModel:
    def __init__(
        self, name: str, model_dir: str, max_batch_size: int, batch_wait_timeout_s: float, threads: int | None = None
    ) -> None:
        # The same thread rule as ours, so the two differ only in what wraps the model.
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
        self.name = name
        self.runner = ModelRunner(
            model_dir, threads=threads or intra_op_threads(cpus), gpu_ids=[str(g) for g in ray.get_gpu_ids()]
        )
        # @serve.batch adds these setters to the method; Ray's typing does not show them.
        batched = cast(Any, self.infer_batch)
        batched.set_max_batch_size(max_batch_size)
        batched.set_batch_wait_timeout_s(batch_wait_timeout_s)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005)
    async def infer_batch(self, requests: list[list[Any]]) -> list[np.ndarray]:
        items = [item for r in requests for item in r]
        logits = await asyncio.to_thread(self.runner.run, items)
        bounds = np.cumsum([len(r) for r in requests])[:-1]
        return list(np.split(logits, bounds))

    async def __call__(self, request: Request) -> dict[str, Any]:
        body = await request.body()
        header_length = request.headers.get("inference-header-content-length")
        if header_length is not None:  # the binary tensor extension; the answer stays JSON
            items = self.runner.decode_binary(body, int(header_length))
        else:
            items = self.runner.decode(json.loads(body))
        return self.runner.respond(self.name, await self.infer_batch(items))


def build(args: dict[str, Any]) -> Any:
    batch = int(args.get("max_batch_size", 16))
    return (
        cast(Any, PlainModel)
        .options(max_ongoing_requests=max(2 * batch, 8))
        .bind(args["name"], args["model_dir"], batch, float(args.get("batch_wait_timeout_s", 0.005)), args.get("threads"))
    )
