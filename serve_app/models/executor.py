"""One batch at a time per session; calls that arrive while it runs are merged into the next.

Batches are formed upstream, in the router's dispatcher, where priority and
deadlines are known. This executor is the replica's half: like a Triton model
instance it runs one batch at a time per session (a second concurrent run on
a session sized for the cores would only fight the first), and it merges the calls
queued behind a running batch up to `max_items`, so batches from several
router replicas still fill. It reports how long each call waited, which is
the router's capacity signal. No Ray here.

A replica with an urgent lane has two executors, one per lane: each runs
its batches in threads of its own (`pool`), and the bulk lane's threads run
at the lowest CPU priority (serve_app.models.runtime), so a high-priority
batch started beside a running bulk batch gets the cores.

An urgent call (a high-priority batch the router sent on its urgent lane to a
replica that runs no session of its own for it: `urgent_session: false`) goes
ahead of every bulk call still waiting and runs as a batch of urgent calls
only: it waits for a running batch to end, never for the batches queued
behind it, and its own batch is not made longer by bulk rows. Up to a bound: a
bulk call that has waited `bulk_max_wait_s` goes next, ahead of the urgent
ones. With more high priority than the model can run, urgent calls would
otherwise be waiting at every turn, and the bulk batches the router had
already sent (admitted requests, in no queue of the router's any more) would
wait until their clients gave up.

Several `runs` (one per session) run that many batches at once. On CPU the
bulk lane uses this: two single-threaded sessions side by side instead of one
session on two threads. Why: a background batch is preempted by everything
else on the node (the router, the proxy, an urgent batch), and one
intra-op thread preempted stalls the other at the next barrier of every
operator; side by side, a preemption slows one batch only. Measured with
`python -m benchmarks contention` (benchmarks/results/contention/bench-realsize/):
beside bursty background load, two sessions x 1 thread lose less throughput
than one session x 2 threads; alone, the two are about even.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from serve_app.models.health import StallWatch

# The longest a bulk call waits while urgent calls keep going ahead of it: of the order of the
# router's own queue budgets (serve_app.scheduling.dispatcher), well inside a client's timeout.
BULK_MAX_WAIT_S = 1.0

# Runs in a worker thread: payloads in, one result (or ServeAppError) per payload out.
RunBatch = Callable[[list[Any]], list[Any]]


@dataclass
class _Call:
    payloads: list[Any]
    items: int
    arrived: float
    future: asyncio.Future[tuple[list[Any], float, float]]
    urgent: bool = False


class BatchExecutor:
    def __init__(
        self,
        run: RunBatch | list[RunBatch],
        max_items: int,
        pool: Executor | None = None,
        clock: Callable[[], float] = time.perf_counter,
        bulk_max_wait_s: float = BULK_MAX_WAIT_S,
    ) -> None:
        # One worker per run function; each runs one batch at a time (a session is not shared).
        self.runs = run if isinstance(run, list) else [run]
        if not self.runs:
            raise ValueError("at least one run function")
        self.max_items = max_items
        self.pool = pool  # None: asyncio's default thread pool; else one with a thread per run
        self.clock = clock
        self.bulk_max_wait_s = bulk_max_wait_s
        self.watch = StallWatch(clock)  # the batches running now, for the replica's health check
        self._pending: list[_Call] = []
        self._workers: list[asyncio.Task[None] | None] = [None] * len(self.runs)

    async def submit(self, payloads: list[Any], items: int, urgent: bool = False) -> tuple[list[Any], float, float]:
        """Results for `payloads`, the seconds the call waited, and the seconds its batch ran.
        `urgent`: taken before every bulk call waiting, after the urgent ones that came first."""
        loop = asyncio.get_running_loop()
        call = _Call(payloads, items, self.clock(), loop.create_future(), urgent)
        if urgent:
            self._pending.insert(sum(1 for c in self._pending if c.urgent), call)
        else:
            self._pending.append(call)
        for i, worker in enumerate(self._workers):
            if worker is None or worker.done():
                self._workers[i] = loop.create_task(self._drain(self.runs[i]))
                break
        return await call.future

    def _take(self) -> list[_Call]:
        """Whole calls, oldest first, up to `max_items` rows (at least one call); urgent calls
        first, unless a bulk call has waited `bulk_max_wait_s`; a batch of either kind takes no
        call of the other."""
        first = self._starved_bulk()
        taken = [self._pending.pop(first)]
        size = taken[0].items
        while (
            len(self._pending) > first
            and size + self._pending[first].items <= self.max_items
            and self._pending[first].urgent == taken[0].urgent
        ):
            call = self._pending.pop(first)
            taken.append(call)
            size += call.items
        return taken

    def _starved_bulk(self) -> int:
        """Where the next batch starts in the pending calls: at the oldest bulk call still awaited
        if urgent calls are ahead of it and it has waited `bulk_max_wait_s`, else at the front."""
        if not self._pending[0].urgent:
            return 0
        bulk = next((i for i, c in enumerate(self._pending) if not c.urgent and not c.future.cancelled()), None)
        if bulk is None or self.clock() - self._pending[bulk].arrived < self.bulk_max_wait_s:
            return 0
        return bulk

    async def _drain(self, run: RunBatch) -> None:
        while self._pending:
            calls = [c for c in self._take() if not c.future.cancelled()]
            if not calls:
                continue
            payloads = [p for c in calls for p in c.payloads]
            started = self.clock()
            try:
                with self.watch.running():
                    results = await asyncio.get_running_loop().run_in_executor(self.pool, run, payloads)
            except Exception as e:  # a bug in the batch function fails this batch, not the replica
                for c in calls:
                    if not c.future.done():
                        c.future.set_exception(e)
                continue
            exec_s = self.clock() - started
            offset = 0
            for c in calls:
                part = results[offset : offset + len(c.payloads)]
                offset += len(c.payloads)
                if not c.future.done():
                    c.future.set_result((part, started - c.arrived, exec_s))
