"""ONNX Runtime session setup: providers from the replica's GPUs, threads from its CPUs."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import onnxruntime as ort

from serve_app.process.cpu_priority import thread_ids, to_background

logger = logging.getLogger("ray.serve")


def select_providers(gpu_ids: list[str] | list[int], use_tensorrt: bool = False) -> list[str]:
    """CUDA (and optionally TensorRT) only when Ray gave this replica a GPU.

    onnxruntime-gpu would otherwise try CUDA on every replica; on a CPU-only
    replica that is a slow failed load and a warning per session.
    """
    available = set(ort.get_available_providers())
    providers: list[str] = []
    if gpu_ids:
        if use_tensorrt and "TensorrtExecutionProvider" in available:
            providers.append("TensorrtExecutionProvider")
        if "CUDAExecutionProvider" in available:
            providers.append("CUDAExecutionProvider")
    providers.append("CPUExecutionProvider")
    return providers


# ONNX Runtime's CUDA provider defaults to EXHAUSTIVE: it benchmarks every cuDNN convolution
# algorithm for each new input shape. A served model sees a new shape for every batch size
# (and, for text, every padded length), so each first batch of a size pays that search.
CUDA_OPTIONS: dict[str, str] = {"cudnn_conv_algo_search": "HEURISTIC"}


def with_options(providers: list[str]) -> list[str | tuple[str, dict[str, str]]]:
    """`providers` as ONNX Runtime takes them, with this project's CUDA options."""
    return [(p, dict(CUDA_OPTIONS)) if p == "CUDAExecutionProvider" else p for p in providers]


def intra_op_threads(num_cpus: float | None) -> int:
    """Threads per session follow the replica's `num_cpus` so replicas don't fight over cores."""
    return max(1, math.ceil(num_cpus)) if num_cpus else 1


def create_session(
    path: Path, providers: list[str], threads: int, spinning: bool = True, background: bool = False
) -> ort.InferenceSession:
    """One ONNX Runtime session. `background`: its intra-op threads run at the lowest CPU
    priority, SCHED_IDLE (serve_app.process.cpu_priority; the caller lowers its own thread).

    `spinning=False` where two sessions share the cores: an idle pool spinning at normal
    priority would take the cores from the other session's batch.
    """
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if not spinning:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    before = thread_ids() if background else set()
    session = ort.InferenceSession(str(path), sess_options=opts, providers=with_options(providers))
    if background:
        # ORT creates the session's thread pool in the constructor and offers no hook to set
        # its threads' priority, so lower the threads that the constructor started. A thread
        # that another part of the process started meanwhile would be lowered too; replicas
        # build their sessions before they take traffic, when nothing else starts threads.
        for tid in thread_ids() - before:
            try:
                to_background(tid)
            except (ProcessLookupError, PermissionError):
                pass
    if providers[0] != session.get_providers()[0]:
        logger.warning("asked for %s but ONNX Runtime runs %s on %s", providers, session.get_providers(), path)
    return session
