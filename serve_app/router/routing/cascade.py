"""Tiered routing: which items the light model may answer on its own (`CascadePolicy`), and
how a route runs its tiers and falls back when one fails (`Cascade`). No Ray here."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from serve_app.config import RouteConfig
from serve_app.contract import Priority
from serve_app.errors import DeadlineExceeded, Overloaded, ServeAppError
from serve_app.manifest import Manifest
from serve_app.scheduling.dispatcher import RequestTiming
from serve_app.scheduling.protection.degrade import Degrading

Signal = Literal["max_prob", "margin", "entropy"]
SIGNALS: tuple[Signal, ...] = ("max_prob", "margin", "entropy")


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def confidence(logits: np.ndarray, signal: Signal) -> np.ndarray:
    """Per-row confidence in [0, 1] from (N, C) logits; higher = surer."""
    p = softmax(logits.astype(np.float64))
    if signal == "max_prob":
        return p.max(axis=-1)
    if signal == "entropy":  # 1 - normalised entropy: 1 for one-hot, 0 for uniform
        h = -(p * np.log(np.clip(p, 1e-12, 1.0))).sum(axis=-1)
        return 1.0 - h / np.log(p.shape[-1])
    top2 = np.sort(p, axis=-1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


@dataclass(frozen=True)
class CascadePolicy:
    threshold: float
    signal: Signal = "max_prob"

    def escalate(self, light_logits: np.ndarray) -> np.ndarray:
        """Boolean mask of rows the heavy model must answer."""
        return confidence(light_logits, self.signal) < self.threshold


# A classifier payload: texts, or images as an (N, 3, H, W) array.
Payload = list[str] | np.ndarray


@dataclass
class ClassifierResult:
    """Logits for N items, which model answered each, and why the heavy tier was skipped, if it was."""

    logits: np.ndarray  # (N, C)
    served_by: list[str]
    degraded: str | None = None


# (model, payload, items, priority, deadline, timing) -> (N, C) logits, or the model's error
Submit = Callable[[str, Payload, int, Priority, float | None, RequestTiming | None], Awaitable[np.ndarray]]
# deployment -> the age of the oldest request in its queue now, in seconds (0 when none)
Standing = Callable[[str], float]


class Cascade:
    """Runs one tiered route: the light model first, the heavy one for the items it is unsure of.

    The rules, each with its reason:
    - the light tier refuses (a client error, overloaded, the deadline cannot be met): that
      refusal is the answer; the heavy tier would be busier or slower still;
    - the light tier fails (circuit open, model error, timeout): the heavy tier answers every
      item, and the response says so (`degraded`). The light breaker's half-open probe comes
      through here too, so route traffic alone can close it again;
    - under overload, `degrading` (the route's policy) may answer a lower class's escalations from
      the light tier without asking the heavy one, while the heavy queue stands; and when the heavy
      tier refuses (overloaded, too slow for the deadline), a class the route lets degrade gets
      the light answer in hand, any other class the refusal (`degraded` says which happened);
    - the heavy tier fails (behind an open circuit, a model error, its replica died), or has not
      answered within `heavy_wait_s` (its replicas lost with their node, say, while Serve places
      new ones): the light answer in hand beats an error or a wait (`degraded`), whatever the class;
    - a client error from the heavy tier is the answer.
    `counts` gets the items each outcome served: light, heavy, fallback, degraded.
    """

    def __init__(
        self,
        route: str,
        light: str,
        heavy: str,
        policy: CascadePolicy,
        submit: Submit,
        degrading: Degrading | None = None,
        standing: Standing = lambda deployment: 0.0,
        heavy_wait_s: float | None = None,
    ) -> None:
        self.route, self.light, self.heavy = route, light, heavy
        self.policy = policy
        self.submit = submit
        self.degrading = degrading
        self.standing = standing
        self.heavy_wait_s = heavy_wait_s
        self.counts: Counter[str] = Counter()

    async def classify(
        self,
        payload: Payload,
        priority: Priority,
        deadline: float | None,
        timing: RequestTiming | None = None,
        tiers: tuple[str, str] | None = None,
    ) -> ClassifierResult:
        """`tiers`: the (light, heavy) deployments this request goes to, when a traffic policy chose
        versions other than the route's own models."""
        light_tier, heavy_tier = tiers or (self.light, self.heavy)
        n = len(payload)
        try:
            light = await self.submit(light_tier, payload, n, priority, deadline, timing)
        except Exception as e:
            if isinstance(e, Overloaded | DeadlineExceeded) or (isinstance(e, ServeAppError) and e.status_code < 500):
                raise
            logits = await self.submit(heavy_tier, payload, n, priority, deadline, timing)
            self.counts["fallback"] += n
            return ClassifierResult(logits, [heavy_tier] * n, f"{light_tier} unavailable; answered by {heavy_tier}")
        escalate = self.policy.escalate(light)
        escalated = int(escalate.sum())
        self.counts["light"] += n - escalated
        if not escalated:
            return ClassifierResult(light, [light_tier] * n)
        degrading = self.degrading
        if degrading is not None and degrading.enabled:
            degrading.follow(self.standing(heavy_tier))
            if degrading.before_heavy(priority):
                self.counts["degraded"] += escalated
                why = f"{heavy_tier} overloaded; {priority.name.lower()} priority answered by {light_tier}"
                return ClassifierResult(light, [light_tier] * n, why)
        idx = np.flatnonzero(escalate)
        subset = [payload[i] for i in idx] if isinstance(payload, list) else payload[idx]
        try:
            heavy = await asyncio.wait_for(
                self.submit(heavy_tier, subset, escalated, priority, deadline, timing), self.heavy_wait_s
            )
        except TimeoutError:
            self.counts["degraded"] += escalated
            why = f"{heavy_tier} gave no answer within {self.heavy_wait_s:g} s; answered by {light_tier}"
            return ClassifierResult(light, [light_tier] * n, why)
        except Exception as e:
            if isinstance(e, ServeAppError) and e.status_code < 500:
                raise
            refused = isinstance(e, Overloaded | DeadlineExceeded)
            if refused and degrading is not None and not degrading.after_refusal(priority):
                raise
            code = e.code if isinstance(e, ServeAppError) else "model_error"
            self.counts["degraded"] += escalated
            return ClassifierResult(light, [light_tier] * n, f"{heavy_tier} {code}; answered by {light_tier}")
        self.counts["heavy"] += escalated
        merged = light.copy()
        merged[idx] = heavy
        return ClassifierResult(merged, [heavy_tier if e else light_tier for e in escalate])


def route_policy(name: str, route: RouteConfig, light_manifest: Manifest) -> CascadePolicy:
    """The route's pinned threshold, or the one calibrated on held-out data (in the light manifest)."""
    if route.threshold is not None:
        return CascadePolicy(route.threshold, route.signal)
    fitted = light_manifest.calibrations.get(route.heavy)
    if fitted is None:
        raise ValueError(
            f"route {name!r} has no threshold and {route.light} was never calibrated against {route.heavy}: "
            "run `serve-app calibrate --config <this config>` or set `threshold`"
        )
    return CascadePolicy(float(fitted["threshold"]), fitted["signal"])
