"""GPT-style generator deployment: continuous batching over a preallocated KV cache.

`generate` hands a sequence to the replica's `ContinuousScheduler` and streams
its tokens. One decode loop per replica runs the scheduler's steps in a worker
thread (ONNX Runtime releases the GIL), so the event loop keeps accepting and
streaming while the model runs; a request that arrives mid-step joins the batch
at the next step. `RequestBatchGenerator` (generator_static.py) is the
request-level `@serve.batch` version it replaces, kept for the benchmark.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

import numpy as np
from ray import serve
from ray.serve import metrics

from serve_app.contract import Priority
from serve_app.errors import InvalidInput, ModelFailure, Overloaded, ServeAppError
from serve_app.models.base import OnnxModel
from serve_app.models.generation.continuous import ContinuousScheduler, QueueFull, SchedulerConfig
from serve_app.models.generation.decoder_graph import DecoderGraph
from serve_app.models.generation.kv_cache import KVCache, Past
from serve_app.models.generation.sampling import GenerationParams
from serve_app.models.generation.sequence import Sequence, TokenEvent
from serve_app.models.health import LoopProgress, StallWatch
from serve_app.observability import tracing
from serve_app.observability.histograms import GaugeHistogram
from serve_app.padding import pad_left
from serve_app.tokenization import TextTokenizer

__all__ = ["GeneratorBase", "TextGenerator", "TokenEvent"]

logger = logging.getLogger("ray.serve")
LATENCY_MS = [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0]


class GeneratorBase(OnnxModel):
    """What both generator versions share: tokenizer, parameter checks, the model call."""

    def __init__(self, name: str, model_path: str, config: dict[str, Any]) -> None:
        super().__init__(name, model_path, config)
        assert self.manifest.generation and self.manifest.tokenizer_file, f"{self.name}: not a generator manifest"
        self.gen = g = self.manifest.generation
        self.tokenizer = TextTokenizer.for_model(self.model_dir, self.manifest, truncate=False)
        self.graph = DecoderGraph(self.session, g)
        self._ids = itertools.count(1)
        self.steps = StallWatch()  # the model call running now, for check_health

    def check_health(self) -> None:
        """Serve's periodic probe: unhealthy while a decode step has run past `stall_timeout_s`
        (a wedged loop holds every sequence on the replica)."""
        self.steps.check(self.config.stall_timeout_s, f"{self.name}: a decode step")

    def warm_up(self) -> None:
        ids, mask = pad_left([[self.tokenizer.eos_id]], self.tokenizer.pad_id)
        self.graph(ids, np.zeros((1, 1), dtype=np.int64), mask, self.empty_past(1))

    def empty_past(self, batch: int) -> Past:
        return self.graph.empty_past(batch)

    def run_model(self, ids: np.ndarray, pos: np.ndarray, mask: np.ndarray, past: Past) -> tuple[np.ndarray, Past]:
        """One forward pass: (B, T, V) logits and the present, each layer's past with the T new positions."""
        with self.steps.running():
            self.inject_faults()  # the fault drill: for a generator, one model call is one "batch"
            return self.graph(ids, pos, mask, past)

    def params_from(self, raw: dict[str, Any]) -> GenerationParams:
        cfg = self.config.generation
        return GenerationParams.from_raw(raw, cfg.default_max_tokens, cfg.max_tokens_limit)

    def new_sequence(self, prompt: str, raw_params: dict[str, Any]) -> Sequence:
        if not isinstance(prompt, str):
            raise InvalidInput("prompt must be a string")
        params = self.params_from(raw_params)
        ids = self.tokenizer.encode(prompt) or [self.tokenizer.eos_id]
        if len(ids) >= self.gen.block_size:
            raise InvalidInput(f"prompt is {len(ids)} tokens; this model's context is {self.gen.block_size} tokens")
        try:
            priority = Priority.parse(raw_params.get("priority"))
        except (ValueError, TypeError) as e:
            raise InvalidInput(f"bad priority: {e}") from None
        limit = min(params.max_tokens, self.gen.block_size - len(ids))
        return Sequence(next(self._ids), ids, params, limit, priority=int(priority))


class _Unfinished(Exception):
    """A traced generation that ended before its last token (the caller left, or a step failed)."""


