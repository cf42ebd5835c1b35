"""The load generator against a small local HTTP server (no Ray): both modes,
content-length and chunked bodies, status and X-Served-By accounting."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import loadgen, workloads
from serve_app.manifest import Manifest


def _serve(loop: asyncio.AbstractEventLoop, ready: threading.Event, port_box: list[int]) -> None:
    asyncio.set_event_loop(loop)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answered = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                path = head.split(b" ")[1]
                if path.startswith(b"/reload") and answered:  # lets go of a kept-alive connection mid-request
                    writer.close()
                    return
                if path.startswith(b"/reset"):  # never answers, even on a new connection
                    writer.close()
                    return
                answered += 1
                if path.startswith(b"/chunked"):
                    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Served-By: light\r\n\r\n"
                                 b"5\r\nhello\r\n0\r\n\r\n")  # fmt: skip
                elif path.startswith(b"/slow"):  # a stream the server answers slowly
                    await asyncio.sleep(1.0)
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                elif path.startswith(b"/busy"):
                    writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\nRetry-After: 1\r\n\r\nbusy")
                elif path.startswith(b"/rude"):  # a refusal that does not say when to come back
                    writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nrude")
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Served-By: heavy\r\n"
                                 b"Server-Timing: queue;dur=1.5, model;dur=2, total;dur=4.25\r\n\r\nok")  # fmt: skip
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def start() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port_box.append(server.sockets[0].getsockname()[1])
        ready.set()

    loop.run_until_complete(start())
    loop.run_forever()


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    loop, ready = asyncio.new_event_loop(), threading.Event()
    port: list[int] = []
    threading.Thread(target=_serve, args=(loop, ready, port), daemon=True).start()
    assert ready.wait(5)
    yield f"http://127.0.0.1:{port[0]}"
    loop.call_soon_threadsafe(loop.stop)


def _workload(tmp_path: Path) -> Path:
    return workloads.write(
        [
            workloads.StreamSpec("plain", "/infer", [{"x": 1}], weight=2),
            workloads.StreamSpec("chunked", "/chunked", [{"x": 2}], weight=1),
            workloads.StreamSpec("busy", "/busy", [{"x": 3}], weight=1, headers={"X-Priority": "low"}),
            workloads.StreamSpec("rude", "/rude", [{"x": 4}], weight=1),
        ],
        tmp_path / "w.json",
    )


def test_closed_loop_counts_every_status_and_model(server_url: str, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = ["--url", server_url, "--workload", str(_workload(tmp_path)), "--concurrency", "4",
            "--seconds", "1.5", "--warmup", "0.2", "--out", str(out), "--raw"]  # fmt: skip
    assert loadgen.main(argv) == 0
    r = json.loads(out.read_text())
    assert r["mode"] == "closed" and 0 < r["requests"] <= len(r["records"])
    assert set(r["streams"]) == {"plain", "chunked", "busy", "rude"}
    # Refusals are told apart by whether they say when to retry.
    assert r["streams"]["busy"]["refused_without_retry_after"] == 0 < r["streams"]["busy"]["requests"]
    assert r["streams"]["rude"]["refused_without_retry_after"] == r["streams"]["rude"]["requests"] > 0
    assert r["streams"]["busy"]["statuses"] == {"503": r["streams"]["busy"]["requests"]}
    assert r["streams"]["chunked"]["served_by"] == {"light": r["streams"]["chunked"]["requests"]}
    assert r["served_by"]["heavy"] == r["streams"]["plain"]["requests"]
    # goodput leaves the 503s out; latency percentiles are over 2xx answers only
    assert r["goodput_rps"] < r["throughput_rps"]
    assert r["p50_ms"] is not None and r["p50_ms"] <= r["p99_ms"]
    # Process CPU over wall time: the fake server shares this process, so the share only has to
    # be a real measurement (positive, at most the machine), not small.
    assert 0 < r["loadgen_cpu"]["core_share"] <= (os.cpu_count() or 1) + 0.1
    assert len(r["records"]) == r["requests"]
    # Server-Timing splits a plain answer's latency into the server's 4.25 ms and the rest.
    plain = r["streams"]["plain"]
    assert plain["server_ms"] == {"p50": 4.25, "p99": 4.25}
    assert plain["outside_server_ms"]["p50"] == pytest.approx(plain["p50_ms"] - 4.25, abs=0.01)
    assert "server_ms" not in r["streams"]["chunked"]  # no header, no split
    # Raw records carry every Server-Timing metric, for where a tail's time went.
    parts = {rec[0]: rec[7] for rec in r["records"]}
    assert parts["plain"] == {"queue": 1.5, "model": 2.0, "total": 4.25} and parts["chunked"] is None


def test_a_record_reads_its_server_timing_header_when_asked() -> None:
    timed = loadgen.Record("a", 0.1, 4.0, 200, "m", timing_header=" queue;dur=0.5, total;dur=3.25")
    assert timed.server_parts == {"queue": 0.5, "total": 3.25}
    assert timed.server_ms == 3.25
    untimed = loadgen.Record("a", 0.1, 4.0, 200, "m")
    assert untimed.server_parts is None and untimed.server_ms is None


def test_server_timing_total_is_read_from_any_position() -> None:
    assert loadgen.server_timing("total;dur=12.5").get("total") == 12.5
    assert loadgen.server_timing('queue;dur=1, total;desc="all";dur=3').get("total") == 3.0
    assert loadgen.server_timing("queue;dur=1").get("total") is None
    assert loadgen.server_timing("total;dur=abc").get("total") is None
    assert loadgen.server_timing('queue;dur=1, model;desc="m";dur=2.5, cache, total;dur=x') == {"queue": 1.0, "model": 2.5}


def test_open_loop_rate_and_warmup_exclusion(server_url: str, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = ["--url", server_url, "--workload", str(_workload(tmp_path)), "--rate", "200",
            "--seconds", "1.0", "--warmup", "0.3", "--out", str(out), "--raw"]  # fmt: skip
    assert loadgen.main(argv) == 0
    r = json.loads(out.read_text())
    assert r["mode"] == "open" and r["client_dropped"] == 0
    assert 120 <= r["requests"] <= 300  # Poisson around 200/s for 1 s
    assert all(0 <= rec[1] <= 1.0 for rec in r["records"])  # send times inside the measured window


def test_in_flight_cap_is_per_stream(server_url: str, tmp_path: Path) -> None:
    """A stream the server answers slowly fills its own cap, not the other stream's: the
    client must not drop the fast stream's arrivals on the flood's account."""
    workload = workloads.write(
        [
            # Fine's share of the rate is so small that all its arrivals together stay under the
            # cap: however long this machine stalls the test server, fine cannot fill it itself.
            workloads.StreamSpec("flood", "/slow", [{"x": 1}], weight=9),
            workloads.StreamSpec("fine", "/infer", [{"x": 2}], weight=1),
        ],
        tmp_path / "w.json",
    )
    out = tmp_path / "r.json"
    argv = ["--url", server_url, "--workload", str(workload), "--rate", "300", "--seconds", "0.6",
            "--warmup", "0.1", "--max-in-flight", "40", "--out", str(out)]  # fmt: skip
    assert loadgen.main(argv) == 0
    r = json.loads(out.read_text())
    flood, fine = r["streams"]["flood"], r["streams"]["fine"]
    assert flood["client_dropped"] > 50 and flood["requests"] <= 40
    assert fine["client_dropped"] == 0 and fine["statuses"] == {"200": fine["requests"]} and fine["requests"] > 10
    assert r["client_dropped"] == flood["client_dropped"]


def test_refused_connections_are_recorded_not_raised(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = ["--url", "http://127.0.0.1:9", "--workload", str(_workload(tmp_path)), "--concurrency", "2",
            "--seconds", "0.3", "--warmup", "0", "--out", str(out)]  # fmt: skip
    assert loadgen.main(argv) == 0
    r = json.loads(out.read_text())
    assert set(r["statuses"]) == {str(loadgen.STATUS_CONN_ERROR)} and r["goodput_rps"] == 0


def test_goodput_in_window_counts_what_arrived_in_it_whenever_it_was_sent() -> None:
    from benchmarks.loadgen import Record, Run, summarize

    run = Run(
        records=[
            Record("a", sent=0.5, latency_ms=200, status=200, served_by="m"),  # inside
            Record("a", sent=1.9, latency_ms=500, status=200, served_by="m"),  # answered after the window
            Record("a", sent=1.0, latency_ms=10, status=503, served_by=""),  # not good
        ],
        carried_in={"a": 3},  # warm-up requests answered inside the window
    )
    out = summarize(run, seconds=2.0)
    assert out["goodput_rps"] == 1.0  # 2 answers sent in the window, over 2 s
    assert out["goodput_in_window_rps"] == 2.0  # 1 + 3 carried in, over 2 s
    assert out["streams"]["a"]["goodput_in_window_rps"] == 2.0


def test_a_request_crossing_a_kept_alive_close_is_sent_again_once(server_url: str, tmp_path: Path) -> None:
    """The server closes each reused connection as the request arrives: every request is sent again
    on a new connection, answered, and counted; a connection that never answers stays a failure."""
    streams = [workloads.StreamSpec("reload", "/reload", [{"x": 1}]), workloads.StreamSpec("reset", "/reset", [{"x": 2}])]
    out = tmp_path / "r.json"
    argv = ["--url", server_url, "--workload", str(workloads.write(streams, tmp_path / "w.json")),
            "--concurrency", "2", "--seconds", "2", "--warmup", "0.1", "--out", str(out)]  # fmt: skip
    assert loadgen.main(argv) == 0
    res = json.loads(out.read_text())
    reload, reset = res["streams"]["reload"], res["streams"]["reset"]
    assert reload["statuses"] == {"200": reload["requests"]} and reload["requests"] > 0
    assert reset["statuses"] == {str(loadgen.STATUS_CONN_ERROR): reset["requests"]} and reset["requests"] > 0
    # Only requests on a connection that had answered before are sent again, each once at most.
    assert 0 < res["stale_connection_retries"] <= res["requests"]


def test_retry_after_is_read_as_seconds() -> None:
    assert loadgen.retry_after_s(" 2 ") == 2.0 and loadgen.retry_after_s("1.5") == 1.5
    assert loadgen.retry_after_s("Wed, 21 Oct 2026 07:28:00 GMT") == 1.0  # a date: one second


def test_clients_that_honor_retry_after_wait_before_sending_again(server_url: str, tmp_path: Path) -> None:
    # `/busy` refuses every request with Retry-After: 1. Four clients for 2.5 s: waiting, each sends
    # three times (at 0, 1 and 2 s; once or twice if the machine stalls); sending again at once,
    # they send as fast as the server answers, which on a loaded machine may be slow: compared
    # with the waiting clients, not with a rate.
    wl = workloads.write([workloads.StreamSpec("busy", "/busy", [{"x": 1}])], tmp_path / "w.json")
    sent = {}
    for honor in (True, False):
        out = tmp_path / f"{honor}.json"
        argv = ["--url", server_url, "--workload", str(wl), "--concurrency", "4", "--seconds", "2.5", "--warmup", "0",
                "--out", str(out), *(["--honor-retry-after"] if honor else [])]  # fmt: skip
        assert loadgen.main(argv) == 0
        result = json.loads(out.read_text())
        assert set(result["statuses"]) == {"503"}
        sent[honor] = result["requests"]
    assert 4 <= sent[True] <= 12 and sent[False] > 3 * sent[True], sent


def test_chaos_counts_lost_requests_from_raw_records_of_either_length() -> None:
    """Raw records gained Server-Timing's metrics at their end; consumers read the fields before it."""
    from benchmarks.chaos import lost, lost_requests

    old = [["good", 0.1, 5.0, 200, "m", 1.0, False], ["good", 0.2, 5.0, 503, "", None, False]]
    new = [[*r, {"total": 1.0}] for r in old] + [["good", 0.3, 30.0, 0, "", None, False, None]]
    assert lost(old, {"good"})["refused_without_retry_after"] == 1
    counts = lost(new, {"good"})
    assert counts["refused_without_retry_after"] == 1 and counts["no_answer"] == 1
    assert [r["status"] for r in lost_requests(new, {"good"})] == [503, 0]


