"""Test doubles shared by the policy tests."""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any

from benchmarks.virtual_time import Clock, VirtualTimeLoop

__all__ = ["Clock", "VirtualTimeLoop", "virtual_time"]


def virtual_time(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """Run an async test on a fresh VirtualTimeLoop."""

    @functools.wraps(test)
    def run() -> None:
        loop = VirtualTimeLoop()
        try:
            loop.run_until_complete(test())
        finally:
            loop.close()

    return run
