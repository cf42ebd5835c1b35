"""`python -m benchmarks contention`: how a background model lane's session layout stands other load.

The bulk lane of a model replica runs under SCHED_IDLE beside the router, the
proxy and the urgent lane (serve_app.process.cpu_priority). This measures, in-process
with ONNX Runtime and no Ray, the bulk throughput of the two layouts a replica
with `threads` cores can use:

- `1x{threads}`: one session with `threads` intra-op threads (one batch at a time);
- `{threads}x1`: `threads` single-threaded sessions, each driven by its own thread.

each alone and beside bursty load at nice 19 (processes that are busy
`share` of every 20 ms, one per core: a stand-in for the router and proxy).
Layouts alternate within each round, so a slow spell of a shared machine hits
both. Inputs are the benchmark workload's (the tokenized demo texts, or
images of the model's size), at the model's configured max_batch_size.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from serve_app.manifest import Manifest
from serve_app.models.runtime import create_session
from serve_app.padding import pad_right
from serve_app.process.cpu_priority import lower_thread_priority
from serve_app.tokenization import TextTokenizer

PERIOD_S = 0.02


def _hog(stop: Any, share: float) -> None:
    os.nice(19)
    busy, idle = PERIOD_S * share, PERIOD_S * (1 - share)
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < busy:
            pass
        time.sleep(idle)


def _feeds(model_dir: Path, batch: int) -> dict[str, np.ndarray]:
    manifest = Manifest.load(model_dir)
    if manifest.family == "resnet":
        s = manifest.image_size or 32
        return {"image": np.random.default_rng(0).random((batch, 3, s, s), dtype=np.float32)}
    from benchmarks.workloads import text_bodies

    # Tokenized and padded the way the replica does it (TextClassifier._prepare/_forward),
    # so the session sees the shapes it sees when served.
    tokenizer = TextTokenizer.for_model(model_dir, manifest, truncate=True)
    texts = [b["inputs"][0]["data"][0] for b in text_bodies(batch)]
    seqs = tokenizer.encode_rows(texts)
    ids, mask = pad_right(seqs, tokenizer.pad_id)
    return {"input_ids": ids, "attention_mask": mask}


def _throughput(model_path: Path, layout: list[int], feeds: dict[str, np.ndarray], seconds: float) -> float:
    """Rows/s of `len(layout)` sessions run side by side, each from its own SCHED_IDLE thread."""
    sessions = [create_session(model_path, ["CPUExecutionProvider"], n, spinning=False, background=True) for n in layout]
    for s in sessions:
        s.run(None, feeds)
    rows = len(next(iter(feeds.values())))
    done = [0] * len(sessions)
    stop_at = time.perf_counter() + seconds

    def drive(i: int) -> None:
        lower_thread_priority()
        while time.perf_counter() < stop_at:
            sessions[i].run(None, feeds)
            done[i] += rows

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(len(sessions))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.perf_counter() - t0)


def run(model_dirs: dict[str, Path], batch: dict[str, int], threads: int, shares: list[float], seconds: float,
        rounds: int) -> dict[str, Any]:  # fmt: skip
    layouts = {f"1x{threads}": [threads], f"{threads}x1": [1] * threads}
    out: dict[str, Any] = {"threads": threads, "shares": shares, "period_ms": PERIOD_S * 1e3, "models": {}}
    for name, model_dir in model_dirs.items():
        feeds = _feeds(model_dir, batch[name])
        model_path = model_dir / Manifest.load(model_dir).onnx_file
        entry: dict[str, Any] = {"batch": batch[name], "rows_per_s": {}}
        for share in shares:
            stop = mp.get_context("spawn").Event()
            hogs = [mp.get_context("spawn").Process(target=_hog, args=(stop, share)) for _ in range(threads if share else 0)]
            for h in hogs:
                h.start()
            samples: dict[str, list[float]] = {k: [] for k in layouts}
            for _ in range(rounds):
                for label, layout in layouts.items():
                    samples[label].append(round(_throughput(model_path, layout, feeds, seconds), 2))
            stop.set()
            for h in hogs:
                h.join()
            entry["rows_per_s"][str(share)] = samples
        out["models"][name] = entry
    return out


def markdown(res: dict[str, Any]) -> str:
    r = res["result"]
    threads = r["threads"]
    wide, side = f"1x{threads}", f"{threads}x1"
    lines = [
        f"Bulk-lane throughput (rows/s, median of rounds; SCHED_IDLE threads) of one session x {threads} threads "
        f"(`{wide}`) vs {threads} single-threaded sessions side by side (`{side}`), alone and beside {threads} "
        f"nice-19 processes each busy `share` of every {r['period_ms']:.0f} ms. In-process ONNX Runtime, no Ray.",
        "",
        f"| model | batch | share per core | {wide} rows/s | {side} rows/s | {side} / {wide} | {wide} loss | {side} loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m, e in r["models"].items():
        base = {k: float(np.median(v)) for k, v in e["rows_per_s"][str(r["shares"][0])].items()}
        for share in r["shares"]:
            med = {k: float(np.median(v)) for k, v in e["rows_per_s"][str(share)].items()}
            lines.append(
                f"| {m} | {e['batch']} | {share} | {med[wide]:.1f} | {med[side]:.1f} | {med[side] / med[wide]:.2f}x | "
                f"{1 - med[wide] / base[wide]:.0%} | {1 - med[side] / base[side]:.0%} |"
            )
    return "\n".join(lines)
