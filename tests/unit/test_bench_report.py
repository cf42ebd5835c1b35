"""The priority report's columns, from a committed run's raw result (no Ray)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import report

RUNS = Path(__file__).resolve().parents[2] / "benchmarks/results/priority/bench-realsize-h100-node"
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks/results"


def _row(markdown: str, policy: str) -> list[str]:
    line = next(x for x in markdown.splitlines() if x.startswith(f"| {policy} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_goodput_is_also_divided_by_the_best_throughput_seen_in_the_run() -> None:
    res = json.loads((RUNS / "cores2-1/result.json").read_text())
    md = report.priority_markdown(res)
    priority, fifo = _row(md, "priority"), _row(md, "fifo")
    # FIFO's flood answered 65.33 req/s, above the closed-loop capacity (56.75): that is the
    # stricter denominator, so priority's 51.5 req/s is 0.91x of capacity but 0.79x of the best.
    assert priority[-3:] == ["0.91x", "0.79x", "1.51"]
    assert fifo[-3:] == ["1.15x", "1.00x", "1.50"]


def test_a_run_pinned_to_fewer_cores_says_so() -> None:
    machine = json.loads((RUNS / "cores4/result.json").read_text())["machine"]
    assert report._cores_text(machine) == "16 cores (4 usable: the run was pinned with CPU affinity)"
    assert report._cores_text({**machine, "usable_cores": 16}) == "16 cores"
    assert report._cores_text({"cores": 2}) == "2 cores"  # results written before the field existed


def test_committed_readmes_are_what_the_report_renders() -> None:
    runs = sorted(p for p in RUNS.iterdir() if p.is_dir())
    assert len(runs) >= 5
    for run in runs:
        res = json.loads((run / "result.json").read_text())
        assert report.priority_markdown(res) in (run / "README.md").read_text(), run.name


def test_the_compare_table_counts_what_was_not_answered_beside_latencies_of_what_was() -> None:
    """Latency covers answered requests only: a setup that refused most of its load shows it."""
    # An H100 run at 4c7eefb where ours refused part of its load (kept here when the run folders went).
    res = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "compare-h100-refusals.json").read_text())
    text = report.compare_markdown(res)
    row = next(line for line in text.splitlines() if line.startswith("| ours") and "req/s" in line and "| 415 |" in line)
    assert row.split(" | ")[2] == "415"  # the 503s of ours at c=32 on resnet-heavy
    assert "(cores; 16 = the whole machine)" in text


def test_side_by_side_rounds_turn_about_and_start_with_what_the_curves_left_deployed() -> None:
    from benchmarks.scenarios import pair_orders

    assert pair_orders(0) == []
    assert pair_orders(3) == [("ours", "plain"), ("plain", "ours"), ("ours", "plain")]
    three = ("ours", "ours-handle", "plain")
    assert pair_orders(2, three) == [three, ("plain", "ours-handle", "ours")]


def test_the_side_by_side_table_gives_each_round_and_the_median_of_their_ratios() -> None:
    def point(rps: float, refused: int = 0) -> dict:
        return {"goodput_rps": rps, "statuses": {"200": 100, **({"503": refused} if refused else {})}}

    rounds = [
        {"round": 0, "order": ["ours", "plain"], "ours": point(900.0), "plain": point(1000.0),
         "ours-binary": point(1200.0), "plain-binary": point(1000.0)},
        {"round": 1, "order": ["plain", "ours"], "ours": point(1300.0, refused=2), "plain": point(1000.0),
         "ours-binary": point(1400.0), "plain-binary": point(1000.0)},
        {"round": 2, "order": ["ours", "plain"], "ours": point(1100.0), "plain": point(1000.0),
         "ours-binary": point(1600.0), "plain-binary": point(1000.0)},
    ]  # fmt: skip
    lines = report.pairs_lines(rounds, 32, plain_replicas=2)
    assert "| 2 | plain, ours | JSON | ours | 1000.0 | 1300.0 | 1.30x | 0, 2 |" in lines
    assert "- ours / plain, JSON: median of the rounds' ratios **1.10x** (range 0.90x-1.30x)" in lines
    assert "| 3 | ours, plain | binary | ours | 1000.0 | 1600.0 | 1.60x | 0, 0 |" in lines
    assert lines[-1] == "- ours / plain, binary: median of the rounds' ratios **1.40x** (range 1.20x-1.60x)"
    assert "plain with 2 model replicas" in lines[1]
    # A run from before the binary rounds: the JSON table alone.
    old = [{k: v for k, v in r.items() if not k.endswith("-binary")} for r in rounds]
    assert not any("binary" in line for line in report.pairs_lines(old, 32)[2:])
    # A third setup in the rounds: its own rows and median against plain.
    three = [{**r, "order": ["ours", "plain", "ours-handle"], "ours-handle": point(500.0)} for r in old]
    median = "- ours-handle / plain, JSON: median of the rounds' ratios **0.50x** (range 0.50x-0.50x)"
    assert median in report.pairs_lines(three, 32)
    assert report.pairs_lines(None, 32) == [] and report.pairs_lines([], 32) == []
