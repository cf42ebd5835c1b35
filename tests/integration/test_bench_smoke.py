"""Every `python -m benchmarks` scenario, run for seconds on the tiny models: the harness
works end to end and writes well-formed results. No timing is asserted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.cluster import stop_ray
from benchmarks.kept import REUSE_ENV

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module", autouse=True)
def one_ray_for_the_module() -> Iterator[None]:
    """The scenarios run on one Ray and one Serve where their settings match: each deletes its
    apps and leaves both up for the next (benchmarks.kept.REUSE_ENV). Starting Ray and Serve
    was most of a smoke run's time; what the scenarios check is their harness, not a fresh
    cluster's figures. The tests are in the order that keeps the chain long: `sweep` starts Serve
    with our gRPC options, which compare's plain app leaves idle (started without them, Serve
    would be restarted for ours), `ingress` runs the shipped ingress on it, and `chaos` a cluster of two
    nodes that it takes apart."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv(REUSE_ENV, "1")
        yield
    stop_ray()


def _bench(scenario: str, model_dir: Path, out: Path, *models: str, extra: tuple[str, ...] = ()) -> dict:
    cmd = [sys.executable, "-m", "benchmarks", scenario, "--smoke", "--model-dir", str(model_dir),
           "--out", str(out), *extra, "--models", *models]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ})
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads((out / "result.json").read_text())
    assert res["scenario"] == scenario and res["command"].startswith(f"python -m benchmarks {scenario}")
    assert res["machine"]["cores"] and res["machine"]["packages"]["ray"]
    assert (out / "README.md").read_text().startswith(f"# Benchmark: {scenario}")
    for name in res.get("plots", []):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    return res


def _answered(point: dict, refusals: bool = False) -> None:
    """A load point that ran: requests answered 200 and figures present. `refusals`: a few 503s
    (the router's own overload control) are the machine's, not the harness's."""
    statuses = point["statuses"]
    assert point["requests"] > 0 and set(statuses) <= ({"200", "503"} if refusals else {"200"}), statuses
    assert statuses.get("200", 0) >= 0.95 * point["requests"], statuses
    assert point["p50_ms"] > 0 and point["p99_ms"] >= point["p50_ms"]
    assert 0 < point["loadgen_cpu"]["core_share"]


def test_sweep(tiny_model_dir: Path, tmp_path: Path) -> None:
    res = _bench("sweep", tiny_model_dir, tmp_path, "bert-heavy")
    points = res["result"]["models"]["bert-heavy"]
    assert [p["max_batch_size"] for p in points] == [4]
    for p in points:
        _answered(p)
        assert p["idle_rss_mb"] > 0 and p["replica_rss_mb"]["bert-heavy"] >= p["idle_rss_mb"] * 0.5
    assert res["plots"] == ["sweep_bert-heavy.png"]


def test_compare(tiny_model_dir: Path, tmp_path: Path) -> None:
    # One model: the harness is the same for each, and CI time is short.
    # One round side by side: ours as the curves left it, then plain deployed again.
    res = _bench("compare", tiny_model_dir, tmp_path, "resnet-heavy", extra=("--pairs", "1"))
    for model in ("resnet-heavy",):
        r = res["result"]["models"][model]
        assert r["limit"]["best"]["items_per_s"] > 0 and len(r["limit"]["points"]) == 2
        for setup in ("naive", "plain", "ours"):
            for point in r[setup]["closed"]:
                _answered(point)
            assert r[setup]["open"]["requests"] > 0
        # the per-process CPU accounting found the processes that did the work
        assert "naive-server" in r["naive"]["closed"][-1]["cpu_cores_by_role"]
        assert "replica:PlainModel" in r["plain"]["closed"][-1]["cpu_cores_by_role"]
        assert {"replica:router", f"replica:{model}"} <= set(r["ours"]["closed"][-1]["cpu_cores_by_role"])
        assert r["ours"]["closed"][-1]["served_by"] == {model: r["ours"]["closed"][-1]["requests"]}
        # The shipped ingress keeps v2 infer in Serve's per-request handling (the direct path is opt-in).
        assert r["ours"]["direct_infer"] is False
        _answered(r["ours-binary"]["closed"][0])  # the binary tensor extension, end to end
        # Each served setup measured with no load too: the cost model's fixed cores.
        assert all(isinstance(r[s]["idle_cores_by_role"], dict) for s in ("plain", "ours", "ours-binary"))
        [pair] = r["pairs"]
        assert pair["order"] == ["ours", "plain"]
        for setup in ("ours", "plain", "ours-binary", "plain-binary"):  # JSON, then binary on both sides
            _answered(pair[setup])
        assert pair["ours"]["served_by"] == {model: pair["ours"]["requests"]}
        assert "replica:PlainModel" in pair["plain"]["cpu_cores_by_role"]
    assert sorted(res["plots"]) == ["curve_resnet-heavy.png"]
    readme = (tmp_path / "README.md").read_text()
    assert "ours vs plain Ray Serve" in readme and "| ours | binary |" in readme and "ceiling, 16 cores" in readme
    assert "| idle cores | total above idle |" in readme
    assert "Side by side: the setups deployed in turn, 1 round at" in readme and "plain with 2 model replicas" in readme


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy not installed")
def test_profile(tiny_model_dir: Path, tmp_path: Path) -> None:
    res = _bench("profile", tiny_model_dir, tmp_path, "bert-heavy")
    r = res["result"]["models"]["bert-heavy"]
    # py-spy attaches to the router as the load starts: on 2 cores its loop can fall far enough
    # behind for the overload control to refuse a request (seen once in CI, 1 of 346).
    _answered(r["load"], refusals=True)
    assert r["profiled"] == sorted(["router", "bert-heavy"])  # py-spy was started on both
    if any("ptrace" in e.lower() or "permission" in e.lower() for e in r["profile_errors"].values()):
        pytest.skip(f"py-spy may not attach here: {r['profile_errors']}")
    assert r["profile_errors"] == {}
    # Both collapsed-stack files came back, with samples in them.
    assert set(r["profiles"]) == {"router", "bert-heavy"}
    for name in r["profiles"].values():
        assert (tmp_path / name).stat().st_size > 0
    assert r["top_self"]["router"]


