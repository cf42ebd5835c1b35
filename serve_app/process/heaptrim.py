"""Hands the C heap's free pages back to the operating system now and then.

Under a flood the router holds thousands of request bodies at once; glibc keeps the pages they
freed in its arenas (one per thread that allocated) as a high-water mark, so the process's
resident size climbs to the largest flood it has seen and stays there, which an operator cannot
tell apart from a leak. `malloc_trim(0)` returns every whole free page of every arena.
Elsewhere than glibc (musl, macOS) there is no such call and this does nothing.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable


def _glibc_malloc_trim() -> Callable[[int], int] | None:
    try:  # the C library this process already runs on: no search for it on disk
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    trim: Callable[[int], int] = fn
    return trim


class HeapTrim:
    """`trim()` returns whether any memory went back; `trims`/`released` count the calls that did."""

    def __init__(self, malloc_trim: Callable[[int], int] | None = None, *, probe: bool = True) -> None:
        self._malloc_trim = malloc_trim if malloc_trim is not None or not probe else _glibc_malloc_trim()
        self.trims = 0
        self.released = 0

    @property
    def available(self) -> bool:
        return self._malloc_trim is not None

    def trim(self) -> bool:
        if self._malloc_trim is None:
            return False
        self.trims += 1
        released = bool(self._malloc_trim(0))
        self.released += released
        return released
