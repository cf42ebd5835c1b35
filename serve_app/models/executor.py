"""One batch at a time per replica; calls that arrive while it runs are merged into the next.

Batches are formed upstream, in the router's dispatcher, where priority and
deadlines are known. This executor is the replica's half: like a Triton model
instance it runs one batch at a time (a second concurrent ONNX Runtime run
would only fight the first for the same cores), and it merges the calls
queued behind a running batch up to `max_items`, so batches from several
router replicas still fill. It reports how long each call waited, which is
the router's capacity signal. No Ray here.

A replica with an urgent lane has two executors, one per session: each runs
its batches in a thread of its own (`pool`), and the bulk lane's thread runs
at the lowest CPU priority (serve_app.models.runtime), so a high-priority
batch started beside a running bulk batch gets the cores.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

# Runs in a worker thread: payloads in, one result (or ServeAppError) per payload out.
RunBatch = Callable[[list[Any]], list[Any]]


@dataclass
class _Call:
    payloads: list[Any]
    items: int
    arrived: float
    future: asyncio.Future[tuple[list[Any], float, float]]


class BatchExecutor:
    def __init__(self, run: RunBatch, max_items: int, pool: Executor | None = None) -> None:
        self.run = run
        self.max_items = max_items
        self.pool = pool  # None: asyncio's default thread pool
        self._pending: list[_Call] = []
        self._worker: asyncio.Task[None] | None = None

    async def submit(self, payloads: list[Any], items: int) -> tuple[list[Any], float, float]:
        """Results for `payloads`, the seconds the call waited, and the seconds its batch ran."""
        loop = asyncio.get_running_loop()
        call = _Call(payloads, items, time.perf_counter(), loop.create_future())
        self._pending.append(call)
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._drain())
        return await call.future

    def _take(self) -> list[_Call]:
        """Whole calls, oldest first, up to `max_items` rows (at least one call)."""
        taken, size = [self._pending.pop(0)], 0
        size = taken[0].items
        while self._pending and size + self._pending[0].items <= self.max_items:
            call = self._pending.pop(0)
            taken.append(call)
            size += call.items
        return taken

    async def _drain(self) -> None:
        while self._pending:
            calls = [c for c in self._take() if not c.future.cancelled()]
            if not calls:
                continue
            payloads = [p for c in calls for p in c.payloads]
            started = time.perf_counter()
            try:
                results = await asyncio.get_running_loop().run_in_executor(self.pool, self.run, payloads)
            except Exception as e:  # a bug in the batch function fails this batch, not the replica
                for c in calls:
                    if not c.future.done():
                        c.future.set_exception(e)
                continue
            exec_s = time.perf_counter() - started
            offset = 0
            for c in calls:
                part = results[offset : offset + len(c.payloads)]
                offset += len(c.payloads)
                if not c.future.done():
                    c.future.set_result((part, started - c.arrived, exec_s))
