"""The multiplex scenario's pure parts (benchmarks.multiplex): popularity, the configs it
deploys, what it makes of the pool's reports."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks.multiplex import (
    POOL,
    MultiplexSettings,
    markdown,
    pool_config,
    separate_config,
    summarize_pool,
    zipf_weights,
)
from serve_app.config import AppArgs

ROOT = Path(__file__).resolve().parents[2]


def test_zipf_weights_fall_with_rank_and_sum_to_one() -> None:
    w = zipf_weights(24, 1.1)
    assert sum(w) == pytest.approx(1.0) and all(a > b for a, b in itertools.pairwise(w))
    assert w[0] / w[1] == pytest.approx(2**1.1)


def test_the_pool_and_the_separate_configs_are_valid_and_keep_only_the_router(tmp_path: Path) -> None:
    base = yaml.safe_load((ROOT / "configs/local.yaml").read_text())
    for name in ("review-00", "review-01"):
        (tmp_path / name).mkdir()
    s = MultiplexSettings(replicas=2, max_models=3)
    config = pool_config(base, s, tmp_path, second_copies=False)
    app = config["applications"][0]
    assert [d["name"] for d in app["deployments"]] == ["router", POOL] and app["deployments"][1]["num_replicas"] == 2
    args = AppArgs.model_validate(app["args"])
    assert sorted(args.models) == ["review-00", "review-01"] and not args.routes
    assert args.pools["review-*"].multiplex is not None and not args.pools["review-*"].multiplex.second_copies
    apart = separate_config(base, s, tmp_path, ["review-00", "review-01"])["applications"][0]
    assert [d["name"] for d in apart["deployments"]] == ["router", "review-00", "review-01"]
    assert "autoscaling_config" not in apart["deployments"][1]
    assert sorted(AppArgs.model_validate(apart["args"]).models) == ["review-00", "review-01"]


def test_the_pool_summary_counts_hits_loads_and_memory() -> None:
    stats = [
        {"replica": "a", "held": ["m1", "m2"], "loads_s": [0.5, 0.7], "batches": {"m1": 8, "m2": 2},
         "cold_batches": {"m1": 1, "m2": 1}, "rss_mb": 300.0},
        {"replica": "b", "held": ["m1"], "loads_s": [0.6], "batches": {"m1": 10}, "cold_batches": {"m1": 2},
         "rss_mb": 250.0},
    ]  # fmt: skip
    out = summarize_pool(stats)
    assert out["batches"] == 20 and out["hit_ratio"] == 0.8 and out["loads"] == 3
    assert out["load_p50_s"] == 0.6 and out["load_p99_s"] == 0.7
    assert [r["rss_mb"] for r in out["per_replica"]] == [300.0, 250.0]
    load = {"goodput_rps": 100.0, "p50_ms": 5.0, "p99_ms": 9.0, "statuses": {"200": 2000}}
    result = {"settings": {**MultiplexSettings().__dict__}, "weights": zipf_weights(24, 1.1),
              "zipf": {"load": load, "pool": out}, "separate_deployments": {"load": load}}  # fmt: skip
    text = markdown({"result": result})
    assert "| zipf | 100.0 | 5.0 | 9.0 |" in text and "| separate_deployments | 100.0" in text


def test_the_history_headline_gives_each_phase_and_the_two_ratios() -> None:
    from benchmarks.history import HEADLINES

    def phase(rps: float, hit: float | None = None) -> dict[str, Any]:
        return {"load": {"goodput_rps": rps}, **({"pool": {"hit_ratio": hit}} if hit is not None else {})}

    result = {
        "zipf": phase(10.0, 0.5), "hot_placement": phase(150.0, 1.0), "hot_no_second_copy": phase(100.0, 1.0),
        "separate_deployments": phase(140.0), "separate_pool": phase(133.0, 1.0),
    }  # fmt: skip
    assert HEADLINES["multiplex"](result) == [
        "zipf 10.0 req/s, hit ratio 0.5", "hot model second copy 1.50x", "pool/separate 0.95x",
    ]  # fmt: skip


def test_the_sizes_phase_takes_one_text_model_per_size_smallest_first(tmp_path: Path) -> None:
    from benchmarks.multiplex import size_sources

    def model(path: Path, family: str, onnx_bytes: int) -> Path:
        path.mkdir(parents=True)
        (path / "manifest.json").write_text(f'{{"family": "{family}"}}')
        (path / "model.onnx").write_bytes(b"\0" * onnx_bytes)
        return path

    model(tmp_path / "models" / "bert-heavy", "bert", 300)
    model(tmp_path / "models" / "bert-light", "bert", 100)
    model(tmp_path / "models" / "bert-light-copy", "bert", 100)  # a size already taken
    model(tmp_path / "models" / "resnet", "resnet", 50)
    big = model(tmp_path / "elsewhere" / "bert-base", "bert", 900)
    found = size_sources(tmp_path / "models", MultiplexSettings(size_sources=(str(big),)))
    assert [p.name for p in found] == ["bert-light-copy", "bert-heavy", "bert-base"]


def test_the_report_gives_load_time_by_size() -> None:
    row = {"source": "/m/bert-base", "onnx_mb": 417.4, "loads": 5, "load_p50_s": 0.78, "load_max_s": 2.0,
           "first_request_p50_ms": 858.5, "statuses": [200]}  # fmt: skip
    result = {"settings": {**MultiplexSettings().__dict__}, "weights": zipf_weights(24, 1.1), "sizes": {"rows": [row]}}
    assert "| /m/bert-base | 417.4 | 5 | 0.78 | 2.0 | 858.5 | [200] |" in markdown({"result": result})
