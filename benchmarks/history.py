"""benchmarks/results/history.csv: one row per benchmark run (date, scenario, results folder,
commit, machine, headline figures). The folders keep only each scenario's latest run; this file
keeps the record of the runs before it. `report.write` adds a row for every run it writes;
`python -m benchmarks.history` rebuilds rows from the result.json files under the results tree.
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
HISTORY = RESULTS / "history.csv"
COLUMNS = ("date", "scenario", "folder", "commit", "machine", "headline", "command")


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _answered_rps(point: dict[str, Any]) -> float:
    """A load point's answers a second: its goodput, or its throughput in runs before goodput was kept."""
    return float(point.get("goodput_rps", point.get("throughput_rps")) or 0.0)


def _compare(result: dict[str, Any]) -> list[str]:
    out = []
    for model, m in result.get("models", {}).items():
        pairs = m.get("pairs") or []
        found = False
        for setup in ("ours", "ours-handle"):
            for suffix, label in (("", ""), ("-binary", " binary")):
                # Answers (2xx) a second, as the run's own report divides them: refusals are not throughput.
                ratios = [
                    _answered_rps(p[f"{setup}{suffix}"]) / _answered_rps(p[f"plain{suffix}"])
                    for p in pairs
                    if f"{setup}{suffix}" in p and f"plain{suffix}" in p and _answered_rps(p[f"plain{suffix}"])
                ]
                if ratios:
                    spread = f"{min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} rounds"
                    out.append(f"{model} {setup}/plain{label} {statistics.median(ratios):.2f}x ({spread})")
                    found = True
        if found:
            continue
        ours, plain = m.get("ours", {}), m.get("plain", {})
        if isinstance(ours, dict) and isinstance(plain, dict) and ours.get("closed") and plain.get("closed"):
            o, p = ours["closed"][-1].get("throughput_rps"), plain["closed"][-1].get("throughput_rps")
            out.append(f"{model} ours/plain {_ratio(o, p)} (curve)")
    return out


def _generation(result: dict[str, Any]) -> list[str]:
    out = []
    for point in result.get("summary", []):
        setups = {k: v for k, v in point.items() if isinstance(v, dict) and "tokens_per_s" in v}
        figures = ", ".join(f"{k} {v['tokens_per_s']} tok/s" for k, v in setups.items())
        out.append(f"c={point.get('concurrency')}: {figures}")
    return out


def _goodput(result: dict[str, Any]) -> list[str]:
    if result.get("degrade"):  # a route with and without degrading: the arms' medians
        return [
            f"{r['mix']} {r['load']}x: degrade on {r['on']['goodput_over_capacity']} / off {r['off']['goodput_over_capacity']}"
            for r in result["degrade"]
            if "on" in r and "off" in r
        ]
    return [
        f"{p['mix']} {p['load']}x: {p['result'].get('goodput_over_capacity')}"
        for p in result.get("points", [])
        if p.get("mix") == "10/30/60"
    ]


def _cascade(result: dict[str, Any]) -> list[str]:
    out = []
    for name, e in result.get("routes", {}).items():
        ratio = e.get("ratio")
        if ratio:
            out.append(f"{name} route/heavy-only {ratio['median']}x ({ratio['min']}-{ratio['max']}, {len(e['rounds'])} rounds)")
    return out


def _soak(result: dict[str, Any]) -> list[str]:
    minutes = [m.get("goodput_over_capacity") for m in result.get("goodput_by_minute", [])[1:]]
    minutes = [m for m in minutes if m is not None]
    return [f"goodput/capacity per minute {min(minutes)}-{max(minutes)}"] if minutes else []


