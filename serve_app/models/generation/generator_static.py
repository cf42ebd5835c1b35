"""Request-level batching for the generator: the `@serve.batch` version continuous batching replaced.

Kept as `generation.scheduler: request` so that the benchmark can run both side
by side (benchmarks/generation.py). `@serve.batch` groups prompts, which are
left-padded and decoded together one token per step until every row is done: a
short generation waits for the longest in its batch, and newcomers wait for the
whole batch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

import numpy as np
from ray import serve

from serve_app.config import BatchingConfig
from serve_app.errors import ServeAppError
from serve_app.models.generation.generator import GeneratorBase
from serve_app.models.generation.sequence import Sequence, TokenEvent
from serve_app.padding import pad_left

# Placeholder for a running row in a step where only failed rows report; never sent on.
KEEPALIVE = TokenEvent("", None, 0, 0, None)


@serve.deployment(max_ongoing_requests=32)
class RequestBatchGenerator(GeneratorBase):
    def __init__(self, name: str, model_path: str, config: dict[str, Any]) -> None:
        super().__init__(name, model_path, config)
        self.cancelled_rows = 0  # generations stopped because their caller left
        self.apply_batching(self.batching)
        self.warm_up()

    def apply_batching(self, batching: BatchingConfig) -> None:
        super().apply_batching(batching)
        batcher: Any = self._run_batch  # type: ignore[misc]  # Ray types @serve.batch as the bare function
        batcher.set_max_batch_size(batching.max_batch_size)
        batcher.set_batch_wait_timeout_s(batching.batch_wait_timeout_s)

    async def runtime_info(self) -> dict[str, Any]:
        return {**await super().runtime_info(), "cancelled_rows": self.cancelled_rows}

    async def generate(self, prompt: str, raw_params: dict[str, Any]) -> AsyncGenerator[TokenEvent, None]:
        """Stream TokenEvents for one prompt (call with `handle.options(stream=True)`)."""
        seq = self.new_sequence(prompt, raw_params)
        try:
            # Called with one row; @serve.batch collects rows into the list the method takes (Ray's
            # typing covers list -> list methods only, not streaming ones).
            async for event in self._run_batch(seq):  # type: ignore[misc, call-arg]
                if isinstance(event, ServeAppError):
                    raise event
                if event is not KEEPALIVE:
                    yield event
        finally:
            # Normal end, error, or the caller cancelled (client disconnect): in every case the
            # row must stop decoding. Only the last matters here; the others are already done.
            seq.cancelled = True

    async def stats(self) -> dict[str, Any]:
        """Batches run, by size: request-level batching's one figure of merit."""
        return {"batch_sizes": dict(self.batch_sizes), "cancelled_rows": self.cancelled_rows}

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.01)  # type: ignore[arg-type]
    async def _run_batch(self, rows: list[Sequence]) -> AsyncGenerator[list[Any], None]:  # type: ignore[misc]
        started = time.perf_counter()
        ids, mask = pad_left([r.prompt for r in rows], self.tokenizer.pad_id)
        pos = np.clip(mask.cumsum(1) - 1, 0, None)
        try:
            logits, past = await asyncio.to_thread(self.run_model, ids, pos, mask, self.empty_past(len(rows)))
        except ServeAppError as e:
            yield [e] * len(rows)
            return
        self.record_batch(len(rows), started)
        next_pos = pos[:, -1:] + 1
        while True:
            feed = np.full((len(rows), 1), self.tokenizer.pad_id, dtype=np.int64)
            out: list[Any] = []
            for i, row in enumerate(rows):
                if not row.finished and row.cancelled:
                    row.finished = True
                    self.cancelled_rows += 1
                if row.finished:
                    out.append(StopIteration)  # tells @serve.batch this caller's stream ended
                    continue
                out.append(row.advance(logits[i, -1], self.tokenizer.eos_id, self.tokenizer.decode))
                feed[i, 0] = row.tokens[-1] if row.tokens else self.tokenizer.eos_id
            yield out
            if all(r.finished for r in rows):
                return
            mask = np.concatenate([mask, np.ones((len(rows), 1), dtype=np.int64)], axis=1)
            try:
                logits, past = await asyncio.to_thread(self.run_model, feed, next_pos, mask, past)
            except ServeAppError as e:
                yield [StopIteration if r.finished else e for r in rows]
                return
            # Finished rows are still fed (the batch decodes to its longest member); keep their
            # positions inside the embedding table, their outputs are never read.
            next_pos = np.minimum(next_pos + 1, self.gen.block_size - 1)
