"""Classifier deployments: BERT-style text and ResNet-style image models.

Two ways in. The router sends a batch as one call (`run`): a list of payloads,
one per client request. A batch returns exactly one result per payload; a
payload that fails validation fails alone (its slot holds the exception) while
the rest run. Any other caller of a `DeploymentHandle` (another Serve app, a
pipeline, a notebook) sends one input per call (`classify`) and gets a plain
`Prediction` or the project's typed error: `@serve.batch` gathers those calls
into batches, sized by the model's `batching` (live through `user_config`),
and runs them on the bulk lane beside the router's.

Lanes: the router sends high-priority batches on the urgent lane and the rest
on the bulk lane (serve_app.scheduling.dispatcher). Each lane has its own
ONNX Runtime session and thread; the bulk lane's threads run at the lowest CPU
priority, so an urgent batch started while a bulk batch runs takes the cores
at once instead of waiting for it (stopping an ORT run would throw its work away).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import numpy as np
import onnxruntime as ort
import ray
from ray import serve

from serve_app.config import BatchingConfig
from serve_app.contract import BULK, LINK_ONGOING, URGENT, BatchReply, LinkAddress, RouterLoad
from serve_app.errors import InvalidInput, ServeAppError
from serve_app.link.server import LinkServer
from serve_app.manifest import ImageSpec
from serve_app.models.base import OnnxModel
from serve_app.models.executor import BatchExecutor, RunBatch
from serve_app.models.health import Stalled, StallWatch
from serve_app.models.prediction import Prediction
from serve_app.models.runtime import create_session
from serve_app.observability import tracing
from serve_app.padding import (
    batch_buckets,
    bucket_size,
    length_buckets,
    length_edge,
    length_edges,
    merged_length_buckets,
    pad_right,
)
from serve_app.process.cpu_priority import lower_thread_priority
from serve_app.protocols.images import decode_image
from serve_app.tokenization import TextTokenizer

Result = np.ndarray | ServeAppError

logger = logging.getLogger(__name__)


# A replica idle this long proves its session with a one-row probe at its next health check.
PROBE_IDLE_S = 30.0
# At shutdown, how long batches that came over the link may take to finish (Serve waits for its own).
LINK_DRAIN_S = 10.0
# Batches of single inputs (`classify`) out at once: the bulk lane's executor runs as many as it has
# sessions and merges the rest, so this only has to cover the most sessions a lane runs.
SINGLE_BATCHES = 4


def payload_items(payload: Any) -> int:
    """Rows in one request's payload: texts in a list, or images along axis 0."""
    if isinstance(payload, np.ndarray):
        return int(payload.shape[0]) if payload.ndim == 4 else 1
    return len(payload) if isinstance(payload, list) else 1


