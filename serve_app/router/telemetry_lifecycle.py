"""Metrics of model versions (traffic, outcomes, rollbacks, shadows) and of the response cache,
exported from the counters the request path bumps (as serve_app.router.telemetry does)."""

from __future__ import annotations

import asyncio
from collections import Counter

from ray.serve import metrics

from serve_app.cache.tiered import ResponseCache
from serve_app.observability.histograms import GaugeHistogram
from serve_app.observability.histograms import tag_keys as tags
from serve_app.router.routing.versions import VersionedModels
from serve_app.router.telemetry import QUEUE_WAIT_MS_BOUNDARIES

PROB_DIFF_BOUNDARIES = [0.001, 0.01, 0.05, 0.1, 0.2, 0.5, 0.9]


class LifecycleTelemetry:
    def __init__(self) -> None:
        mv = tags("model", "version")
        self.weight = metrics.Gauge(
            "serve_app_version_weight", description="Share of a model's unversioned requests a version gets now.", tag_keys=mv
        )
        self.calls = metrics.Counter(
            "serve_app_version_calls",
            description="Calls to a model version by outcome: ok, error (counts against the version), refused.",
            tag_keys=tags("model", "version", "outcome"),
        )
        # Per call and per mirrored row: binned here, exported as series (serve_app/observability/histograms.py).
        self.latency = GaugeHistogram(
            "serve_app_version_latency_ms",
            "Time from a call's admission to a version's answer",
            QUEUE_WAIT_MS_BOUNDARIES,
            ("model", "version"),
        )
        self.rollbacks = metrics.Counter(
            "serve_app_rollbacks", description="Canaries rolled back to weight 0 automatically.", tag_keys=mv
        )
        self.shadow_rows = metrics.Counter(
            "serve_app_shadow_rows",
            description="Rows mirrored to a candidate version, by whether its label agreed with the primary's.",
            tag_keys=tags("model", "version", "outcome"),
        )
        self.shadow_calls = metrics.Counter(
            "serve_app_shadow_calls",
            description="Mirrored calls that failed (error), or were not sent: too many in flight (skipped), dropped "
            "while they waited for the router's idle time (yielded).",
            tag_keys=tags("model", "version", "outcome"),
        )
        self.shadow_agreement = metrics.Gauge(
            "serve_app_shadow_agreement", description="Share of mirrored rows whose label agreed, since start.", tag_keys=mv
        )
        self.prob_diff = GaugeHistogram(
            "serve_app_shadow_prob_diff",
            "Per mirrored row, the largest difference between the primary's and the candidate's probabilities",
            PROB_DIFF_BOUNDARIES,
            ("model", "version"),
        )
        self.cache_lookups = metrics.Counter(
            "serve_app_cache_lookups",
            description="Response cache lookups: hits by tier, and misses.",
            tag_keys=tags("tier", "outcome"),
        )
        self.cache_evictions = metrics.Counter("serve_app_cache_evictions", description="Answers evicted from the local tier.")
        self.cache_bytes = metrics.Gauge("serve_app_cache_bytes", description="Bytes the local tier holds.")
        self.cache_entries = metrics.Gauge("serve_app_cache_entries", description="Answers the local tier holds.")
        self.cache_shared_errors = metrics.Counter(
            "serve_app_cache_shared_errors", description="Failed or slow calls to the shared (Redis) tier, each a miss."
        )
        self._sent: Counter[str] = Counter()

    def _delta(self, key: str, now: int) -> int:
        d, self._sent[key] = now - self._sent[key], now
        return max(d, 0)

    async def export(self, versions: VersionedModels, cache: ResponseCache) -> None:
        for (model, version), share in versions.policy.effective_weights().items():
            self.weight.set(share, tags={"model": model, "version": version})
        for (model, version, outcome), n in list(versions.calls.items()):
            if d := self._delta(f"calls/{model}/{version}/{outcome}", n):
                self.calls.inc(d, tags={"model": model, "version": version, "outcome": outcome})
        for (model, version), lats in list(versions.latencies.items()):
            versions.latencies[(model, version)] = []
            self.latency.add({"model": model, "version": version}, (lat * 1e3 for lat in lats))
        await self.latency.export()
        rolled = Counter((r.model, r.version) for r in versions.policy.rollbacks)
        for (model, version), n in rolled.items():
            if d := self._delta(f"rollback/{model}/{version}", n):
                self.rollbacks.inc(d, tags={"model": model, "version": version})
        for (model, version), s in list(versions.shadows.items()):
            mv = {"model": model, "version": version}
            for outcome, n in (("agree", s.agreed), ("disagree", s.rows - s.agreed)):
                if d := self._delta(f"shadow/{model}/{version}/{outcome}", n):
                    self.shadow_rows.inc(d, tags={**mv, "outcome": outcome})
            for outcome, n in (("error", s.errors), ("skipped", s.skipped), ("yielded", s.yielded)):
                if d := self._delta(f"shadowcall/{model}/{version}/{outcome}", n):
                    self.shadow_calls.inc(d, tags={**mv, "outcome": outcome})
            self.shadow_agreement.set(s.agreement, tags=mv)
            diffs, s.prob_diffs = s.prob_diffs, []
            self.prob_diff.add(mv, diffs)
            await asyncio.sleep(0)
        await self.prob_diff.export()
        for (tier, outcome), n in list(cache.lookups.items()):
            if d := self._delta(f"cache/{tier}/{outcome}", n):
                self.cache_lookups.inc(d, tags={"tier": tier, "outcome": outcome})
        if d := self._delta("cache/evictions", cache.local.evictions):
            self.cache_evictions.inc(d)
        if cache.shared is not None and (d := self._delta("cache/shared_errors", cache.shared.errors)):
            self.cache_shared_errors.inc(d)
        self.cache_bytes.set(cache.local.bytes)
        self.cache_entries.set(len(cache.local))
