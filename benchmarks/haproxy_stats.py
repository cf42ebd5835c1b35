"""What Serve's HAProxy saw of its servers, read from its admin socket (`show stat`), and its
own memory and connections (`show info`).

Which router replicas were up, how often a health check or the traffic it observed
(`observe layer4`) took one down, and how many requests went to the fallback server
(Serve's Python proxy, a `backup` that takes over only when no router replica is up). Beside a
soak's memory samples: what HAProxy's pools hold (allocated, and in use by live connections) and
the connections it has open, which tell pools that follow the load from memory that leaks.
"""

from __future__ import annotations

import contextlib
import csv
import socket
from pathlib import Path

BASE = Path("/tmp/haproxy-serve")
# show stat columns kept: state, last check, health-check and observed failures, sessions
KEEP = ("pxname", "svname", "status", "check_status", "chkfail", "chkdown", "hanafail", "scur", "qcur", "stot", "bck")
# show info fields kept: pool bytes allocated (free objects cached included) and in use, connections open
INFO_KEEP = ("PoolAlloc_bytes", "PoolUsed_bytes", "CurrConns")


def admin_socket(base: Path = BASE) -> Path | None:
    """The admin socket HAProxy wrote most recently: the running cluster's."""
    socks = [p for p in base.glob("*/admin.sock") if p.is_socket()]
    return max(socks, key=lambda p: p.stat().st_mtime) if socks else None


def ask(path: Path, command: bytes, timeout_s: float = 2.0) -> str:
    """One command on the admin socket, its whole answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(str(path))
        s.sendall(command + b"\n")
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode()


def parse_servers(text: str) -> list[dict[str, str]]:
    """Server rows (not the FRONTEND/BACKEND summaries) of `show stat` CSV, the KEEP columns."""
    rows = csv.DictReader(text.lstrip("# ").splitlines())
    return [{k: r.get(k, "") for k in KEEP} for r in rows if r.get("svname") not in ("FRONTEND", "BACKEND", None)]


def ask_running(command: bytes, base: Path = BASE) -> str | None:
    """`command`'s answer from the running HAProxy; None when there is none to ask."""
    path = admin_socket(base)
    if path is None:
        return None
    with contextlib.suppress(OSError):
        return ask(path, command)
    return None


def servers(base: Path = BASE) -> list[dict[str, str]]:
    """The running HAProxy's servers; empty when there is none to ask."""
    text = ask_running(b"show stat", base)
    return parse_servers(text) if text is not None else []


def parse_info(text: str) -> dict[str, int]:
    """The INFO_KEEP fields of `show info` ("Name: value" lines), as integers."""
    fields = dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)
    return {k: int(fields[k]) for k in INFO_KEEP if fields.get(k, "").strip().isdigit()}


def info(base: Path = BASE) -> dict[str, int]:
    """The running HAProxy's pools and connections; empty when there is none to ask."""
    text = ask_running(b"show info", base)
    return parse_info(text) if text is not None else {}


def summary(samples: list[list[dict[str, str]]]) -> dict[str, dict[str, int | str]]:
    """Per server over a run: samples not UP, the most health-check and observed failures and
    transitions to DOWN, and the requests it took (the last `stot` seen)."""
    out: dict[str, dict[str, int | str]] = {}
    for sample in samples:
        for r in sample:
            key = f"{r['pxname']}/{r['svname']}"
            s = out.setdefault(key, {"backup": r["bck"] == "1", "samples": 0, "not_up": 0, "chkdown": 0, "hanafail": 0,
                                     "requests": 0, "last_check": ""})  # fmt: skip
            s["samples"] = int(s["samples"]) + 1
            s["not_up"] = int(s["not_up"]) + (not r["status"].startswith("UP") and r["bck"] != "1")
            for k in ("chkdown", "hanafail"):
                s[k] = max(int(s[k]), int(r[k] or 0))
            s["requests"] = max(int(s["requests"]), int(r["stot"] or 0))
            s["last_check"] = r["check_status"]
    return out
