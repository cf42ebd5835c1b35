"""`python -m serve_app.tools.drain`: the preStop hook of a Ray worker pod that really drains it.

When Kubernetes stops a worker pod (scale-down, a node upgrade), killing Ray at once loses
the requests its replicas hold. This hook first tells the GCS that the node is going
(`ray drain-node`, reason preemption): Serve starts replacement replicas elsewhere and
stops routing to the ones here, which finish what they hold and exit. The hook waits until
no Serve replica is left on this node, or the deadline passes, and only then returns and
lets Kubernetes stop the pod. The pod's `terminationGracePeriodSeconds` must exceed the
deadline (serve_app/tools/kuberay.py sets both).
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

DEADLINE_S = 120


def wait_until(
    done: Callable[[], bool],
    deadline_s: float,
    poll_s: float = 2.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Ask `done` every `poll_s` until it says yes (True) or the deadline passes (False). An
    error counts as a no: the GCS may be busy or restarting, which must not end the drain."""
    until = clock() + deadline_s
    while True:
        try:
            if done():
                return True
        except Exception:
            pass
        if clock() >= until:
            return False
        sleep(poll_s)


def this_node() -> str:
    """This pod's Ray node id, found once and named in every drain request, so that a retried
    request can only ever drain this node."""
    import ray

    if not ray.is_initialized():
        ray.init(address="auto", logging_level=logging.ERROR)
    return str(ray.get_runtime_context().get_node_id())


def request_drain(node: str, deadline_s: float, run: Callable[..., Any] = subprocess.run) -> bool:
    """Tell the GCS that `node` is going (reason preemption); whether it accepted."""
    done = run(
        ["ray", "drain-node", f"--node-id={node}", "--reason=DRAIN_NODE_REASON_PREEMPTION",
         "--reason-message=pod terminating", f"--deadline-remaining-seconds={max(1, int(deadline_s))}"],
        check=False, capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        print(f"drain request failed: {(done.stderr or '').strip()[-500:]}", flush=True)
    return bool(done.returncode == 0)


def serve_replicas_here(node: str) -> int:
    from ray.util.state import list_actors

    alive = list_actors(filters=[("node_id", "=", node), ("state", "=", "ALIVE")], limit=10_000)
    return sum(1 for a in alive if (a.class_name or "").startswith("ServeReplica"))


def drain(
    node: Callable[[], str],
    request: Callable[[str, float], bool],
    replicas: Callable[[str], int],
    deadline_s: float,
    poll_s: float = 2.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Find this node, have its drain accepted, then wait until no Serve replica is left on it,
    each step retried within one deadline; what happened, in a line."""
    until = clock() + deadline_s
    found: list[str] = []

    def left() -> float:
        return max(0.0, until - clock())

    def find() -> bool:
        found.append(node())
        return True

    if not wait_until(find, left(), poll_s, clock, sleep):
        return "could not reach Ray to find this node"
    if not wait_until(lambda: request(found[0], left()), left(), poll_s, clock, sleep):
        return f"the drain request was not accepted within {deadline_s:.0f} s"
    if not wait_until(lambda: replicas(found[0]) == 0, left(), poll_s, clock, sleep):
        return f"replicas still here after {deadline_s:.0f} s"
    return "drained"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m serve_app.tools.drain", description=__doc__)
    p.add_argument("--deadline-s", type=int, default=DEADLINE_S, help="give up waiting after this (default: %(default)s)")
    ns = p.parse_args(argv)
    print(drain(this_node, request_drain, serve_replicas_here, ns.deadline_s), flush=True)
    return 0  # a preStop hook that fails only delays the stop it exists to make safe


if __name__ == "__main__":
    sys.exit(main())
