"""One Serve application per test module, started the way `serve.run` users start it, on a Serve
that the modules of a package share: starting Ray and Serve is most of a module's setup on a
small machine."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.app import build_app
from serve_app.protocols.grpc_v2 import SERVICER
from tests.integration.cli_serving import ready, wait_for

# Driver-side handles made by a module's tests. Each runs a metrics pusher that outlives
# serve.shutdown(); left running, it reconnects to whichever Ray starts next and, once that
# one is stopped, kills the pytest process at exit (seen in CI: "Failed to connect to GCS").
_HANDLES: list[DeploymentHandle] = []


def deployment_handle(name: str, app: str) -> DeploymentHandle:
    handle = serve.get_deployment_handle(name, app)
    _HANDLES.append(handle)
    return handle


# The in-process Serve that the modules of tests/integration/shared_serve share, one after another.
SHARED_PORT = 8123
SHARED_GRPC_PORT = 9123


def shared_serve() -> Iterator[str]:
    """Start Ray and Serve in this process, yield Serve's URL, then tear both down. Serve's gRPC
    proxy serves the OIP v2 gRPC service on SHARED_GRPC_PORT too."""
    # Logical CPUs: six or more deployments at the default 1 CPU each, on a 2-core machine.
    # address="local": always a cluster of our own, never one a previous module left exiting.
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    grpc = {"port": SHARED_GRPC_PORT, "grpc_servicer_functions": [SERVICER]}
    serve.start(http_options={"host": "127.0.0.1", "port": SHARED_PORT}, grpc_options=grpc)
    try:
        yield f"http://127.0.0.1:{SHARED_PORT}"
    finally:
        release_handles()
        serve.shutdown()
        ray.shutdown()


def app_for_module(args: dict[str, Any], url: str, name: str = "default") -> Iterator[str]:
    """Run the app on the shared Serve (`serve.run`, as users do), yield its URL once
    /v2/health/ready says so, then delete it: the next module starts from an empty Serve."""
    try:
        serve.run(build_app(args), name=name, route_prefix="/")
        wait_for(lambda: ready(url), 120, "application never became ready")
        yield url
    finally:
        release_handles()
        serve.delete(name)


def release_handles() -> None:
    """Stop the handles' metrics pushers before their cluster goes away."""
    while _HANDLES:
        _HANDLES.pop().shutdown()
