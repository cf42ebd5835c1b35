"""The Grafana dashboard and Prometheus alert rules users load: generated files match their
sources, the dashboard is what Grafana's schema knows, and `promtool` (Prometheus' own checker,
from Debian's `prometheus` package, which README's test command installs) accepts every rule and
every dashboard query, and the rules fire on the series they are meant for. That every metric
they name is exported is checked against a running app in tests/integration/test_scheduling.py."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from serve_app.observability import dashboard, manifests
from serve_app.observability.names import dashboard_exprs, metric_names, rule_exprs

ROOT = Path(__file__).resolve().parents[2]
OBS = ROOT / "observability"


def _promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool not found: install Debian's `prometheus` package (README's test command does)"
    return found


def _run(*args: str, cwd: Path = OBS) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_committed_dashboard_and_manifest_match_their_sources():
    assert (OBS / "grafana-dashboard.json").read_text() == dashboard.render(), "run `serve-app k8s monitoring`"
    assert (ROOT / "k8s" / "monitoring.yaml").read_text() == manifests.render(), "run `serve-app k8s monitoring`"


def test_the_dashboard_is_a_grafana_dashboard_model():
    committed = json.loads((OBS / "grafana-dashboard.json").read_text())
    # Read into the types generated from Grafana's schema and written back: nothing lost or added.
    assert dashboard.normalized(committed) == committed
    bogus = copy.deepcopy(committed)
    bogus["panels"][1]["fieldconfig"] = {}  # a misspelt key is no part of the model
    assert dashboard.normalized(bogus) != bogus
    panels = committed["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        assert p["type"] in ("row", "timeseries", "stat"), p["type"]
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        refs = [t["refId"] for t in p.get("targets", [])]
        assert len(set(refs)) == len(refs) and all(refs), p["title"]
        assert all(t["datasource"] == {"type": "prometheus", "uid": "${datasource}"} for t in p.get("targets", []))
    names = {v["name"] for v in committed["templating"]["list"]}
    assert names == {"datasource", "model"}
    # The model list has generators too: their metrics are not the classifiers' admissions.
    (models,) = (v for v in committed["templating"]["list"] if v["name"] == "model")
    assert metric_names([models["query"]]) == {"ray_serve_app_admitted_total", "ray_serve_app_gen_tokens_total"}


def test_the_dashboard_shows_what_operators_need():
    names = metric_names(dashboard_exprs(json.loads((OBS / "grafana-dashboard.json").read_text())))
    wanted = {
        "ray_serve_app_admitted_total",  # request rate
        "ray_serve_app_request_latency_ms_bucket",  # p50/p99 per model and priority
        "ray_serve_app_shed_total",  # shed by reason
        "ray_serve_app_queue_depth",
        "ray_serve_app_batch_size_sum",
        "ray_serve_app_breaker_state",
        "ray_serve_app_gen_kv_occupancy",
        "ray_serve_app_gen_tokens_total",
        "ray_serve_app_gen_ttft_ms_bucket",
        "ray_serve_app_gen_itl_ms_bucket",
        "ray_serve_app_cache_lookups_total",
        "ray_serve_app_version_calls_total",
    }
    assert wanted <= names, wanted - names


def test_promtool_accepts_the_rules():
    done = _run("check", "rules", "prometheus-rules.yaml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 7 rules found" in done.stdout, done.stdout


def test_promtool_rejects_a_broken_rule(tmp_path: Path):
    """The checker is real: a rule with a PromQL syntax error fails it."""
    rules = yaml.safe_load((OBS / "prometheus-rules.yaml").read_text())
    rules["groups"][0]["rules"][0]["expr"] = "sum by (model (rate(x[5m]))"
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump(rules))
    done = _run("check", "rules", "broken.yaml", cwd=tmp_path)
    assert done.returncode != 0 and "parse error" in (done.stdout + done.stderr)


def test_each_alert_fires_on_its_failure_and_not_on_health():
    """promtool's rule unit tests: synthetic series in, the alerts that must (and must not) fire."""
    done = _run("test", "rules", "prometheus-rules.test.yaml")
    assert done.returncode == 0, done.stdout + done.stderr
    tested = set(re.findall(r"alertname: (\w+)", (OBS / "prometheus-rules.test.yaml").read_text()))
    alerts = {r["alert"] for g in yaml.safe_load((OBS / "prometheus-rules.yaml").read_text())["groups"] for r in g["rules"]}
    assert tested == alerts


