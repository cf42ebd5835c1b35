"""Chaos on a multi-node Ray cluster started on this one machine, under steady load.

A head node and a worker node are started with `ray start` twice, each with its
own logical CPUs and a custom resource that names it, the way Ray's own
multi-node tests do on one host. The app runs a classifier with two replicas
(one per node), the generator on the worker, and two router replicas on the head:
the head plays an ingress node that carries no generation, so a worker's loss
leaves alive every router that holds a client's connection, and each stream it
cuts ends with an error event and [DONE].
The load generator sends classification requests throughout; each phase breaks
one thing in the middle of its window:

- replica: `ray.kill` of one classifier replica (the one on the head node);
- router:  `ray.kill` of one router replica;
- stall:   the generator's decode loop wedges (a fault drill set live through
           `user_config`) while streams run: its health check must fail and Serve
           must replace it; each stream must end with an error event and [DONE];
- malformed: a corpus of bad requests mixed into the load (no fault);
- node:    the worker node's raylet and every process under it are SIGKILLed, and a new
           worker node joins (as KubeRay recreates a lost pod).

Per phase: the client-visible answers by status, answers lost (a timeout, a
reset, or a 5xx other than a 503 with Retry-After), refusals without
Retry-After, the time until goodput is back, and what the router reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from benchmarks import workloads
from benchmarks.cluster import HTTP_PORT, RAY_PORT, Probe, RayCluster, run_loadgen
from benchmarks.cores import server_argv
from benchmarks.scenarios import DEFAULT_INGRESS, single_versions
from serve_app.tools.kuberay import INGRESS_RESOURCE  # the head offers it, as KubeRay's ingress pods do: routers run there alone

WORKER_RESOURCE = "chaos_worker"
WORKER_NODE_MANAGER_PORT = 6402
CLASSIFIER = "resnet-heavy"
GENERATOR = "gpt"
BASE_URL = f"http://127.0.0.1:{HTTP_PORT}"
RECOVERED_SHARE = 0.8  # goodput back to this share of the pre-fault mean counts as recovered


@dataclass
class ChaosSettings:
    seconds: float = 40.0  # measured window of each phase
    fault_at_s: float = 10.0  # when in the window the fault strikes
    warmup_s: float = 2.0  # load before each measured window
    concurrency: int = 16
    streams: int = 4  # SSE streams running through the decode-loop stall and the node's loss
    head_cpus: int = 4
    worker_cpus: int = 3
    phases: tuple[str, ...] = ("replica", "router", "stall", "malformed", "node")
    # Router replicas on the head, as configs/local.yaml runs them. With one, its death leaves no
    # other router for HAProxy to replay on: every replay goes back to the dead one.
    routers: int = 2
    malformed_during: tuple[str, ...] = ("malformed",)  # phases whose load carries the bad-request corpus

    @classmethod
    def smoke(cls) -> ChaosSettings:
        # CI-sized: the bad requests ride along with the replica's death instead of taking a
        # phase of their own; both must still cost the good requests nothing.
        phases = ("replica", "router", "stall", "node")
        malformed = ("replica", "malformed")  # `--phases malformed` still runs a phase of its own
        return cls(seconds=6.0, fault_at_s=2.0, warmup_s=0.5, concurrency=8, streams=2, phases=phases, malformed_during=malformed)


class MultiNodeCluster(RayCluster):
    """The head (an ingress node: its own logical CPUs and the `ingress` resource), plus one worker
    node joined with `ray start --address`."""

    reusable = False  # its scenario kills the worker node

    def __init__(self, workdir: Path, model_dir: Path, head_cpus: int, worker_cpus: int) -> None:
        head = (f"--num-cpus={head_cpus}", f"--resources={json.dumps({INGRESS_RESOURCE: 1})}")
        super().__init__(DEFAULT_INGRESS, workdir, model_dir, head)
        self.worker_cpus = worker_cpus

    def __enter__(self) -> MultiNodeCluster:
        super().__enter__()
        self.add_worker()
        return self

    def add_worker(self) -> None:
        # Ports of its own: two raylets on one host must not share agent or worker ports.
        subprocess.run(
            server_argv(["ray", "start", f"--address=127.0.0.1:{RAY_PORT}", f"--num-cpus={self.worker_cpus}",
             f"--resources={json.dumps({WORKER_RESOURCE: 1})}", f"--node-manager-port={WORKER_NODE_MANAGER_PORT}",
             "--dashboard-agent-listen-port=52366", "--min-worker-port=15000", "--max-worker-port=19999",
             "--disable-usage-stats"]),
            env=self.env, check=True, capture_output=True,
        )  # fmt: skip

    def kill_worker_node(self) -> int:
        """SIGKILL the worker node's raylet and everything under it, as a lost machine would; returns
        how many processes died."""
        raylet = next(p for p in psutil.process_iter(["name", "cmdline"]) if _is_worker_raylet(p))
        victims = [*raylet.children(recursive=True), raylet]
        for p in victims:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGKILL)
        return len(victims)


def _is_worker_raylet(p: psutil.Process) -> bool:
    cmd = " ".join(p.info.get("cmdline") or [])
    return "raylet" in (p.info.get("name") or "") and f"--node_manager_port={WORKER_NODE_MANAGER_PORT}" in cmd


def chaos_config(
    base: dict[str, Any], model_dir: Path, stall_faults: dict[str, Any] | None = None, routers: int = 2
) -> dict[str, Any]:
    """The user's config cut down to one classifier (two replicas), the generator and `routers` routers.

    Routers run on the ingress node (the head) and the generator on the worker: a stream's
    connection runs through a router that outlives the worker, which can end it properly.
    """
    config = json.loads(json.dumps(base))
    app = config["applications"][0]
    args = app["args"]
    args["model_dir"] = str(model_dir)
    args["models"] = {m: args["models"][m] for m in (CLASSIFIER, GENERATOR)}
    # Stalls show within seconds; the generator's own default (minutes) suits real models.
    args["models"][GENERATOR]["stall_timeout_s"] = 3.0
    args["routes"] = {}
    args.setdefault("scheduling", {})["anonymous_max_priority"] = "high"
    gpt_tuning: dict[str, Any] = {"faults": stall_faults or {}}
    app["deployments"] = [
        {"name": "router", "num_replicas": routers,
         "ray_actor_options": {"num_cpus": 0.2, "resources": {INGRESS_RESOURCE: 0.01}}},
        # One classifier replica per node: a lost node takes one of them, not both.
        {"name": CLASSIFIER, "num_replicas": 2, "max_replicas_per_node": 1, "ray_actor_options": {"num_cpus": 0.3}},
        {"name": GENERATOR, "num_replicas": 1, "ray_actor_options": {"num_cpus": 0.3, "resources": {WORKER_RESOURCE: 0.01}},
         "user_config": gpt_tuning, "health_check_period_s": 1, "health_check_timeout_s": 10,
         "graceful_shutdown_timeout_s": 2},
    ]  # fmt: skip
    return config


# -- the Ray side: which replica runs where, and killing one ---------------------------------


class RayView:
    """A driver connection to the cluster, for what only Ray can do or tell (kill an actor, where it runs)."""

    def __enter__(self) -> RayView:
        os.environ["RAY_AUTH_MODE"] = "token"
        import ray

        ray.init(address=f"127.0.0.1:{RAY_PORT}", log_to_driver=False, logging_level=logging.ERROR)
        return self

    def __exit__(self, *exc: object) -> None:
        import ray

        ray.shutdown()

    def replicas(self, deployment: str) -> list[dict[str, Any]]:
        import ray
        from ray._private import state

        worker_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"] and WORKER_RESOURCE in n["Resources"]}
        prefix = f"SERVE_REPLICA::default#{deployment}#"
        return [
            {"name": a["Name"], "on_worker": a["Address"]["NodeID"] in worker_nodes}
            for a in state.actors().values()
            if a.get("State") == "ALIVE" and (a.get("Name") or "").startswith(prefix)
        ]

    def kill(self, actor_name: str) -> None:
        import ray

        ray.kill(ray.get_actor(actor_name, namespace="serve"), no_restart=True)


# -- load, and what it saw -------------------------------------------------------------------


def malformed_streams(model_dir: Path) -> list[workloads.StreamSpec]:
    """Bad requests of every kind a client can send, each expected to get a 4xx alone."""
    size = 32
    good = workloads.image_bodies(1, size)[0]
    corpus: list[tuple[str, str, list[dict[str, Any]]]] = [
        ("bad-shape", f"/v2/models/{CLASSIFIER}/infer",
         [{"inputs": [{"name": "image", "shape": [1, 3, size], "datatype": "UINT8", "data": [0] * (3 * size)}]}]),
        ("bad-dtype", f"/v2/models/{CLASSIFIER}/infer",
         [{"inputs": [{"name": "image", "shape": [1, 3, size, size], "datatype": "BOOL", "data": [True] * (3 * size * size)}]}]),
        ("huge-dims", f"/v2/models/{CLASSIFIER}/infer",
         [{"inputs": [{"name": "image", "shape": [2**62, 2**62, 3, 3], "datatype": "UINT8", "data": [1]}]}]),
        ("bad-image", f"/v2/models/{CLASSIFIER}/infer",
         [{"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": ["bm90IGFuIGltYWdl"]}]}]),
        ("unknown-model", "/v2/models/nope/infer", [good]),
        ("bad-sampling", "/v1/completions", [{"model": GENERATOR, "prompt": "hi", "top_k": -5, "max_tokens": 4}]),
    ]  # fmt: skip
    return [workloads.StreamSpec(name, path, bodies, weight=0.05) for name, path, bodies in corpus]


def timeline(records: list[list[Any]], seconds: float) -> list[int]:
    """2xx answers per second of the window, by when they were sent."""
    per_s = [0] * int(seconds)
    for _stream, sent, _lat, status, *_ in records:
        if 200 <= status < 300 and int(sent) < len(per_s):
            per_s[int(sent)] += 1
    return per_s


def recovery_s(per_s: list[int], fault_at_s: float) -> float | None:
    """Seconds from the fault until goodput holds RECOVERED_SHARE of its pre-fault mean for 3 s."""
    before = per_s[1 : int(fault_at_s)]
    if not before:
        return None
    target = RECOVERED_SHARE * sum(before) / len(before)
    for t in range(int(fault_at_s), len(per_s) - 2):
        if all(v >= target for v in per_s[t : t + 3]):
            return max(0.0, t - fault_at_s)
    return None


# The load generator's mark for an answer whose status line and headers came, then its body was cut.
CUT_MID_ANSWER = "error:TruncatedBody"


def lost(records: list[list[Any]], good_streams: set[str]) -> dict[str, int]:
    """Answers a client could not use: no answer, an answer cut after its head, a 5xx that is not a
    503 with Retry-After, a refusal without Retry-After; and for the malformed corpus, anything but
    a 4xx. An answer cut after its head counts apart from no answer: HAProxy has passed that
    answer's head on to the client, so it cannot send the request again elsewhere (its retries end
    where an answer begins), while a request without any answer it can."""
    out = {"no_answer": 0, "cut_mid_answer": 0, "server_error": 0, "refused_without_retry_after": 0, "malformed_not_4xx": 0}
    for stream, _sent, _lat, status, by, _ms, retry_after, *_ in records:
        if stream not in good_streams:
            out["malformed_not_4xx"] += not (400 <= status < 500)
        elif status <= 0:
            out["cut_mid_answer" if by == CUT_MID_ANSWER else "no_answer"] += 1
        elif status in (429, 503) and not retry_after:
            out["refused_without_retry_after"] += 1
        elif status >= 500 and status != 503:
            out["server_error"] += 1
    return out


def lost_requests(records: list[list[Any]], good_streams: set[str]) -> list[dict[str, Any]]:
    """Each good request a client could not use, with when it was sent and how long it waited: a
    status of 0 is a timeout, -1 a reset or refused connection."""
    return [
        {"sent_s": round(sent, 3), "latency_ms": round(lat, 1), "status": status, "served_by": by}
        for stream, sent, lat, status, by, _ms, retry_after, *_ in records
        if stream in good_streams
        and (status <= 0 or (status >= 500 and status != 503) or (status in (429, 503) and not retry_after))
    ]


async def _one_stream(client: httpx.AsyncClient) -> dict[str, Any]:
    body = {"model": GENERATOR, "prompt": "the", "max_tokens": 96, "stream": True, "temperature": 0.0}
    seen: dict[str, Any] = {"status": None, "tokens": 0, "error_event": False, "done": False}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            seen["status"] = r.status_code
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    seen["done"] = True
                elif line.startswith("data: "):
                    event = json.loads(line.removeprefix("data: "))
                    seen["error_event"] |= "error" in event
                    seen["tokens"] += bool(event.get("choices"))
    except httpx.HTTPError as e:
        seen["transport_error"] = type(e).__name__
    return seen


def run_streams(n: int, duration_s: float) -> list[dict[str, Any]]:
    """`n` clients streaming completions one after another for `duration_s`; every stream's ending."""

    async def go() -> list[dict[str, Any]]:
        done: list[dict[str, Any]] = []
        stop = time.monotonic() + duration_s
        async with httpx.AsyncClient(base_url=BASE_URL, timeout=60) as client:

            async def client_loop() -> None:
                while time.monotonic() < stop:
                    done.append(await _one_stream(client))

            await asyncio.gather(*(client_loop() for _ in range(n)))
        return done

    return asyncio.run(go())


