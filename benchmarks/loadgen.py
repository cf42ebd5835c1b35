"""The load generator, run as its own process: closed loop or open loop (Poisson).

Why not httpx/aiohttp: on a 2-core machine the client competes with the server
for CPU, and a general-purpose client spends ~0.5-1 ms of CPU per request. This
one sends pre-encoded HTTP/1.1 requests over keep-alive connections on uvloop
and parses only the status line and the headers it needs, and it measures and
reports its own CPU cost (`loadgen_cpu`), so every result says how much of the
machine the client took.

- closed loop: `--concurrency N` clients, each sends its next request when the
  previous one answered (throughput at a fixed number in flight).
- open loop: `--rate R` requests/s with exponential gaps (Poisson arrivals).
  Latency is measured from the *scheduled* send time, so a slow server is not
  flattered by the client waiting for it (no coordinated omission). In-flight
  requests are capped per stream (`--max-in-flight`); arrivals over the cap are
  counted as `client_dropped` (in total and per stream) rather than buffered
  without bound. Per stream, because streams stand for independent clients: a
  low-priority flood filling one shared cap would make the client drop
  high-priority arrivals that the server never saw, which no figure about the
  server should hide.

Requests come from a workload file (see `benchmarks.workloads`): weighted
streams, each with a path, headers and bodies. A warm-up phase runs first and is
excluded from every figure.

Usage: python -m benchmarks.loadgen --url http://127.0.0.1:8000 --workload W.json \
           (--concurrency N | --rate R) --seconds 10 --warmup 3 --out result.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

STATUS_TIMEOUT = 0  # the request did not answer within --timeout
STATUS_CONN_ERROR = -1  # connection refused / reset before an answer


class TruncatedBody(Exception):
    """The status line and headers arrived, then the connection closed before the whole body."""


class StaleConnection(Exception):
    """A kept-alive connection that had answered before closed without a byte of this answer.

    HTTP lets a server (here HAProxy, whose old process lets go of its connections when Serve
    reloads it) close an idle persistent connection at any time, so a request can cross the
    close on the wire. HTTP clients send such a request once more on a new connection (Go's
    net/http, urllib3, aiohttp do); this one does too, and counts it (`stale_connection_retries`).
    """


@dataclass
class Stream:
    """One kind of request in the mix (a model, a priority...)."""

    name: str
    weight: float
    raw: list[bytes]  # complete pre-encoded HTTP requests, cycled
    next_index: int = 0
    order: list[int] | None = None  # indices into `raw` to cycle instead (a skewed draw, for caches)
    # The true label of each body: its 2xx answers' bodies are kept and scored after the run.
    labels: list[str] | None = None
    last_body: int = 0  # the index of the body `next_request` gave last

    def next_request(self) -> bytes:
        i = self.next_index if self.order is None else self.order[self.next_index % len(self.order)]
        self.last_body = i % len(self.raw)
        self.next_index += 1
        return self.raw[self.last_body]


@dataclass
class Record:
    stream: str
    sent: float  # seconds since the start of measurement
    latency_ms: float
    status: int
    served_by: str
    retry_after: bool = False  # the answer carried Retry-After (what a 503 or 429 owes its client)
    # Server-Timing as sent, when sent: read after the run, so that the client spends no time on
    # it while it loads the server (the server under test shares the client's cores).
    timing_header: str | None = None
    body: int = 0  # which of the stream's bodies was sent
    answer: bytes | None = None  # a 2xx answer's body, kept when the stream knows its labels

    @cached_property
    def server_parts(self) -> dict[str, float] | None:
        """Every Server-Timing metric (queue, model, ...), when the answer carried the header."""
        return None if self.timing_header is None else server_timing(self.timing_header)

    @property
    def server_ms(self) -> float | None:
        """The server's own `Server-Timing: total`, when it sent one."""
        return None if self.server_parts is None else self.server_parts.get("total")


@dataclass
class Run:
    records: list[Record] = field(default_factory=list)
    client_dropped: int = 0
    client_dropped_by_stream: dict[str, int] = field(default_factory=dict)
    # 2xx answers, per stream, to requests sent during the warm-up that arrived inside the window:
    # part of what the server delivered in the window (see `summarize`).
    carried_in: dict[str, int] = field(default_factory=dict)
    stale_connection_retries: int = 0
    window_start_unix: float = 0.0  # wall-clock time of the measured window's start: records' `sent` counts from it


