"""Model versions in the router: which deployment answers a request (the traffic policy), what each
version's calls did (for rollback), and the shadow calls mirrored to a candidate off the client's path."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import numpy as np

from serve_app.config import AppArgs, TrafficConfig, check_traffic
from serve_app.contract import Priority
from serve_app.errors import DeadlineExceeded, NotFound, Overloaded, ServeAppError
from serve_app.router.routing.cascade import Payload, Submit, softmax
from serve_app.scheduling.dispatcher import RequestTiming
from serve_app.scheduling.shadows import IdleRelease
from serve_app.scheduling.traffic import ShadowStats, TrafficPolicy

logger = logging.getLogger("ray.serve")
IDLE_POLL_S = 0.002  # how often waiting mirrors look for the router's idle time


@dataclass
class Mirror:
    """One answered request to send to a candidate version, with the primary's answer to compare."""

    stats: ShadowStats
    deployment: str  # the candidate version's
    payload: Payload
    items: int
    primary: np.ndarray


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
        client_work: Callable[[Collection[str]], bool] = lambda ignored: False,
    ) -> None:
        self.args = args
        self.served = args.served  # the dict itself: a pydantic private attribute is slow to reach per call
        self.raw_submit = submit
        self.policy = policy or TrafficPolicy({m: cfg.version for m, cfg in args.models.items()})
        self.policy.update(args.traffic)
        # Whether the router holds client work (rows queued, batches in flight) for any deployment
        # but the shadows' candidates (deployment -> mirrors sent at once): mirrors wait for the moments it holds none.
        self.candidates = self._candidates()
        self.mirrors: IdleRelease[Mirror] = IdleRelease(lambda: client_work(self.candidates.keys()))
        self._drain: asyncio.Task[None] | None = None
        self.shadows: dict[tuple[str, str], ShadowStats] = {}
        # Per (model, version): calls by outcome, and latencies not yet exported (telemetry drains them).
        self.calls: Counter[tuple[str, str, str]] = Counter()
        self.latencies: dict[tuple[str, str], list[float]] = defaultdict(list)
        self._shadow_tasks: set[asyncio.Task[None]] = set()

    def update(self, traffic: dict[str, TrafficConfig]) -> None:
        """A new traffic configuration (the router's user_config), checked against the catalog."""
        check_traffic(self.args, traffic)
        self.policy.update(traffic)
        self.candidates = self._candidates()

    def _candidates(self) -> dict[str, int]:
        """The deployments that shadows are mirrored to now, with the mirrors sent to each at once."""
        return {
            self.args.versions(model)[p.config.shadow.version]: p.config.shadow.batch
            for model, p in self.policy.models.items()
            if p.config.shadow is not None
        }

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
        mirror = Mirror(stats, self.args.versions(model)[version], payload, items, primary)
        offer = self.mirrors.offer(mirror, self.policy.shadow_limit(model))
        if offer.refused:
            stats.skipped += 1
            return
        if offer.dropped is not None:
            offer.dropped.stats.yielded += 1
        if self._drain is None or self._drain.done():
            self._drain = asyncio.get_running_loop().create_task(self._send_when_idle())

    async def _send_when_idle(self) -> None:
        """Send waiting mirrors whenever the router has no client work, until none waits."""
        loop = asyncio.get_running_loop()
        while True:
            # As many as the oldest waiting mirror's shadow sends at once (1 if the policy dropped it since).
            for mirror in self.mirrors.release(self.candidates.get(self.mirrors.waiting[0].deployment, 1)):
                task = loop.create_task(self._shadow(mirror))
                self._shadow_tasks.add(task)
                task.add_done_callback(self._shadow_done)
            if not self.mirrors.waiting:
                return
            await asyncio.sleep(IDLE_POLL_S)

    def _shadow_done(self, task: asyncio.Task[None]) -> None:
        self._shadow_tasks.discard(task)
        self.mirrors.done()

    async def _shadow(self, m: Mirror) -> None:
        """The candidate's answer, compared with the primary's and dropped. Low priority, so that it
        never takes a place a client's request could have; whatever it does, no client sees it."""
        try:
            logits = await self.raw_submit(m.deployment, m.payload, m.items, Priority.LOW, None, None)
            primary = softmax(np.asarray(m.primary, dtype=np.float64))
            m.stats.compare(primary, softmax(np.asarray(logits, dtype=np.float64)))
        except Exception:  # a shadow's failure is counted and goes no further
            m.stats.errors += 1

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
            # Decided by another router of the application (or by this one before it restarted).
            "adopted_rollbacks": [{"model": r.model, "version": r.version, "reason": r.reason} for r in self.policy.adopted],
            "calls": {f"{m}/{v}/{o}": n for (m, v, o), n in sorted(self.calls.items())},
            "shadows": shadows,
        }

    async def stop(self) -> None:
        self.mirrors.waiting.clear()
        tasks = [*self._shadow_tasks, *([self._drain] if self._drain is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
