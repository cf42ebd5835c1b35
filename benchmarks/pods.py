"""`python -m benchmarks pods --scenario NAME`: the committed KubeRay manifest on the pod bed.

Scenarios (each starts the bed from k8s/rayservice.yaml, benchmarks/podbed.py):
- start: time to ready; every ingress pod answers on its own address; where each router and model
  replica runs (routers on ingress pods, models on worker pods: every answer crossed the network).
- pod-loss: open-loop load from the client's own namespace and core; a worker pod (the one holding
  the text route's light tier), an ingress pod and the head are killed in turn (every process of the
  pod at once). Per kill: sent, answered, refused with Retry-After then answered, failed, lost, and
  each route's longest time without an answer. Killed worker and ingress pods come back as the
  operator recreates them; the head's container restarts in place.
- upgrade: a changed serveConfigV2 (the canary's weight, one batch size, one added model) PUT under
  load: what the clients saw, the time to running, and the canary's share measured in the answers.
- scale-out: open-loop load stepping up past what the pods hold and back down: routers and model
  replicas follow by the shipped autoscaling policies (the bed adds pods as KubeRay's autoscaler
  would); per step goodput (answers within `--goodput-deadline-s`) over what was sent, p99, and
  the routers and replicas counted each second.
- all: start, pod-loss, upgrade, scale-out on one bed.

The bed stands in for the operator's autoscaler too: a replica that fits on no pod gets a new pod
of the group that can hold it (benchmarks/podbed.py, `follow_demand`).

The result goes to benchmarks/results/pods/<scenario>/result.json and README.md.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmarks import history
from benchmarks.podbed import ROOT, SERVE_PORT, Bed
from benchmarks.podclient import REFUSED_TO_THE_END, TIMED_OUT

RESULTS = ROOT / "benchmarks" / "results" / "pods"
SCENARIOS = ("start", "pod-loss", "upgrade", "scale-out")
ADDED = "bert-light-b"  # the model the upgrade adds
KILLS = ("worker", "ingress", "head")
# No answer by the client's deadline: no status at all, timed out, or refused with Retry-After to the end.
LOST = (0, TIMED_OUT, REFUSED_TO_THE_END)


# -- what the client's records say (pure) -----------------------------------------------------------
def summarize(records: Sequence[Sequence[Any]], window: tuple[float, float]) -> dict[str, Any]:
    """Outcomes of the requests sent in `window` (unix seconds), and each route's longest gap."""
    inside = [r for r in records if window[0] <= r[1] < window[1]]
    answered = [r for r in inside if r[3] == 200]
    out: dict[str, Any] = {
        "sent": len(inside),
        "answered": len(answered),
        "answered_after_refusal": sum(1 for r in answered if r[6] > 0),
        "answered_after_connection_error": sum(1 for r in answered if r[5] > 0),
        "refusals": sum(r[6] for r in inside),
        "connection_errors": sum(r[5] for r in inside),
        "failed": {str(s): sum(1 for r in inside if r[3] == s) for s in sorted({r[3] for r in inside} - {200, *LOST})},
        "lost": sum(1 for r in inside if r[3] in LOST),
        "lost_refused_to_the_end": sum(1 for r in inside if r[3] == REFUSED_TO_THE_END),
        "longest_gap_s": {},
    }
    for route in sorted({r[0] for r in inside}):
        done = sorted(r[2] for r in answered if r[0] == route and r[2] <= window[1])
        out["longest_gap_s"][route] = round(longest_gap(done, window), 3)
    return out


def longest_gap(times: Sequence[float], window: tuple[float, float]) -> float:
    """The longest stretch of `window` with no time in `times` (sorted)."""
    edges = [window[0], *times, window[1]]
    return max(b - a for a, b in itertools.pairwise(edges))


# -- running -----------------------------------------------------------------------------------------
def write_bodies(model_dir: Path, path: Path, n: int, direct: tuple[str, ...] = ()) -> None:
    """Held-out inputs, n distinct per route (the light tier's manifest shapes them), and for the
    models named in `direct` (sent by name, past the routes)."""
    from benchmarks.workloads import bodies_for

    bodies = {
        "text-classify": bodies_for(model_dir / "bert-light", n),
        "image-classify": bodies_for(model_dir / "resnet-light", n),
        **{m: bodies_for(model_dir / m, n) for m in direct},
    }
    path.write_text(json.dumps(bodies))


