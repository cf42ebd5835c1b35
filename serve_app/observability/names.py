"""The queries a dashboard or rule file holds, and the metric names they read: what a scrape
of a running app must export for them to show anything."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
# Every metric this project reads comes through Ray's endpoint, which prefixes `ray_`.
_METRIC = re.compile(r"(?<![A-Za-z0-9_:])ray_[A-Za-z0-9_:]*")


def dashboard_exprs(model: dict[str, Any]) -> list[str]:
    """Every panel query of a Grafana dashboard model."""
    return [t["expr"] for p in model.get("panels", []) for t in p.get("targets", []) if t.get("expr")]


def rule_exprs(rules: dict[str, Any]) -> list[str]:
    """Every alerting and recording rule's expression of a Prometheus rule file."""
    return [str(r["expr"]) for g in rules["groups"] for r in g["rules"]]


def metric_names(exprs: Iterable[str]) -> set[str]:
    """Metric names in PromQL expressions (label values in quotes are not names)."""
    return {m for e in exprs for m in _METRIC.findall(_QUOTED.sub('""', e))}
