"""The ingress settings every deployment of this app starts Ray with: one place that
`serve-app serve`, the KubeRay manifest (serve_app/tools/kuberay.py) and the benchmarks read.

Ray reads these when it starts (its HAProxy and proxies), so they are environment variables of
the processes that start Ray, not fields of the Serve config.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping

# HAProxy's connections at once (its global `maxconn`; Ray's default 4096). The same number decides
# whether HAProxy keeps a connection to the router open for the next request: once a fifth of the
# descriptors it may use are taken (`tune.pool-low-fd-ratio`), a connection that finished its
# request is closed instead of kept idle. At Ray's default that fifth is about a thousand requests
# in flight, which an open-loop spike reaches: each request then opened a new connection to the
# router, whose event loop accepts one connection per turn, so requests and HAProxy's health
# checks queued in the router's accept queue until the checks failed and the clients timed out
# (benchmarks/results/soak/README.md). HAProxy asks for about 2.5 descriptors a connection (both
# sides and the splice pipes of Ray's config) and will not start when the hard limit is lower.
HAPROXY_MAXCONN = 7680
RAY_DEFAULT_MAXCONN = 4096
FDS_PER_CONNECTION = 2.5
FD_HEADROOM = 256  # listeners, health checks, logs


def haproxy_maxconn(fd_hard_limit: int | None) -> int:
    """`HAPROXY_MAXCONN`, or as much of it as a hard limit on open files lets HAProxy start with
    (None: unknown, as for the KubeRay pods, whose runtimes allow far more). Never below Ray's own
    default: a limit too low for that already kept HAProxy from starting."""
    if fd_hard_limit is None or fd_hard_limit < 0:  # RLIM_INFINITY is -1 on Linux
        return HAPROXY_MAXCONN
    fits = int((fd_hard_limit - FD_HEADROOM) / FDS_PER_CONNECTION)
    return max(RAY_DEFAULT_MAXCONN, min(HAPROXY_MAXCONN, fits))


def local_haproxy_maxconn() -> int:
    """`haproxy_maxconn` for a Ray started from this process: HAProxy inherits its hard limit."""
    try:
        import resource  # POSIX only
    except ImportError:
        return haproxy_maxconn(None)
    return haproxy_maxconn(resource.getrlimit(resource.RLIMIT_NOFILE)[1])


# Opt-in, not shipped: behind HAProxy, v2 infer from the router's HTTP server straight to its app,
# ahead of Serve's per-request wrapper (serve_app/router/edge/direct.py), through Serve's hook for
# HTTP middlewares. Faster, but then those calls behave unlike the same app under any other
# launcher: a timeout is a 504 (limits.infer_timeout_s) instead of Serve's 408, and Serve's
# request metrics, access log and max_ongoing_requests leave them out.
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
    "RAY_SERVE_HAPROXY_MAXCONN": str(haproxy_maxconn(None)),
}


def with_ingress_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with the ingress settings added, HAProxy's connections fitted to this machine's limit
    on open files; a variable already set there wins (an operator's choice)."""
    return {**INGRESS_ENV, "RAY_SERVE_HAPROXY_MAXCONN": str(local_haproxy_maxconn()), **env}


def export_lines(env: Mapping[str, str]) -> str:
    """The ingress settings as shell `export` lines (`serve-app ingress-env`), for the nodes of a
    cluster started with `ray start`: Ray reads them when it starts, on each node."""
    return "\n".join(f"export {name}={shlex.quote(value)}" for name, value in env.items())
