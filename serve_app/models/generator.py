"""GPT-style generator deployment: KV-cache decoding, token streaming.

Request-level batching for now: `@serve.batch` groups prompts, which are
left-padded and decoded together one token per step until every row is done.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from ray import serve

from serve_app.errors import InvalidInput, ServeAppError
from serve_app.models.base import OnnxModel
from serve_app.models.batching import pad_left
from serve_app.models.sampling import GenerationParams, StreamingText, sample
from serve_app.tokenization import TextTokenizer


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    params: GenerationParams
    # Set when the caller goes away; the decode loop then stops this row at its next step.
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(frozen=True)
class TokenEvent:
    """One decode step's output for one request; the last one has a finish_reason."""

    text: str
    token_id: int | None
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None = None  # "stop" (EOS or stop string) or "length"


@dataclass
class _Row:
    request: GenerateRequest
    params: GenerationParams
    prompt: list[int]
    limit: int  # max new tokens, capped by the context window
    rng: np.random.Generator
    stream: StreamingText
    tokens: list[int]
    done: bool = False


# Placeholder for a running row in a step where only failed rows report; never sent on.
KEEPALIVE = TokenEvent("", None, 0, 0, None)


@serve.deployment(max_ongoing_requests=32)
class TextGenerator(OnnxModel):
    cancelled_rows = 0  # generations stopped because their caller left

    def warm_up(self) -> None:
        assert self.manifest.generation and self.manifest.tokenizer_file, f"{self.name}: not a generator manifest"
        self.gen = self.manifest.generation
        self.tokenizer = TextTokenizer.from_file(self.model_dir / self.manifest.tokenizer_file)
        ids, mask = pad_left([[self.tokenizer.eos_id]], self.tokenizer.pad_id)
        self._step(ids, mask, np.zeros((1, 1), dtype=np.int64), self._empty_past(1))

    def _empty_past(self, batch: int) -> np.ndarray:
        g = self.gen
        return np.zeros((g.n_layers, 2, batch, g.n_heads, 0, g.head_dim), dtype=np.float32)

    def _step(self, ids: np.ndarray, mask: np.ndarray, pos: np.ndarray, past: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.faults.delay_s:  # the fault drill: a generator's "batch" is one decode step
            time.sleep(self.faults.delay_s)
        logits, present = self.session.run(None, {"input_ids": ids, "position_ids": pos, "attention_mask": mask, "past": past})
        return logits[:, -1], present  # (B, V), (L, 2, B, nh, P+T, hs)

    def params_from(self, raw: dict[str, Any]) -> GenerationParams:
        stop = raw.get("stop") or ()
        params = GenerationParams(
            max_tokens=int(raw.get("max_tokens") or self.config.generation.default_max_tokens),
            temperature=float(raw.get("temperature", 0.0)),
            top_p=float(raw.get("top_p", 1.0)),
            top_k=int(raw.get("top_k", 0)),
            seed=raw.get("seed"),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
        )
        params.validate(self.config.generation.max_tokens_limit)
        return params

    async def generate(self, prompt: str, raw_params: dict[str, Any]) -> AsyncGenerator[TokenEvent, None]:
        """Stream TokenEvents for one prompt (call with `handle.options(stream=True)`)."""
        if not isinstance(prompt, str):
            raise InvalidInput("prompt must be a string")
        request = GenerateRequest(prompt, self.params_from(raw_params))
        try:
            async for event in self._run_batch(request):
                if isinstance(event, ServeAppError):
                    raise event
                if event is not KEEPALIVE:
                    yield event
        finally:
            # Normal end, error, or the caller cancelled (client disconnect): in every case the
            # row must stop decoding. Only the last matters here; the others are already done.
            request.cancelled.set()

    def _new_row(self, req: GenerateRequest) -> _Row:
        assert self.tokenizer is not None
        prompt = self.tokenizer.encode(req.prompt) or [self.tokenizer.eos_id]
        if len(prompt) >= self.gen.block_size:
            raise InvalidInput(f"prompt is {len(prompt)} tokens; this model's context is {self.gen.block_size} tokens")
        limit = min(req.params.max_tokens, self.gen.block_size - len(prompt))
        return _Row(req, req.params, prompt, limit, np.random.default_rng(req.params.seed), StreamingText(req.params.stop), [])

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.01)
    async def _run_batch(self, requests: list[GenerateRequest]) -> AsyncGenerator[list[Any], None]:
        rows: list[_Row | None] = []
        first: list[Any] = []
        for req in requests:
            try:
                rows.append(self._new_row(req))
                first.append(None)
            except ServeAppError as e:
                rows.append(None)
                first.append(e)
        live = [r for r in rows if r is not None]
        if not live:
            yield first
            return
        if any(isinstance(f, ServeAppError) for f in first):
            # Failed rows get their error now; they hold no slot in the decode loop.
            yield [f if f is not None else KEEPALIVE for f in first]
        started = time.perf_counter()
        ids, mask = pad_left([r.prompt for r in live], self.tokenizer.pad_id)
        pos = np.clip(mask.cumsum(1) - 1, 0, None)
        logits, past = await asyncio.to_thread(self._step, ids, mask, pos, self._empty_past(len(live)))
        self.record_batch(len(live), started)
        next_pos = pos[:, -1:] + 1
        slot = {id(r): i for i, r in enumerate(live)}  # row -> index in the running batch
        while True:
            feed = np.full((len(live), 1), self.tokenizer.pad_id, dtype=np.int64)
            out: list[Any] = []
            for row in rows:
                if row is not None and not row.done and row.request.cancelled.is_set():
                    row.done = True
                    self.cancelled_rows += 1
                if row is None or row.done:
                    out.append(StopIteration)  # tells @serve.batch this caller's stream ended
                    continue
                i = slot[id(row)]
                out.append(self._advance(row, logits[i]))
                feed[i, 0] = row.tokens[-1] if row.tokens else self.tokenizer.eos_id
            yield out
            if all(r.done for r in live):
                return
            mask = np.concatenate([mask, np.ones((len(live), 1), dtype=np.int64)], axis=1)
            logits, past = await asyncio.to_thread(self._step, feed, mask, next_pos, past)
            next_pos = next_pos + 1

    def _advance(self, row: _Row, logits: np.ndarray) -> TokenEvent:
        """Sample one token for `row` and report the text it adds."""
        tok = sample(logits, row.params, row.rng)
        finish: str | None = None
        if tok == self.tokenizer.eos_id:
            finish = "stop"
        else:
            row.tokens.append(tok)
            if len(row.tokens) >= row.limit:
                finish = "length"
        delta = row.stream.update(self.tokenizer.decode(row.tokens))
        if row.stream.stopped:
            finish = "stop"
        if finish:
            delta += row.stream.flush()
            row.done = True
        return TokenEvent(delta, tok, len(row.prompt), len(row.tokens), finish)
