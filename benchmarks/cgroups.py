"""A pod's CPU request as the kubelet enforces it: a cgroup of its own with CPU shares.

On a Kubernetes node every pod's processes live in a cgroup whose `cpu.shares` follow the pod's
CPU request (millicores x 1024 / 1000): when the node's cores are all busy, each pod gets its
requested part of them, whatever its neighbours do. The pod bed runs every pod on the same core,
so without this a GPU pod placing its replicas again after a loss would take the core from the
ingress pods' routers, which on a real node have cores of their own. Needs the cgroup v1 `cpu`
controller writable (root); where it is not, `available` says why and pods share the core unweighted.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
MIN_SHARES = 2  # the kernel's (and the kubelet's) least


def shares(cores: float) -> int:
    """The kubelet's `cpu.shares` for a request of `cores` (MilliCPUToShares)."""
    return max(MIN_SHARES, int(cores * 1000) * 1024 // 1000)


def available(root: Path = CPU_ROOT) -> str | None:
    """None where CPU groups can be made here, else why not."""
    if not (root / "cpu.shares").exists():
        return f"no cgroup v1 cpu controller at {root}"
    if not os.access(root, os.W_OK):
        return f"{root} is not writable (root needed)"
    return None


class CpuGroup:
    """One pod's CPU group, `<root>/<name>`, with the shares of its request."""

    def __init__(self, name: str, cores: float, root: Path = CPU_ROOT) -> None:
        self.path = root / name
        self.shares = shares(cores)

    def create(self) -> CpuGroup:
        self.path.mkdir(exist_ok=True)
        (self.path / "cpu.shares").write_text(str(self.shares))
        return self

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """`argv` started inside the group: its children (a raylet's workers) stay in it."""
        procs = self.path / "cgroup.procs"
        return ["/bin/sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *argv]

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def remove(self, timeout_s: float = 10.0) -> None:
        """Kill what is left in it, then delete it."""
        deadline = time.monotonic() + timeout_s
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        if self.path.exists():
            self.path.rmdir()