def encode_request(host: str, method: str, path: str, headers: dict[str, str], body: bytes) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}", "Connection: keep-alive"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def load_streams(workload: dict[str, Any], host: str) -> list[Stream]:
    streams = []
    for s in workload["streams"]:
        raw = []
        for b in s["bodies"]:
            if isinstance(b, dict):  # the binary tensor extension: JSON header, then raw tensors
                headers = {"Content-Type": "application/octet-stream",
                           "Inference-Header-Content-Length": str(b["header_length"]), **s.get("headers", {})}  # fmt: skip
                body = base64.b64decode(b["base64"])
            else:
                headers, body = {"Content-Type": "application/json", **s.get("headers", {})}, b.encode()
            raw.append(encode_request(host, s.get("method", "POST"), s["path"], headers, body))
        streams.append(
            Stream(name=s["name"], weight=float(s.get("weight", 1.0)), raw=raw, order=s.get("order"), labels=s.get("labels"))
        )
    return streams


def server_timing(value: str) -> dict[str, float]:
    """Every `name;dur=ms` metric of a Server-Timing header (W3C: comma-separated metrics); a
    metric without a numeric `dur` is left out."""
    metrics: dict[str, float] = {}
    for metric in value.split(","):
        name, *params = (p.strip() for p in metric.split(";"))
        for p in params:
            key, _, dur = p.partition("=")
            if key == "dur":
                try:
                    metrics[name] = float(dur)
                except ValueError:
                    pass
    return metrics


