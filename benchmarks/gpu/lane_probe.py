"""ResNet-50 through ours on a GPU, binary inputs at c=32: with the urgent lane (the default) and
without, a fresh Ray each; py-spy on the model replica and a router meanwhile.
Run on the lent GPU machine by remote.sh's environment:  python benchmarks/gpu/lane_probe.py OUT_DIR"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from benchmarks.cluster import HTTP_PORT, RayCluster, run_loadgen
from benchmarks.scenarios import (
    DEFAULT_INGRESS,
    Settings,
    inclusive_frames,
    ours_config,
    pids,
    pin_replicas,
    probe,
    router_status,
    top_frames,
    workload,
)

MODEL = "resnet-heavy"


def _start_profiles(py_spy: str, out_dir: Path, variant: str) -> list[tuple[str, Path, subprocess.Popen[bytes]]]:
    """py-spy on the model replica and the router for the first load point (6 s)."""
    procs = []
    for role in (MODEL, "router"):
        pid, f = pids(f"replica:{role}")[0], out_dir / f"{variant}_{role}.txt"
        cmd = [py_spy, "record", "--pid", str(pid), "--duration", "6", "--rate", "40", "--format", "raw", "--output", str(f)]
        procs.append((role, f, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
    return procs


def _report_profiles(procs: list[tuple[str, Path, subprocess.Popen[bytes]]]) -> None:
    for role, f, p in procs:
        _, err = p.communicate(timeout=60)
        print(role, "py-spy rc", p.returncode, err.decode()[-300:], flush=True)
        if f.exists():
            for frame, share in top_frames(f, 10):
                print(f"  self {share:6.1%} {frame}", flush=True)
            for frame, share in inclusive_frames(f, 25):
                print(f"  incl {share:6.1%} {frame}", flush=True)


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    config_path = Path(os.environ.get("PROBE_CONFIG", "configs/bench-gpu.yaml")).resolve()
    model_dir = Path(os.environ.get("PROBE_MODEL_DIR", "models-realsize")).resolve()
    s = Settings(models=[MODEL], model_dir=model_dir, config=config_path)
    s.measured_models_only = True
    tmp = Path(tempfile.mkdtemp())
    py_spy = shutil.which("py-spy")
    results = {}
    for variant, override in (("lanes", {}), ("no-lanes", {"urgent_lane": False})):
        config = pin_replicas(ours_config(s), [MODEL])
        config["applications"][0]["args"]["models"][MODEL].update(override)
        with RayCluster(DEFAULT_INGRESS, tmp, s.model_dir) as cluster:
            cluster.deploy(config, probe(s, MODEL))
            url = f"http://127.0.0.1:{HTTP_PORT}"
            procs = _start_profiles(py_spy, out_dir, variant) if py_spy and variant == "lanes" else []
            for binary in (True, False):
                wl = workload(s, MODEL, tmp, binary=binary)
                r = run_loadgen(url, wl, {"concurrency": 32}, 5.0, 2.0, (MODEL, "router"))
                status = router_status(url)
                key = f"{variant}-{'binary' if binary else 'json'}"
                results[key] = {k: r[k] for k in ("throughput_rps", "p50_ms", "p99_ms", "cpu_cores_by_role", "statuses")}
                results[key]["router_status_model"] = {k: v for k, v in status.items() if MODEL in json.dumps(v)}
                print(key, r["throughput_rps"], r["p50_ms"], r["p99_ms"], r["cpu_cores_by_role"], flush=True)
            _report_profiles(procs)
    (out_dir / "lane_probe.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path, help="where lane_probe.json and the py-spy stacks go")
    main(parser.parse_args().out_dir)
