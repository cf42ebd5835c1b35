"""Does a busy bulk lane slow an urgent batch? The replica's two lanes, standalone, no Ray.

    python -m benchmarks.lane_interference MODEL_DIR OUT.json [URGENT_THREADS]

An urgent session (URGENT_THREADS intra-op threads, default 2, normal priority) runs
lone requests 50 ms apart, first with the bulk sessions idle, then while two
single-threaded bulk sessions run batches of 8 back to back under SCHED_IDLE, as a
replica lays them out (serve_app/models/classifier.py). Also the CPU time per row of
each lane's batch, measured before the bulk sessions start. Text models only (a BERT-style
model directory with its tokenizer). Why: it tells whether a high-priority request's
slower run under a flood comes from the bulk lane beside it or from the rest of the node
(benchmarks/results/priority/).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from benchmarks import probe_args
from benchmarks.workloads import TEST_SEED
from serve_app.cpu_priority import lower_thread_priority
from serve_app.manifest import Manifest
from serve_app.models.runtime import create_session
from serve_app.padding import pad_right
from serve_app.tokenization import TextTokenizer
from serve_app.zoo.data import sentiment_dataset

REQUESTS = 60
GAP_S = 0.05
BULK_BATCH = 8


def _latencies(session: ort.InferenceSession, rows: list[list[int]], pad_id: int) -> dict[str, float]:
    lat = []
    for i in range(REQUESTS):
        ids, mask = pad_right([rows[i % len(rows)]], pad_id)
        started = time.perf_counter()
        session.run(None, {"input_ids": ids, "attention_mask": mask})
        lat.append((time.perf_counter() - started) * 1e3)
        time.sleep(GAP_S)
    a = np.array(lat)
    return {q: round(float(np.percentile(a, p)), 2) for q, p in (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100))}


def _cpu_ms_per_row(session: ort.InferenceSession, feed: dict[str, np.ndarray], reps: int = 12) -> float:
    """Process CPU time per row of `feed`'s batch (every thread of this process: run it alone)."""
    session.run(None, feed)
    started = time.process_time()
    for _ in range(reps):
        session.run(None, feed)
    return round((time.process_time() - started) * 1e3 / (reps * len(feed["input_ids"])), 2)


def main(argv: list[str]) -> int:
    ns = probe_args.parse(
        argv, __doc__, "python -m benchmarks.lane_interference", "MODEL_DIR", "OUT", optional=("URGENT_THREADS",)
    )
    model_dir, out = Path(ns.MODEL_DIR), Path(ns.OUT)
    urgent_threads = int(ns.URGENT_THREADS or 2)
    manifest = Manifest.load(model_dir)
    tok = TextTokenizer.for_model(model_dir, manifest, truncate=True)
    texts, _ = sentiment_dataset(64, TEST_SEED)
    rows = tok.encode_rows(texts)
    path, cpu = model_dir / manifest.onnx_file, ["CPUExecutionProvider"]
    urgent = create_session(path, cpu, urgent_threads, spinning=False)
    bulk = [create_session(path, cpu, 1, spinning=False, background=True) for _ in range(2)]
    ids, mask = pad_right(rows[:BULK_BATCH], tok.pad_id)
    feed = {"input_ids": ids, "attention_mask": mask}
    one = {"input_ids": ids[:1], "attention_mask": mask[:1]}
    for _ in range(3):
        urgent.run(None, one)
    result: dict[str, Any] = {"model_dir": str(model_dir), "urgent_threads": urgent_threads}
    # What a row costs in cores on each lane, nothing else running: a lone urgent request against
    # a row of a full bulk batch (the priority scenario's goodput turns on the difference).
    result["cpu_ms_per_row"] = {
        "urgent_batch_1": _cpu_ms_per_row(urgent, one),
        f"bulk_batch_{BULK_BATCH}": _cpu_ms_per_row(bulk[0], feed),
    }
    result["urgent_alone_ms"] = _latencies(urgent, rows, tok.pad_id)
    stop, done = threading.Event(), [0]

    def bulk_loop(session: ort.InferenceSession) -> None:
        lower_thread_priority()
        while not stop.is_set():
            session.run(None, feed)
            done[0] += BULK_BATCH

    threads = [threading.Thread(target=bulk_loop, args=(s,)) for s in bulk]
    for t in threads:
        t.start()
    time.sleep(1.0)
    started, before = time.perf_counter(), done[0]
    result["urgent_beside_busy_bulk_ms"] = _latencies(urgent, rows, tok.pad_id)
    result["bulk_rows_per_s_meanwhile"] = round((done[0] - before) / (time.perf_counter() - started), 1)
    stop.set()
    for t in threads:
        t.join()
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
