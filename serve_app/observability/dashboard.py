"""The Grafana dashboard users load as it is: built with Grafana's own SDK
(`grafana-foundation-sdk`, whose models are generated from Grafana's dashboard
schema), written to `observability/grafana-dashboard.json`.

Metric names are as Ray's Prometheus endpoint exports them: `ray_` in front of
the name the app registers, `_total` after a counter's, `_bucket` after a
histogram's (the app's per-request and per-token histograms register their
`_bucket` series themselves: `serve_app/observability/histograms.py`).
`tests/integration/test_scheduling.py` checks every name here against a scrape
of a running app.
"""

from __future__ import annotations

import json
from typing import Any

from grafana_foundation_sdk.builders import common as gc
from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement, SortOrder, TooltipDisplayMode
from grafana_foundation_sdk.models.dashboard import Dashboard, DataSourceRef, VariableRefresh

UID = "serve-app-overview"
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
MODEL = 'model=~"$model"'


def _q(expr: str, legend: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).datasource(DS)


def _series(title: str, unit: str, *targets: prometheus.Dataquery, description: str = "") -> timeseries.Panel:
    panel = (
        timeseries.Panel().title(title).unit(unit).datasource(DS).height(8).span(12)
        .legend(gc.VizLegendOptions().show_legend(True).display_mode(LegendDisplayMode.LIST)
                .placement(LegendPlacement.BOTTOM).calcs([]))
        .tooltip(gc.VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.DESCENDING))
    )  # fmt: skip
    if description:
        panel = panel.description(description)
    for t in targets:
        panel = panel.with_target(t)
    return panel


def _rate(metric: str, by: str, where: str = MODEL) -> str:
    return f"sum by ({by}) (rate({metric}{{{where}}}[$__rate_interval]))"


def _quantile(q: float, metric: str, by: str, where: str = MODEL) -> str:
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{{{where}}}[$__rate_interval])))"


def _traffic(board: gd.Dashboard) -> gd.Dashboard:
    """Traffic and latency by model and priority."""
    lat = "ray_serve_app_request_latency_ms"
    return (
        board
        .with_row(gd.Row("Traffic and latency"))
        .with_panel(
            _series("Requests admitted by model and priority", "reqps",
                    _q(_rate("ray_serve_app_admitted_total", "model, priority"), "{{model}} {{priority}}"))
        )
        .with_panel(
            _series("Latency p50 / p99 by model and priority", "ms",
                    _q(_quantile(0.5, lat, "model, priority"), "p50 {{model}} {{priority}}"),
                    _q(_quantile(0.99, lat, "model, priority"), "p99 {{model}} {{priority}}"),
                    description="From admission in the router to the model's answer.")
        )
        .with_panel(
            _series("Shed by reason", "reqps", _q(_rate("ray_serve_app_shed_total", "model, reason"), "{{model}} {{reason}}"),
                    description="Refused or dropped: deadline, queue_budget, queue_delay, queue_full, evicted, "
                    "expired, starved, breaker_open.")
        )
        .with_panel(
            _series("Shed by priority", "reqps",
                    _q(_rate("ray_serve_app_shed_by_priority_total", "model, priority"), "{{model}} {{priority}}"))
        )
    )  # fmt: skip


def _queues(board: gd.Dashboard) -> gd.Dashboard:
    """Router queues, batch sizes, circuit breakers."""
    return (
        board
        .with_row(gd.Row("Queues, batches, breakers"))
        .with_panel(
            _series("Rows queued in the router", "short",
                    _q(f"sum by (model, priority) (ray_serve_app_queue_depth{{{MODEL}}})", "{{model}} {{priority}}"))
        )
        .with_panel(
            _series("Queue wait p99", "ms", _q(_quantile(0.99, "ray_serve_app_queue_wait_ms", "model"), "{{model}}"))
        )
        .with_panel(
            _series("Mean batch size", "short",
                    _q(f"{_rate('ray_serve_app_batch_size_sum', 'model')} / {_rate('ray_serve_app_batch_size_count', 'model')}",
                       "{{model}}"))
        )
        .with_panel(
            stat.Panel().title("Circuit breakers open").datasource(DS).height(8).span(12)
            .reduce_options(gc.ReduceDataOptions().values(False).calcs(["lastNotNull"]))
            .description("0 closed, 1 half-open, 2 open.")
            .with_target(_q(f"max by (model) (ray_serve_app_breaker_state{{{MODEL}}})", "{{model}}"))
        )
    )  # fmt: skip


