"""`python -m serve_app.drain`: the preStop hook of a Ray worker pod that really drains it.

When Kubernetes stops a worker pod (scale-down, a node upgrade), killing Ray at once loses
the requests its replicas hold. This hook first tells the GCS that the node is going
(`ray drain-node`, reason preemption): Serve starts replacement replicas elsewhere and
stops routing to the ones here, which finish what they hold and exit. The hook waits until
no Serve replica is left on this node, or the deadline passes, and only then returns and
lets Kubernetes stop the pod. The pod's `terminationGracePeriodSeconds` must exceed the
deadline (serve_app/kuberay.py sets both).
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import time
from collections.abc import Callable

DEADLINE_S = 120


def wait_until_empty(
    count: Callable[[], int],
    deadline_s: float,
    poll_s: float = 2.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Poll `count` (Serve replicas left on this node) until it is 0 (True) or the deadline passes (False)."""
    until = clock() + deadline_s
    while True:
        try:
            if count() == 0:
                return True
        except Exception:  # the GCS may be busy or restarting: keep waiting, do not abort the drain
            pass
        if clock() >= until:
            return False
        sleep(poll_s)


def serve_replicas_here() -> int:
    import ray
    from ray.util.state import list_actors

    if not ray.is_initialized():
        ray.init(address="auto", logging_level=logging.ERROR)
    node = ray.get_runtime_context().get_node_id()
    alive = list_actors(filters=[("node_id", "=", node), ("state", "=", "ALIVE")], limit=10_000)
    return sum(1 for a in alive if (a.class_name or "").startswith("ServeReplica"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m serve_app.drain", description=__doc__)
    p.add_argument("--deadline-s", type=int, default=DEADLINE_S, help="give up waiting after this (default: %(default)s)")
    ns = p.parse_args(argv)
    subprocess.run(
        ["ray", "drain-node", "--reason=DRAIN_NODE_REASON_PREEMPTION", "--reason-message=pod terminating",
         f"--deadline-remaining-seconds={ns.deadline_s}"],
        check=False,
    )  # fmt: skip
    drained = wait_until_empty(serve_replicas_here, ns.deadline_s)
    print("drained" if drained else f"replicas still here after {ns.deadline_s} s", flush=True)
    return 0  # a preStop hook that fails only delays the stop it exists to make safe


if __name__ == "__main__":
    sys.exit(main())