def router_status() -> dict[str, Any]:
    try:
        status: dict[str, Any] = httpx.get(f"{BASE_URL}/router/status", timeout=10).json()
        return {
            "retried_batches": status["models"].get(CLASSIFIER, {}).get("retried_batches"),
            "shed": status["models"].get(CLASSIFIER, {}).get("shed"),
            "breaker": status["models"].get(CLASSIFIER, {}).get("breaker"),
            "generator_breakers": status.get("generator_breakers"),
        }
    except (httpx.HTTPError, ValueError, KeyError) as e:
        return {"error": type(e).__name__}


# -- phases ----------------------------------------------------------------------------------


@dataclass
class Phase:
    name: str
    fault: str
    affected: list[dict[str, Any]]
    status_before: list[dict[str, Any]]  # each router replica answers for itself: a few samples


def run(s: ChaosSettings, model_dir: Path, config_path: Path) -> dict[str, Any]:
    base = single_versions(yaml.safe_load(config_path.read_text()))
    out: dict[str, Any] = {"settings": asdict(s), "phases": {}}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        with MultiNodeCluster(tmp, model_dir, s.head_cpus, s.worker_cpus) as cluster, RayView() as ray_view:
            probe = Probe(f"/v2/models/{CLASSIFIER}/infer", workloads.image_bodies(1, 32)[0])
            out["deploy_s"] = round(cluster.deploy(chaos_config(base, model_dir, routers=s.routers), probe), 1)
            out["placement"] = {d: ray_view.replicas(d) for d in ("router", CLASSIFIER, GENERATOR)}
            good = workloads.StreamSpec(CLASSIFIER, f"/v2/models/{CLASSIFIER}/infer", workloads.image_bodies(64, 32))
            for phase in s.phases:
                print(f"chaos: phase {phase}", flush=True)
                streams = [good, *(malformed_streams(model_dir) if phase in s.malformed_during else [])]
                workload = workloads.write(streams, tmp / f"{phase}.json")
                out["phases"][phase] = _phase(s, phase, cluster, ray_view, base, model_dir, workload, {good.name})
    return out


