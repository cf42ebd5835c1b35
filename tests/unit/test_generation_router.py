"""The router's generation helpers with fake streams (no Ray): SSE endings and sibling choices."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from serve_app.errors import DeadlineExceeded, InvalidInput, Overloaded, Unavailable
from serve_app.router.endpoints import generation
from serve_app.router.endpoints.generation import Generated
from serve_app.scheduling.protection.breaker import BreakerState, CircuitBreaker
from tests.unit.fakes import VirtualTimeLoop


def run_virtual(coro: Any) -> Any:
    """Run on a virtual clock: the sleeps below take no wall time."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


class Event:
    def __init__(self, text: str, finish_reason: str | None = None) -> None:
        self.text, self.finish_reason = text, finish_reason
        self.prompt_tokens, self.completion_tokens = 1, 1


class Stream:
    """A replica's token stream that yields `events`, then raises `error` (a replica dying mid-stream)."""

    def __init__(self, events: list[Event], error: BaseException | None = None, hang: bool = False) -> None:
        self.events, self.error, self.hang = list(events), error, hang
        self.cancelled = False

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Event:
        if self.events:
            return self.events.pop(0)
        if self.error is not None:
            raise self.error
        if self.hang:  # a replica that stopped producing tokens
            await asyncio.sleep(3600)
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


class ActorDiedError(Exception):
    """Stands in for Ray's error when the replica behind a stream dies."""


def sse(stream: Stream, timeout_s: float = 100.0, breaker: CircuitBreaker | None = None) -> list[str]:
    breaker = breaker or CircuitBreaker()

    async def collect() -> list[str]:
        first = await stream.__anext__()
        render = lambda event, is_first: {"text": event.text}  # noqa: E731
        deadline = time.monotonic() + timeout_s
        events = generation.sse_events(stream, first, render, lambda last: None, deadline, breaker)  # type: ignore[arg-type]
        return [chunk async for chunk in events]

    return run_virtual(collect())


@pytest.mark.parametrize(
    ("error", "code"), [(ActorDiedError("replica gone"), "model_error"), (InvalidInput("bad"), "invalid_input")]
)
def test_a_stream_that_fails_midway_ends_with_an_error_event_and_done(error, code):
    stream = Stream([Event("a"), Event("b")], error)
    chunks = sse(stream)
    assert chunks[:2] == ['data: {"text":"a"}\n\n', 'data: {"text":"b"}\n\n']
    failure = json.loads(chunks[2].removeprefix("data: "))["error"]
    assert failure["code"] == code and "replica gone" not in failure["message"]  # no exception text leaks
    assert chunks[3] == "data: [DONE]\n\n" and len(chunks) == 4
    assert stream.cancelled


def test_a_finished_stream_ends_with_done():
    chunks = sse(Stream([Event("a"), Event("b", "stop")]))
    assert chunks == ['data: {"text":"a"}\n\n', 'data: {"text":"b"}\n\n', "data: [DONE]\n\n"]


def test_the_first_failing_choice_cancels_its_siblings_and_its_error_is_the_answer():
    cancelled: list[int] = []

    async def choice(i: int) -> Generated:
        try:
            if i == 1:
                await asyncio.sleep(0.01)
                raise InvalidInput("choice 1 failed")
            await asyncio.sleep(10)
            return Generated("x", "stop", 1, 1)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    with pytest.raises(InvalidInput, match="choice 1 failed"):
        run_virtual(generation.all_or_none([choice(i) for i in range(3)], time.monotonic() + 100))
    assert sorted(cancelled) == [0, 2]


def test_all_choices_in_order_when_none_fails():
    async def choice(i: int, delay: float) -> Generated:
        await asyncio.sleep(delay)
        return Generated(str(i), "stop", 1, 1)

    out: Any = run_virtual(generation.all_or_none([choice(0, 0.02), choice(1, 0.0)], time.monotonic() + 100))
    assert [g.text for g in out] == ["0", "1"]