def placement(bed: Bed) -> dict[str, list[str]]:
    """Each deployment's running replicas by the pod they run on."""
    apps = bed.serve_details().get("applications", {})
    by_address = {h.address: name for name, h in bed.hosts.items()}
    out: dict[str, list[str]] = {}
    for app in apps.values():
        for name, d in app.get("deployments", {}).items():
            nodes = [r.get("node_ip", "") for r in d.get("replicas", []) if r.get("state") == "RUNNING"]
            out[name] = sorted(f"{by_address.get(ip, ip)} ({ip})" for ip in nodes)
    return out


def wait_whole(bed: Bed, before: dict[str, list[str]], timeout_s: float) -> float:
    """Until every pod is back, every deployment runs at least the replicas it ran before the kill,
    and every ingress pod answers; the seconds it took."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    while time.monotonic() < deadline:
        try:
            now = placement(bed)
            replicas_back = all(len(now.get(d, [])) >= len(pods) for d, pods in before.items())
            if replicas_back and len(bed.alive_nodes()) >= len(bed.pods) and bed._ingress_ready():
                return time.monotonic() - t0
        except Exception:  # the head may be away: wait for it
            pass
        time.sleep(1)
    raise TimeoutError(f"the cluster was not whole again within {timeout_s:.0f} s")


def run_client(
    bed: Bed, ns: argparse.Namespace, bodies: Path, out: Path, seconds: float, endpoints: Path | None = None
) -> subprocess.Popen[bytes]:
    assert bed.client is not None
    argv = [
        sys.executable, "-m", "benchmarks.podclient", "--targets", ",".join(bed.ingress_addresses()),
        *(["--endpoints", str(endpoints)] if endpoints else []),
        "--port", str(SERVE_PORT), "--rate", str(ns.rate), "--seconds", str(seconds), "--bodies", str(bodies),
        "--deadline-s", str(ns.deadline_s), "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(bed.client.command(argv, bed.client_cores), env=env, cwd=ROOT)


def kill_phase(bed: Bed, ns: argparse.Namespace, kill: str, bodies: Path) -> dict[str, Any]:
    """One pod killed under load: the client's outcomes and gaps, and how long the cluster took to recover."""
    if kill == "worker":
        light = placement(bed).get("bert-light", [])
        victim = light[0].split()[0] if light else next(n for n in bed.pods if bed.pods[n].group not in ("head", "ingress"))
    elif kill == "ingress":
        victim = bed.pod_of(bed.ingress_addresses()[0])
    else:
        victim = "head"
    before = placement(bed)
    out = bed.workdir / f"client-{kill}.json"
    endpoints = bed.workdir / "endpoints.json"
    stop = threading.Event()
    service = threading.Thread(target=bed.follow_endpoints, args=(endpoints, stop), daemon=True)
    service.start()
    client = run_client(bed, ns, bodies, out, ns.phase_s, endpoints)
    time.sleep(ns.fault_at_s)
    killed_at = time.time()
    killed = bed.kill_pod(victim)
    event: dict[str, Any] = {}

    def bring_back() -> None:
        # A worker or ingress pod is recreated by the operator after a while; the head's container
        # restarts in place at once.
        time.sleep(0 if victim == "head" else ns.replace_after_s)
        bed.start_pod(victim)
        event["restarted_after_s"] = round(time.time() - killed_at, 2)
        if victim == "head":
            bed.wait_dashboard(120)
            event["head_dashboard_back_s"] = round(time.time() - killed_at, 2)

    back = threading.Thread(target=bring_back)
    back.start()
    client.wait(timeout=ns.phase_s + ns.deadline_s + 120)
    back.join()
    stop.set()
    service.join()
    data = json.loads(out.read_text())
    whole_s = wait_whole(bed, before, 300)
    window = (data["start"] + ns.warmup_s, data["start"] + data["seconds"])
    after = (killed_at, data["start"] + data["seconds"])
    return {
        "killed": victim,
        "address": bed.hosts[victim].address,
        "processes_killed": killed,
        "killed_at_s": round(killed_at - data["start"], 2),
        "offered_rate": round(data["offered_rate"], 2),
        "dropped_by_client": data["dropped_by_client"],
        "whole": summarize(data["records"], window),
        "after_kill": summarize(data["records"], after),
        "cluster_whole_after_s": round(time.time() - killed_at, 1),
        "whole_wait_s": round(whole_s, 1),
        **event,
        "placement_before": before,
        "placement_after": placement(bed),
    }