def _phase(
    s: ChaosSettings,
    phase: str,
    cluster: MultiNodeCluster,
    ray_view: RayView,
    base: dict[str, Any],
    model_dir: Path,
    workload: Path,
    good_streams: set[str],
) -> dict[str, Any]:
    result: dict[str, Any] = {}
    streams: list[dict[str, Any]] = []
    warmup = s.warmup_s

    def strike() -> None:
        time.sleep(warmup + s.fault_at_s)
        result["fault"] = _strike(phase, cluster, ray_view, base, model_dir, s.routers)

    striker = threading.Thread(target=strike)
    striker.start()
    stream_thread = None
    if phase in ("stall", "node"):  # streams through the wedged decode loop, and through the node's loss
        stream_thread = threading.Thread(target=lambda: streams.extend(run_streams(s.streams, warmup + s.seconds)))
        stream_thread.start()
    load = run_loadgen(BASE_URL, workload, {"concurrency": s.concurrency}, s.seconds, warmup, raw=True)
    striker.join()
    if stream_thread is not None:
        stream_thread.join()
    records = load.pop("records")
    per_s = timeline(records, s.seconds)
    result.update(
        statuses=load["statuses"],
        requests=load["requests"],
        lost=lost(records, good_streams),
        lost_requests=lost_requests(records, good_streams),
        # When the fault struck, in the seconds the records' `sent` counts (the load generator is
        # a process of its own, so its window starts a little after the striker's clock).
        fault_in_window_s=round(result["fault"]["at"] - load["window_start_unix"], 3)
        if "at" in result.get("fault", {})
        else None,
        stale_connection_retries=load["stale_connection_retries"],
        goodput_per_s=per_s,
        recovery_s=recovery_s(per_s, s.fault_at_s) if phase != "malformed" else None,
        p99_ms=load["p99_ms"],
        cpu_cores_by_role=load["cpu_cores_by_role"],
        router=router_status(),
        replicas_after={d: ray_view.replicas(d) for d in ("router", CLASSIFIER, GENERATOR)},
    )
    if streams:
        result["streams"] = summarize_streams(streams)
    return result


