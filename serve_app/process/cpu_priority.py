"""CPU priority of threads, for processes that share cores (Linux; elsewhere no-ops).

Three tiers where a router and model replicas share a node, best first:
1. a model's urgent lane, at the niceness Ray gives every worker (15 by
   default, `RAY_worker_niceness`);
2. the router, at nice 19 by default (`scheduling.router_nice`): where models are the
   bottleneck, it has little work per request (benchmarks/results/profile/), so it yields
   to urgent batches. A catalog of small models whose router is the bottleneck keeps it at
   the workers' niceness instead (configs/local.yaml), so it does not wait behind the rest;
3. a model's bulk lane, under SCHED_IDLE: it gets every idle cycle and
   nothing more.

CFS weights: nice 15 is 36, nice 19 is 15, SCHED_IDLE is 3. nice 19 alone for
the bulk lane would leave it 30% of the cores beside an urgent batch at nice
15; SCHED_IDLE leaves it about 8%. Every step here lowers a priority, which
needs no privilege (raising one needs CAP_SYS_NICE, which pods rarely have).
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable

logger = logging.getLogger("ray.serve")
LINUX = sys.platform.startswith("linux")


def thread_ids() -> set[int]:
    """Kernel thread ids of this process's threads."""
    return {int(t) for t in os.listdir("/proc/self/task")} if LINUX else set()


def to_background(tid: int) -> None:
    """Run thread `tid` under SCHED_IDLE."""
    if LINUX:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


def lower_thread_priority() -> None:
    """Make the calling thread a background thread."""
    to_background(threading.get_native_id())


def is_background(tid: int) -> bool:
    return LINUX and os.sched_getscheduler(tid) == os.SCHED_IDLE


def renice_process(nice: int) -> None:
    """Give every thread of this process niceness `nice` (threads started later inherit it).

    Linux keeps niceness per thread, so `os.nice` would change the calling thread only.
    Raising priority (a lower value than now) needs CAP_SYS_NICE: then this logs and
    leaves the process as it is.
    """
    if not LINUX:
        return
    for tid in thread_ids():
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
        except PermissionError:
            logger.warning("could not set this process's niceness to %d", nice)
            return


# A core that runs only SCHED_IDLE work is still busy to the kernel: a task that waits behind
# another on the other core moves to it at the next periodic load balance, not at once as it
# would to an idle core (which pulls waiting tasks the moment it goes idle). Background work
# that runs for long stretches therefore naps briefly and often (benchmarks/results/images/).
NAP_EVERY_S = 0.0005
# Long enough to enter the scheduler's idle path, where the balancing happens; the kernel's timer
# slack makes the sleep itself somewhat longer.
NAP_S = 0.00002


# How long background work waits at most, in steps, at one call while its process's urgent work is
# in flight (a few requests' time in the router), and over a Pacer's whole life (a decoder's: one
# request's images, whatever their number): it is slowed, never stalled. The total stays well
# inside the router's time limit for a decoder's answer (serve_app.protocols.decoders.CALL_TIMEOUT_S).
MAX_YIELD_S = 0.005
MAX_YIELD_TOTAL_S = 4.0
YIELD_STEP_S = 0.0001


class Pacer:
    """Call `pace()` often from background work: every `every_s` of wall time it sleeps `nap_s`,
    so that its core goes idle for a moment. Time is wall time, as the kernel's balancing sees it.
    With `busy`, any call instead waits while `busy()` says that latency-sensitive work is running
    (up to `max_yield_s` a wait and `max_yield_total_s` in all): background work in the same CPU
    class would take half a core from it, and no class lower than SCHED_IDLE exists."""

    def __init__(
        self,
        every_s: float = NAP_EVERY_S,
        nap_s: float = NAP_S,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
        busy: Callable[[], bool] | None = None,
        max_yield_s: float = MAX_YIELD_S,
        max_yield_total_s: float = MAX_YIELD_TOTAL_S,
    ) -> None:
        self.every_s, self.nap_s, self.clock, self.sleep = every_s, nap_s, clock, sleep
        self.busy, self.max_yield_s, self.yield_left_s = busy, max_yield_s, max_yield_total_s
        self.naps = 0
        self.yields = 0  # calls that found `busy()` true, and waited while it was
        self._due = clock() + every_s

    def pace(self) -> None:
        # Urgent work is looked for at every call (a mapped byte's read, and while it is set a read
        # of /proc for the cores), not only when a nap is due: a call comes every block of work,
        # and a nap's interval spans many blocks.
        if self.busy is not None and self.yield_left_s > 0 and self.busy():
            start = self.clock()
            until = start + min(self.max_yield_s, self.yield_left_s)
            while self.busy() and self.clock() < until:
                self.sleep(YIELD_STEP_S)
            now = self.clock()
            self.yield_left_s -= now - start
            self.yields += 1
            self._due = now + self.every_s
            return
        now = self.clock()
        if now < self._due:
            return
        self.sleep(self.nap_s)
        self.naps += 1
        self._due = self.clock() + self.every_s