def bulk_layout(threads: int, sessions: int) -> list[int]:
    """Intra-op threads per bulk session: `threads` split as evenly as they go, at least one each."""
    sessions = max(1, min(sessions, threads))
    return [threads // sessions + (i < threads % sessions) for i in range(sessions)]


class Classifier(OnnxModel):
    """The batch path both classifier families share; subclasses turn payloads into logits."""

    supports_lanes = True

    def __init__(self, name: str, model_path: str, config: dict[str, Any]) -> None:
        super().__init__(name, model_path, config)
        self.lanes: dict[str, BatchExecutor] = {}
        self.router_load = RouterLoad()
        self.last_answer = time.monotonic()  # when a batch or a health probe last ran on a session
        self._probe: asyncio.Future[None] | None = None  # the health probe in flight
        self._probe_watch = StallWatch()
        # Routers on this node send batches here rather than through Serve (serve_app.link).
        self.link: LinkServer | None = LinkServer(self.run, ray.get_runtime_context().get_node_id())
        self.sessions = [self.session]  # every session a lane runs; warm_up runs each
        self.output_names = [self.manifest.outputs[0].name]  # the logits; an export may give more
        self._size_single_batches()
        size = self.batching.max_batch_size
        # Intra-op threads of each session per lane, for runtime_info.
        self.lane_layout: dict[str, list[int]] = {BULK: [self.threads]}
        if not (self.lanes_enabled or self.side_by_side):
            self.lanes[BULK] = BatchExecutor(partial(self._run_payloads, session=self.session), size)
            return
        # The bulk lane gets sessions of its own whose threads, and the threads that drive them, run
        # in the background: beside an urgent lane, and without one where `bulk_sessions` asks for
        # them (then a router on the same cores goes first). On CPU that is by default one
        # single-threaded session per core the model may use, running batches side by side (see
        # serve_app.models.executor: a preempted background thread then stalls one batch, not every
        # operator of one wide batch); on a GPU one session (each would hold the weights).
        on_cpu = self.providers[0] == "CPUExecutionProvider"
        layout = bulk_layout(self.threads, self.config.advanced.bulk_sessions or (self.threads if on_cpu else 1))
        bulk = [create_session(self.onnx_path, self.providers, n, spinning=False, background=True) for n in layout]
        self.sessions += bulk
        self.lane_layout = {BULK: layout}
        pool = ThreadPoolExecutor(len(bulk), thread_name_prefix=f"{name}-bulk", initializer=lower_thread_priority)
        runs: list[RunBatch] = [partial(self._run_payloads, session=session) for session in bulk]
        self.lanes[BULK] = BatchExecutor(runs, size, pool)
        if not self.lanes_enabled:
            return
        # `self.session` serves the urgent lane at normal priority.
        self.lane_layout[URGENT] = [self.session_threads]
        urgent_pool = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-urgent")
        self.lanes[URGENT] = BatchExecutor(partial(self._run_payloads, session=self.session), size, urgent_pool)

    def warm_up(self, buckets: list[int] | None = None) -> None:
        """Every session runs the shapes of these batch sizes (default: the current batching's)."""
        buckets = buckets or self._buckets()
        for session in self.sessions:
            self._warm(session, buckets)

    def _warm(self, session: ort.InferenceSession, buckets: list[int] | None) -> None:
        """Run the graph once so the first real request doesn't pay for lazy init."""
        raise NotImplementedError

    def _buckets(self, max_batch_size: int | None = None) -> list[int] | None:
        """On a GPU, the few batch sizes every batch is padded to (batching.batch_buckets); None on CPU,
        where a padded row costs as much as a real one and a new shape costs nothing extra."""
        if self.session.get_providers()[0] == "CPUExecutionProvider":  # what runs, not what was asked
            return None
        return batch_buckets(max_batch_size or self.batching.max_batch_size)

    def apply_batching(self, batching: BatchingConfig) -> None:
        new, old = self._buckets(batching.max_batch_size), self._buckets() or []
        if added := [b for b in new or [] if b not in old]:
            # A live batch size change (`user_config`): the shapes it adds run once here, before any
            # batch is formed for them, not in the first requests that meet them. Serve runs this
            # in a thread, so the batches meanwhile go on at the old size.
            self.warm_up(added)
        super().apply_batching(batching)
        for lane in self.lanes.values():
            lane.max_items = batching.max_batch_size
        self._size_single_batches()

    def _size_single_batches(self) -> None:
        batcher: Any = self._single_batch  # Ray types @serve.batch's method without its setters
        batcher.set_max_batch_size(self.batching.max_batch_size)
        batcher.set_batch_wait_timeout_s(self.batching.batch_wait_timeout_s)

    async def classify(self, item: Any) -> Prediction:
        """One input from any `DeploymentHandle` caller: a text (TextClassifier); an image as a
        (3, H, W) float32 array in [0, 1] or uint8, or encoded PNG/JPEG bytes (ImageClassifier).
        Batched with other callers' inputs; raises InvalidInput for an input the model cannot take."""
        payload = await self._single_payload(item)
        result = await self._single_batch(payload)
        if isinstance(result, BaseException):
            raise result
        return Prediction.of(result[0], self.manifest.labels)

    @serve.batch(max_concurrent_batches=SINGLE_BATCHES)
    async def _single_batch(self, payloads: list[Any]) -> list[Result]:
        results, _, _ = await self.lanes[BULK].submit(payloads, len(payloads))
        return results

    async def _single_payload(self, item: Any) -> Any:
        """One input as a one-row payload of the batch path."""
        raise NotImplementedError

    async def run(
        self, payloads: list[Any], router: str = "", router_queued: int = 0, lane: str = BULK,
        traces: list[str | None] | None = None,
    ) -> BatchReply:  # fmt: skip
        """One batch from a router: a result or error per payload, and the timings the router learns
        from. `traces`: each payload's trace context, when any request in the batch is traced."""
        arrived = time.monotonic()
        self.router_load.report(router, router_queued / self.batching.max_batch_size, arrived)
        items = sum(payload_items(p) for p in payloads)
        # Without a session of its own (urgent_session: false, or a replica without lanes), an urgent
        # batch runs next on the bulk lane's sessions.
        executor = self.lanes.get(lane) or self.lanes[BULK]
        results, wait_s, exec_s = await executor.submit(payloads, items, urgent=lane == URGENT)
        if traces:
            self._trace_batch(traces, results, arrived + wait_s, exec_s, items, lane)
        link = await self._link_address()
        return BatchReply(results, wait_s, exec_s, self.batching.max_batch_size, self.batching.batch_wait_timeout_s, link)

    async def _link_address(self) -> LinkAddress | None:
        """The link's address, listening from the first batch on (it needs the replica's loop)."""
        if self.link is None:
            return None
        try:
            return await self.link.start()
        except Exception:  # no private socket directory, say: batches keep coming through Serve
            logger.exception("%s: the same-node link could not start", self.name)
            self.link = None
            return None

    def __del__(self) -> Coroutine[Any, Any, None] | None:
        """Serve's graceful shutdown calls this on the replica's loop after its own requests
        drained, and awaits what it returns: the link's batches finish. Called by the garbage
        collector instead (no loop running), it only removes the socket."""
        link = getattr(self, "link", None)  # None too if the constructor failed before making it
        if link is None or link.address is None:  # never listened: nothing to drain or remove
            return None
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            link.remove_socket()
            return None
        return link.close(LINK_DRAIN_S)

    def _trace_batch(
        self, traces: list[str | None], results: list[Result], started: float, exec_s: float, items: int, lane: str
    ) -> None:
        """The batch's run, as a span under each traced request's round trip."""
        for traceparent, result in zip(traces, results, strict=True):
            attributes = {"serve_app.model": self.name, "serve_app.lane": lane, "serve_app.batch.items": items}
            error = result if isinstance(result, BaseException) else None
            tracing.record("model.run", tracing.from_traceparent(traceparent), started, started + exec_s, attributes, error)

    async def runtime_info(self) -> dict[str, Any]:
        return {**await super().runtime_info(), "lane_sessions": self.lane_layout}

    async def check_health(self) -> None:
        """Serve's periodic probe: unhealthy while any lane's batch has run past `stall_timeout_s`,
        or when, idle for `PROBE_IDLE_S`, its session does not answer a one-row probe (a replica
        nobody sends work to would otherwise look healthy whatever became of its session). One
        probe at a time: a probe that hangs is reported, not started again beside itself."""
        limit = self.config.stall_timeout_s
        for name, lane in self.lanes.items():
            lane.watch.check(limit, f"{self.name}: a {name} batch")
        if self._probe is not None:
            self._probe_watch.check(limit, f"{self.name}: a health probe")
            return
        if time.monotonic() - self.last_answer < PROBE_IDLE_S or any(len(lane.watch) for lane in self.lanes.values()):
            return
        self._probe = probe = asyncio.ensure_future(asyncio.to_thread(self._run_probe))
        try:
            await asyncio.wait_for(asyncio.shield(probe), limit)
        except TimeoutError:
            raise Stalled(f"{self.name}: a health probe has run for {limit:g} s") from None
        except Exception as e:  # any failure of the probe: the session does not answer
            raise Stalled(f"{self.name}: the session failed a probe ({type(e).__name__})") from e
        self.last_answer = time.monotonic()

    def _run_probe(self) -> None:
        try:
            with self._probe_watch.running():
                self._probe_one_row(self.session)
        finally:
            self._probe = None

    def _probe_one_row(self, session: ort.InferenceSession) -> None:
        """The smallest run of the model: one row."""
        raise NotImplementedError

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Work the routers hold for this model, in batches, and the batches that came over the link
        (Serve counts only its own calls): what the autoscaling policy adds to ongoing requests."""
        linked = self.link.inflight if self.link is not None else 0
        return {RouterLoad.METRIC: self.router_load.total(time.monotonic()), LINK_ONGOING: float(linked)}

    def _run_payloads(self, payloads: list[Any], session: ort.InferenceSession) -> list[Result]:
        """Runs in a lane's thread: validate each payload, run the valid rows on the lane's session, split back."""
        results: list[Result | None] = []
        prepared: list[Any] = []
        for payload in payloads:
            try:
                prepared.append(self._prepare(payload))
                results.append(None)
            except ServeAppError as e:
                results.append(e)
        if prepared:
            started = time.perf_counter()
            self.inject_faults()
            logits = self._forward_all(prepared, session)
            self.record_batch(len(logits), started)
            self.last_answer = time.monotonic()
            bounds = np.cumsum([0, *(self._rows(p) for p in prepared)])
            parts = iter(logits[a:b] for a, b in itertools.pairwise(bounds))
            results = [next(parts) if r is None else r for r in results]
        return results  # type: ignore[return-value]  # every None was replaced

    def _prepare(self, payload: Any) -> Any:
        raise NotImplementedError

    def _rows(self, prepared: Any) -> int:
        raise NotImplementedError

    def _forward_all(self, prepared: list[Any], session: ort.InferenceSession) -> np.ndarray:
        raise NotImplementedError


@serve.deployment(max_ongoing_requests=16)
class TextClassifier(Classifier):
    """BYTES text in, (N, C) logits out; tokenizes server-side, pads per length bucket (on a GPU,
    per group of neighbouring buckets: serve_app.padding.merged_length_buckets)."""

    def __init__(self, name: str, model_path: str, config: dict[str, Any]) -> None:
        super().__init__(name, model_path, config)
        self.tokenizer: TextTokenizer | None = TextTokenizer.for_model(self.model_dir, self.manifest, truncate=True)
        # BERT exports take segment ids as well; a single text is segment 0 throughout.
        self.segments = "token_type_ids" in self.manifest.input_names
        self.warm_up()

    def _warm(self, session: ort.InferenceSession, buckets: list[int] | None) -> None:
        """On a GPU, every (batch size, length) shape that `_forward` pads batches to, once: each new
        shape's first run is slow there (see serve_app.padding.batch_buckets). On CPU, one run."""
        assert self.tokenizer is not None
        if buckets is None:
            self._forward([[self.tokenizer.pad_id]], session)
            return
        for length in length_edges(self.max_len):
            for n in buckets:  # exactly this shape: `_forward` would pad to the buckets in use now
                ids, mask = pad_right([[self.tokenizer.pad_id]] * n, self.tokenizer.pad_id, length)
                session.run(None, self._feeds(ids, mask))

    def _probe_one_row(self, session: ort.InferenceSession) -> None:
        assert self.tokenizer is not None
        self._forward([[self.tokenizer.pad_id]], session)

    @property
    def max_len(self) -> int:
        return self.manifest.max_sequence_length or 512

    def _forward(self, seqs: list[list[int]], session: ort.InferenceSession, length: int | None = None) -> np.ndarray:
        """Logits of `seqs`, padded to their longest on CPU. On a GPU, to a shape `_warm` ran: rows up
        to a batch bucket (one-token rows, dropped from the answer), length to its bucket's edge."""
        assert self.tokenizer is not None
        rows, buckets = len(seqs), self._buckets()
        if buckets is not None:
            seqs = seqs + [[self.tokenizer.pad_id]] * (next((b for b in buckets if b >= rows), rows) - rows)
            length = length or min(length_edge(max(len(s) for s in seqs)), self.max_len)
        ids, mask = pad_right(seqs, self.tokenizer.pad_id, length)
        logits = session.run(self.output_names, self._feeds(ids, mask))[0]
        return logits[:rows]

    def _feeds(self, ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        feeds = {"input_ids": ids, "attention_mask": mask}
        if self.segments:
            feeds["token_type_ids"] = np.zeros_like(ids)
        return feeds

    def _prepare(self, texts: Any) -> list[list[int]]:
        assert self.tokenizer is not None
        if not isinstance(texts, list) or not texts:
            raise InvalidInput("empty batch: send at least one text")
        if not all(isinstance(t, str) for t in texts):
            raise InvalidInput("text inputs must be strings")
        return self.tokenizer.encode_rows(texts)

    def _rows(self, prepared: list[list[int]]) -> int:
        return len(prepared)

    async def _single_payload(self, item: Any) -> list[str]:
        if not isinstance(item, str):
            raise InvalidInput(f"{self.name} takes one text (str) per call, got {type(item).__name__}")
        return [item]

    def _forward_all(self, prepared: list[list[list[int]]], session: ort.InferenceSession) -> np.ndarray:
        seqs = [s for p in prepared for s in p]
        out: np.ndarray | None = None
        step = self.batching.max_batch_size
        # On CPU a padded token costs as much as a real one: a run per length bucket. On a GPU a
        # small run costs about its kernel launches: neighbouring buckets run as one while that
        # at most doubles their padded tokens (each run's shape is still one `_warm` ran).
        lengths = [len(s) for s in seqs]
        groups = merged_length_buckets(lengths) if self._buckets() is not None else length_buckets(lengths)
        for bucket in groups:
            for i in range(0, len(bucket), step):
                rows = bucket[i : i + step]
                logits = self._forward([seqs[r] for r in rows], session)
                if out is None:
                    out = np.empty((len(seqs), logits.shape[1]), dtype=logits.dtype)
                out[rows] = logits
        assert out is not None, "at least one bucket"
        return out


@serve.deployment(max_ongoing_requests=16)
class ImageClassifier(Classifier):
    """(N, 3, H, W) images in: float32 in [0, 1], or uint8 (4x less to send), out (N, C) logits."""

    def __init__(self, name: str, model_path: str, config: dict[str, Any]) -> None:
        super().__init__(name, model_path, config)
        self.input_name = self.manifest.inputs[0].name  # "image" in ours, "input", "pixel_values"... in exports
        self.normalize = Normalize.of(self.manifest.image)
        self.warm_up()

    def _warm(self, session: ort.InferenceSession, buckets: list[int] | None) -> None:
        s = self.manifest.image_size or 32
        for n in buckets or [1]:
            session.run(self.output_names, {self.input_name: np.zeros((n, 3, s, s), dtype=np.float32)})

    def _buckets(self, max_batch_size: int | None = None) -> list[int] | None:
        """On a GPU, one batch size: max_batch_size. ONNX Runtime's CUDA convolutions keep the cuDNN
        plan of the last input shape only and build a new one whenever the shape changes
        (`Conv::UpdateState` in onnxruntime/core/providers/cuda/nn/conv.cc; onnxruntime issue
        23006): for a ResNet-50, CPU work that outlasts the batch many times over, so a session fed
        a mix of batch sizes spends its time planning. A padded row costs the GPU far less."""
        buckets = super()._buckets(max_batch_size)
        return None if buckets is None else buckets[-1:]

    def _probe_one_row(self, session: ort.InferenceSession) -> None:
        """One row, padded to the one shape the session runs on a GPU (another would cost a new plan)."""
        s, n = self.manifest.image_size or 32, (self._buckets() or [1])[0]
        session.run(self.output_names, {self.input_name: np.zeros((n, 3, s, s), dtype=np.float32)})

    def _prepare(self, images: Any) -> np.ndarray:
        s = self.manifest.image_size
        if not isinstance(images, np.ndarray) or images.ndim != 4 or images.shape[1:] != (3, s, s):
            shape = getattr(images, "shape", None)
            raise InvalidInput(f"image must be a tensor of shape [N, 3, {s}, {s}], got {shape}")
        if images.shape[0] == 0:
            raise InvalidInput("empty batch: send at least one image")
        if images.dtype == np.uint8:
            return images  # scaled to [0, 1] as it is copied into the batch (image_feed)
        if not np.isfinite(images).all():
            raise InvalidInput("image contains NaN or Inf")
        return images

    def _rows(self, prepared: np.ndarray) -> int:
        return len(prepared)

    async def _single_payload(self, item: Any) -> np.ndarray:
        """Encoded bytes are decoded here, in a thread: a handle caller has no router to do it."""
        if isinstance(item, bytes | memoryview):
            s = self.manifest.image_size or 0
            return (await asyncio.to_thread(decode_image, item, s, 0, self.manifest.image.resize))[None]
        if not isinstance(item, np.ndarray) or item.ndim != 3:
            shape = getattr(item, "shape", None)
            raise InvalidInput(f"{self.name} takes one image per call: a (3, H, W) array or PNG/JPEG bytes, got {shape}")
        return item[None]

    def _forward_all(self, prepared: list[np.ndarray], session: ort.InferenceSession) -> np.ndarray:
        total = sum(len(p) for p in prepared)
        step, buckets = self.batching.max_batch_size, self._buckets()
        parts = []
        for start in range(0, total, step):
            stop = min(total, start + step)
            size = stop - start if buckets is None else bucket_size(stop - start, buckets)
            feed = image_feed(prepared, start, stop, size, self.normalize)
            parts.append(session.run(self.output_names, {self.input_name: feed})[0][: stop - start])
        return np.concatenate(parts)


class Normalize:
    """(x - mean) / std per channel, as x * scale + shift on a (N, 3, H, W) batch in place."""

    def __init__(self, mean: list[float], std: list[float]) -> None:
        std_ = np.asarray(std, dtype=np.float32).reshape(1, 3, 1, 1)
        self.scale = 1.0 / std_
        self.shift = -np.asarray(mean, dtype=np.float32).reshape(1, 3, 1, 1) / std_

    @classmethod
    def of(cls, spec: ImageSpec) -> Normalize | None:
        return cls(spec.mean, spec.std) if spec.normalizes else None

    def __call__(self, rows: np.ndarray) -> None:
        rows *= self.scale
        rows += self.shift


def image_feed(payloads: list[np.ndarray], start: int, stop: int, size: int, normalize: Normalize | None = None) -> np.ndarray:
    """Rows `start` to `stop` of the payloads, one after another, as one float32 batch of `size`
    rows, zero after `stop` (a GPU's padding). Every row is written once: uint8 pixels are scaled
    to [0, 1] as they are copied in, where a cast, a scaling, a concatenation and a padding copy
    would each pass over the whole batch. `normalize`: the model's mean/std, applied to the rows
    written (pixels always arrive in [0, 1] or as uint8, whatever the model wants)."""
    feed = np.empty((size, *payloads[0].shape[1:]), dtype=np.float32)
    at = offset = 0
    for p in payloads:
        lo, hi = max(start, offset) - offset, min(stop, offset + len(p)) - offset
        if lo < hi:
            rows = feed[at : at + hi - lo]
            if p.dtype == np.uint8:
                np.divide(p[lo:hi], np.float32(255), out=rows, dtype=np.float32)
            else:
                rows[...] = p[lo:hi]
            at += hi - lo
        offset += len(p)
    feed[at:] = 0
    if normalize is not None:
        normalize(feed[:at])
    return feed
