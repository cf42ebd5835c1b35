"""Does one SCHED_IDLE busy loop slow a bare uvicorn server's tail on this machine?

Run from the repository root: `python benchmarks/results/images/local/runs/bare-uvicorn-idle-loop/run.py`.
Open loop at 1,500 req/s through the project's load client, three pairs of 12 s phases: none,
then one busy-loop process under SCHED_IDLE (benchmarks.images.IDLE_LOOP).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.cluster import run_loadgen
from benchmarks.images import idle_loops

HERE = Path(__file__).resolve().parent
BODY = '{"inputs":[{"name":"text","shape":[1],"datatype":"BYTES","data":["hello there"]}]}'


def main() -> None:
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "bare_app:app", "--port", "8123", "--loop", "uvloop", "--http", "httptools",
         "--log-level", "warning"],
        cwd=HERE,
    )  # fmt: skip
    time.sleep(3)
    pooled: dict[str, list[float]] = {"none": [], "idle_loop": []}
    rounds = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            wl = Path(tmp) / "wl.json"
            wl.write_text(json.dumps({"streams": [{"name": "text", "path": "/", "weight": 1, "headers": {}, "bodies": [BODY]}]}))
            for _ in range(3):
                for name in ("none", "idle_loop"):
                    with idle_loops(1 if name == "idle_loop" else 0):
                        load = run_loadgen("http://127.0.0.1:8123", wl, {"rate": 1500.0}, 12, 2, max_in_flight=64, raw=True)
                    lat = [rec[2] for rec in load.pop("records") if rec[3] == 200]
                    pooled[name] += lat
                    rounds.append({"phase": name, "answers": len(lat), "p50_ms": round(float(np.percentile(lat, 50)), 2),
                                   "p99_ms": round(float(np.percentile(lat, 99)), 2)})  # fmt: skip
    finally:
        server.kill()
    summary = {k: {f"p{q}_ms": round(float(np.percentile(v, q)), 2) for q in (50, 99)} for k, v in pooled.items()}
    result = {"rounds": rounds, "pooled": summary}
    (HERE / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["pooled"]))


if __name__ == "__main__":
    main()
