"""`python -m benchmarks precision`: each model's FP32 graph beside its lower-precision variants
(serve_app.zoo.quantize), in ONNX Runtime on this machine's CPU, no Ray: accuracy on the held-out
test split, rows per second at batch 1 and at the model's configured max_batch_size, p50 latency
of one row, file size, and the memory a replica's session takes (resident set growth of a fresh
process that loads the graph and runs one batch).

Precisions alternate within each round, so a slow spell of the shared machine hits each of them.
Variants missing from the model directories are built first, as `serve-app models build` does.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.contention import _feeds
from serve_app.manifest import Manifest
from serve_app.models.runtime import create_session
from serve_app.zoo.data import TEST_SEED
from serve_app.zoo.evaluate import classifier_logits
from serve_app.zoo.quantize import build_variant

PRECISIONS = ("fp32", "int8")


def _rows_per_s(path: Path, feeds: dict[str, np.ndarray], threads: int, seconds: float) -> tuple[float, float]:
    """(rows/s, median seconds per run) of one session with `threads` intra-op threads, run back to back."""
    session = create_session(path, ["CPUExecutionProvider"], threads)
    for _ in range(3):
        session.run(None, feeds)
    rows = len(next(iter(feeds.values())))
    times: list[float] = []
    stop_at = time.perf_counter() + seconds
    while time.perf_counter() < stop_at:
        t = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - t)
    return rows * len(times) / sum(times), statistics.median(times)


def _rss_growth(path: str, feeds: dict[str, np.ndarray], threads: int, out: Any) -> None:
    import onnxruntime  # noqa: F401  (the library's own memory is not the model's)
    import psutil

    proc = psutil.Process()
    before = proc.memory_info().rss
    session = create_session(Path(path), ["CPUExecutionProvider"], threads)
    session.run(None, feeds)
    out.put(proc.memory_info().rss - before)


def session_memory(path: Path, feeds: dict[str, np.ndarray], threads: int) -> int:
    """Bytes a fresh process grows by when it loads the graph and runs one batch."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_rss_growth, args=(str(path), feeds, threads, q))
    p.start()
    grown = int(q.get(timeout=300))
    p.join()
    return grown


def run(
    model_dirs: dict[str, Path], batch: dict[str, int], threads: int, seconds: float, rounds: int, n_eval: int
) -> dict[str, Any]:
    out: dict[str, Any] = {"threads": threads, "rounds": rounds, "seconds_per_point": seconds, "models": {}}
    for model, model_dir in model_dirs.items():
        manifest = Manifest.load(model_dir)
        for precision in PRECISIONS:
            if precision != "fp32" and precision not in manifest.variants:
                build_variant(model_dir, precision)  # type: ignore[arg-type]
        manifest = Manifest.load(model_dir)
        paths = {p: model_dir / manifest.onnx_file_for(p) for p in PRECISIONS}
        feeds = {1: _feeds(model_dir, 1), batch[model]: _feeds(model_dir, batch[model])}
        speed: dict[str, dict[int, list[float]]] = {p: {b: [] for b in feeds} for p in PRECISIONS}
        one_row: dict[str, list[float]] = {p: [] for p in PRECISIONS}
        for _ in range(rounds):
            for b, f in feeds.items():
                for p in PRECISIONS:
                    rps, per_run = _rows_per_s(paths[p], f, threads, seconds)
                    speed[p][b].append(rps)
                    if b == 1:
                        one_row[p].append(per_run)
        per: dict[str, Any] = {}
        for p in PRECISIONS:
            logits, labels = classifier_logits(model_dir, n_eval, TEST_SEED, precision=p)
            per[p] = {
                "test_accuracy": float((logits.argmax(1) == labels).mean()),
                "rows_per_s": {str(b): statistics.median(v) for b, v in speed[p].items()},
                "rows_per_s_rounds": {str(b): v for b, v in speed[p].items()},
                "p50_ms_one_row": statistics.median(one_row[p]) * 1000,
                "file_bytes": paths[p].stat().st_size,
                "session_rss_bytes": session_memory(paths[p], feeds[batch[model]], threads),
                "build_report": manifest.variants.get(p),
            }
        base = per["fp32"]
        for p in PRECISIONS[1:]:
            v = per[p]
            v["vs_fp32"] = {
                "accuracy_points": round((v["test_accuracy"] - base["test_accuracy"]) * 100, 2),
                "speed": {b: round(v["rows_per_s"][b] / base["rows_per_s"][b], 2) for b in v["rows_per_s"]},
                "file_size": round(v["file_bytes"] / base["file_bytes"], 3),
                "session_memory": round(v["session_rss_bytes"] / base["session_rss_bytes"], 3),
            }
        out["models"][model] = {"batch": batch[model], "precisions": per}
    return out


def markdown(res: dict[str, Any]) -> str:
    r = res["result"]
    lines = [
        f"ONNX Runtime on the CPU, one session with {r['threads']} intra-op threads, {r['rounds']} rounds of "
        f"{r['seconds_per_point']:g} s per point (medians); accuracy on the held-out test split.",
        "",
        "| model | precision | test accuracy | rows/s, batch 1 | rows/s, batch N | p50 one row | file | session memory |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, m in r["models"].items():
        n = str(m["batch"])
        for p, v in m["precisions"].items():
            ratio = v.get("vs_fp32")
            rel = (
                f" ({ratio['accuracy_points']:+.2f} pt)",
                f" ({ratio['speed']['1']}x)",
                f" ({ratio['speed'][n]}x)",
                f" ({ratio['file_size']}x)",
                f" ({ratio['session_memory']}x)",
            ) if ratio else ("",) * 5  # fmt: skip
            lines.append(
                f"| {model} | {p} | {v['test_accuracy'] * 100:.2f}%{rel[0]} | {v['rows_per_s']['1']:,.0f}{rel[1]} | "
                f"{v['rows_per_s'][n]:,.0f} (N={n}){rel[2]} | {v['p50_ms_one_row']:.2f} ms | "
                f"{v['file_bytes'] / 2**20:.2f} MiB{rel[3]} | {v['session_rss_bytes'] / 2**20:.1f} MiB{rel[4]} |"
            )
    return "\n".join(lines) + "\n"
