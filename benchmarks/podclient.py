"""An open-loop client of a Kubernetes Service: several addresses, and the retries a user's client makes.

`python -m benchmarks.podclient --targets A,B --rate R --seconds S --bodies F --out O` sends Poisson
arrivals at R a second for S seconds, alternating the routes of F. Each request goes to the next
address that is not marked down (as kube-proxy spreads connections over a Service's endpoints); a
connection error marks that address down for a second and sends the request again to another one;
a 503 or 429 with Retry-After is sent again after it. A request is answered (200), failed (another
status) or lost (no answer by its deadline: timed out, or refused until then). One record per request goes to
O, with what left the client and what it dropped, so offered load is what was really sent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

TIMED_OUT = -2  # no answer within the deadline
REFUSED_TO_THE_END = -3  # refused with Retry-After until the deadline passed
# Record fields, one list per request.
FIELDS = ["route", "sent", "done", "status", "attempts", "connection_errors", "refusals", "served_by", "detail"]


@dataclass
class Targets:
    """The Service's endpoints, with the ones that refused a connection marked down a while."""

    addresses: list[str]
    down_s: float = 1.0
    _next: int = 0
    _down_until: dict[str, float] = field(default_factory=dict)

    def pick(self, now: float, avoid: str | None = None) -> str:
        n = len(self.addresses)
        for i in range(n):
            address = self.addresses[(self._next + i) % n]
            if address != avoid and self._down_until.get(address, 0.0) <= now:
                self._next = (self._next + i + 1) % n
                return address
        self._next = (self._next + 1) % n
        return self.addresses[self._next]

    def mark_down(self, address: str, now: float) -> None:
        self._down_until[address] = now + self.down_s

    def update(self, addresses: list[str]) -> None:
        """The Service's ready endpoints changed (a pod went away, or a new one passed its probe)."""
        if addresses and addresses != self.addresses:
            self.addresses = addresses
            self._next %= len(addresses)


async def follow_endpoints(targets: Targets, path: Path, period_s: float = 0.25) -> None:
    """Re-read the endpoints file the bed keeps, as kube-proxy follows a Service's endpoints."""
    while True:
        try:
            targets.update(json.loads(path.read_text()))
        except (OSError, ValueError):
            pass
        await asyncio.sleep(period_s)


async def one_request(
    client: httpx.AsyncClient, targets: Targets, route: str, body: bytes, deadline_s: float, port: int
) -> list[Any]:
    sent = time.time()
    attempts = errors = refusals = 0
    status, served_by, detail = 0, "", ""
    avoid: str | None = None
    while True:
        left = sent + deadline_s - time.time()
        if left <= 0:
            status = REFUSED_TO_THE_END if refusals else TIMED_OUT
            break
        address = targets.pick(time.monotonic(), avoid)
        attempts += 1
        try:
            r = await client.post(
                f"http://{address}:{port}/v2/models/{route}/infer",
                content=body,
                headers={"content-type": "application/json", "cache-control": "no-cache"},
                timeout=left,
            )
        except httpx.TimeoutException:
            status = TIMED_OUT
            break
        except httpx.TransportError:
            # Refused, reset or closed without an answer: the pod went away. Try another address.
            errors += 1
            targets.mark_down(address, time.monotonic())
            avoid = address
            await asyncio.sleep(0.05)
            continue
        status = r.status_code
        if status in (429, 503) and "retry-after" in r.headers:
            refusals += 1
            detail = f"refused: {r.text[:160]}"  # the last refusal's reason, kept if it is answered later
            await asyncio.sleep(min(float(r.headers["retry-after"]), max(0.0, sent + deadline_s - time.time())))
            continue
        served_by = r.headers.get("x-served-by", "")
        if status != 200:  # who answered it so, for the report
            detail = f"{r.headers.get('server', '')} {r.text[:160]}"
        break
    return [route, sent, time.time(), status, attempts, errors, refusals, served_by, detail]


async def run(ns: argparse.Namespace) -> dict[str, Any]:
    bodies: dict[str, list[Any]] = json.loads(Path(ns.bodies).read_text())
    encoded = {route: [json.dumps(b).encode() for b in items] for route, items in bodies.items()}
    routes = sorted(encoded)
    targets = Targets(ns.targets.split(","))
    rng = random.Random(ns.seed)
    limits = httpx.Limits(max_connections=ns.max_in_flight, max_keepalive_connections=ns.max_in_flight)
    tasks: list[asyncio.Task[list[Any]]] = []
    dropped = 0
    follower = asyncio.create_task(follow_endpoints(targets, Path(ns.endpoints))) if ns.endpoints else None
    async with httpx.AsyncClient(limits=limits) as client:
        start = time.time()
        t = 0.0
        i = 0
        while t < ns.seconds:
            t += rng.expovariate(ns.rate)
            delay = start + t - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if sum(not task.done() for task in tasks[-ns.max_in_flight :]) >= ns.max_in_flight:
                dropped += 1  # the client's own limit: shown, never hidden in a latency
                continue
            route = routes[i % len(routes)]
            body = encoded[route][(i // len(routes)) % len(encoded[route])]
            i += 1
            tasks.append(asyncio.create_task(one_request(client, targets, route, body, ns.deadline_s, ns.port)))
        sent_window = time.time() - start
        records = await asyncio.gather(*tasks)
    if follower is not None:
        follower.cancel()
    return {
        "fields": FIELDS,
        "records": records,
        "start": start,
        "seconds": sent_window,
        "offered_rate": len(records) / sent_window,
        "dropped_by_client": dropped,
        "targets": targets.addresses,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.podclient", description=__doc__)
    p.add_argument("--targets", required=True, help="comma-separated addresses (the Service's endpoints)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoints", default=None, help="a JSON list of the ready addresses, re-read as it changes")
    p.add_argument("--rate", type=float, required=True, help="Poisson arrivals a second")
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--bodies", required=True, help="JSON: route -> list of v2 request bodies")
    p.add_argument("--deadline-s", type=float, default=30.0, help="a request not answered by then is lost")
    p.add_argument("--max-in-flight", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    ns = p.parse_args(argv)
    result = asyncio.run(run(ns))
    Path(ns.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
