"""Every endpoint and dependency of the router runs on its event loop.

FastAPI runs a plain `def` endpoint or dependency in a worker thread, one hop per request,
and anyio's hop looks for the loop's root task by walking every task on it: with the
thousands of requests a router holds under a flood, that walk is a large share of its CPU.
"""

from __future__ import annotations

import inspect

import pytest
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute

from serve_app.router.endpoints import endpoints_openai, endpoints_status, endpoints_v2


def _calls(d: Dependant) -> list:
    return [d.call, *(c for sub in d.dependencies for c in _calls(sub))]


@pytest.mark.parametrize("module", [endpoints_v2, endpoints_openai, endpoints_status], ids=lambda m: m.__name__)
def test_every_endpoint_and_dependency_is_async(module) -> None:  # type: ignore[no-untyped-def]
    routes = [r for r in module.api.routes if isinstance(r, APIRoute)]
    assert routes
    for route in routes:
        for call in _calls(route.dependant):
            if call is not None:
                assert inspect.iscoroutinefunction(call), f"{route.path}: {call.__qualname__} is not async"
