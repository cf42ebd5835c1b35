"""Model versions in the router: which deployment answers a request (the traffic policy), what each
version's calls did (for rollback), and the shadow calls mirrored to a candidate off the client's path."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from serve_app.config import AppArgs, TrafficConfig, check_traffic
from serve_app.contract import Priority
from serve_app.errors import DeadlineExceeded, NotFound, Overloaded, ServeAppError
from serve_app.router.cascade import Payload, Submit, softmax
from serve_app.scheduling.dispatcher import RequestTiming
from serve_app.scheduling.traffic import ShadowStats, TrafficPolicy

logger = logging.getLogger("ray.serve")


def counts_against_version(error: Exception) -> bool:
    """A failure of the version itself: not the client's error, nor a refusal for lack of capacity or time."""
    if isinstance(error, Overloaded | DeadlineExceeded):
        return False
    return not (isinstance(error, ServeAppError) and error.status_code < 500)


class VersionedModels:
    """Resolves names to deployments and wraps every model call with outcome records and shadows."""

    def __init__(
        self,
        args: AppArgs,
        submit: Submit,
        policy: TrafficPolicy | None = None,
        clients_waiting: Callable[[], bool] = lambda: False,
    ) -> None:
        self.args = args
        self.served = args.served  # the dict itself: a pydantic private attribute is slow to reach per call
        self.raw_submit = submit
        # Whether client requests wait in the router's queues now: a mirror then yields its turn.
        self.clients_waiting = clients_waiting
        self.policy = policy or TrafficPolicy({m: cfg.version for m, cfg in args.models.items()})
        self.policy.update(args.traffic)
        self.shadows: dict[tuple[str, str], ShadowStats] = {}
        # Per (model, version): calls by outcome, and latencies not yet exported (telemetry drains them).
        self.calls: Counter[tuple[str, str, str]] = Counter()
        self.latencies: dict[tuple[str, str], list[float]] = defaultdict(list)
        self._shadow_tasks: set[asyncio.Task[None]] = set()

    def update(self, traffic: dict[str, TrafficConfig]) -> None:
        """A new traffic configuration (the router's user_config), checked against the catalog."""
        check_traffic(self.args, traffic)
        self.policy.update(traffic)

    def version_of(self, deployment: str) -> str:
        return self.served[deployment].version

    def deployment(self, model: str, version: str | None, session: str | None = None, tenant: str | None = None) -> str:
        """The deployment that answers `model`: the version asked for, else the policy's choice."""
        versions = self.args.versions(model)
        if version is None:
            version = self.policy.choose(model, session, tenant)
        elif version not in versions:
            raise NotFound(f"model {model!r} has no version {version!r}; available: {sorted(versions)}")
        return versions[version]

    def serving(self, model: str) -> list[str]:
        """The deployments that answer unversioned requests now (what the model's readiness asks of)."""
        versions = self.args.versions(model)
        policy = self.policy.models.get(model)
        live = policy.weights() if policy is not None else {self.args.models[model].version: 1.0}
        return [versions[v] for v in live]

    async def submit(
        self,
        deployment: str,
        payload: Payload,
        items: int,
        priority: Priority,
        deadline: float | None,
        timing: RequestTiming | None,
    ) -> Any:
        """One call to a deployment's queue; its outcome recorded and, when the policy draws it, mirrored."""
        served = self.served[deployment]
        started = time.monotonic()
        try:
            logits = await self.raw_submit(deployment, payload, items, priority, deadline, timing)
        except Exception as e:
            failed = counts_against_version(e)
            if failed:
                self.policy.record(served.model, served.version, time.monotonic() - started, failed=True)
            self.calls[(served.model, served.version, "error" if failed else "refused")] += 1
            raise
        latency = time.monotonic() - started
        self.policy.record(served.model, served.version, latency, failed=False)
        self.calls[(served.model, served.version, "ok")] += 1
        if served.model in self.policy.models:  # latency per version is for models whose versions share traffic
            self.latencies[(served.model, served.version)].append(latency)
        candidate = self.policy.shadow(served.model, served.version)
        if candidate is not None:
            self._mirror(served.model, candidate, payload, items, logits)
        return logits

    def _mirror(self, model: str, version: str, payload: Payload, items: int, primary: np.ndarray) -> None:
        stats = self.shadows.setdefault((model, version), ShadowStats())
        if len(self._shadow_tasks) >= self.policy.shadow_limit(model):
            stats.skipped += 1
            return
        if self.clients_waiting():  # shadows take spare capacity only, never a client's
            stats.yielded += 1
            return
        task = asyncio.get_running_loop().create_task(self._shadow(stats, model, version, payload, items, primary))
        self._shadow_tasks.add(task)
        task.add_done_callback(self._shadow_tasks.discard)

    async def _shadow(
        self, stats: ShadowStats, model: str, version: str, payload: Payload, items: int, primary: np.ndarray
    ) -> None:
        """The candidate's answer, compared with the primary's and dropped. Low priority, so that it
        never takes a place a client's request could have; whatever it does, no client sees it."""
        deployment = self.args.versions(model)[version]
        try:
            logits = await self.raw_submit(deployment, payload, items, Priority.LOW, None, None)
            stats.compare(softmax(np.asarray(primary, dtype=np.float64)), softmax(np.asarray(logits, dtype=np.float64)))
        except Exception:  # a shadow's failure is counted and goes no further
            stats.errors += 1

    def snapshot(self) -> dict[str, Any]:
        """Weights in effect, rollbacks, calls per version and what shadows found: for /router/status."""
        weights: dict[str, dict[str, float]] = {}
        for (model, version), share in self.policy.effective_weights().items():
            weights.setdefault(model, {})[version] = round(share, 4)
        shadows = {
            f"{m}/{v}": {"rows": s.rows, "agreed": s.agreed, "agreement": round(s.agreement, 4), "errors": s.errors}
            | {"skipped": s.skipped, "yielded": s.yielded}
            for (m, v), s in self.shadows.items()
        }
        return {
            "weights": weights,
            "rollbacks": [{"model": r.model, "version": r.version, "reason": r.reason} for r in self.policy.rollbacks],
            "calls": {f"{m}/{v}/{o}": n for (m, v, o), n in sorted(self.calls.items())},
            "shadows": shadows,
        }

    async def stop(self) -> None:
        for task in list(self._shadow_tasks):
            task.cancel()
        await asyncio.gather(*self._shadow_tasks, return_exceptions=True)