def upgraded(serve_config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """serveConfigV2 changed as an operator would change it: the canary's weight, one model's batch
    size, one model added (a second text model from the image's bert-light export); and what changed."""
    config = copy.deepcopy(serve_config)
    app = config["applications"][0]
    router = next(d for d in app["deployments"] if d["name"] == "router")
    weights = router["user_config"]["traffic"]["bert-heavy"]["weights"]
    weights.update({"1": 50, "2": 50})
    app["args"]["models"]["bert-light"]["batching"]["max_batch_size"] = 32
    app["args"]["models"][ADDED] = {"path": "models/bert-light", "family": "bert"}
    light = next(d for d in app["deployments"] if d["name"] == "bert-light")
    app["deployments"].append(
        {"name": ADDED, "max_replicas_per_node": 1, "ray_actor_options": dict(light["ray_actor_options"]), "num_replicas": 1}
    )
    return config, {"canary_weights": dict(weights), "bert-light max_batch_size": 32, "added_model": ADDED}


def upgrade_phase(bed: Bed, ns: argparse.Namespace, bodies: Path) -> dict[str, Any]:
    """The changed serveConfigV2 PUT under load, as the operator does on an edit of the RayService."""
    config, change = upgraded(bed.cluster.serve_config)
    out = bed.workdir / "client-upgrade.json"
    client = run_client(bed, ns, bodies, out, ns.phase_s)
    time.sleep(ns.fault_at_s)
    submitted = time.time()
    bed.submit(config)
    took_s = None
    deadline = time.monotonic() + ns.phase_s
    while time.monotonic() < deadline:
        try:
            apps = bed.serve_details().get("applications", {})
        except httpx.HTTPError:  # the dashboard busy with the update: ask again
            time.sleep(0.5)
            continue
        d = apps.get("default", {}).get("deployments", {})
        if apps.get("default", {}).get("status") == "RUNNING" and d.get(ADDED, {}).get("status") == "HEALTHY":
            took_s = time.time() - submitted
            break
        time.sleep(0.5)
    client.wait(timeout=ns.phase_s + ns.deadline_s + 120)
    data = json.loads(out.read_text())
    records = data["records"]
    # The canary's share once the change is in: after the app runs again, or in the load's last
    # third where it did not get there within the phase (routers take a new weight live).
    applied = submitted + took_s if took_s is not None else data["start"] + data["seconds"] * 2 / 3
    try:
        app = bed.serve_details().get("applications", {}).get("default", {})
        statuses = {"app": app.get("status"), **{d: v.get("status") for d, v in app.get("deployments", {}).items()}}
    except httpx.HTTPError as e:
        statuses = {"app": f"unknown: {e!r}"}

    def v2_share(rs: list[list[Any]]) -> float | None:
        heavy = [r for r in rs if r[0] == "bert-heavy" and r[3] == 200]
        return round(sum("bert-heavy-v2" in r[7] for r in heavy) / len(heavy), 3) if heavy else None

    # Through a pod that answers: one the autoscaler added may hold no router, and the routers
    # may still be rolling when the load ends.
    base = f"http://{wait_ready_ingress(bed, 300)}:{SERVE_PORT}"
    from benchmarks.workloads import text_bodies

    added = httpx.post(f"{base}/v2/models/{ADDED}/infer", json=text_bodies(1)[0], timeout=60)
    batch = httpx.get(f"{base}/v2/models/bert-light/config", timeout=30).json().get("max_batch_size")
    return {
        "change": change,
        "seconds_to_running": None if took_s is None else round(took_s, 1),
        "whole": summarize(records, (data["start"] + ns.warmup_s, data["start"] + data["seconds"])),
        "v2_share_before": v2_share([r for r in records if r[1] < submitted]),
        "v2_share_after": v2_share([r for r in records if r[1] >= applied]),
        "v2_share_after_from_s": round(applied - data["start"], 1),
        "statuses_at_end": statuses,
        "added_model_status": added.status_code,
        "bert_light_max_batch_size": batch,
    }


def wait_ready_ingress(bed: Bed, timeout_s: float) -> str:
    """The first ingress pod whose router answers its readiness probe."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready := [a for a in bed.ingress_addresses() if bed.ready(a)]:
            return ready[0]
        time.sleep(1)
    raise TimeoutError(f"no ingress pod ready within {timeout_s:.0f} s")


def step_summary(records: Sequence[Sequence[Any]], window: tuple[float, float], deadline_s: float) -> dict[str, Any]:
    """One step of the scale-out: what was sent in it, answered in time (goodput), p99 of the answers."""
    inside = [r for r in records if window[0] <= r[1] < window[1]]
    answered = sorted(r[2] - r[1] for r in inside if r[3] == 200)
    out = summarize(records, window)
    seconds = window[1] - window[0]
    out |= {
        "offered_rps": round(len(inside) / seconds, 2),
        "goodput_rps": round(sum(1 for t in answered if t <= deadline_s) / seconds, 2),
        "goodput_over_offered": round(sum(1 for t in answered if t <= deadline_s) / len(inside), 3) if inside else None,
        "p99_ms": round(answered[min(len(answered) - 1, int(0.99 * len(answered)))] * 1e3, 1) if answered else None,
    }
    return out


def scale_out_phase(bed: Bed, ns: argparse.Namespace, bodies: Path) -> dict[str, Any]:
    """Load stepping through `ns.rates`, one client per step; the replicas sampled every second."""
    counts: list[dict[str, Any]] = []
    stop = threading.Event()
    endpoints = bed.workdir / "endpoints.json"
    threads = [threading.Thread(target=bed.follow_endpoints, args=(endpoints, stop), daemon=True)]

    def sample() -> None:
        while not stop.is_set():
            try:
                now = placement(bed)
                counts.append({"t": round(time.time(), 1), "pods": len(bed.pods), **{d: len(p) for d, p in now.items()}})
            except Exception:  # the dashboard busy: the next second's sample
                pass
            stop.wait(1.0)

    threads.append(threading.Thread(target=sample, daemon=True))
    for t in threads:
        t.start()
    steps = []
    for i, rate in enumerate(ns.rates):
        out = bed.workdir / f"client-scale-{i}.json"
        step_ns = argparse.Namespace(**{**vars(ns), "rate": rate})
        client = run_client(bed, step_ns, bodies, out, ns.step_s, endpoints)
        client.wait(timeout=ns.step_s + ns.deadline_s + 120)
        data = json.loads(out.read_text())
        window = (data["start"], data["start"] + data["seconds"])
        inside = [c for c in counts if window[0] <= c["t"] < window[1]]
        steps.append({
            "rate": rate,
            "dropped_by_client": data["dropped_by_client"],
            **step_summary(data["records"], window, ns.goodput_deadline_s),
            "routers": sorted({c.get("router", 0) for c in inside}),
            "replicas_max": {d: max(c.get(d, 0) for c in inside) for d in (inside[-1] if inside else {}) if d != "t"},
        })  # fmt: skip
    stop.set()
    for t in threads:
        t.join(timeout=15)
    return {"rates": list(ns.rates), "step_s": ns.step_s, "goodput_deadline_s": ns.goodput_deadline_s, "steps": steps,
            "timeline": changes(counts)}  # fmt: skip


def changes(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The samples at which any count differs from the sample before (the first one always)."""
    out: list[dict[str, Any]] = []
    for sample in samples:
        if not out or {k: v for k, v in sample.items() if k != "t"} != {k: v for k, v in out[-1].items() if k != "t"}:
            out.append(sample)
    return out


def save(result: dict[str, Any], ns: argparse.Namespace) -> Path:
    """result.json and README.md, written after each phase so a later phase's failure keeps the rest."""
    out = Path(ns.out) if ns.out else RESULTS / ns.scenario
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "README.md").write_text(markdown(result))
    history.append(result, out)
    return out


