"""Hosts on one machine: Linux network namespaces on a bridge, each with its own address.

What a pod network gives a Kubernetes pod: its own network stack (loopback, ports, an address
other pods reach), so two pods can both listen on port 8000. Needs root (`ip netns`, veth pairs,
a bridge). Addresses come from a subnet the bed owns (10.233.0.0/24 by default); everything it
creates is named with its prefix and removed by `Network.remove`, also after a crash.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


class NetnsUnavailable(RuntimeError):
    """This machine (or this user) cannot make network namespaces."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def available() -> str | None:
    """None where namespaces can be made here, else why not (for a test to skip with)."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"pbprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` refused: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    """One namespace: a pod's network stack, with `address` on the bed's bridge."""

    name: str  # the namespace's name (`ip netns exec NAME ...`)
    address: str
    hosts: dict[str, str] = field(default_factory=dict)  # names this host resolves (/etc/hosts)

    def command(self, argv: Sequence[str], cores: str | None = None) -> list[str]:
        """`argv` run inside this host, pinned to `cores` (taskset's list) where given."""
        pinned = ["taskset", "-c", cores, *argv] if cores else list(argv)
        return ["ip", "netns", "exec", self.name, *pinned]

    def pids(self) -> list[int]:
        """Every process in this host's network namespace: what a pod's loss kills."""
        out = _ip("netns", "pids", self.name, check=False).stdout
        return [int(p) for p in out.split()]

    def kill_all(self, sig: int = signal.SIGKILL, timeout_s: float = 15.0) -> int:
        """Kill every process of the host at once, as a node's loss does; the count killed."""
        killed = 0
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pids = self.pids()
            if not pids:
                return killed
            for pid in pids:
                try:
                    os.kill(pid, sig)
                    killed += 1
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        raise RuntimeError(f"{self.name}: processes left after {timeout_s} s: {self.pids()}")


class Network:
    """A bridge and the hosts on it. `add` makes a host; `remove` deletes everything made."""

    def __init__(self, prefix: str = "pb", subnet: str = "10.233.0.0/24") -> None:
        self.prefix = prefix
        self.subnet = ipaddress.ip_network(subnet)
        self.bridge = f"{prefix}br0"
        self.hosts: dict[str, Host] = {}
        self._addresses = iter(self.subnet.hosts())
        self.gateway = str(next(self._addresses))

    def create(self) -> Network:
        self.remove()  # what a crashed run left behind
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        return self

    def add(self, role: str, hosts: Mapping[str, str] | None = None) -> Host:
        """A new host named `<prefix>-<role>`, its loopback up and its address on the bridge."""
        ns = f"{self.prefix}-{role}"
        index = len(self.hosts)
        address = str(next(self._addresses))
        outer, inner = f"{self.prefix}v{index}", f"{self.prefix}p{index}"
        _ip("netns", "add", ns)
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", outer, "master", self.bridge)
        _ip("link", "set", outer, "up")
        _ip("link", "set", inner, "netns", ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", inner)
        _ip("-n", ns, "link", "set", inner, "up")
        _ip("-n", ns, "route", "add", "default", "via", self.gateway)
        host = Host(ns, address, dict(hosts or {}))
        self.hosts[role] = host
        self.write_hosts()
        return host

    def name(self, hostname: str, role: str) -> None:
        """Make `hostname` resolve to the host of `role` in every host (a Service's DNS name)."""
        for host in self.hosts.values():
            host.hosts[hostname] = self.hosts[role].address
        self.write_hosts()

    def write_hosts(self) -> None:
        # `ip netns exec` bind-mounts /etc/netns/<ns>/* over /etc/* for what it starts. As in a pod,
        # the host's own name is its address; the resolver is a local one that is not there, so a
        # name that is not in hosts fails at once instead of waiting on a DNS server out of reach.
        for host in self.hosts.values():
            d = Path("/etc/netns") / host.name
            d.mkdir(parents=True, exist_ok=True)
            names = {**host.hosts, socket.gethostname(): host.address}
            lines = ["127.0.0.1 localhost", *(f"{a} {n}" for n, a in sorted(names.items()))]
            (d / "hosts").write_text("\n".join(lines) + "\n")
            (d / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")

    def remove(self) -> None:
        """Kill every process in the bed's namespaces, then delete them, their links and the bridge."""
        for ns in self._namespaces():
            Host(ns, "").kill_all()
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        for link in self._links():
            _ip("link", "del", link, check=False)
        self.hosts.clear()

    def _namespaces(self) -> Iterable[str]:
        out = _ip("netns", "list", check=False).stdout
        names = [line.split()[0] for line in out.splitlines() if line.strip()]
        return [n for n in names if n.startswith(f"{self.prefix}-")]

    def _links(self) -> Iterable[str]:
        out = _ip("-o", "link", "show", check=False).stdout
        names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
        return [n for n in names if n == self.bridge or n.startswith(f"{self.prefix}v")]