class Connection:
    """One keep-alive HTTP/1.1 connection; reconnects after errors."""

    def __init__(self, host: str, port: int, keep_answers: bool = False) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.answered = 0  # answers on the current connection
        self.keep_answers = keep_answers
        self.last_answer: bytes | None = None

    async def _ensure(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        # A connection the server already closed (HAProxy ends idle ones after its keep-alive
        # timeout) is not reused: HTTP clients check for this before sending, as urllib3 does.
        if self.reader is None or self.writer is None or self.writer.is_closing() or self.reader.at_eof():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            self.answered = 0
        return self.reader, self.writer

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def request(self, raw: bytes) -> tuple[int, str, str | None, float | None]:
        """Send one request; return (status, X-Served-By, the Server-Timing header or None when
        none came, Retry-After's seconds or None when none came).
        A response cache's X-Cache joins X-Served-By after a "|" (`bert-heavy|hit-local`), and so
        does a degraded answer's mark (`bert-light|degraded`). With `keep_answers`, the body of a
        Content-Length answer is left in `last_answer`."""
        self.last_answer = None
        reader, writer = await self._ensure()
        try:
            writer.write(raw)
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as e:
            if self.answered and not e.partial:
                raise StaleConnection from e
            raise
        except (ConnectionResetError, BrokenPipeError) as e:
            if self.answered:
                raise StaleConnection from e
            raise
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        length, chunked, served_by, close, cache = 0, False, "", False, ""
        timing: str | None = None
        retry_after: float | None = None
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.lower()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding" and "chunked" in value.lower():
                chunked = True
            elif name == "x-served-by":
                served_by = value.strip()
            elif name == "server-timing":
                timing = value
            elif name == "connection" and "close" in value.lower():
                close = True
            elif name == "retry-after":
                retry_after = retry_after_s(value)
            elif name == "x-cache":
                cache = value.strip()
            elif name == "x-degraded":
                cache = "degraded"  # a tiered route's light answer standing in for its heavy tier's
        try:
            if chunked:
                while True:
                    size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                    await reader.readexactly(size + 2)
                    if size == 0:
                        break
            elif length:
                body = await reader.readexactly(length)
                self.last_answer = body if self.keep_answers else None
        except (asyncio.IncompleteReadError, ConnectionResetError) as e:
            raise TruncatedBody(f"status {status}") from e
        self.answered += 1
        if close:
            self.close()
        return status, f"{served_by}|{cache}" if cache else served_by, timing, retry_after


def retry_after_s(value: str) -> float:
    """Retry-After's delta-seconds; an HTTP date (which none of ours sends) counts as one second."""
    try:
        return max(0.0, float(value.strip()))
    except ValueError:
        return 1.0


class LoadGenerator:
    def __init__(self, url: str, streams: list[Stream], seed: int, timeout_s: float, honor_retry_after: bool = False) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.streams = streams
        self.weights = [s.weight for s in streams]
        self.rng = random.Random(seed)
        self.timeout_s = timeout_s
        # Closed loop: a client told to come back later (429/503 with Retry-After) waits that long
        # before its next request, as well-behaved clients do; off, it sends again at once.
        self.honor_retry_after = honor_retry_after
        self.run = Run()
        self.keep_answers = any(s.labels for s in streams)
        self.measure_from = 0.0
        self.stop_at = 0.0

    def _pick(self) -> Stream:
        return self.rng.choices(self.streams, self.weights)[0] if len(self.streams) > 1 else self.streams[0]

    async def _one(self, conn: Connection, stream: Stream, scheduled: float) -> float:
        """One request and its record; returns the seconds the server asked the client to wait."""
        raw = stream.next_request()
        body = stream.last_body
        try:
            try:
                async with asyncio.timeout(self.timeout_s):
                    answer = await conn.request(raw)
            except StaleConnection:
                conn.close()
                self.run.stale_connection_retries += 1
                left = self.timeout_s - (time.perf_counter() - scheduled)
                async with asyncio.timeout(max(left, 0.001)):
                    answer = await conn.request(raw)
        except asyncio.TimeoutError:
            conn.close()
            answer = STATUS_TIMEOUT, "", None, None
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError, TruncatedBody) as e:
            conn.close()
            # What the connection did, in place of X-Served-By: a cut body is not a refused connection.
            answer = STATUS_CONN_ERROR, f"error:{type(e).__name__}", None, None
            await asyncio.sleep(0.05)  # don't spin on a refusing server
        status, served_by, timing, retry_after = answer
        done = time.perf_counter()
        if scheduled < self.measure_from and 200 <= status < 300 and self.measure_from <= done <= self.stop_at:
            self.run.carried_in[stream.name] = self.run.carried_in.get(stream.name, 0) + 1
        if scheduled >= self.measure_from and done <= self.stop_at + self.timeout_s:
            self.run.records.append(
                Record(
                    stream.name,
                    scheduled - self.measure_from,
                    (done - scheduled) * 1000,
                    status,
                    served_by,
                    retry_after is not None,
                    timing,
                    body,
                    conn.last_answer if stream.labels and 200 <= status < 300 else None,
                )
            )
        return retry_after if retry_after is not None and status in (429, 503) else 0.0

    async def closed(self, concurrency: int, warmup_s: float, seconds: float) -> Run:
        start = time.perf_counter()
        self.measure_from, self.stop_at = start + warmup_s, start + warmup_s + seconds
        self.run.window_start_unix = time.time() + warmup_s

        async def client() -> None:
            conn = Connection(self.host, self.port, self.keep_answers)
            while (t := time.perf_counter()) < self.stop_at:
                wait = await self._one(conn, self._pick(), t)
                if wait and self.honor_retry_after:
                    if time.perf_counter() + wait >= self.stop_at:
                        break  # its next turn falls past the window (a sleep to the edge may wake just short of it)
                    await asyncio.sleep(wait)
            conn.close()

        await asyncio.gather(*(client() for _ in range(concurrency)))
        return self.run

    async def open(self, rate: float, warmup_s: float, seconds: float, max_in_flight: int) -> Run:
        start = time.perf_counter()
        self.measure_from, self.stop_at = start + warmup_s, start + warmup_s + seconds
        self.run.window_start_unix = time.time() + warmup_s
        idle: list[Connection] = []
        in_flight: dict[str, set[asyncio.Task[None]]] = {st.name: set() for st in self.streams}

        async def fire(stream: Stream, scheduled: float) -> None:
            conn = idle.pop() if idle else Connection(self.host, self.port, self.keep_answers)
            try:
                await self._one(conn, stream, scheduled)
            finally:
                idle.append(conn)

        scheduled = start
        while (scheduled := scheduled + self.rng.expovariate(rate)) < self.stop_at:
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            stream = self._pick()
            tasks = in_flight[stream.name]
            if len(tasks) >= max_in_flight:
                if scheduled >= self.measure_from:
                    self.run.client_dropped += 1
                    dropped = self.run.client_dropped_by_stream
                    dropped[stream.name] = dropped.get(stream.name, 0) + 1
                continue
            task = asyncio.create_task(fire(stream, scheduled))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        pending = set().union(*in_flight.values())
        if pending:
            await asyncio.wait(pending)
        for conn in idle:
            conn.close()
        return self.run


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50_ms": None, "p90_ms": None, "p99_ms": None, "mean_ms": None}
    arr = np.asarray(values)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"p50_ms": round(float(p50), 2), "p90_ms": round(float(p90), 2), "p99_ms": round(float(p99), 2),
            "mean_ms": round(float(arr.mean()), 2)}  # fmt: skip