def test_a_stream_that_stops_producing_ends_at_its_deadline_with_an_error_event_and_done():
    stream = Stream([Event("a"), Event("b")], hang=True)
    chunks = sse(stream, timeout_s=5.0)
    assert json.loads(chunks[2].removeprefix("data: "))["error"]["code"] == "deadline_exceeded"
    assert chunks[3:] == ["data: [DONE]\n\n"] and stream.cancelled


def test_generations_past_their_deadline_are_all_stopped_with_a_504():
    cancelled: list[int] = []

    async def slow(i: int) -> Generated:
        try:
            await asyncio.sleep(60)
            return Generated("x", "stop", 1, 1)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    with pytest.raises(DeadlineExceeded):
        run_virtual(generation.all_or_none([slow(0), slow(1)], time.monotonic() + 5))
    assert sorted(cancelled) == [0, 1]


def test_streams_failing_on_a_broken_generator_open_its_breaker_and_requests_then_fail_fast():
    clock = [0.0]
    breaker = CircuitBreaker(failure_threshold=2, open_s=5.0, clock=lambda: clock[0])
    sse(Stream([Event("a")], InvalidInput("bad")), breaker=breaker)  # a client's error: not the generator's fault
    sse(Stream([Event("a")], Overloaded("queue full")), breaker=breaker)  # nor a full queue
    assert breaker.state == BreakerState.CLOSED
    for _ in range(2):
        sse(Stream([Event("a")], ActorDiedError("replica gone")), breaker=breaker)
    assert breaker.state == BreakerState.OPEN
    with pytest.raises(Unavailable, match="circuit open") as refused:
        generation.check_breaker("gpt", breaker)
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s >= 1
    # After open_s one probe goes through; a stream that finishes closes the circuit.
    clock[0] += 5.0
    generation.check_breaker("gpt", breaker)
    sse(Stream([Event("a"), Event("b", "stop")]), breaker=breaker)
    assert breaker.state == BreakerState.CLOSED


def test_whole_generations_count_for_the_breaker_too(monkeypatch):
    breaker = CircuitBreaker(failure_threshold=1, open_s=5.0)
    # The handle's stream, without Ray: the handle stands for its own token stream.
    monkeypatch.setattr(generation, "open_stream", lambda handle, prompt, params: handle)
    done = run_virtual(generation.generate_text(Stream([Event("a", "stop")]), "p", {}, breaker))  # type: ignore[arg-type]
    assert done.text == "a" and breaker.state == BreakerState.CLOSED
    with pytest.raises(ActorDiedError):
        run_virtual(generation.generate_text(Stream([], ActorDiedError("gone")), "p", {}, breaker))  # type: ignore[arg-type]
    assert breaker.state == BreakerState.OPEN


class Streams:
    """A generator handle whose successive streams are the given ones (one per call, as replicas answer)."""

    def __init__(self, *streams: Stream) -> None:
        self.streams, self.opened = list(streams), 0

    def next(self) -> Stream:
        self.opened += 1
        return self.streams.pop(0)


def _first(handle: Streams) -> Any:
    return run_virtual(generation.first_event(handle, "p", {}, time.monotonic() + 100, CircuitBreaker()))  # type: ignore[arg-type]


def test_a_stream_whose_replica_died_before_its_first_token_opens_once_more(monkeypatch):
    from ray.exceptions import ActorDiedError as RayActorDied

    monkeypatch.setattr(generation, "open_stream", lambda handle, prompt, params: handle.next())
    dead, live = Stream([], RayActorDied()), Stream([Event("a")])
    handle = Streams(dead, live)
    stream, first = _first(handle)
    assert stream is live and first.text == "a" and handle.opened == 2 and dead.cancelled
    # Dead twice: a 503 with Retry-After (Serve is replacing it), never a 500.
    with pytest.raises(Unavailable) as refused:
        _first(Streams(Stream([], RayActorDied()), Stream([], RayActorDied())))
    assert refused.value.retry_after_s is not None
    # Any other failure is not retried: a bad request is the answer.
    handle = Streams(Stream([], InvalidInput("bad")), Stream([Event("a")]))
    with pytest.raises(InvalidInput):
        _first(handle)
    assert handle.opened == 1