def _multiplex(result: dict[str, Any]) -> list[str]:
    out = []
    for phase in ("zipf", "zipf_no_second_copy", "zipf_open"):
        if (p := result.get(phase)) is not None:
            out.append(f"{phase} {p['load'].get('goodput_rps')} req/s, hit ratio {p['pool'].get('hit_ratio')}")
    on, off = result.get("hot_placement"), result.get("hot_no_second_copy")
    if on is not None and off is not None:
        out.append(f"hot model second copy {_ratio(on['load'].get('goodput_rps'), off['load'].get('goodput_rps'))}")
    apart, pool = result.get("separate_deployments"), result.get("separate_pool")
    if apart is not None and pool is not None:
        out.append(f"pool/separate {_ratio(pool['load'].get('goodput_rps'), apart['load'].get('goodput_rps'))}")
    for row in (result.get("sizes") or {}).get("rows", []):
        out.append(f"load {row['onnx_mb']} MB p50 {row['load_p50_s']} s")
    return out


def _simulate(result: dict[str, Any]) -> list[str]:
    return [
        f"{r['mix']} {r['load']}x: {r['goodput_median']} (late refusals {'/'.join(map(str, r['refused_late']))})"
        for r in result.get("table", [])
        if r.get("mix") == "10/30/60"
    ]


def _pods(result: dict[str, Any]) -> list[str]:
    out = [f"ready {result['start']['seconds_to_ready']} s"] if "start" in result else []
    for kill, k in (result.get("pod_loss") or {}).items():
        if isinstance(k, dict) and "whole" in k:
            gap = max(k["whole"]["longest_gap_s"].values(), default=0.0)
            out.append(f"{kill} lost {k['whole']['lost']} of {k['whole']['sent']}, gap {gap} s")
    if "upgrade" in result:
        out.append(f"upgrade lost {result['upgrade']['whole']['lost']}, v2 share {result['upgrade']['v2_share_after']}")
    return out


HEADLINES = {
    "cascade": _cascade, "compare": _compare, "generation": _generation, "goodput": _goodput, "multiplex": _multiplex,
    "simulate": _simulate, "soak": _soak, "pods": _pods,
}  # fmt: skip


def row(saved: dict[str, Any], folder: str) -> dict[str, str]:
    """A run's row from its result.json as `report.write` saves it."""
    machine = saved.get("machine") or {}
    scenario = str(saved.get("scenario") or "")
    try:
        # A pods run keeps its figures at the top level of its result.json.
        figures = saved if scenario == "pods" else saved.get("result") or {}
        headline = "; ".join(HEADLINES.get(scenario, lambda r: [])(figures))
    except (KeyError, TypeError, ZeroDivisionError, ValueError):  # an older run's layout: no headline
        headline = ""
    where = machine.get("gpu") or f"{machine.get('cpu', '?')} x{machine.get('cores', '?')}"
    return {
        "date": str(machine.get("date", ""))[:19],
        "scenario": scenario,
        "folder": folder,
        "commit": str(machine.get("commit", "")),
        "machine": str(where),
        "headline": headline,
        "command": str(saved.get("command", "")),
    }


def read(path: Path = HISTORY) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def write_rows(rows: list[dict[str, str]], path: Path = HISTORY) -> None:
    unique = {(r["date"], r["scenario"], r["folder"], r["commit"]): r for r in rows}
    ordered = sorted(unique.values(), key=lambda r: (r["date"], r["scenario"], r["folder"]))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows(ordered)


def append(saved: dict[str, Any], out_dir: Path, path: Path = HISTORY) -> None:
    """The run just written, as a row (only for runs written inside the results tree)."""
    try:
        folder = str(out_dir.resolve().relative_to(path.parent.resolve()))
    except ValueError:
        return
    write_rows([*read(path), row(saved, folder)], path)


def rebuild(root: Path = RESULTS) -> list[dict[str, str]]:
    rows = read(root / "history.csv")
    for result in sorted(root.rglob("result.json")):
        saved = json.loads(result.read_text())
        if isinstance(saved, dict) and saved.get("scenario"):
            rows.append(row(saved, str(result.parent.relative_to(root))))
    return rows


if __name__ == "__main__":
    write_rows(rebuild(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS))
    print(f"wrote {HISTORY}")