def test_chaos_counts_an_answer_cut_after_its_head_apart_from_no_answer() -> None:
    """HAProxy can send a request again while no answer has begun, not once its head went out."""
    from benchmarks.chaos import CUT_MID_ANSWER, lost

    records = [
        ["good", 0.1, 5.0, -1, CUT_MID_ANSWER, None, None],
        ["good", 0.2, 5.0, -1, "error:ConnectionResetError", None, None],
        ["good", 0.3, 5.0, 0, "", None, None],
    ]
    counts = lost(records, {"good"})
    assert counts["cut_mid_answer"] == 1 and counts["no_answer"] == 2


def test_kept_answers_are_scored_against_the_true_labels_degraded_ones_apart() -> None:
    from benchmarks.loadgen import Record, Run, summarize

    def answer(label: str) -> bytes:
        return json.dumps({"outputs": [{"name": "logits", "data": [0.1, 0.9]}, {"name": "label", "data": [label]}]}).encode()

    run = Run(
        records=[
            Record("r", 0.1, 5, 200, "light", body=0, answer=answer("positive")),  # right
            Record("r", 0.2, 5, 200, "heavy", body=1, answer=answer("negative")),  # right
            Record("r", 0.3, 5, 200, "light|degraded", body=2, answer=answer("positive")),  # wrong, marked
            Record("r", 0.4, 5, 200, "light|degraded", body=1, answer=answer("negative")),  # right, marked
            Record("r", 0.5, 5, 503, "", body=0),  # refused: not scored
        ]
    )
    out = summarize(run, seconds=1.0, labels={"r": ["positive", "negative", "negative"]})
    assert out["scored"] == {
        "answers": 4, "accuracy": 0.75, "degraded": 2, "degraded_accuracy": 0.5, "unmarked_accuracy": 1.0,
    }  # fmt: skip
    assert out["streams"]["r"]["scored"]["degraded"] == 2
    assert "scored" not in summarize(run, seconds=1.0)  # no labels, no scoring