def test_a_whole_generation_whose_replica_died_runs_once_more(monkeypatch):
    from ray.exceptions import ActorDiedError as RayActorDied

    monkeypatch.setattr(generation, "open_stream", lambda handle, prompt, params: handle.next())
    handle = Streams(Stream([Event("x")], RayActorDied()), Stream([Event("a", "stop")]))
    done = run_virtual(generation.generate_text(handle, "p", {}, CircuitBreaker()))  # type: ignore[arg-type]
    assert done.text == "a" and handle.opened == 2
    dead_twice: Any = Streams(Stream([], RayActorDied()), Stream([], RayActorDied()))
    with pytest.raises(Unavailable):
        run_virtual(generation.generate_text(dead_twice, "p", {}, CircuitBreaker()))


def test_a_replica_death_that_a_retry_survives_does_not_count_against_the_breaker(monkeypatch):
    """One replica's death fails every stream it held at once; retried on a live replica, those
    streams must not open the circuit for everyone. A retry that fails too does count."""
    from ray.exceptions import ActorDiedError as RayActorDied

    monkeypatch.setattr(generation, "open_stream", lambda handle, prompt, params: handle.next())
    breaker = CircuitBreaker(failure_threshold=1, open_s=5.0)
    failures: list[int] = []
    counted = breaker.on_failure

    def on_failure() -> None:
        failures.append(1)
        counted()

    monkeypatch.setattr(breaker, "on_failure", on_failure)
    for _ in range(3):
        handle = Streams(Stream([], RayActorDied()), Stream([Event("a", "stop")]))
        run_virtual(generation.generate_text(handle, "p", {}, breaker))  # type: ignore[arg-type]
        handle = Streams(Stream([], RayActorDied()), Stream([Event("a")]))
        run_virtual(generation.first_event(handle, "p", {}, time.monotonic() + 100, breaker))  # type: ignore[arg-type]
    assert breaker.state == BreakerState.CLOSED and not failures  # (a later success would close it again)
    with pytest.raises(Unavailable):
        run_virtual(generation.generate_text(Streams(Stream([], RayActorDied()), Stream([], RayActorDied())), "p", {}, breaker))  # type: ignore[arg-type]
    assert breaker.state == BreakerState.OPEN and len(failures) == 1


def test_serves_queue_at_the_caller_being_full_is_a_503_with_retry_after_and_no_breaker_failure():
    """The generator deployment bounds the calls queued for its replicas (max_queued_requests);
    Serve's refusal past it reaches the client as a 503 with Retry-After and does not count as
    the generator failing."""
    from ray.serve.exceptions import BackPressureError

    refusal = BackPressureError(num_queued_requests=16, max_queued_requests=16)
    answer = generation.unavailable_if_gone(refusal)
    assert isinstance(answer, Overloaded) and answer.status_code == 503 and answer.retry_after_s
    breaker = CircuitBreaker(failure_threshold=1)
    generation.record(breaker, refusal)
    assert breaker.state is BreakerState.CLOSED


def _events(stream: Stream) -> Any:
    return generation.sse_events(stream, Event("first"), lambda e, f: {}, lambda last: None, 1e9, CircuitBreaker())  # type: ignore[arg-type]


def test_an_sse_response_stops_its_replica_stream_when_the_client_left_before_the_first_event():
    """Starlette never starts the events then, so only the response can stop the replica's stream."""
    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}

    async def gone(message: Any) -> None:
        raise OSError("client left")

    async def receive() -> Any:
        return {"type": "http.disconnect"}

    stream = Stream([Event("a"), Event("b", "stop")])
    with pytest.raises(Exception):  # noqa: B017  # Starlette turns the OSError into its ClientDisconnect
        asyncio.run(generation.StreamOfEvents(_events(stream), stream, {})(scope, receive, gone))  # type: ignore[arg-type]
    assert stream.cancelled


def test_an_sse_response_never_sent_stops_its_replica_stream_when_dropped():
    """The request was cancelled between its handler and its response."""
    stream = Stream([Event("a")])
    response = generation.StreamOfEvents(_events(stream), stream, {})  # type: ignore[arg-type]
    assert not stream.cancelled
    del response
    assert stream.cancelled
