"""A stalled batch sent once more: the first answer wins.

A replica whose node is gone, or that Serve is stopping for a rolling update, can leave a call
unanswered for many seconds (until Ray declares the node dead, or the batch timeout), and every
request of the batch waits with it while the model's other replicas sit idle. A batch still
unanswered after a few of its predicted service times is sent again beside the first call;
Serve's handle routes the copy by its replicas' answers to queue-length probes, which a lost
replica does not give, and whichever call answers first answers the batch, the other cancelled.

A budget bounds the extra work, as gRPC's hedging throttle does: each batch sent earns a tenth of
a token, a hedge spends one, so a model that is slow for every batch (overloaded, not lost) is
sent at most a tenth more work. No Ray here: the calls are any awaitables.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class HedgeBudget:
    """Tokens for hedges: `ratio` earned per batch sent, up to `burst` (and as many at the start,
    so that the batches stalled by one lost node can all be hedged at once)."""

    def __init__(self, ratio: float = 0.1, burst: float = 8.0) -> None:
        if ratio <= 0 or burst < 1:
            raise ValueError(f"a hedge budget needs a positive ratio and a burst of one at least, got {ratio}, {burst}")
        self.ratio, self.burst = ratio, burst
        self.tokens = burst

    def earn(self) -> None:
        self.tokens = min(self.burst, self.tokens + self.ratio)

    def spend(self) -> bool:
        """Whether a hedge may go now; takes its token if so."""
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


async def first_answer(call: Callable[[], Awaitable[T]], after_s: float | None, may_hedge: Callable[[], bool]) -> tuple[T, bool]:
    """`call()`'s result, and whether a second `call()` was sent: the second goes when the first has
    not answered within `after_s` (None: never) and `may_hedge()` allows it. The first call to
    succeed wins and the other is cancelled; a call that fails leaves the other to answer, and
    where both fail, the later failure is raised. Cancelling this cancels both."""
    first: asyncio.Future[T] = asyncio.ensure_future(call())
    try:
        done, _ = await asyncio.wait({first}, timeout=after_s)
    except asyncio.CancelledError:
        first.cancel()
        raise
    if done or not may_hedge():
        return await first, False
    second: asyncio.Future[T] = asyncio.ensure_future(call())
    pending: set[asyncio.Future[T]] = {first, second}
    error: BaseException | None = None
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if (error := task.exception()) is None:
                    return task.result(), True
        assert error is not None
        raise error
    finally:
        for task in (first, second):
            task.cancel()