def server_split(records: list[Record]) -> dict[str, Any]:
    """Of the 2xx answers that carried Server-Timing: p50/p99 of the server's own handling
    and of the rest (client, network, proxy, the server's event loop before the handler)."""
    timed = [(r.latency_ms, r.server_ms) for r in records if 200 <= r.status < 300 and r.server_ms is not None]
    if not timed:
        return {}
    server = np.asarray([s for _, s in timed])
    outside = np.asarray([lat - s for lat, s in timed])
    return {
        "server_ms": {"p50": round(float(np.percentile(server, 50)), 2), "p99": round(float(np.percentile(server, 99)), 2)},
        "outside_server_ms": {
            "p50": round(float(np.percentile(outside, 50)), 2),
            "p99": round(float(np.percentile(outside, 99)), 2),
        },
    }


def answered_label(answer: bytes) -> str | None:
    """The first item's `label` output of a v2 JSON answer."""
    try:
        outputs = json.loads(answer)["outputs"]
        return next(str(o["data"][0]) for o in outputs if o["name"] == "label")
    except (ValueError, KeyError, IndexError, TypeError, StopIteration):
        return None


def scored(records: list[Record], labels: dict[str, list[str]]) -> dict[str, Any] | None:
    """Accuracy of the 2xx answers whose bodies were kept, all of them and the degraded ones
    (a tiered route's light answer standing in for its heavy tier's); None when none were."""
    kept = [r for r in records if r.answer is not None and r.stream in labels]
    if not kept:
        return None
    right = [answered_label(r.answer) == labels[r.stream][r.body] for r in kept]  # type: ignore[arg-type]
    marks = [r.served_by.endswith("|degraded") for r in kept]
    degraded = [ok for ok, marked in zip(right, marks, strict=True) if marked]
    full = [ok for ok, marked in zip(right, marks, strict=True) if not marked]
    return {
        "answers": len(kept),
        "accuracy": round(sum(right) / len(right), 4),
        "degraded": len(degraded),
        "degraded_accuracy": round(sum(degraded) / len(degraded), 4) if degraded else None,
        # Were a degraded answer ever unmarked, this would fall from the route's own accuracy.
        "unmarked_accuracy": round(sum(full) / len(full), 4) if full else None,
    }


def pooled(scored: list[dict[str, Any]], key: str, weight: str | None) -> float | None:
    """The mean of `key` over several runs' `scored` figures, each weighted by its `weight`
    count (its unmarked answers when None)."""
    pairs = []
    for x in scored:
        if x.get(key) is None:
            continue
        n = x[weight] if weight else x["answers"] - x["degraded"]
        pairs.append((x[key], n))
    total = sum(n for _, n in pairs)
    return round(sum(v * n for v, n in pairs) / total, 4) if total else None