def run(ns: argparse.Namespace) -> dict[str, Any]:
    counts = dict(kv.split("=") for kv in ns.pods) if ns.pods else {}
    bed = Bed(
        counts={k: int(v) for k, v in counts.items()},
        model_dir=Path(ns.model_dir).resolve(),
        workdir=Path(ns.workdir),
        server_cores=ns.server_cores,
        client_cores=ns.client_cores,
    )
    from benchmarks.report import machine_info

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    result: dict[str, Any] = {
        "command": "python -m benchmarks pods " + " ".join(ns.argv),
        "scenario": "pods",
        "pods_scenario": ns.scenario,
        "machine": {**machine_info(), "commit": commit},
    }
    with bed:
        steps = bed.start(ns.start_timeout_s)
        result["start"] = {
            "seconds_to_ready": round(steps["running_s"], 1),
            "steps_s": {k: round(v, 1) for k, v in steps.items()},
            "pods": {name: {"group": p.group, "address": bed.hosts[name].address} for name, p in bed.pods.items()},
            "ingress_answers": ingress_answers(bed),
            "placement": placement(bed),
            # Each pod's CPU shares, from its request (benchmarks/cgroups.py), or why there are none.
            "cpu_shares": {n: g.shares for n, g in bed.cpu_groups.items()} or {"unavailable": bed.cpu_groups_unavailable},
        }
        if ns.scenario in ("pod-loss", "all"):
            bodies = bed.workdir / "bodies.json"
            write_bodies(bed.model_dir, bodies, ns.inputs)
            result["pod_loss"] = {"rate": ns.rate, "inputs_per_route": ns.inputs}
            for kill in ns.kills:
                result["pod_loss"][kill] = kill_phase(bed, ns, kill, bodies)
                save(result, ns)
        if ns.scenario in ("upgrade", "all"):
            bodies = bed.workdir / "bodies-upgrade.json"
            write_bodies(bed.model_dir, bodies, ns.inputs, direct=("bert-heavy",))
            result["upgrade"] = upgrade_phase(bed, ns, bodies)
            save(result, ns)
        if ns.scenario in ("scale-out", "all"):
            bodies = bed.workdir / "bodies.json"
            write_bodies(bed.model_dir, bodies, ns.inputs)
            result["scale_out"] = scale_out_phase(bed, ns, bodies)
        save(result, ns)
    return result


