"""What every model deployment shares: manifest, session, batching knobs, stats.

Subclasses add one family's pre/post-processing and how it batches. Each deployment
class finishes its own `__init__` with `self.warm_up()`, once everything warm-up needs
is in place: the base constructor only loads, and calls no method a subclass overrides.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import Any

import ray
from ray import serve
from ray.serve import metrics

from serve_app.config import BatchingConfig, FaultConfig, ModelConfig, ReplicaTuning
from serve_app.errors import ModelFailure
from serve_app.exports import Declared, discover
from serve_app.models.runtime import create_session, intra_op_threads, select_providers
from serve_app.observability import tracing
from serve_app.sources import local_path

BATCH_SIZE_BOUNDARIES = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0]


def own_session_threads(config: ModelConfig, threads: int, lanes_enabled: bool) -> int:
    """Intra-op threads of a replica's own session: with an urgent lane that session is the lane's
    (`urgent_threads`, else the replica's threads), else it is the only one."""
    return (config.advanced.urgent_threads or threads) if lanes_enabled else threads


def session_plan(config: ModelConfig, supports_lanes: bool) -> tuple[bool, bool]:
    """(whether the urgent lane has a session of its own, whether bulk sessions run side by side
    without one). Without its own session (`urgent_session: false`) the urgent lane's batches run
    next on the bulk lane's sessions (serve_app.models.executor)."""
    own = supports_lanes and config.advanced.urgent_lane and config.advanced.urgent_session
    return own, supports_lanes and not own and (config.advanced.bulk_sessions or 1) > 1


class OnnxModel:
    """Loads the model; the deployment warms it up before the replica reports ready."""

    # Whether this family can run an urgent lane (a second session for high-priority batches).
    supports_lanes = False

    def __init__(self, name: str, model_path: str, config: dict[str, Any]) -> None:
        self.name = name
        self.config = ModelConfig.model_validate(config)
        # A URI is fetched into this node's cache first; an export without a manifest is read as it is.
        self.model_dir, self.manifest = discover(local_path(model_path), Declared.of(name, self.config))
        ctx = ray.get_runtime_context()
        self.gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        num_cpus = ctx.get_assigned_resources().get("CPU")
        self.providers = select_providers(self.gpu_ids)
        self.threads = self.config.advanced.intra_op_threads or intra_op_threads(num_cpus)
        self.lanes_enabled, self.side_by_side = session_plan(self.config, self.supports_lanes)
        # With two sessions sharing the cores, neither pool may spin while idle (runtime.create_session).
        self.onnx_path = self.model_dir / self.manifest.onnx_file_for(self.config.precision)
        spinning = not (self.lanes_enabled or self.side_by_side)
        self.session_threads = own_session_threads(self.config, self.threads, self.lanes_enabled)
        self.session = create_session(self.onnx_path, self.providers, self.session_threads, spinning=spinning)
        self.batch_sizes: Counter[int] = Counter()
        self._batch_hist = metrics.Histogram(
            "serve_app_batch_size",
            description="Items per executed model batch.",
            boundaries=BATCH_SIZE_BOUNDARIES,
            tag_keys=("model",),
        )
        self._batch_hist.set_default_tags({"model": name})
        self._latency_hist = metrics.Histogram(
            "serve_app_batch_latency_ms",
            description="Model execution time per batch.",
            boundaries=[1, 2, 5, 10, 20, 50, 100, 200, 500, 1000],
            tag_keys=("model",),
        )
        self._latency_hist.set_default_tags({"model": name})
        self.faults: FaultConfig = self.config.faults
        self._faults_since: float | None = None
        self.batching = self.config.batching
        tracing.setup(self.config.tracing, service=name)

    def warm_up(self) -> None:
        """Run the graph so the first real request doesn't pay for lazy init."""
        raise NotImplementedError

    def apply_batching(self, batching: BatchingConfig) -> None:
        """Live batching knobs; subclasses pass them on to whatever forms their batches."""
        self.batching = batching

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Live-tune batching (and fault drills) through the Serve config's `user_config`, without a restart."""
        tuning = ReplicaTuning.model_validate(user_config)
        self.apply_batching(BatchingConfig(**tuning.model_dump(exclude={"faults"})))
        if tuning.faults != self.faults:
            self._faults_since = None  # a changed drill starts its clock again
        self.faults = tuning.faults

    def record_batch(self, size: int, started: float) -> None:
        self.batch_sizes[size] += 1
        self._batch_hist.observe(size)
        self._latency_hist.observe((time.perf_counter() - started) * 1000)

    def inject_faults(self) -> None:
        """Drills: a slow or failing model, set live through `user_config` (see FaultConfig)."""
        if self.faults.duration_s is not None:
            now = time.monotonic()
            if self._faults_since is None:
                self._faults_since = now
            if now - self._faults_since > self.faults.duration_s:
                return
        if self.faults.delay_s:
            time.sleep(self.faults.delay_s)
        if self.faults.error_rate and random.random() < self.faults.error_rate:
            raise ModelFailure(f"{self.name}: injected fault")

    async def metadata(self) -> dict[str, Any]:
        return {"manifest": self.manifest.model_dump(mode="json"), "batching": self.batching.model_dump()}

    async def runtime_info(self) -> dict[str, Any]:
        """Where and how this replica runs; the GPU packing test reads it."""
        ctx = serve.get_replica_context()
        return {
            "replica": ctx.replica_id.unique_id,
            "resources": ray.get_runtime_context().get_assigned_resources(),  # what its deployment entry asked
            "gpu_ids": self.gpu_ids,
            "providers": self.session.get_providers(),
            "batching": self.batching.model_dump(),
            "faults": self.faults.model_dump(),
            "batch_sizes": dict(self.batch_sizes),
        }
