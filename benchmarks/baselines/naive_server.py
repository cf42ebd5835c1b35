"""The common tutorial server: FastAPI + ONNX Runtime, one `session.run` per request, one worker.

Started as `uvicorn benchmarks.baselines.naive_server:app --workers 1` with
$BENCH_MODEL_DIR and $BENCH_MODEL_NAME set. The endpoint is a plain `def`, so
FastAPI runs it in its thread pool, as the tutorials do.
"""

from __future__ import annotations

import os
from typing import Any

from fastapi import Body, FastAPI

from benchmarks.baselines.runner import ModelRunner

NAME = os.environ.get("BENCH_MODEL_NAME", "model")
# 0 = ONNX Runtime's default, one intra-op thread per core. $BENCH_GPU_IDS: on the GPU ours gets.
runner = ModelRunner(
    os.environ["BENCH_MODEL_DIR"],
    threads=int(os.environ.get("BENCH_THREADS", "0")),
    gpu_ids=[g for g in os.environ.get("BENCH_GPU_IDS", "").split(",") if g],
)
app = FastAPI()


@app.get("/v2/health/ready")
def ready() -> dict[str, bool]:
    return {"ready": True}


@app.post("/v2/models/{name}/infer")
def infer(name: str, body: dict[str, Any] = Body(...)) -> dict[str, Any]:  # noqa: B008 - FastAPI's idiom
    return runner.respond(NAME, runner.run(runner.decode(body)))