def _generation(board: gd.Dashboard) -> gd.Dashboard:
    """Generation: tokens, TTFT/ITL, KV cache, sequences."""
    return (
        board
        .with_row(gd.Row("Generation"))
        .with_panel(
            _series("Tokens per second", "short", _q(_rate("ray_serve_app_gen_tokens_total", "model"), "{{model}}"))
        )
        .with_panel(
            _series("Time to first token and between tokens, p99", "ms",
                    _q(_quantile(0.99, "ray_serve_app_gen_ttft_ms", "model"), "TTFT {{model}}"),
                    _q(_quantile(0.99, "ray_serve_app_gen_itl_ms", "model"), "ITL {{model}}"))
        )
        .with_panel(
            _series("KV cache occupancy", "percentunit",
                    _q(f"max by (model) (ray_serve_app_gen_kv_occupancy{{{MODEL}}})", "{{model}}"))
        )
        .with_panel(
            _series("Sequences running and waiting", "short",
                    _q(f"sum by (model) (ray_serve_app_gen_running{{{MODEL}}})", "running {{model}}"),
                    _q(f"sum by (model) (ray_serve_app_gen_waiting{{{MODEL}}})", "waiting {{model}}"))
        )
    )  # fmt: skip


def _lifecycle(board: gd.Dashboard) -> gd.Dashboard:
    """Versions, shadows, the response cache."""
    return (
        board
        .with_row(gd.Row("Versions, shadows, cache"))
        .with_panel(
            _series("Calls per version", "reqps",
                    _q(_rate("ray_serve_app_version_calls_total", "model, version, outcome"),
                       "{{model}} v{{version}} {{outcome}}"))
        )
        .with_panel(
            _series("Traffic weight per version", "percentunit",
                    _q(f"max by (model, version) (ray_serve_app_version_weight{{{MODEL}}})", "{{model}} v{{version}}"),
                    _q(f"sum by (model, version) (increase(ray_serve_app_rollbacks_total{{{MODEL}}}[$__range]))",
                       "rollbacks {{model}} v{{version}}"))
        )
        .with_panel(
            _series("Shadow agreement", "percentunit",
                    _q(f"max by (model, version) (ray_serve_app_shadow_agreement{{{MODEL}}})", "{{model}} v{{version}}"))
        )
        .with_panel(
            _series("Response cache", "reqps",
                    _q("sum by (tier, outcome) (rate(ray_serve_app_cache_lookups_total[$__rate_interval]))",
                       "{{tier}} {{outcome}}"),
                    _q("sum(rate(ray_serve_app_cache_evictions_total[$__rate_interval]))", "evictions"))
        )
    )  # fmt: skip


def _replicas(board: gd.Dashboard) -> gd.Dashboard:
    """Replica health."""
    return (
        board
        .with_row(gd.Row("Replicas"))
        .with_panel(
            _series("Healthy replicas by deployment", "short",
                    _q("sum by (deployment) (ray_serve_deployment_replica_healthy)", "{{deployment}}"))
        )
    )  # fmt: skip


def build() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model."""
    board = (
        gd.Dashboard("serve-app: models, priorities, lifecycle")
        .uid(UID)
        .tags(["serve-app", "ray-serve"])
        .refresh("10s")
        .time("now-30m", "now")
        .with_variable(gd.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_variable(
            gd.QueryVariable("model")
            .label("Model")
            .datasource(DS)
            # Classifiers are admitted through the router's queues, generators are not: the list
            # takes both, or choosing a generator would leave the Generation row empty.
            .query("query_result(count by (model) (ray_serve_app_admitted_total or ray_serve_app_gen_tokens_total))")
            .regex('/model="([^"]+)"/')
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )
    )  # fmt: skip
    for section in (_traffic, _queues, _generation, _lifecycle, _replicas):
        board = section(board)
    model: dict[str, Any] = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    # Grafana keys panels by id and a panel's queries by refId; the SDK leaves both to the caller.
    for i, panel in enumerate(model["panels"], 1):
        panel["id"] = i
        for ref, target in zip("ABCDEFGH", panel.get("targets", []), strict=False):
            target["refId"] = ref
    return normalized(model)


def normalized(model: dict[str, Any]) -> dict[str, Any]:
    """`model` read into the SDK's schema types (panel options by panel type, queries by data
    source) and written out again: what Grafana's schema knows of it. A key it does not know
    is dropped, a missing default is filled in."""
    register_default_plugins()
    out: dict[str, Any] = json.loads(json.dumps(Dashboard.from_json(model), cls=JSONEncoder))
    return out


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"