def test_priority(tiny_model_dir: Path, tmp_path: Path) -> None:
    res = _bench("priority", tiny_model_dir, tmp_path, "bert-heavy")
    e = res["result"]["models"]["bert-heavy"]
    assert e["capacity_rps"] > 0 and e["rates_rps"]["low"] == pytest.approx(2 * e["capacity_rps"], rel=0.01)
    for policy in ("priority", "fifo"):
        assert set(e[policy]["loaded"]["streams"]) == {"bert-heavy/high", "bert-heavy/low"}
        assert e[policy]["loaded"]["streams"]["bert-heavy/high"]["requests"] > 0
        assert e[policy]["unloaded"]["streams"]["bert-heavy/high"]["requests"] > 0
    assert "| priority |" in (tmp_path / "README.md").read_text()


def test_cascade(tiny_model_dir: Path, tmp_path: Path) -> None:
    res = _bench("cascade", tiny_model_dir, tmp_path, "bert-heavy")
    routes = res["result"]["routes"]
    assert set(routes) == {"text-classify", "image-classify"}
    for e in routes.values():
        _answered(e["route"])
        _answered(e["heavy_only"])
        assert e["calibration"]["signal"] in ("max_prob", "margin", "entropy")
        # Every answer scored against its input's true label; the ratio is the rounds' median.
        assert 0.0 < e["accuracy"]["route"] <= 1.0 and 0.0 < e["accuracy"]["heavy_only"] <= 1.0, e["accuracy"]
        assert e["ratio"]["min"] <= e["ratio"]["median"] <= e["ratio"]["max"]
    assert "| text-classify |" in (tmp_path / "README.md").read_text()


def test_generation(tiny_model_dir: Path, tmp_path: Path) -> None:
    res = _bench("generation", tiny_model_dir, tmp_path, "gpt")
    r = res["result"]
    assert r["setups"] == ["gpt", "gpt-request-10ms", "plain"]
    assert r["same_text"] is True, r["texts"]  # plain Ray Serve's generator makes the same tokens as ours
    assert {p["label"] for p in r["phases"]} == set(r["setups"])
    for phase in r["phases"]:
        assert phase["requests"] > 0 and phase["errors"] == 0 and phase["tokens_per_s"] > 0, phase
        assert phase["ttft_ms"]["p50"] > 0 and phase["itl_ms"]["p99"] > 0
        role = "replica:PlainGenerator" if phase["label"] == "plain" else f"replica:{phase['label']}"
        assert role in phase["cpu_cores_by_role"], phase["cpu_cores_by_role"]
    (row,) = r["summary"]
    assert row["vs gpt-request-10ms"]["tokens_per_s"] > 0 and row["gpt-request-10ms"]["mean_batch"] >= 1
    assert row["vs plain"]["tokens_per_s"] > 0 and row["plain"]["errors"] == 0
    readme = (tmp_path / "README.md").read_text()
    assert row["gpt"]["errors"] == 0 and readme.count("| 4 |") == 5 and "| 4 | plain Ray Serve |" in readme


