"""Does an idle-class busy loop slow the text requests less if it naps now and then?

Run from the repository root: `PYTHONPATH=$PWD python
benchmarks/results/images/local/runs/xeon-spinner-naps/spinner_naps.py KIND...`, with KIND among
those in SPINNERS. One deployment of configs/local.yaml (one replica per model), text to
`bert-heavy` open loop at 30% of its capacity, and for two rounds a 15 s phase per kind: no
spinner ("none"), then each kind's process beside the load. Prints, per kind, the pooled text p50
and p99 and where the slowest 1% of the requests spent their time (benchmarks.images.tail_parts).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from benchmarks import images, workloads
from benchmarks.cluster import Probe, RayCluster, run_loadgen
from benchmarks.scenarios import DEFAULT_INGRESS, pin_replicas, single_versions

IDLE = "import os, time\nos.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"


def napping(every_s: float) -> str:
    """Busy for `every_s`, then a 50 us sleep, for ever."""
    loop = "while True:\n    t = time.perf_counter() + {e}\n    while time.perf_counter() < t: pass\n    time.sleep(0.00005)\n"
    return IDLE + loop.format(e=every_s)


def bursts(busy_s: float) -> str:
    """Busy for `busy_s` four times a second."""
    loop = "while True:\n    t = time.perf_counter()\n    while time.perf_counter() < t + {b}: pass\n    time.sleep(0.25 - {b})\n"
    return IDLE + loop.format(b=busy_s)


def decoding(paced: bool) -> str:
    """Four 1024x1024 PNGs decoded four times a second, as the router's decoders would (paced or not)."""
    setup = "from benchmarks.images import png_images\nfrom serve_app.protocols import images as I\n"
    if not paced:  # Pillow's own reads: no naps, 64 KiB blocks
        setup += "import io\nI._PacedBytes = io.BytesIO\nI.PACED_BLOCK = 65536\n"
    loop = "pngs = png_images(4, 1024)\nwhile True:\n    t = time.perf_counter()\n    I.decode_images(pngs, 32)\n"
    return IDLE + setup + loop + "    time.sleep(max(0.0, t + 0.25 - time.perf_counter()))\n"


SPINNERS = {
    "idle": IDLE + "while True: pass\n",
    "nap_0.25ms": napping(0.00025),
    "nap_0.5ms": napping(0.0005),
    "nap_1ms": napping(0.001),
    "nap_2ms": napping(0.002),
    "pinned": IDLE.replace("import os, time\n", "import os, time\nos.sched_setaffinity(0, {1})\n") + "while True: pass\n",
    "bursts_2.7ms": bursts(0.0027),
    "bursts_8ms": bursts(0.008),
    "decode_paced": decoding(True),
    "decode_unpaced": decoding(False),
}


def main(kinds: list[str]) -> dict[str, Any]:
    model_dir = Path("models").resolve()
    config = single_versions(yaml.safe_load(Path("configs/local.yaml").read_text()))
    config["applications"][0]["args"]["model_dir"] = str(model_dir)
    pin_replicas(config, [images.TEXT_MODEL, images.IMAGE_MODEL])
    pooled: dict[str, list[tuple[float, dict[str, float]]]] = {}
    with tempfile.TemporaryDirectory() as name, RayCluster(DEFAULT_INGRESS, Path(name), model_dir) as cluster:
        tmp = Path(name)
        cluster.deploy(config, Probe(f"/v2/models/{images.TEXT_MODEL}/infer", workloads.text_bodies(1)[0]))
        capacity = run_loadgen(images.BASE_URL, images.workload(tmp / "cap.json", 1.0, 0.0, []), {"concurrency": 8}, 7.5, 2.0)
        rate = round(0.3 * capacity["goodput_rps"], 1)
        text = images.workload(tmp / "text.json", rate, 0.0, [], images.IMAGE_MODEL)
        for _ in range(2):
            for kind in ["none", *kinds]:
                spinner = [subprocess.Popen([sys.executable, "-c", SPINNERS[kind]])] if kind != "none" else []
                try:
                    load = run_loadgen(images.BASE_URL, text, {"rate": rate}, 15, 2, max_in_flight=64, raw=True)
                finally:
                    for p in spinner:
                        p.kill()
                        p.wait()
                timed = [(r[2], r[7]) for r in load["records"] if r[0] == "text" and r[3] == 200 and r[7]]
                pooled.setdefault(kind, []).extend(timed)
    out: dict[str, Any] = {"text_rate_rps": rate}
    for kind, timed in pooled.items():
        latency = [lat for lat, _ in timed]
        p50, p99 = (round(float(np.percentile(latency, q)), 2) for q in (50, 99))
        out[kind] = {"requests": len(latency), "p50_ms": p50, "p99_ms": p99, "slowest_1pct": images.tail_parts(timed)["tail"]}
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), indent=1))