def _strike(
    phase: str, cluster: MultiNodeCluster, ray_view: RayView, base: dict[str, Any], model_dir: Path, routers: int
) -> dict[str, Any]:
    at = time.time()
    if phase == "replica":
        victim = next(r for r in ray_view.replicas(CLASSIFIER) if not r["on_worker"])
        ray_view.kill(victim["name"])
        return {"killed": victim, "at": at}
    if phase == "router":
        victim = ray_view.replicas("router")[0]
        ray_view.kill(victim["name"])
        return {"killed": victim, "at": at}
    if phase == "node":
        on_worker = {d: [r for r in ray_view.replicas(d) if r["on_worker"]] for d in ("router", CLASSIFIER, GENERATOR)}
        killed = cluster.kill_worker_node()
        # A replacement node joins, as KubeRay recreates a worker pod that died.
        cluster.add_worker()
        return {"killed_processes": killed, "replicas_on_it": on_worker, "at": at, "new_node_after_s": round(time.time() - at, 1)}
    if phase == "stall":
        return _stall(cluster, ray_view, base, model_dir, routers)
    return {"none": True}


def _stall(cluster: MultiNodeCluster, ray_view: RayView, base: dict[str, Any], model_dir: Path, routers: int) -> dict[str, Any]:
    """Wedge the generator's next model call for longer than its stall timeout, then take the drill
    back so that the replacement starts clean; wait until Serve has replaced the wedged replica."""
    before = {r["name"] for r in ray_view.replicas(GENERATOR)}
    started = time.monotonic()
    _serve_config(cluster, chaos_config(base, model_dir, {"delay_s": 30.0}, routers))
    time.sleep(2.0)  # the running replica's next decode step picks the drill up and wedges
    _serve_config(cluster, chaos_config(base, model_dir, routers=routers))
    replaced_after = None
    while time.monotonic() - started < 60:
        now = {r["name"] for r in ray_view.replicas(GENERATOR)}
        if now and not (now & before):
            replaced_after = round(time.monotonic() - started, 1)
            break
        time.sleep(0.5)
    return {"replaced_after_s": replaced_after, "stalled": sorted(before)}


