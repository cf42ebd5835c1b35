"""The ingress settings every deployment of this app starts Ray with: one place that
`serve-app serve`, the KubeRay manifest (serve_app/tools/kuberay.py) and the benchmarks read.

Ray reads these when it starts (its HAProxy and proxies), so they are environment variables of
the processes that start Ray, not fields of the Serve config.
"""

from __future__ import annotations

from collections.abc import Mapping

# Behind HAProxy, v2 infer from the router's HTTP server straight to its app, ahead of Serve's
# per-request wrapper (serve_app/router/edge/direct.py), through Serve's hook for HTTP middlewares.
DIRECT_INFER_ENV: dict[str, str] = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "serve_app.router.edge.direct:middlewares"}

INGRESS_ENV: dict[str, str] = {
    # HAProxy in front of the router replicas, and direct gRPC between replicas: the best of the
    # four ingress settings measured (benchmarks/results/ingress/local/).
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    # Besides a refused connection, a request that a dying router replica dropped without an answer
    # is replayed on another router: no endpoint has side effects (benchmarks/results/chaos/).
    "RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure empty-response",
    # A router replica leaves HAProxy after five failed health checks in a row, not two, so that a
    # router busy for a few seconds under a spike is not replaced by Serve's Python proxy, which
    # sends the same requests to the same router at a fraction of the speed. A dead one refuses
    # connections and is out in about a second either way.
    "RAY_SERVE_HAPROXY_HEALTH_CHECK_FALL": "5",
    # A request HAProxy replays is tried again up to this many times, a second apart: long enough
    # for the health checks above to take a dead router out, after which the replay goes to Serve's
    # proxy (HAProxy's backup server), which holds it until Serve has started a new router. With
    # HAProxy's default of three, a lone router's death answered its requests in flight with a 500.
    "RAY_SERVE_HAPROXY_RETRIES": "8",
    # Nor is a router taken out for errors HAProxy sees on live traffic: under an open-loop spike a
    # few connections to a saturated router time out, and marking it down for them hands the whole
    # spike to Serve's Python proxy (benchmarks/results/goodput/). Health checks and refused
    # connections still take a dead router out.
    "RAY_SERVE_HAPROXY_OBSERVE_MARK_DOWN_ENABLED": "0",
    # HAProxy replays only a request that fits in one buffer: 64 KiB holds a JSON image.
    "RAY_SERVE_HAPROXY_TUNE_BUFSIZE": "65536",
    **DIRECT_INFER_ENV,
}


def with_ingress_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with the ingress settings added; a variable already set there wins (an operator's choice)."""
    return {**INGRESS_ENV, **env}
