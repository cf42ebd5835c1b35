"""Processes on this machine as the harness sees them. A zombie has exited (only its parent has
not reaped it yet), so it never counts as running; a process remembered as [pid, start time] is
the same one only while both match, since pids are reused."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable

import psutil

# What a process is remembered by: [pid, start time] (psutil's create_time).
Marked = list[float]


def running(p: psutil.Process) -> bool:
    """Whether `p` still runs: neither gone nor a zombie."""
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def named(names: Iterable[str]) -> list[psutil.Process]:
    """The running processes whose name contains one of `names`."""
    wanted = tuple(names)
    return [
        p
        for p in psutil.process_iter(["name", "status"])
        if p.info["status"] != psutil.STATUS_ZOMBIE and any(n in (p.info["name"] or "") for n in wanted)
    ]


def marked_process(marked: Marked | None) -> psutil.Process | None:
    """The process remembered as [pid, start time], if that very process still runs."""
    if marked is None:
        return None
    with contextlib.suppress(psutil.Error):
        p = psutil.Process(int(marked[0]))
        if p.create_time() == marked[1] and running(p):
            return p
    return None


def signal_marked(marked: Marked | None, sig: int) -> bool:
    """Send `sig` to the remembered process if it still runs; returns whether it did."""
    p = marked_process(marked)
    if p is None:
        return False
    with contextlib.suppress(psutil.Error):
        p.send_signal(sig)
        return True
    return False


def wait_marked(marked: Marked | None, timeout_s: float) -> float:
    """Wait until the remembered process has ended (a zombie has); returns seconds waited."""
    started = time.perf_counter()
    while marked_process(marked) is not None and time.perf_counter() - started <= timeout_s:
        time.sleep(0.1)
    return time.perf_counter() - started
