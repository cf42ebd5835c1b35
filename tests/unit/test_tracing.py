"""Tracing without Ray: W3C context in and out, the router's queue and batch spans, the
generator's step spans, exported over OTLP/HTTP to a real receiver (tests/otlp_receiver.py)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from typing import Any

import pytest

from serve_app.config import TracingConfig
from serve_app.contract import BatchReply
from serve_app.errors import ModelFailure
from serve_app.observability import tracing
from serve_app.router.edge.traced import route_of
from serve_app.scheduling.dispatcher import Dispatcher, DispatchSettings
from serve_app.scheduling.protection.limit import AdaptiveLimit
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan, running_receiver, traceparent
from tests.unit.test_continuous import Harness

SERVER, CLIENT = 2, 3  # OTLP's SpanKind numbers


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with running_receiver() as r:
        assert tracing.setup(TracingConfig(otlp_endpoint=r.url, export_interval_ms=50), "unit")
        yield r
        tracing.shutdown()


def caller() -> tuple[str, str]:
    return secrets.token_hex(16), secrets.token_hex(8)


def by_name(spans: list[ReceivedSpan]) -> dict[str, list[ReceivedSpan]]:
    out: dict[str, list[ReceivedSpan]] = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def named(receiver: OtlpReceiver, trace_id: str, *names: str) -> dict[str, list[ReceivedSpan]]:
    """The trace's spans by name, once every one of `names` is in (flush gives up silently after
    its timeout, which a stalled machine can outlast)."""
    return by_name(receiver.wait_for(trace_id, lambda spans: set(names) <= {x.name for x in spans}))


class Model:
    """One batch at a time; remembers the trace context each batch carried."""

    def __init__(self, fail: bool = False) -> None:
        self.traces: list[list[str | None] | None] = []
        self.fail = fail

    async def send(self, payloads: list[Any], queued: int, lane: str, traces: list[str | None] | None = None) -> BatchReply:
        self.traces.append(traces)
        await asyncio.sleep(0.005)
        if self.fail:
            raise ModelFailure("the replica failed")
        return BatchReply([str(p).upper() for p in payloads], wait_s=0.001, exec_s=0.004)


def dispatcher(model: Model) -> Dispatcher:
    return Dispatcher("m", model.send, DispatchSettings(max_batch_size=4), limit=AdaptiveLimit(initial=1))


def test_routes_are_named_without_the_model_so_span_names_stay_few():
    assert route_of("/v2/models/bert-heavy/infer") == ("/v2/models/{model}/infer", "bert-heavy")
    assert route_of("/v2/models/bert-heavy/versions/2/infer") == ("/v2/models/{model}/versions/{version}/infer", "bert-heavy")
    assert route_of("/v1/completions") == ("/v1/completions", None)


def test_without_an_endpoint_nothing_exports_but_the_callers_context_is_carried(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert not tracing.setup(TracingConfig(), "unit") and not tracing.exporting()
    with tracing.server_span("GET /", {}, {}) as span:
        assert span is None and tracing.current_traceparent() is None and tracing.current() is None
    trace_id, span_id = caller()
    with tracing.server_span("GET /", {"traceparent": traceparent(trace_id, span_id)}, {}):
        # The next hop gets the caller's own context: the trace goes on past this process.
        assert tracing.current_traceparent() == traceparent(trace_id, span_id)
    assert tracing.from_traceparent("00-not-a-trace-01") is None and tracing.from_traceparent(None) is None


def test_the_environment_names_the_endpoint_as_opentelemetry_documents(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/")
    assert tracing.endpoint_of(TracingConfig()) == "http://collector:4318/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4318/v1/traces")
    assert tracing.endpoint_of(TracingConfig()) == "http://traces:4318/v1/traces"
    assert tracing.endpoint_of(TracingConfig(otlp_endpoint="http://mine/v1/traces")) == "http://mine/v1/traces"


def test_a_queued_request_gets_queue_and_batch_spans_under_its_own_trace_and_the_replica_its_context(receiver):
    model = Model()
    trace_id, span_id = caller()

    async def scenario() -> None:
        d = dispatcher(model)
        with tracing.server_span("POST /v2/models/{model}/infer", {"traceparent": traceparent(trace_id, span_id)}, {}):
            assert await d.submit("a", 1) == "A"
        assert await d.submit("b", 1) == "B"  # outside any trace

    asyncio.run(scenario())
    tracing.flush()
    spans = named(receiver, trace_id, "POST /v2/models/{model}/infer", "router.queue", "model.batch")
    (server,) = spans["POST /v2/models/{model}/infer"]
    (queue,) = spans["router.queue"]
    (batch,) = spans["model.batch"]
    assert server.parent_span_id == span_id and server.kind == SERVER
    assert queue.parent_span_id == server.span_id and batch.parent_span_id == server.span_id and batch.kind == CLIENT
    assert batch.attributes["serve_app.model"] == "m" and batch.attributes["serve_app.batch.items"] == 1
    assert server.start_ns <= queue.start_ns <= queue.end_ns <= batch.end_ns <= server.end_ns
    # The replica's spans go under the batch's round trip; an untraced batch carries nothing.
    assert model.traces == [[traceparent(trace_id, batch.span_id)], None]


def test_a_failed_batch_marks_each_traced_requests_round_trip_as_an_error(receiver):
    trace_id, span_id = caller()

    async def scenario() -> None:
        d = dispatcher(Model(fail=True))
        with tracing.server_span("POST /", {"traceparent": traceparent(trace_id, span_id)}, {}):
            with pytest.raises(ModelFailure):
                await d.submit("a", 1)

    asyncio.run(scenario())
    tracing.flush()
    (batch,) = named(receiver, trace_id, "model.batch")["model.batch"]
    assert batch.status_code == 2 and batch.attributes["error.type"] == "ModelFailure"  # STATUS_CODE_ERROR


class ReplicaDied(Exception):
    """Stands in for Ray's error when the replica running a batch dies."""


