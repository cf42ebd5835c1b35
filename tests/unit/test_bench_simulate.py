"""The scheduling simulation: the shipped config's policy for the demo `resnet-heavy`, on a virtual
clock, at half and three times the simulated model's capacity (seconds of CPU, no Ray)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.history import row
from benchmarks.simulate import SimulateSettings, markdown, run

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local.yaml"


def test_the_shipped_policy_serves_half_its_capacity_in_full_and_sheds_low_first_at_three_times_it(tmp_path):
    result = run(SimulateSettings.smoke(), tmp_path, CONFIG)
    half, triple = result["table"]
    assert (half["load"], triple["load"]) == (0.5, 3.0)
    # Below capacity nothing is refused and the model answers what is offered.
    assert half["least_answered"]["share"] == 1.0 and 0.4 < half["goodput_median"] < 0.6
    # Over it the model stays busy, high is answered in full, low is what is refused, at once.
    assert triple["goodput_median"] > 0.8 and triple["timeouts"] == 0 and triple["other_errors"] == 0
    (point,) = [p["result"] for p in result["points"] if p["load"] == 3.0]
    classes = point["classes"]
    assert classes["high"]["answered_share"] == 1.0 and classes["normal"]["answered_share"] > classes["low"]["answered_share"]
    assert point["refused"] > 0 and point["refused_late"] <= 0.01 * point["refused"]
    # What the report and the history say of it.
    assert "| 10/30/60 | 3.0x |" in markdown({"result": result})
    saved = {"scenario": "simulate", "machine": {}, "result": result, "command": "python -m benchmarks simulate"}
    assert "10/30/60 3.0x:" in row(saved, "simulate/local")["headline"]