def summarize(run: Run, seconds: float, labels: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """Figures over the measured window: throughput counts answers of any status, goodput only 2xx.
    `labels`: each stream's true labels, to score the answers kept."""

    def block(records: list[Record], carried_in: int) -> dict[str, Any]:
        ok = [r.latency_ms for r in records if 200 <= r.status < 300]
        # 2xx answers that arrived inside the window, whenever their request was sent: what the
        # server delivered in it. Under overload a deep queue keeps answering requests sent in
        # the window long after it, which `goodput_rps` credits to the window; and it answers
        # warm-up requests inside the window, which only this figure counts.
        in_window = carried_in + sum(1 for r in records if 200 <= r.status < 300 and r.sent + r.latency_ms / 1000 <= seconds)
        statuses: dict[str, int] = {}
        served: dict[str, int] = {}
        errors: dict[str, int] = {}  # requests without an answer, by what the connection did
        for r in records:
            statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
            into = served if r.status > 0 else errors
            if r.served_by:
                into[r.served_by] = into.get(r.served_by, 0) + 1
        refused = [r for r in records if r.status in (429, 503)]
        refused_ms = percentiles([r.latency_ms for r in refused])
        return {
            "requests": len(records),
            "refused_without_retry_after": sum(1 for r in refused if not r.retry_after),
            # How fast a "no" came: a refusal is only worth something to a client that gets it quickly.
            "refused_p50_ms": refused_ms["p50_ms"],
            "refused_p99_ms": refused_ms["p99_ms"],
            "timeouts": sum(1 for r in records if r.status == STATUS_TIMEOUT),
            "throughput_rps": round(len(records) / seconds, 2),
            "goodput_rps": round(len(ok) / seconds, 2),
            "goodput_in_window_rps": round(in_window / seconds, 2),
            **percentiles(ok),
            "statuses": statuses,
            "served_by": served,
            "connection_errors": errors,
            **server_split(records),
            **({"scored": scored(records, labels)} if labels else {}),
        }

    # A stream the client only dropped in the window still gets its line.
    by_stream: dict[str, list[Record]] = {k: [] for k in run.client_dropped_by_stream}
    for r in run.records:
        by_stream.setdefault(r.stream, []).append(r)
    return {
        **block(run.records, sum(run.carried_in.values())),
        "client_dropped": run.client_dropped,
        "stale_connection_retries": run.stale_connection_retries,
        "streams": {
            k: {**block(v, run.carried_in.get(k, 0)), "client_dropped": run.client_dropped_by_stream.get(k, 0)}
            for k, v in by_stream.items()
        },
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.loadgen", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--workload", required=True, type=Path, help="JSON file written by benchmarks.workloads")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--concurrency", type=int, help="closed loop: clients in flight")
    mode.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second")
    p.add_argument("--seconds", type=float, default=10.0, help="measured window")
    p.add_argument("--warmup", type=float, default=3.0, help="excluded from the figures")
    p.add_argument("--timeout", type=float, default=30.0, help="per request; a timeout is recorded as status 0")
    p.add_argument("--max-in-flight", type=int, default=512, help="open loop: cap on outstanding requests, per stream")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--raw", action="store_true", help="also write every request's record")
    p.add_argument(
        "--honor-retry-after",
        action="store_true",
        help="closed loop: wait what a 429/503's Retry-After asks before sending again",
    )
    p.add_argument("--out", type=Path, help="result JSON (default: stdout)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    ns = p.parse_args(argv)
    if ns.honor_retry_after and ns.concurrency is None:
        p.error("--honor-retry-after is for the closed loop (--concurrency): an open loop's arrivals do not wait")

    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop

        # This run's loop only: installing uvloop's policy would change every later loop in the process.
        loop_factory = uvloop.new_event_loop
    except ImportError:  # plain asyncio still works, at a higher CPU cost per request
        pass
    parts = urlsplit(ns.url)
    workload = json.loads(ns.workload.read_text())
    streams = load_streams(workload, parts.netloc)
    gen = LoadGenerator(ns.url, streams, ns.seed, ns.timeout, ns.honor_retry_after)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        if ns.concurrency is not None:
            run = runner.run(gen.closed(ns.concurrency, ns.warmup, ns.seconds))
            load: dict[str, Any] = {"mode": "closed", "concurrency": ns.concurrency}
        else:
            run = runner.run(gen.open(ns.rate, ns.warmup, ns.seconds, ns.max_in_flight))
            load = {"mode": "open", "rate_rps": ns.rate}
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    sent = max(1, len(run.records))
    result = {
        **load,
        "seconds": ns.seconds,
        "warmup_s": ns.warmup,
        "window_start_unix": round(run.window_start_unix, 3),
        **summarize(run, ns.seconds, {s.name: s.labels for s in streams if s.labels}),
        # What the client itself cost: share of one core over the whole run, and per request.
        "loadgen_cpu": {"core_share": round(cpu / wall, 3), "cpu_us_per_request": round(cpu / sent * 1e6 * ns.seconds / wall, 1)},
    }
    if ns.raw:
        result["records"] = [
            [
                r.stream,
                round(r.sent, 4),
                round(r.latency_ms, 3),
                r.status,
                r.served_by,
                r.server_ms,
                r.retry_after,
                r.server_parts,
            ]
            for r in run.records
        ]
    text = json.dumps(result)
    if ns.out:
        ns.out.write_text(text)
    else:
        sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