def test_promtool_parses_every_dashboard_query(tmp_path: Path):
    """Each panel query, with Grafana's variables given values, as a recording rule for promtool."""
    exprs = dashboard_exprs(json.loads((OBS / "grafana-dashboard.json").read_text()))
    concrete = [
        e.replace("$__rate_interval", "5m").replace("$__range", "1h").replace("$model", ".*").replace("$datasource", "")
        for e in exprs
    ]
    assert not any("$" in e for e in concrete), concrete
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"panel:q{i}", "expr": e} for i, e in enumerate(concrete)]}]}
    (tmp_path / "dashboard-queries.yaml").write_text(yaml.safe_dump(rules))
    done = _run("check", "rules", "dashboard-queries.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_monitoring_manifest_scrapes_ray_and_haproxy_on_every_ray_pod():
    from ray.serve._private.constants import RAY_SERVE_HAPROXY_METRICS_PORT

    docs = list(yaml.safe_load_all((ROOT / "k8s" / "monitoring.yaml").read_text()))
    kinds = Counter(d["kind"] for d in docs)
    assert kinds == {"PodMonitor": 1, "PrometheusRule": 1, "ConfigMap": 1}
    monitor = next(d for d in docs if d["kind"] == "PodMonitor")
    scraped = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    # Ray's metrics-export-port, and the port HAProxy's exporter listens on where Serve runs it.
    wanted = {"metrics": 8080, "haproxy-metrics": RAY_SERVE_HAPROXY_METRICS_PORT}
    assert scraped == set(wanted)
    ray = yaml.safe_load((ROOT / "k8s" / "rayservice.yaml").read_text())["spec"]["rayClusterConfig"]
    templates = [ray["headGroupSpec"]["template"]] + [g["template"] for g in ray["workerGroupSpecs"]]
    for t in templates:
        assert monitor["spec"]["selector"]["matchLabels"].items() <= t["metadata"]["labels"].items()
        ports = {p["name"]: p["containerPort"] for c in t["spec"]["containers"] for p in c.get("ports", [])}
        assert {name: ports.get(name) for name in wanted} == wanted
    policy = next(yaml.safe_load_all((ROOT / "k8s" / "networkpolicy.yaml").read_text()))
    from_monitoring = [
        r for r in policy["spec"]["ingress"]
        if any("monitoring" in str(f.get("namespaceSelector")) for f in r.get("from", []))
    ]  # fmt: skip
    assert {p["port"] for r in from_monitoring for p in r["ports"]} == set(wanted.values())
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((OBS / "prometheus-rules.yaml").read_text())


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (model) (rate(ray_serve_app_shed_total{model=~"$model"}[5m]))', {"ray_serve_app_shed_total"}),
        ("histogram_quantile(0.99, sum by (le) (rate(ray_serve_app_x_bucket[5m]))) > 500", {"ray_serve_app_x_bucket"}),
        ('max by (deployment) (ray_serve_deployment_replica_healthy{application="ray_x"}) == 0',
         {"ray_serve_deployment_replica_healthy"}),
    ],
)  # fmt: skip
def test_metric_names_are_read_from_queries(expr: str, names: set[str]):
    assert metric_names([expr]) == names


def test_rule_exprs_reads_every_rule():
    rules: dict[str, Any] = yaml.safe_load((OBS / "prometheus-rules.yaml").read_text())
    assert len(rule_exprs(rules)) == 7