def ingress_answers(bed: Bed) -> list[dict[str, Any]]:
    """One request per route through each ingress pod's own address."""
    import httpx

    from benchmarks.workloads import image_bodies, text_bodies

    out = []
    for address in bed.ingress_addresses():
        for route, body in (("text-classify", text_bodies(1)[0]), ("image-classify", image_bodies(1, image_size(bed))[0])):
            r = httpx.post(f"http://{address}:{SERVE_PORT}/v2/models/{route}/infer", json=body, timeout=60)
            out.append({"ingress": address, "route": route, "status": r.status_code, "served_by": r.headers.get("x-served-by")})
    return out


def image_size(bed: Bed) -> int:
    from serve_app.manifest import Manifest

    return Manifest.load(bed.model_dir / "resnet-light").image_size or 32


def markdown(result: dict[str, Any]) -> str:
    s = result["start"]
    lines = [
        f"# Pod bed: {result['pods_scenario']}",
        "",
        f"`{result['command']}` on {result['machine'].get('cpu')} x{result['machine'].get('cores')} "
        f"(client on one core, the cluster on the other), commit {result['machine'].get('commit')}.",
        "",
        f"Ready in {s['seconds_to_ready']} s ({s['steps_s']}). Pods: "
        + ", ".join(f"{n} {p['address']}" for n, p in s["pods"].items())
        + ".",
        "",
        "| ingress | route | status | served by |",
        "|---|---|---|---|",
        *(f"| {a['ingress']} | {a['route']} | {a['status']} | {a['served_by']} |" for a in s["ingress_answers"]),
        "",
        "Replicas: " + "; ".join(f"{d}: {', '.join(p)}" for d, p in s["placement"].items()) + ".",
        "",
        f"CPU shares by pod (its request, as a kubelet weighs it): {s.get('cpu_shares')}.",
    ]
    loss = result.get("pod_loss")
    if loss:
        lines += [
            "",
            f"Pod loss under open-loop load ({loss['rate']}/s, {loss['inputs_per_route']} distinct inputs a route):",
            "",
            "| killed | sent | answered | after 503 | after conn. error | failed | lost | longest gap (s) | whole again (s) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for kill in KILLS:
            if kill not in loss:
                continue
            k = loss[kill]
            w = k["whole"]
            gaps = ", ".join(f"{r} {g}" for r, g in w["longest_gap_s"].items())
            lines.append(
                f"| {kill} ({k['killed']}) | {w['sent']} | {w['answered']} | {w['answered_after_refusal']} | "
                f"{w['answered_after_connection_error']} | {w['failed'] or 0} | {w['lost']} | {gaps} | "
                f"{k['cluster_whole_after_s']} |"
            )
    scale = result.get("scale_out")
    if scale:
        lines += [
            "",
            f"Scale-out: open-loop steps of {scale['step_s']:g} s; goodput is answers within {scale['goodput_deadline_s']:g} s.",
            "",
            "| rate | offered | goodput/offered | p99 ms | lost | after 503 | after conn. error | routers | pods (most) |",
            "|---|---|---|---|---|---|---|---|---|",
            *(
                f"| {st['rate']:g} | {st['offered_rps']} | {st['goodput_over_offered']} | {st['p99_ms']} | {st['lost']} | "
                f"{st['answered_after_refusal']} | {st['answered_after_connection_error']} | {st['routers']} | "
                f"{st['replicas_max'].get('pods')} |"
                for st in scale["steps"]
            ),
        ]
    up = result.get("upgrade")
    if up:
        w = up["whole"]
        lines += [
            "",
            f"Upgrade under load: {up['change']} PUT as the operator does; running in {up['seconds_to_running']} s. "
            f"Sent {w['sent']}, answered {w['answered']} ({w['answered_after_refusal']} after a 503), failed {w['failed'] or 0}, "
            f"lost {w['lost']}; bert-heavy's answers from version 2: {up['v2_share_before']} before, {up['v2_share_after']} "
            f"from {up.get('v2_share_after_from_s')} s; statuses at the end {up.get('statuses_at_end')}; "
            f"{ADDED} answers {up['added_model_status']}; bert-light's max_batch_size {up['bert_light_max_batch_size']}.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(
        prog="python -m benchmarks pods", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="start")
    p.add_argument("--pods", nargs="*", default=["gpu=2"], help="pods per worker group, e.g. gpu=2 ingress=2 (default: gpu=2)")
    p.add_argument("--model-dir", default=str(ROOT / "models"), help="what the image holds in its models directory")
    p.add_argument("--workdir", default="/tmp/pb", help="each pod's --temp-dir and log")
    p.add_argument("--server-cores", default="1", help="taskset list for every Ray process, HAProxy and Redis")
    p.add_argument("--client-cores", default="0", help="taskset list for the load generator")
    p.add_argument("--rate", type=float, default=5.0, help="open-loop requests a second (keep it below the bed's capacity)")
    p.add_argument("--inputs", type=int, default=1000, help="distinct held-out inputs a route")
    p.add_argument("--phase-s", type=float, default=60.0)
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--fault-at-s", type=float, default=15.0)
    p.add_argument("--replace-after-s", type=float, default=10.0, help="when the operator's new pod for a lost one starts")
    p.add_argument("--deadline-s", type=float, default=30.0)
    p.add_argument("--kills", nargs="*", default=list(KILLS), choices=KILLS)
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--rates", type=float, nargs="+", default=[5, 15, 30, 15, 5], help="scale-out: each step's rate")
    p.add_argument("--step-s", type=float, default=60.0, help="scale-out: seconds a step")
    p.add_argument("--goodput-deadline-s", type=float, default=2.0, help="scale-out: an answer later than this is not goodput")
    p.add_argument("--out", default=None, help="result directory (default benchmarks/results/pods/<scenario>)")
    ns = p.parse_args(argv)
    ns.argv = argv
    result = run(ns)
    print(f"wrote {save(result, ns)}")
    print(markdown(result))
    return 0