def test_a_batch_sent_again_after_its_replica_died_carries_only_the_waiting_requests_traces(receiver):
    (trace_a, span_a), (trace_b, span_b) = caller(), caller()
    sent: list[tuple[list[Any], list[str | None] | None]] = []

    async def scenario() -> None:
        dying = asyncio.Event()

        async def send(payloads: list[Any], queued: int, lane: str, traces: list[str | None] | None = None) -> BatchReply:
            sent.append((list(payloads), traces))
            await asyncio.sleep(0.5 if payloads == ["x"] else 0.05)  # x's batch outlasts a and b's arrival
            if payloads == ["a", "b"]:
                dying.set()
                await asyncio.sleep(0.05)
                raise ReplicaDied("actor died")
            return BatchReply([str(p).upper() for p in payloads], wait_s=0.001, exec_s=0.004)

        d = Dispatcher(
            "m",
            send,
            DispatchSettings(max_batch_size=4),
            limit=AdaptiveLimit(initial=1),
            retryable=lambda e: isinstance(e, ReplicaDied),
        )

        async def traced(name: str, trace_id: str, span_id: str) -> Any:
            with tracing.server_span("POST /", {"traceparent": traceparent(trace_id, span_id)}, {}):
                return await d.submit(name, 1)

        first = asyncio.ensure_future(d.submit("x", 1))  # holds the one batch slot while a and b queue
        await asyncio.sleep(0.01)
        a, b = asyncio.ensure_future(traced("a", trace_a, span_a)), asyncio.ensure_future(traced("b", trace_b, span_b))
        await dying.wait()
        a.cancel()  # a's client leaves while the replica dies under the batch
        assert await b == "B" and await first == "X"

    asyncio.run(scenario())
    tracing.flush()
    (batch_b,) = named(receiver, trace_b, "model.batch")["model.batch"]
    (batch_a,) = named(receiver, trace_a, "model.batch")["model.batch"]
    assert [p for p, _ in sent] == [["x"], ["a", "b"], ["b"]]
    assert sent[-1][1] == [traceparent(trace_b, batch_b.span_id)]  # the retry carries b's context alone
    assert batch_b.status_code != 2 and "serve_app.replica.exec_ms" in batch_b.attributes
    assert batch_a.status_code == 2 and "serve_app.replica.exec_ms" not in batch_a.attributes


def test_a_caller_that_does_not_sample_gets_no_spans_recorded(receiver):
    trace_id, span_id = caller()
    sampled_id, sampled_span = caller()

    async def scenario() -> None:
        d = dispatcher(Model())
        with tracing.server_span("POST /", {"traceparent": traceparent(trace_id, span_id, sampled=False)}, {}):
            assert await d.submit("a", 1) == "A"
        # A sampled request after it: once its spans are in, the unsampled one's would be too.
        with tracing.server_span("POST /", {"traceparent": traceparent(sampled_id, sampled_span)}, {}):
            assert await d.submit("b", 1) == "B"

    asyncio.run(scenario())
    tracing.flush()
    names = {s.name for s in receiver.wait_for(sampled_id, lambda spans: len(spans) >= 3)}
    assert names == {"POST /", "router.queue", "model.batch"}, names
    assert receiver.trace(trace_id) == []


def test_a_generation_records_its_prefill_and_each_decode_step_under_the_callers_span(receiver, tiny_model_dir):
    h = Harness(tiny_model_dir)
    trace_id, span_id = caller()
    seq = h.submit("the food was", max_tokens=5, ignore_eos=True)
    seq.trace = tracing.from_traceparent(traceparent(trace_id, span_id))
    h.submit("an untraced neighbour", max_tokens=5)
    h.run()
    tracing.flush()
    decodes = len(seq.tokens) - 1
    spans = by_name(receiver.wait_for(trace_id, lambda got: sum(x.name == "decode" for x in got) >= decodes))
    assert len(spans["prefill"]) >= 1 and len(spans["decode"]) == len(seq.tokens) - 1
    assert {s.parent_span_id for s in spans["prefill"] + spans["decode"]} == {span_id}
    assert max(s.attributes["serve_app.step.rows"] for s in spans["decode"]) == 2  # the neighbour shared steps
    assert len(receiver.spans) == len(spans["prefill"]) + len(spans["decode"])  # nothing for the untraced one
