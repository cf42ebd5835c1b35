"""Traffic policy per model: which version answers a request that names none (weighted split,
sticky keys), which candidate a request is mirrored to (shadow), and automatic rollback of a
canary that does worse than its baseline. Plain classes: no Ray, no clock but the one given."""

from __future__ import annotations

import hashlib
import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from serve_app.config import RollbackConfig, TrafficConfig

logger = logging.getLogger("ray.serve")


def unit_hash(model: str, key: str) -> float:
    """A key's stable place in [0, 1): the same key lands on the same version while weights hold."""
    digest = hashlib.blake2b(f"{model}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


class OutcomeWindow:
    """One version's recent calls: latency and whether it failed, forgotten after `window_s`."""

    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        self.window_s = window_s
        self.clock = clock
        self.calls: deque[tuple[float, float, bool]] = deque()  # (when, latency_s, failed)

    def record(self, latency_s: float, failed: bool) -> None:
        self.calls.append((self.clock(), latency_s, failed))
        self._forget()

    def _forget(self) -> None:
        horizon = self.clock() - self.window_s
        while self.calls and self.calls[0][0] < horizon:
            self.calls.popleft()

    def summary(self) -> tuple[int, float, float]:
        """(calls, error rate, p99 latency of the calls that succeeded) in the window."""
        self._forget()
        n = len(self.calls)
        if not n:
            return 0, 0.0, 0.0
        failed = sum(1 for _, _, f in self.calls if f)
        ok = [lat for _, lat, f in self.calls if not f]
        p99 = float(np.percentile(ok, 99)) if ok else 0.0
        return n, failed / n, p99


@dataclass(frozen=True)
class Rollback:
    model: str
    version: str
    reason: str


# A rollback as routers share it: (model, version, the version's configured weight, why). The
# weight ties it to the configuration it was decided under: as in `TrafficPolicy.update`, a rollback
# stands until the version's weight is changed, so one decided under another weight does not apply.
SharedRollback = tuple[str, str, float, str]


# How sure a rollback for errors must be: the canary's error rate is judged by its interval at this
# many standard errors (one-sided, about 1 in 700), not its point estimate. The rule is checked every
# few seconds over a sliding window of tens of calls; judged by point estimates, a canary failing
# exactly as often as the baseline is rolled back by chance within minutes.
ERROR_Z = 3.0
# Answered calls each side needs before their p99s are compared: over fewer, a p99 is about the
# slowest call (over 100, 1% of the way from the second slowest to it), and one slow call would
# roll a canary back.
P99_MIN_CALLS = 200


def wilson_bound(failed: float, n: int, z: float, upper: bool) -> float:
    """Wilson's score interval for a rate of `failed` in `n`: its upper or lower end."""
    p, zz = failed / n, z * z
    centre, half = p + zz / (2 * n), z * math.sqrt(p * (1 - p) / n + zz / (4 * n * n))
    return (centre + half if upper else centre - half) / (1 + zz / n)


def rollback_reason(rule: RollbackConfig, canary: OutcomeWindow, baseline: OutcomeWindow) -> str | None:
    """Why the canary should go, or None: both sides need `min_requests` calls in the window, and
    its error rate must be over the baseline's by the margin beyond chance (ERROR_Z)."""
    n_c, err_c, p99_c = canary.summary()
    n_b, err_b, p99_b = baseline.summary()
    if n_c < rule.min_requests or n_b < rule.min_requests:
        return None
    canary_low = wilson_bound(err_c * n_c, n_c, ERROR_Z, upper=False)
    if canary_low > wilson_bound(err_b * n_b, n_b, ERROR_Z, upper=True) + rule.max_error_rate_increase:
        return f"error rate {err_c:.3f} over {n_c} calls against the baseline's {err_b:.3f}"
    enough = min(n_c * (1 - err_c), n_b * (1 - err_b)) >= P99_MIN_CALLS
    if rule.max_p99_ratio is not None and enough and p99_b > 0 and p99_c > p99_b * rule.max_p99_ratio:
        return f"p99 {p99_c * 1e3:.1f} ms against the baseline's {p99_b * 1e3:.1f} ms"
    return None


@dataclass
class ModelTraffic:
    """One model's policy as configured, and the versions rolled back since."""

    config: TrafficConfig
    baseline: str
    rolled_back: dict[str, str] = field(default_factory=dict)  # version -> why

    def weights(self) -> dict[str, float]:
        """Weights in effect: rolled-back versions get none; if none is left, the baseline takes all."""
        live = {v: w for v, w in self.config.weights.items() if w > 0 and v not in self.rolled_back}
        return live or {self.baseline: 1.0}


class TrafficPolicy:
    """Every model's traffic policy in one router; models without one always get their first version."""

    def __init__(
        self,
        first_versions: dict[str, str],
        clock: Callable[[], float] = time.monotonic,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.first_versions = first_versions  # model -> its entry's version
        self.clock = clock
        self.rng = rng
        self.models: dict[str, ModelTraffic] = {}
        self.windows: dict[tuple[str, str], OutcomeWindow] = {}
        self.rollbacks: list[Rollback] = []  # every rollback this router decided (metrics and status read it)
        self.adopted: list[Rollback] = []  # rollbacks other routers decided, applied here

    def update(self, traffic: dict[str, TrafficConfig]) -> None:
        """Apply a new configuration. A rollback stands until the version's weight is changed; a
        version whose weight or rollback rule changed is judged afresh, not on its old outcomes."""
        models = {}
        for model, config in traffic.items():
            old = self.models.get(model)
            old_weights, rolled_back = (old.config.weights, old.rolled_back) if old is not None else ({}, {})
            same_rule = old is not None and config.rollback == old.config.rollback
            kept = {}
            for version in set(config.weights) | set(old_weights):
                same_weight = old is not None and config.weights.get(version) == old_weights.get(version)
                if same_weight and version in rolled_back:
                    kept[version] = rolled_back[version]
                if not (same_weight and same_rule):
                    self.windows.pop((model, version), None)
            baseline = config.baseline or self.first_versions[model]
            kept.pop(baseline, None)  # what canaries are judged against is never rolled back
            models[model] = ModelTraffic(config, baseline, kept)
        self.models = models

    def choose(self, model: str, session: str | None = None, tenant: str | None = None) -> str:
        """The version that answers a request naming none."""
        policy = self.models.get(model)
        if policy is None:
            return self.first_versions[model]
        weights = policy.weights()
        if len(weights) == 1:
            return next(iter(weights))
        key = session if policy.config.sticky == "session" else tenant if policy.config.sticky == "tenant" else None
        u = unit_hash(model, key) if key else self.rng()
        total = sum(weights.values())
        acc = 0.0
        for version, w in weights.items():
            acc += w / total
            if u < acc:
                return version
        return version  # u within rounding of 1.0

    def shadow(self, model: str, answered_by: str) -> str | None:
        """The candidate version to mirror this answered request to, or None."""
        policy = self.models.get(model)
        shadow = policy.config.shadow if policy is not None else None
        if shadow is None or shadow.version == answered_by or self.rng() >= shadow.share:
            return None
        return shadow.version

    def shadow_limit(self, model: str) -> int:
        policy = self.models.get(model)
        return policy.config.shadow.max_inflight if policy is not None and policy.config.shadow is not None else 0

    def record(self, model: str, version: str, latency_s: float, failed: bool) -> None:
        """A call's outcome, kept for rollback when the model's policy has a rule."""
        policy = self.models.get(model)
        if policy is None or policy.config.rollback is None:
            return
        window = self.windows.get((model, version))
        if window is None:
            window = self.windows[(model, version)] = OutcomeWindow(policy.config.rollback.window_s, self.clock)
        window.record(latency_s, failed)

    def check_rollbacks(self) -> list[Rollback]:
        """Roll back every canary doing worse than its baseline now; returns the new rollbacks."""
        new = []
        for model, policy in self.models.items():
            rule = policy.config.rollback
            baseline = self.windows.get((model, policy.baseline))
            if rule is None or baseline is None:
                continue
            for version in policy.weights():
                canary = self.windows.get((model, version))
                if version == policy.baseline or canary is None:
                    continue
                reason = rollback_reason(rule, canary, baseline)
                if reason is not None:
                    new.append(_roll_back(policy, model, version, reason, "rolled back"))
        self.rollbacks.extend(new)
        return new

    @property
    def judges(self) -> bool:
        """Whether any model's canaries are judged here (a rollback rule is configured)."""
        return any(p.config.rollback is not None for p in self.models.values())

    def standing(self) -> list[SharedRollback]:
        """The rollbacks in effect here, decided here or adopted, as other routers adopt them."""
        return [
            (model, version, policy.config.weights.get(version, 0.0), reason)
            for model, policy in self.models.items()
            for version, reason in policy.rolled_back.items()
        ]

    def running(self) -> list[tuple[str, str, float]]:
        """(model, version, configured weight) of every version this router's policies name."""
        return [(m, v, w) for m, policy in self.models.items() for v, w in policy.config.weights.items()]

    def adopt(self, shared: list[SharedRollback]) -> list[Rollback]:
        """Apply rollbacks other routers decided, where this router runs the same weight for that
        version; returns those new here. Each router sees only its share of a canary's calls, and
        a router started later saw none of the calls that condemned it."""
        new = []
        for model, version, weight, reason in shared:
            policy = self.models.get(model)
            if policy is None or version in policy.rolled_back or policy.config.weights.get(version) != weight:
                continue
            if version == policy.baseline:
                continue  # the baseline is what canaries are judged against, never rolled back
            new.append(_roll_back(policy, model, version, reason, "adopted another router's rollback of"))
        self.adopted.extend(new)
        return new

    def effective_weights(self) -> dict[tuple[str, str], float]:
        """(model, version) -> its share of unversioned requests now, for every model with a policy."""
        out = {}
        for model, policy in self.models.items():
            weights = policy.weights()
            total = sum(weights.values())
            for version in policy.config.weights:
                out[(model, version)] = weights.get(version, 0.0) / total
        return out


def _roll_back(policy: ModelTraffic, model: str, version: str, reason: str, how: str) -> Rollback:
    policy.rolled_back[version] = reason
    logger.warning("traffic: %s %s version %s (weight 0): %s", how, model, version, reason)
    return Rollback(model, version, reason)


@dataclass
class ShadowStats:
    """What mirrored calls found, per (model, candidate version); telemetry drains `prob_diffs`."""

    rows: int = 0
    agreed: int = 0
    errors: int = 0
    skipped: int = 0  # mirrors not taken: too many in flight
    yielded: int = 0  # mirrors dropped while they waited for the router's idle time (the wait is bounded)
    prob_diffs: list[float] = field(default_factory=list)

    def compare(self, p: np.ndarray, q: np.ndarray) -> None:
        """Label agreement per row, and the largest probability difference per row, of the primary's
        and the candidate's (N, C) class probabilities."""
        self.rows += len(p)
        self.agreed += int((p.argmax(axis=1) == q.argmax(axis=1)).sum())
        self.prob_diffs.extend(np.abs(p - q).max(axis=1).tolist())

    @property
    def agreement(self) -> float:
        return self.agreed / self.rows if self.rows else 1.0
