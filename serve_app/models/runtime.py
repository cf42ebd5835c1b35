"""ONNX Runtime session setup: providers from the replica's GPUs, threads from its CPUs."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import onnxruntime as ort

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


def intra_op_threads(num_cpus: float | None) -> int:
    """Threads per session follow the replica's `num_cpus` so replicas don't fight over cores."""
    return max(1, math.ceil(num_cpus)) if num_cpus else 1


def create_session(path: Path, providers: list[str], threads: int) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(path), sess_options=opts, providers=providers)
    if providers[0] != session.get_providers()[0]:
        logger.warning("asked for %s but ONNX Runtime runs %s on %s", providers, session.get_providers(), path)
    return session