def test_soak(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The soak, CI-sized: seconds instead of minutes, so only the answers are checked, not the slopes."""
    res = _bench("soak", tiny_model_dir, tmp_path, "bert-heavy")
    r = res["result"]
    assert r["capacity_rps"] > 0 and r["load"]["requests"] > 0
    # Past capacity every answer is a 200 or a refusal that says when to retry.
    assert r["unexpected_statuses"] == {} and r["load"]["refused_without_retry_after"] == 0, r["load"]
    assert "200" in r["load"]["statuses"]
    assert any(k.startswith("replica:router#") for k in r["memory"]) and r["router_samples"]
    # HAProxy's pools and connections sampled beside the memory, and reported.
    assert r["haproxy_info"] and {"PoolAlloc_bytes", "PoolUsed_bytes", "CurrConns"} <= set(r["haproxy_info"][-1])
    assert "HAProxy's pools (`show info`" in (tmp_path / "README.md").read_text()


def test_images(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Text alone and beside a PNG burst on one router: both phases answered, the ratio computed."""
    res = _bench("images", tiny_model_dir, tmp_path, "bert-heavy", "resnet-heavy")
    r = res["result"]
    assert r["text_rate_rps"] > 0 and len(r["rounds"]) == 1
    phases = r["rounds"][0]
    assert phases["alone"]["streams"]["text"]["statuses"] == {"200": phases["alone"]["streams"]["text"]["requests"]}
    burst = phases["with_burst"]["streams"]
    assert set(burst["png"]["statuses"]) == {"200"} and set(burst["text"]["statuses"]) == {"200"}
    assert phases["text_p99_ratio"] > 0 and r["pooled_text_p99_ratio"] > 0
    # The router's Server-Timing splits every text request's time into parts.
    assert set(r["text_tail_parts_ms"]) == {"alone", "with_burst"}
    assert r["text_tail_parts_ms"]["alone"]["all"]["replica"] > 0
    readme = (tmp_path / "README.md").read_text()
    assert "pooled over the rounds" in readme and "slowest 1%" in readme


def test_contention(tiny_model_dir: Path, tmp_path: Path) -> None:
    res = _bench("contention", tiny_model_dir, tmp_path, "bert-heavy")
    assert res["result"] and "| " in (tmp_path / "README.md").read_text()


def test_ingress(tiny_model_dir: Path, tmp_path: Path) -> None:
    res = _bench("ingress", tiny_model_dir, tmp_path, "bert-heavy")
    labels = [s["label"] for s in res["result"]["settings"]]
    # smoke: one of the four, the shipped ingress (on the Ray the earlier tests kept)
    assert labels == ["haproxy+throughput-optimized"] and res["result"]["settings"][0]["retry_on"]
    for s in res["result"]["settings"]:
        assert s["models"]["bert-heavy"], s["label"]
        for p in s["models"]["bert-heavy"]:
            _answered(p)


def test_chaos(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The chaos suite, CI-sized: a real two-node Ray cluster, each fault under load."""
    res = _bench("chaos", tiny_model_dir, tmp_path, "resnet-heavy")
    r = res["result"]
    # Serve spread the classifier over both nodes, so the node kill takes one of its replicas.
    assert sorted(x["on_worker"] for x in r["placement"]["resnet-heavy"]) == [False, True], r["placement"]
    phases = r["phases"]
    nothing_lost = {
        "no_answer": 0, "cut_mid_answer": 0, "server_error": 0, "refused_without_retry_after": 0, "malformed_not_4xx": 0,
    }  # fmt: skip
    # A killed classifier replica costs no client a request: its batches run again on the other.
    # Bad requests mixed into that load (CI's smoke has no phase of their own for them) get their
    # 4xx alone; the good ones around them are all answered.
    assert phases["replica"]["fault"]["killed"] and phases["replica"]["lost"] == nothing_lost, phases["replica"]
    assert any(s.startswith("4") for s in phases["replica"]["statuses"]) and "malformed" not in phases
    # The wedged decode loop fails its health check and Serve replaces the replica; every stream
    # that was answered 200 ends with [DONE], an error event first if it was cut.
    stall = phases["stall"]
    assert stall["fault"]["replaced_after_s"] is not None, stall["fault"]
    assert stall["streams"]["started"] > 0 and stall["streams"]["cut_without_done"] == 0, stall["streams"]
    # A killed router replica costs no request that had no answer yet (HAProxy sends each again to
    # the other router), and the app goes on answering after it (back to its earlier rate is the
    # benchmark's claim: a 6 s phase leaves its replacement too few seconds on a loaded 2-core
    # machine to show it). An answer whose head the router had written when it died is cut, and
    # HAProxy cannot replay it: the benchmark counts those apart (`cut_mid_answer`); at most the
    # one answer a router writes at a time is cut.
    router = phases["router"]
    after_kill = int(router["fault_in_window_s"]) + 1
    assert {**router["lost"], "cut_mid_answer": 0} == nothing_lost and router["lost"]["cut_mid_answer"] <= 1, router
    assert sum(router["goodput_per_s"][after_kill:]) > 0, router
    # The worker node dies with a classifier replica and the generator, the routers (on the head,
    # the ingress node) live on: no request is lost, the app goes on answering (back to full rate
    # within 30 s is the benchmark's claim, not CI's), and every stream the node cut ends with an
    # error event and [DONE].
    node = phases["node"]
    assert node["fault"]["replicas_on_it"]["gpt"] and not node["fault"]["replicas_on_it"]["router"], node["fault"]
    assert node["lost"] == nothing_lost and sum(node["goodput_per_s"][int(node["fault_in_window_s"]) + 1 :]) > 0, node
    assert node["streams"]["started"] > 0 and node["streams"]["cut_without_done"] == 0, node["streams"]