@serve.deployment(max_ongoing_requests=80)
class TextGenerator(GeneratorBase):
    """Batching is the decode loop's, per step (not `@serve.batch`)."""

    def __init__(self, name: str, model_path: str, config: dict[str, Any]) -> None:
        super().__init__(name, model_path, config)
        cfg = self.config.generation
        self.cache = KVCache(self.graph.shape, cfg.kv_slots)
        self.scheduler = ContinuousScheduler(
            self.run_model,
            self.cache,
            eos_id=self.tokenizer.eos_id,
            pad_id=self.tokenizer.pad_id,
            detokenize=self.tokenizer.decode,
            config=SchedulerConfig(cfg.prefill_chunk, cfg.prefill_budget, cfg.max_waiting, cfg.preemption),
        )
        self._streams: dict[int, asyncio.Queue[TokenEvent | ServeAppError]] = {}
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.Task[None] | None = None
        self._metrics = GenerationMetrics(self.name)
        self.progress = LoopProgress()
        self.coalesce = cfg.coalesce_stream
        self.warm_up()

    def check_health(self) -> None:
        """Unhealthy while a decode step runs too long (the base check), or while sequences wait
        and the loop is dead or takes no step: alive and stepping, or replaced."""
        super().check_health()
        alive = self._loop is not None and not self._loop.done()
        stepping = len(self.steps) > 0
        self.progress.check(self.scheduler.has_work, stepping, alive, self.config.stall_timeout_s, f"{self.name}: decode loop")

    async def generate(self, prompt: str, raw_params: dict[str, Any]) -> AsyncGenerator[TokenEvent, None]:
        """Stream TokenEvents for one prompt (call with `handle.options(stream=True)`)."""
        seq = self.new_sequence(prompt, raw_params)
        span = self._trace(seq, raw_params.get(tracing.TRACEPARENT))
        had_work = self.scheduler.has_work
        try:
            self.scheduler.submit(seq)
            self.progress.arrived(had_work)
        except QueueFull as e:
            error = Overloaded(f"{self.name}: {e}", retry_after_s=1.0)
            if span is not None:
                span.end(time.monotonic(), error)
            raise error from None
        queue: asyncio.Queue[TokenEvent | ServeAppError] = asyncio.Queue()
        self._streams[seq.id] = queue
        self._start_loop()
        try:
            while True:
                item = await queue.get()
                if isinstance(item, ServeAppError):
                    raise item
                event = item
                # Tokens that piled up while this stream was being sent go out as one event: under
                # load, each hop (replica, router, proxy) then pays per chunk, not per token.
                while self.coalesce and event.finish_reason is None and not queue.empty():
                    later = queue.get_nowait()
                    if isinstance(later, ServeAppError):
                        yield event
                        raise later
                    event = event.merge(later)
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            # Normal end, error, or the caller went away (the router cancels the stream when its
            # client disconnects): the scheduler drops the sequence and frees its slot next step.
            seq.cancelled = True
            self._streams.pop(seq.id, None)
            if span is not None:
                span.set("serve_app.completion_tokens", len(seq.tokens))
                span.set("serve_app.preemptions", seq.preemptions)
                span.end(time.monotonic(), None if seq.finished else _Unfinished())

    def _trace(self, seq: Sequence, traceparent: Any) -> tracing.OpenSpan | None:
        """The generation's span, under the router's call; its prefill and decode steps go under it."""
        parent = tracing.from_traceparent(traceparent if isinstance(traceparent, str) else None)
        if parent is None:
            return None
        attributes = {
            "serve_app.model": self.name,
            "serve_app.prompt_tokens": len(seq.prompt),
            "serve_app.priority": seq.priority,
        }
        span = tracing.OpenSpan.start("generate", parent, time.monotonic(), attributes, internal=True)
        seq.trace = span.context
        return span

    def _start_loop(self) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
        if self._loop is None or self._loop.done():
            self._loop = asyncio.get_running_loop().create_task(self._decode_loop())
            self._loop.add_done_callback(self._loop_ended)
        self._wake.set()

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        """The loop only ends on a bug: fail its streams rather than leave them waiting forever."""
        if task.cancelled() or task.exception() is None:
            return
        logger.error("%s: decode loop died", self.name, exc_info=task.exception())
        # The exception's text stays in the replica's log: it can carry paths and internals.
        self._fail_all(ModelFailure(f"{self.name}: decode loop failed"))

    def _fail_all(self, error: ServeAppError) -> None:
        for seq in self.scheduler.abort_all():
            if (queue := self._streams.get(seq.id)) is not None:
                queue.put_nowait(error)

    async def _decode_loop(self) -> None:
        assert self._wake is not None
        while True:
            if not self.scheduler.has_work:
                self._export_metrics(self._metrics.refresh)
                self._wake.clear()
                # Awake now and then while idle: Ray drops a gauge that is not set again.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), GenerationMetrics.KEEPALIVE_S)
                continue
            started = time.perf_counter()
            try:
                with self.steps.running():
                    events = await asyncio.to_thread(self.scheduler.step)
                self.progress.stepped()
            except Exception as e:  # a failed step fails its sequences, not the replica
                if not isinstance(e, ServeAppError):
                    logger.exception("%s: decode step failed", self.name)
                    e = ModelFailure(f"{self.name}: decode step failed ({type(e).__name__})")
                self._fail_all(e)
                continue
            for seq, event in events:
                if (queue := self._streams.get(seq.id)) is not None:
                    queue.put_nowait(event)
            if events:
                self.record_batch(len(events), started)  # "batch size": tokens this step produced
            self._export_metrics(self._metrics.update)

    def _export_metrics(self, export: Callable[[ContinuousScheduler], None]) -> None:
        try:
            export(self.scheduler)
        except Exception:  # metrics must not stop the decode loop
            logger.exception("%s: exporting metrics failed", self.name)

    async def stats(self) -> dict[str, Any]:
        """The scheduler's view: running and waiting sequences, KV occupancy, tokens/s, TTFT, ITL."""
        return self.scheduler.snapshot()

    async def runtime_info(self) -> dict[str, Any]:
        info = await super().runtime_info()
        info["generation"] = self.scheduler.snapshot()
        return info