class BusyFlag:
    """How many of this process's latency-sensitive tasks are in flight, published as one byte
    (nonzero: busy) in an anonymous memory file that child processes map (`fd`), so that their
    background work can yield to it (Pacer's `busy`). Without memfd (not Linux) nothing is
    published, and nothing waits.

    The count and the byte change together under a lock, which any thread may take: the request
    handlers that hold the flag, and the decoders' I/O threads that make its file (`fd`). Under the
    lock nothing blocks or allocates, so a background thread never holds it for long; it is
    reentrant, so a garbage collection that ends a request's coroutine inside it cannot deadlock."""

    def __init__(self) -> None:
        self.count = 0
        self._map: mmap.mmap | None = None
        self._fd: int | None = None
        self._lock = threading.RLock()

    def fd(self) -> int | None:
        """The file's descriptor, for a child process to map; made on first use."""
        if self._fd is not None or not hasattr(os, "memfd_create"):
            return self._fd
        fd = os.memfd_create("serve-app-busy", os.MFD_CLOEXEC)
        os.ftruncate(fd, 1)
        view = mmap.mmap(fd, 1)
        with self._lock:
            if self._fd is None:  # else another thread made it first
                view[0] = int(self.count > 0)
                self._map = view
                self._fd = fd
                return fd
        view.close()
        os.close(fd)
        return self._fd

    def held(self) -> BusyFlag:
        """`with flag.held():` counts the block in flight (it nests). A plain object rather than a
        generator: it is entered once per request."""
        return self

    def __enter__(self) -> None:
        with self._lock:
            self.count += 1
            if self._map is not None:
                self._map[0] = 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self.count -= 1
            if self._map is not None and self.count == 0:
                self._map[0] = 0


def busy_reader(fd: int) -> Callable[[], bool]:
    """In a child process: whether the parent's BusyFlag behind `fd` says busy."""
    view = mmap.mmap(fd, 1, prot=mmap.PROT_READ)
    return lambda: view[0] != 0


LOADAVG = "/proc/loadavg"
CGROUP = "/sys/fs/cgroup"


def runnable_tasks(loadavg: bytes) -> int:
    """Tasks running or waiting for a core now, on every core of the machine: the fourth field of
    /proc/loadavg (`runnable/total`). In a container, the node's count, not the container's."""
    return int(loadavg.split()[3].partition(b"/")[0])


def cgroup_cpu_limit(root: str = CGROUP) -> float | None:
    """This process's cgroup CPU quota in cores (a pod's CPU limit), or None where it has none:
    cgroup v2's `cpu.max` (`quota period`, or `max`), else v1's `cpu.cfs_quota_us` (-1: none)."""
    try:
        with open(os.path.join(root, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as f:
            quota_us = int(f.read())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as f:
            period_us = int(f.read())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError, ZeroDivisionError):
        return None


def usable_cores(root: str = CGROUP) -> int:
    """The cores this process may use: its CPU affinity (a cpuset), capped by its cgroup's CPU
    quota, rounded up. Fewer than the machine's whenever a container is limited."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)
    return max(1, min(cores, math.ceil(limit))) if limit else max(1, cores)


def cores_taken(cpus: int | None = None, path: str = LOADAVG) -> Callable[[], bool]:
    """Whether the tasks that run or wait now, the caller among them (it is running), leave none
    of the caller's cores free. A task that wakes then finds none idle: one of the models' bulk
    batches, in the caller's own SCHED_IDLE class, would share a core with it. With a core free,
    the waking task takes that one.

    The count is the machine's (a container's /proc shows the node's), the cores the caller's
    own (`usable_cores`: a pod's CPU limit or cpuset): a limited container thus counts its cores
    taken sooner, never later. Where the count cannot be read (not Linux), or reads 0 (a sandbox
    such as gVisor prints `0/0`; a real kernel counts the reader), always True: the caller yields
    as if every core were taken. Hyperthreads count as cores."""
    n = cpus or usable_cores()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return lambda: True

    def taken() -> bool:
        try:
            runnable = runnable_tasks(os.pread(fd, 128, 0))
        except (OSError, ValueError, IndexError):
            return True
        return runnable < 1 or runnable >= n

    return taken


def when_contended(busy: Callable[[], bool], taken: Callable[[], bool]) -> Callable[[], bool]:
    """`busy`, and only while no core is left free (`cores_taken`): latency-sensitive work in
    flight costs a background task a wait only where the task would take the last core it could
    run on. The flag first: it is one mapped byte, the count a read of /proc."""
    return lambda: busy() and taken()


# The router's latency-sensitive work in flight (its model batches out, and classifications other
# than encoded images' or low priority's, serve_app.router.endpoints.codecs.urgent): its image decoders
# yield to it while no core is left free (serve_app.protocols.decoders).
MODEL_WORK = BusyFlag()
