"""Ours as `bench compare` deploys it (configs/local.yaml, bert-heavy pinned to one replica), 32
closed-loop clients on bert-heavy, with optional overrides; per thread of the router and the
model replica, its time on a CPU and its time runnable but waiting for one (/proc schedstat),
and the machine's idle share. Used to choose configs/local.yaml's `scheduling.router_nice` (router-nice-ab-2026-11-27/), and
again here, with /router/status's view of bert-heavy's lanes after each point, for the bulk lane's
priority (this folder's README).

    PYTHONPATH=. python benchmarks/results/compare/local/runs/router-nice-ab-2026-11-27/probe.py OVERRIDES 2   (or this folder's copy)

OVERRIDES: JSON (`sched`: the scheduling section; other keys: bert-heavy's model
entry, e.g. `{"urgent_lane": false}`); second: load points per deployment (10 s each).
The configs/local.yaml of the commit it runs at is the base: at fd681be and after, `{}` is
already nice 15; `{"sched": {"router_nice": 19}}` gives the code before."""

import json
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.scenarios import (
    DEFAULT_INGRESS,
    HTTP_PORT,
    RayCluster,
    Settings,
    ours_config,
    pids,
    pin_replicas,
    run_loadgen,
    workload,
)
from benchmarks.scenarios import probe as ready_probe

ROOT = Path(__file__).resolve().parents[6]
MODEL = "bert-heavy"


def snap(pid: int) -> dict[str, tuple[str, int, int, int]]:
    out = {}
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            run, wait, n = map(int, (t / "schedstat").read_text().split())
            out[t.name] = ((t / "comm").read_text().strip(), run, wait, n)
        except OSError:
            pass
    return out


def main() -> None:
    over = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    s = Settings(models=[MODEL], model_dir=ROOT / "models", config=ROOT / "configs/local.yaml")
    tmp = Path(tempfile.mkdtemp())
    with RayCluster(DEFAULT_INGRESS, tmp, s.model_dir) as cluster:
        cfg = pin_replicas(ours_config(s), [MODEL])
        args = cfg["applications"][0]["args"]
        if "sched" in over:
            args["scheduling"] = {**args.get("scheduling", {}), **over.pop("sched")}
        args["models"][MODEL].update(over)
        print(args["models"][MODEL], args.get("scheduling"))
        cluster.deploy(cfg, ready_probe(s, MODEL))
        url = f"http://127.0.0.1:{HTTP_PORT}"
        roles = {r: pids(r)[0] for r in ("replica:router", f"replica:{MODEL}")}

        def threads() -> None:
            time.sleep(3)
            a = {r: snap(p) for r, p in roles.items()}
            t0 = time.monotonic()
            time.sleep(5)
            b = {r: snap(p) for r, p in roles.items()}
            dt = time.monotonic() - t0
            for r in roles:
                for tid, (name, run, wait, n) in b[r].items():
                    if tid in a[r] and run - a[r][tid][1] > 0.01 * dt * 1e9:
                        _, run0, wait0, n0 = a[r][tid]
                        print(f"{r} {name:20s} cpu {(run - run0) / dt / 1e9:.3f} runq-wait {(wait - wait0) / dt / 1e9:.3f} "
                              f"slices/s {(n - n0) / dt:.0f}")  # fmt: skip

        for _ in range(reps):
            th = threading.Thread(target=threads)
            th.start()
            i0 = [int(x) for x in open("/proc/stat").readline().split()[1:]]
            r = run_loadgen(url, workload(s, MODEL, tmp), {"concurrency": 32}, 10, 1, (MODEL, "router"))
            i1 = [int(x) for x in open("/proc/stat").readline().split()[1:]]
            th.join()
            d = [b - a for a, b in zip(i0, i1, strict=True)]
            shares = [round(x / sum(d), 3) for x in d[:7]]
            print("rps", round(r["goodput_rps"]), "p50", r.get("p50_ms"), "machine shares user,nice,sys,idle,iowait,irq,softirq:", shares)
            import urllib.request
            st = json.loads(urllib.request.urlopen(url + "/router/status").read())
            m = st["models"].get(MODEL, {})
            print(json.dumps({k: v for k, v in m.items() if k in ("lanes", "batches", "completed_items")}, indent=None)[:3000])


if __name__ == "__main__":
    main()