def _serve_config(cluster: MultiNodeCluster, config: dict[str, Any]) -> None:
    """Apply a changed config the way operators do (`serve run` of the file): only user_config differs."""
    config = {**config, "http_options": {**config.get("http_options", {}), "host": "127.0.0.1", "port": HTTP_PORT}}
    path = cluster.workdir / "chaos-config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    with contextlib.suppress(subprocess.TimeoutExpired):
        subprocess.run(
            ["serve", "run", f"--address=127.0.0.1:{RAY_PORT}", "--non-blocking", str(path)],
            env=cluster.env, capture_output=True, timeout=60,
        )  # fmt: skip


def summarize_streams(streams: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [x for x in streams if x["status"] == 200]
    return {
        "started": len(streams),
        "refused": {
            str(x["status"]): sum(1 for y in streams if y["status"] == x["status"]) for x in streams if x["status"] != 200
        },
        "ended_with_done": sum(x["done"] for x in ok),
        "ended_with_error_event": sum(x["error_event"] for x in ok),
        "cut_without_done": sum(not x["done"] for x in ok),
        "transport_errors": sum("transport_error" in x for x in streams),
    }


def markdown(res: dict[str, Any]) -> str:
    r = res["result"]
    lines = [
        f"Multi-node Ray on one machine (head and one worker node, `ray start` twice); deploy took {r['deploy_s']} s.",
        f"Load: {r['settings']['concurrency']} closed-loop clients on `{CLASSIFIER}` (two replicas), "
        f"{r['settings']['seconds']:.0f} s per phase, the fault at {r['settings']['fault_at_s']:.0f} s.",
        "",
        "| phase | requests | statuses | lost (no answer / cut mid-answer / 5xx / refused without Retry-After) "
        "| malformed not 4xx | recovery to 80% goodput | p99 ms | sent again on a new connection |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, p in r["phases"].items():
        lost_ = p["lost"]
        rec = (
            "-"
            if p["recovery_s"] is None and name == "malformed"
            else (f"{p['recovery_s']:.0f} s" if p["recovery_s"] is not None else "not within the window")
        )
        lines.append(
            f"| {name} | {p['requests']} | {p['statuses']} | {lost_['no_answer']} / {lost_.get('cut_mid_answer', 0)} / "
            f"{lost_['server_error']} / "
            f"{lost_['refused_without_retry_after']} | {lost_['malformed_not_4xx']} | {rec} | {p['p99_ms']} "
            f"| {p.get('stale_connection_retries', '-')} |"
        )
    for name, p in r["phases"].items():
        lines += ["", f"**{name}**: fault `{json.dumps(p.get('fault'))}`; router after: `{json.dumps(p['router'])}`"]
        if "streams" in p:
            lines.append(f"streams through the fault: `{json.dumps(p['streams'])}`")
        lines.append(f"goodput per second: {p['goodput_per_s']}")
    return "\n".join(lines)
