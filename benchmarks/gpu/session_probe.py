"""One ResNet-50 ONNX Runtime session outside Ray and Serve, run the ways a GPU replica runs it:
intra-op threads 1 (a replica's num_cpus) or all cores, spinning or not, from a normal thread or
a SCHED_IDLE one (the bulk lane's), each batch size warmed first; then batch sizes in turn, as
a replica's batches come, against one size throughout. Prints ms per run (wall, CPU).
Run on the lent GPU machine in remote.sh's environment:
  python benchmarks/gpu/session_probe.py [MODEL_DIR]"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from serve_app.manifest import Manifest
from serve_app.models.runtime import create_session, select_providers
from serve_app.process.cpu_priority import lower_thread_priority

SIZES = (1, 4, 32)


def bench(session: ort.InferenceSession, size: int, n: int, reps: int = 10) -> str:
    x = np.random.rand(n, 3, size, size).astype(np.float32)
    session.run(None, {"image": x})  # this shape's first run
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(reps):
        session.run(None, {"image": x})
    return f"n={n}: {(time.perf_counter() - wall) / reps * 1e3:.1f} ms wall, {(time.thread_time() - cpu) / reps * 1e3:.1f} ms cpu"


def alternating(session: ort.InferenceSession, size: int, sizes: tuple[int, ...], rounds: int = 4) -> str:
    """Batch sizes in turn, as a replica's batches come (each size already run once): ONNX
    Runtime's CUDA convolutions keep the plan of the last shape only."""
    feeds = [np.random.rand(n, 3, size, size).astype(np.float32) for n in sizes]
    for x in feeds:
        session.run(None, {"image": x})
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(rounds):
        for x in feeds:
            session.run(None, {"image": x})
    runs = rounds * len(feeds)
    wall_ms, cpu_ms = (time.perf_counter() - wall) / runs * 1e3, (time.thread_time() - cpu) / runs * 1e3
    return f"sizes {sizes} in turn: {wall_ms:.1f} ms wall, {cpu_ms:.1f} ms cpu"


def in_idle_thread(fn: Callable[[], Any]) -> Any:
    out: list[Any] = []

    def run() -> None:
        lower_thread_priority()
        out.append(fn())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out[0]


def main(model_dir: Path) -> None:
    manifest = Manifest.load(model_dir)
    path, size = model_dir / manifest.onnx_file_for("fp32"), manifest.image_size or 32
    providers = select_providers(["0"] if os.environ.get("CUDA_VISIBLE_DEVICES", "0") != "" else [])
    cores = len(os.sched_getaffinity(0))
    for threads, spinning, background in ((1, True, False), (1, False, False), (cores, True, False), (1, False, True)):
        session = create_session(path, providers, threads, spinning=spinning, background=background)
        runs = [partial(bench, session, size, n) for n in SIZES]
        results = [in_idle_thread(r) if background else r() for r in runs]
        label = f"threads={threads} spinning={spinning} {'SCHED_IDLE thread' if background else 'normal thread'}"
        print(label, session.get_providers()[0], "|", " | ".join(results), flush=True)
    session = create_session(path, providers, 1)
    print("threads=1", alternating(session, size, (4, 2, 8, 1)), "|", alternating(session, size, (32,)), flush=True)


def in_ray_task(model_dir: Path) -> None:
    """The same session in a Ray task holding a quarter GPU and one CPU, as a replica does."""
    import ray

    ray.init(include_dashboard=False)

    @ray.remote(num_gpus=0.25, num_cpus=1)
    def task() -> str:
        manifest = Manifest.load(model_dir)
        session = create_session(model_dir / manifest.onnx_file_for("fp32"), select_providers(ray.get_gpu_ids()), 1)
        size = manifest.image_size or 32
        return f"{session.get_providers()[0]} | " + " | ".join(bench(session, size, n) for n in SIZES)

    print("ray task, threads=1", ray.get(task.remote(), timeout=90), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path, nargs="?", default=Path("models-realsize/resnet-heavy"))
    model_dir = parser.parse_args().model_dir.resolve()
    main(model_dir)
    in_ray_task(model_dir)
