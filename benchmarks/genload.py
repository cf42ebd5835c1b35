"""Closed-loop load of streaming completions: per-request TTFT, inter-token gaps, latency, tokens.

Each of `concurrency` clients sends a streaming `/v1/completions` request, reads
its server-sent events to the end, and sends the next. One SSE chunk is one
generated token (the router renders one event per decode step of a sequence).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import numpy as np

from serve_app.zoo.data import corpus


@dataclass(frozen=True)
class GenRequest:
    prompt: str
    max_tokens: int


# Many short generations, some medium, a few long: request-level batching holds each batch for
# its longest member, which is what iteration-level scheduling removes.
LENGTH_MIX: tuple[tuple[float, int, int], ...] = ((0.6, 4, 16), (0.3, 17, 48), (0.1, 49, 96))


def mixed_workload(n: int, seed: int = 0, max_tokens_limit: int = 96) -> list[GenRequest]:
    """Prompts of 1 to 24 words from the demo corpus; output lengths from LENGTH_MIX (capped)."""
    rng = np.random.default_rng(seed)
    words = corpus(400, seed).split()
    shares = np.array([m[0] for m in LENGTH_MIX])
    out = []
    for _ in range(n):
        start = int(rng.integers(0, len(words) - 30))
        prompt = " ".join(words[start : start + int(rng.integers(1, 25))])
        _, lo, hi = LENGTH_MIX[int(rng.choice(len(LENGTH_MIX), p=shares / shares.sum()))]
        out.append(GenRequest(prompt, min(int(rng.integers(lo, hi + 1)), max_tokens_limit)))
    return out


@dataclass
class Record:
    sent: float
    first: float | None = None
    done: float | None = None
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens in the chunk)
    tokens: int = 0
    status: int = 0


@dataclass
class PhaseResult:
    label: str
    concurrency: int
    seconds: float
    requests: int
    errors: int
    tokens: int
    tokens_per_s: float
    requests_per_s: float
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    chunk_gap_ms: dict[str, float]
    tokens_per_chunk: float
    latency_ms: dict[str, float]
    server: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _pcts(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    a = np.array(values) * 1000
    return {"p50": round(float(np.percentile(a, 50)), 2), "p90": round(float(np.percentile(a, 90)), 2),
            "p99": round(float(np.percentile(a, 99)), 2), "mean": round(float(a.mean()), 2)}  # fmt: skip


async def _one(session: aiohttp.ClientSession, url: str, model: str, req: GenRequest) -> Record:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"continuous_usage_stats": True}}  # fmt: skip
    rec = Record(sent=time.perf_counter())
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            rec.status = resp.status
            if resp.status != 200:
                await resp.read()
                rec.done = time.perf_counter()
                return rec
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: {"):
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if "error" in chunk:  # an error event mid-stream
                    rec.status = -1
                    continue
                if rec.first is None:
                    rec.first = now
                so_far = chunk["usage"]["completion_tokens"]  # a chunk may carry several tokens
                rec.chunks.append((now, so_far - rec.tokens))
                rec.tokens = so_far
    except aiohttp.ClientError:
        rec.status = -1  # a broken stream counts as an error, not as a crash of the benchmark
    rec.done = time.perf_counter()
    return rec


async def closed_loop(
    url: str, model: str, workload: list[GenRequest], concurrency: int, seconds: float, warmup: float
) -> tuple[list[Record], float, float]:
    """Run for warmup + seconds; returns records and the measured window [t0, t1] (perf_counter)."""
    requests = itertools.cycle(workload)
    records: list[Record] = []
    t0 = time.perf_counter() + warmup
    t1 = t0 + seconds
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def client() -> None:
            while time.perf_counter() < t1:
                records.append(await _one(session, url, model, next(requests)))

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return records, t0, t1


def summarize(label: str, concurrency: int, records: list[Record], t0: float, t1: float) -> PhaseResult:
    """Tokens/s counts tokens that arrived inside the window; latencies are of requests sent inside it."""
    window = t1 - t0
    tokens = sum(n for r in records for t, n in r.chunks if t0 <= t <= t1)
    measured = [r for r in records if t0 <= r.sent <= t1]
    ok = [r for r in measured if r.status == 200 and r.first is not None and r.done is not None]
    if len(measured) - len(ok):
        print(f"  {label}: {len(measured) - len(ok)} of {len(measured)} requests failed", flush=True)
    # Inter-token latency: a chunk of n tokens after a gap g counts as n tokens g/n apart.
    gaps = [(b - a) / n for r in ok for (a, _), (b, n) in itertools.pairwise(r.chunks) for _ in range(n)]
    chunk_gaps = [b - a for r in ok for (a, _), (b, _) in itertools.pairwise(r.chunks)]
    return PhaseResult(
        label=label,
        concurrency=concurrency,
        seconds=round(window, 2),
        requests=len(measured),
        errors=len(measured) - len(ok),
        tokens=tokens,
        tokens_per_s=round(tokens / window, 1),
        requests_per_s=round(sum(1 for r in ok if r.done is not None and r.done <= t1) / window, 2),
        ttft_ms=_pcts([r.first - r.sent for r in ok if r.first is not None]),
        itl_ms=_pcts(gaps),
        chunk_gap_ms=_pcts(chunk_gaps),
        tokens_per_chunk=round(tokens / max(1, sum(1 for r in records for t, _ in r.chunks if t0 <= t <= t1)), 2),
        latency_ms=_pcts([r.done - r.sent for r in ok if r.done is not None]),
    )


def run_phase(url: str, model: str, label: str, workload: list[GenRequest], concurrency: int, seconds: float,
              warmup: float) -> PhaseResult:  # fmt: skip
    records, t0, t1 = asyncio.run(closed_loop(url, model, workload, concurrency, seconds, warmup))
    return summarize(label, concurrency, records, t0, t1)


def main(argv: list[str] | None = None) -> int:
    """A quick look against a running app: one closed-loop phase, its figures as JSON."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m benchmarks.genload", description=__doc__)
    p.add_argument("url", help="the app, e.g. http://127.0.0.1:8000")
    p.add_argument("model", help="a generator, e.g. gpt")
    p.add_argument("concurrency", type=int, help="clients streaming at once")
    p.add_argument("--seconds", type=float, default=10.0, help="measured window (default: %(default)s)")
    p.add_argument("--warmup", type=float, default=2.0, help="excluded from the figures (default: %(default)s)")
    ns = p.parse_args(argv)
    result = run_phase(ns.url, ns.model, ns.model, mixed_workload(200), ns.concurrency, ns.seconds, ns.warmup)
    print(json.dumps(result.to_json(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
