"""Clients elsewhere: the load generator on cores of its own, the server on the rest.

A load figure is what a user would see only when the client does not take the server's
cores: on one machine the load generator, HAProxy and the replicas otherwise share them,
and the client's own cost eats the capacity it measures. `python -m benchmarks` pins
itself (and so every load generator it starts) to the client's cores, and starts every
server-side process (`ray start`, whose raylet's workers, HAProxy and replicas inherit its
cores; the baselines' servers; Redis) under `taskset` on the server's. The plan travels to
those places in the environment, so no scenario threads it through.

The pod bed (benchmarks/podbed.py) does the same with network namespaces and its own flags.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

SERVER_CORES_ENV = "BENCH_SERVER_CORES"
CLIENT_CORES_ENV = "BENCH_CLIENT_CORES"


def parse(cores: str) -> set[int]:
    """taskset's list form: "0", "0-2", "0,3"."""
    out: set[int] = set()
    for part in cores.split(","):
        lo, _, hi = part.strip().partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    if not out:
        raise ValueError(f"no cores in {cores!r}")
    return out


def spell(cores: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cores))


@dataclass(frozen=True)
class CorePlan:
    """Which cores the client and the server get; `shared` where both run on every core."""

    client: str | None
    server: str | None

    @property
    def shared(self) -> bool:
        return self.client is None

    @classmethod
    def split(cls, usable: set[int], client: str | None = None, server: str | None = None) -> CorePlan:
        """The client on `client` (default: the highest usable core), the server on `server`
        (default: the other usable cores). One usable core cannot be split: shared."""
        if client is None and server is None and len(usable) < 2:
            return cls(None, None)
        want_client = parse(client) if client else {max(usable)}
        want_server = parse(server) if server else usable - want_client
        if not want_server or want_client & want_server:
            raise ValueError(f"client cores {spell(want_client)} and server cores {spell(want_server)} must not overlap")
        if missing := (want_client | want_server) - usable:
            raise ValueError(f"cores {spell(missing)} are not usable here (usable: {spell(usable)})")
        return cls(spell(want_client), spell(want_server))

    def apply(self) -> None:
        """This process (the harness, and every client it starts) onto the client's cores; the
        server's cores put where `server_argv` finds them."""
        if self.shared:
            os.environ.pop(SERVER_CORES_ENV, None)
            os.environ.pop(CLIENT_CORES_ENV, None)
            return
        assert self.client is not None and self.server is not None
        os.environ[SERVER_CORES_ENV] = self.server
        os.environ[CLIENT_CORES_ENV] = self.client
        os.sched_setaffinity(0, parse(self.client))

    def record(self) -> dict[str, object]:
        """What result.json says of it."""
        return {"shared": True} if self.shared else {"client_cores": self.client, "server_cores": self.server}


def usable_cores() -> set[int]:
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def server_argv(argv: Sequence[str]) -> list[str]:
    """`argv` pinned to the server's cores when a plan is in force; as it is otherwise."""
    cores = os.environ.get(SERVER_CORES_ENV)
    return ["taskset", "-c", cores, *argv] if cores else list(argv)


def in_force() -> dict[str, object]:
    """The plan this process runs under, for the report."""
    server, client = os.environ.get(SERVER_CORES_ENV), os.environ.get(CLIENT_CORES_ENV)
    return {"client_cores": client, "server_cores": server} if server and client else {"shared": True}
