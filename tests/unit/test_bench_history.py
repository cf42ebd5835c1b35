"""benchmarks/results stays a report: latest runs, one history file, no scripts, under 3 MB."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from benchmarks import history

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def tracked(under: Path) -> list[Path]:
    out = subprocess.run(["git", "ls-files", str(under)], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / line for line in out.split()]


def test_results_hold_no_scripts_no_run_folders_and_stay_under_3_mb():
    files = tracked(RESULTS)
    assert files, "results are tracked"
    assert [f for f in files if f.suffix in (".py", ".sh")] == []
    assert [f for f in files if "runs" in f.relative_to(RESULTS).parts] == []
    assert sum(f.stat().st_size for f in files if f.exists()) < 3 * 1024 * 1024


def test_every_committed_run_has_its_history_row():
    folders = {r["folder"] for r in history.read()}
    for result in RESULTS.rglob("result.json"):
        saved = json.loads(result.read_text())
        if isinstance(saved, dict) and saved.get("scenario"):
            assert str(result.parent.relative_to(RESULTS)) in folders, result


def test_a_run_written_adds_one_row_with_its_headline_and_a_rerender_adds_none(tmp_path: Path):
    path = tmp_path / "history.csv"
    saved = {
        "scenario": "compare",
        "command": "python -m benchmarks compare --pairs 2",
        "machine": {"cpu": "EPYC", "cores": 2, "commit": "abc1234", "date": "2026-11-28T06:50:36+00:00"},
        "result": {
            "models": {
                "bert-heavy": {
                    "pairs": [
                        {
                            "ours": {"throughput_rps": 44.0},
                            "plain": {"throughput_rps": 40.0},
                            "ours-binary": {"throughput_rps": 50.0},
                            "plain-binary": {"throughput_rps": 40.0},
                        },
                        {
                            "ours": {"throughput_rps": 47.0},
                            "plain": {"throughput_rps": 32.0},
                            "ours-binary": {"throughput_rps": 48.0},
                            "plain-binary": {"throughput_rps": 32.0},
                        },
                    ]
                }
            }
        },
    }
    out = tmp_path / "compare" / "local"
    history.append(saved, out, path)
    history.append(saved, out, path)
    (row,) = history.read(path)
    assert (row["folder"], row["commit"], row["machine"]) == ("compare/local", "abc1234", "EPYC x2")
    assert row["headline"] == (
        "bert-heavy ours/plain 1.28x (1.10-1.47, 2 rounds); bert-heavy ours/plain binary 1.38x (1.25-1.50, 2 rounds)"
    )
    history.append(saved, tmp_path.parent / "elsewhere", path)  # a run written outside the tree: no row
    assert len(history.read(path)) == 1


def test_compare_headlines_count_answers_not_refusals():
    """A round where ours refused half its requests (503) is half as good, as the run's report says."""
    pair = {
        "ours": {"throughput_rps": 44.0, "goodput_rps": 22.0},
        "plain": {"throughput_rps": 40.0, "goodput_rps": 40.0},
    }
    (headline,) = history._compare({"models": {"m": {"pairs": [pair]}}})
    assert headline == "m ours/plain 0.55x (0.55-0.55, 1 rounds)"