def test_a_stream_with_labels_keeps_its_answers_and_records_which_body_went(server_url: str, tmp_path: Path) -> None:
    spec = workloads.StreamSpec("ok", "/ok", [{"x": 1}, {"x": 2}], labels=["a", "b"])
    (stream,) = loadgen.load_streams(json.loads(workloads.write([spec], tmp_path / "w.json").read_text()), "h")
    assert stream.labels == ["a", "b"]
    stream.next_request()
    assert stream.last_body == 0
    stream.next_request()
    assert stream.last_body == 1


@pytest.mark.parametrize("model", ["bert-light", "resnet-light"])
def test_a_load_stream_cycles_a_thousand_distinct_held_out_inputs_with_the_cache_off(tiny_model_dir: Path, model: str):
    spec = workloads.v2_infer(model, tiny_model_dir / model, "low", scored=True)
    assert len({json.dumps(b, sort_keys=True) for b in spec.bodies}) >= workloads.DISTINCT_INPUTS
    assert spec.headers == {"Cache-Control": "no-cache", "X-Priority": "low"}
    assert spec.labels is not None and len(spec.labels) == len(spec.bodies)
    if model == "bert-light":  # each text's label is the held-out split's label of that text
        texts, truth = workloads.held_out_texts(len(spec.bodies))
        names = Manifest.load(tiny_model_dir / model).labels
        assert [b["inputs"][0]["data"][0] for b in spec.bodies] == texts
        assert spec.labels == [names[t] for t in truth]