class GenerationMetrics:
    """Prometheus metrics of one replica's decode loop, through Ray's metrics agent.

    Every step counts its tokens and bins their latencies; the gauges and the latency
    histograms are set every EXPORT_S while steps run, when the loop runs out of work, and every
    KEEPALIVE_S while it is idle (within Ray's report interval: Ray forgets a gauge's value once
    it has exported it)."""

    EXPORT_S = 1.0
    KEEPALIVE_S = 5.0

    def __init__(self, model: str, clock: Callable[[], float] = time.monotonic) -> None:
        def tags() -> dict[str, str]:
            return {"model": model}  # fresh each time: Ray Serve adds its own tags to the dict it is given

        def gauge(name: str, doc: str) -> metrics.Gauge:
            g = metrics.Gauge(name, description=doc, tag_keys=("model",))
            g.set_default_tags(tags())
            return g

        self.running = gauge("serve_app_gen_running", "Sequences in the decode batch.")
        self.waiting = gauge("serve_app_gen_waiting", "Sequences waiting for a KV slot (preempted ones included).")
        self.kv_occupancy = gauge("serve_app_gen_kv_occupancy", "Share of KV cache positions in use.")
        self.kv_slots = gauge("serve_app_gen_kv_slots_used", "KV cache slots in use.")
        self.tokens = metrics.Counter("serve_app_gen_tokens", description="Generated tokens.", tag_keys=("model",))
        self.tokens.set_default_tags(tags())
        # Observed for every token: binned here, exported as series (serve_app/observability/histograms.py).
        self.ttft = GaugeHistogram("serve_app_gen_ttft_ms", "Time to first token", LATENCY_MS, ("model",))
        self.itl = GaugeHistogram("serve_app_gen_itl_ms", "Time between consecutive tokens of a sequence", LATENCY_MS, ("model",))
        self._tags = tags()
        self._seen = 0
        self.clock = clock
        self._exported = -float("inf")

    def update(self, s: ContinuousScheduler) -> None:
        """After each step."""
        new = s.stats.generated_tokens - self._seen
        if new:
            self.tokens.inc(new)
        self._seen = s.stats.generated_tokens
        steps = s.stats.last_step_latencies
        self.ttft.add(self._tags, (seconds * 1000 for kind, seconds in steps if kind == "ttft"))
        self.itl.add(self._tags, (seconds * 1000 for kind, seconds in steps if kind != "ttft"))
        if self.clock() - self._exported >= self.EXPORT_S:
            self.refresh(s)

    def refresh(self, s: ContinuousScheduler) -> None:
        """Set every gauge and latency series now."""
        self.running.set(len(s.running))
        self.waiting.set(len(s.waiting))
        self.kv_slots.set(s.cache.used_slots)
        self.kv_occupancy.set(s.cache.used_positions / s.cache.capacity_positions)
        self.ttft.flush()
        self.itl.flush()
        self._exported = self.clock()
