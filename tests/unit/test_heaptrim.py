"""The router's heap trim: real glibc hands freed pages back, and the background loop calls it."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from serve_app.process.heaptrim import HeapTrim
from serve_app.router.background import BackgroundLoops
from tests.unit.test_background import pool


def resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
def test_trimming_gives_freed_heap_pages_back_to_the_os():
    heap = HeapTrim()
    assert heap.available
    heap.trim()  # start from a trimmed heap
    # 64 KiB blocks come from the heap (under glibc's mmap threshold); freeing every other one
    # leaves holes that glibc keeps, because the blocks above them are still in use.
    blocks = [bytearray(os.urandom(16)) * 4096 for _ in range(2048)]  # 128 MiB
    del blocks[::2]
    held = resident_bytes()
    assert heap.trim()
    returned = held - resident_bytes()
    assert returned > 32 * 2**20, f"{returned / 2**20:.1f} MiB returned of the 64 MiB freed"
    assert heap.trims == 2 and heap.released >= 1
    del blocks


def test_without_glibc_trimming_is_a_no_op():
    heap = HeapTrim(None, probe=False)
    assert not heap.available and not heap.trim() and heap.trims == 0


def test_the_router_trims_its_heap_again_and_again(monkeypatch: pytest.MonkeyPatch):
    # A real loop and a real thread (a trim runs off the event loop), so no virtual clock here:
    # the interval is shortened and the test waits for the count, not for a time.
    monkeypatch.setattr("serve_app.router.background.TRIM_EVERY_S", 0.01)
    calls: list[int] = []

    def fake_malloc_trim(pad: int) -> int:
        calls.append(pad)
        return 1  # "some memory went back"

    async def go() -> None:
        loops = BackgroundLoops(pool(), {}, None)
        loops.heap_trim = HeapTrim(fake_malloc_trim)
        loops.start()
        while loops.heap_trim.released < 3:  # counted after the call returns, in the trim's thread
            await asyncio.sleep(0.01)
        loops.check()
        await loops.stop()
        assert set(calls) == {0}

    asyncio.run(asyncio.wait_for(go(), 30))
