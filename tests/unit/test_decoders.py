"""The router's image decoder processes and the pacing of background work, without Ray: real
worker processes over real sockets."""

from __future__ import annotations

import asyncio
import base64
import io
import mmap
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from serve_app.contract import Priority
from serve_app.errors import InvalidInput, ModelFailure
from serve_app.link.client import LinkedSender
from serve_app.process import cpu_priority
from serve_app.process.cpu_priority import BusyFlag, Pacer
from serve_app.protocols import decoders, images, v2
from serve_app.protocols.decoders import DecoderPool
from serve_app.router.endpoints import codecs
from serve_app.router.endpoints.endpoints_status import _transport
from serve_app.router.routing.dispatchers import MarkedSender

LINUX = sys.platform.startswith("linux")
ROOT = Path(__file__).resolve().parents[2]


def _png(rgb: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def _noisy(side: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (side, side, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def pool() -> Iterator[DecoderPool]:
    p = DecoderPool(workers=2)
    yield p
    p.shutdown()


def test_processes_decode_what_the_router_would(pool: DecoderPool) -> None:
    pngs = [_png(_noisy(40, i)) for i in range(3)]
    # Binary-extension elements are views of the body; JSON's are base64.
    values: list[bytes | memoryview | str] = [memoryview(pngs[0]), pngs[1], base64.b64encode(pngs[2]).decode()]
    got = asyncio.run(pool.decode(values, 16))
    np.testing.assert_array_equal(got, images.decode_images(pngs, 16))
    assert len(pool.pids()) == 1  # one request at a time here: one worker was enough


def test_without_memfd_the_images_go_through_the_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decoders, "MEMFD", False)  # the router's side; the worker follows the header
    # Noise hardly compresses: each PNG is far larger than a socket's buffers.
    pngs = [_png(_noisy(600, i)) for i in range(2)]
    p = DecoderPool()
    try:
        assert min(len(b) for b in pngs) > 2**20
        np.testing.assert_array_equal(asyncio.run(p.decode(pngs, 8)), images.decode_images(pngs, 8))
    finally:
        p.shutdown()


def test_bad_images_are_a_400_with_the_same_words_across_the_process_boundary(pool: DecoderPool) -> None:
    with pytest.raises(InvalidInput, match=r"image 1: not a PNG or JPEG image"):
        asyncio.run(pool.decode([_png(_noisy(8)), b"GIF89a..."], 8))
    with pytest.raises(InvalidInput, match=r"image 0: a BYTES image in JSON must be base64"):
        asyncio.run(pool.decode(["not base64!"], 8))


@pytest.mark.skipif(not LINUX, reason="scheduling classes are Linux's")
def test_workers_run_in_the_background(pool: DecoderPool) -> None:
    asyncio.run(pool.decode([_png(_noisy(8))], 8))
    for pid in pool.pids():
        assert os.sched_getscheduler(pid) == os.SCHED_IDLE


def test_the_event_loop_runs_while_a_worker_decodes(pool: DecoderPool) -> None:
    values: list[bytes | memoryview | str] = [_png(_noisy(1024, 5))] * 2

    async def go() -> int:
        ticks = 0
        decoding = asyncio.ensure_future(pool.decode(values, 32))
        while not decoding.done():
            ticks += 1
            await asyncio.sleep(0.001)
        assert (await decoding).shape == (2, 3, 32, 32)
        return ticks

    assert asyncio.run(go()) >= 3


def test_a_dead_worker_costs_no_request(pool: DecoderPool) -> None:
    """A worker killed between requests is found dead by the next one, which goes to a new worker."""
    asyncio.run(pool.decode([_png(_noisy(8))], 8))
    (old,) = pool.pids()
    os.kill(old, signal.SIGKILL)
    restarts = pool.restarts
    assert asyncio.run(pool.decode([_png(_noisy(8))], 8)).shape == (1, 3, 8, 8)
    assert pool.restarts == restarts + 1 and old not in pool.pids()


def test_a_worker_error_that_is_not_the_inputs_is_a_500(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's own loop, on a thread over a socket pair: a failure that is not the input's
    comes back as a 500 with the exception's type, and the worker serves the next request."""

    def failing(blobs: Any, size: int, resize: int | None = None) -> np.ndarray:
        if bytes(blobs[0]) == b"boom":
            raise MemoryError("no room")
        return images.decode_images(blobs, size, resize)

    monkeypatch.setattr(decoders, "decode_images", failing)
    monkeypatch.setattr(decoders, "lower_thread_priority", lambda: None)  # this test's own thread
    router, worker = socket.socketpair()
    thread = threading.Thread(target=decoders.serve, args=(worker,), daemon=True)
    thread.start()
    handle = object.__new__(decoders.DecoderWorker)
    handle.sock = router
    ok, error = handle.call([b"boom"], 8)
    assert not ok and isinstance(error, ModelFailure) and "MemoryError" in str(error)
    ok, pixels = handle.call([_png(_noisy(8))], 8)
    assert ok and pixels.shape == (1, 3, 8, 8)
    router.close()  # the worker's loop ends with the router's end
    thread.join(timeout=10)
    assert not thread.is_alive()
    worker.close()


def test_without_a_worker_process_the_router_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    def cannot_start(self: decoders.DecoderWorker) -> None:
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(decoders.DecoderWorker, "__init__", cannot_start)
    p = DecoderPool()
    try:
        assert asyncio.run(p.decode([_png(_noisy(8))], 8)).shape == (1, 3, 8, 8)
        assert p.pids() == []
    finally:
        p.shutdown()


def test_workers_end_when_their_router_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "router.py"
    script.write_text(
        textwrap.dedent(
            """
            import asyncio, io, os, signal
            import numpy as np
            from PIL import Image
            from serve_app.protocols.decoders import DECODERS

            async def main():
                buf = io.BytesIO()
                Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(buf, format="PNG")
                await DECODERS.decode([buf.getvalue()], 8)
                print(*DECODERS.pids(), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

            if __name__ == "__main__":
                asyncio.run(main())
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60)
    workers = [int(pid) for pid in done.stdout.split()]
    assert workers, done.stderr
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in workers)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has ended; only its parent (init, here) has yet to reap it.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_pacer_naps_once_per_interval_of_wall_time() -> None:
    now = [0.0]
    naps: list[float] = []
    pacer = Pacer(every_s=0.001, nap_s=0.00002, clock=lambda: now[0], sleep=naps.append)
    for _ in range(10):  # 0.3 ms between calls: a nap at 1.2 ms, 2.4 ms
        now[0] += 0.0003
        pacer.pace()
    assert naps == [0.00002, 0.00002] and pacer.naps == 2


def test_a_large_png_decodes_in_small_blocks_with_naps(monkeypatch: pytest.MonkeyPatch) -> None:
    pacers: list[Pacer] = []

    def eager(busy: Callable[[], bool] | None = None) -> Pacer:  # naps at every read, and records them
        pacers.append(Pacer(every_s=0.0, sleep=lambda _: None, busy=busy))
        return pacers[-1]

    monkeypatch.setattr(images, "Pacer", eager)
    img = images._open(_png(_noisy(1024, 7)), 0)
    assert getattr(img, "decodermaxblock") == images.PACED_BLOCK  # noqa: B009  # Image.open gives an ImageFile
    img.load()
    # About 3 MB of noise compresses to about as much: many blocks, a chance to nap before each.
    assert pacers[-1].naps > 3 * 2**20 // images.PACED_BLOCK // 2


def test_pacer_waits_at_any_call_while_busy_and_within_its_limits() -> None:
    now = [0.0]
    busy = [True]

    def sleep(s: float) -> None:
        now[0] += s
        if now[0] >= 0.003:  # the urgent work ends 3 ms in
            busy[0] = False

    pacer = Pacer(
        every_s=0.001, clock=lambda: now[0], sleep=sleep, busy=lambda: busy[0], max_yield_s=0.005, max_yield_total_s=0.010
    )
    pacer.pace()  # no nap is due yet, but urgent work is running: the work waits for it
    assert 0.003 <= now[0] < 0.0032 and pacer.yields == 1 and pacer.naps == 0
    waited = now[0]
    pacer.pace()  # neither busy nor due: the work goes on
    assert now[0] == waited and pacer.yields == 1 and pacer.naps == 0
    pacer.busy = lambda: True  # urgent work that never ends: each wait stops at its limit
    for expected in (0.005, 0.010 - waited - 0.005):  # then the total's rest: 10 ms in all
        start = now[0]
        pacer.pace()
        assert now[0] - start == pytest.approx(expected, abs=2e-4)
    assert pacer.yields == 3
    start = now[0]
    pacer.pace()  # nothing left to wait, and the nap's interval has not passed since the last wait
    assert now[0] == start and pacer.naps == 0
    now[0] += 0.0011
    pacer.pace()  # a plain nap
    assert pacer.naps == 1 and pacer.yields == 3


def test_runnable_tasks_are_loadavgs_fourth_field() -> None:
    assert cpu_priority.runnable_tasks(b"0.52 0.41 0.30 3/120 4242\n") == 3
    assert cpu_priority.runnable_tasks(b"12.00 9.10 8.00 17/2048 1\n") == 17


@pytest.mark.parametrize(
    ("content", "taken"),
    [
        (b"1.0 1.0 1.0 3/120 1\n", True),  # the caller and two others
        (b"1.0 1.0 1.0 2/120 1\n", True),  # the caller and one other: no core left for a task that wakes
        (b"1.0 1.0 1.0 1/120 1\n", False),  # the caller alone: a core free
        (b"not a loadavg\n", True),  # unreadable: yield as if taken
        (b"0.00 0.00 0.00 0/0 0\n", True),  # a sandbox's made-up count (gVisor): a real one counts the reader
    ],
)
def test_cores_taken_leaves_a_core_free(tmp_path: Path, content: bytes, taken: bool) -> None:
    loadavg = tmp_path / "loadavg"
    loadavg.write_bytes(content)
    assert cpu_priority.cores_taken(cpus=2, path=str(loadavg))() is taken


def test_cores_taken_rereads_the_count_at_every_call(tmp_path: Path) -> None:
    loadavg = tmp_path / "loadavg"
    loadavg.write_bytes(b"1.0 1.0 1.0 5/120 1\n")
    taken = cpu_priority.cores_taken(cpus=4, path=str(loadavg))
    assert taken()
    loadavg.write_bytes(b"1.0 1.0 1.0 3/120 1\n")  # same length, read from the start again
    assert not taken()


def test_without_a_count_every_core_is_taken(tmp_path: Path) -> None:
    assert cpu_priority.cores_taken(path=str(tmp_path / "absent"))()


def _real_count() -> int:
    with open(cpu_priority.LOADAVG, "rb") as f:
        return cpu_priority.runnable_tasks(f.read())


@pytest.mark.skipif(not os.path.exists(cpu_priority.LOADAVG) or _real_count() < 1, reason="no real /proc/loadavg")
def test_this_machines_count_is_read() -> None:
    assert cpu_priority.cores_taken(cpus=100_000)() is False  # more cores than tasks: one is free
    assert cpu_priority.cores_taken(cpus=1)() is True  # the reader itself takes the one core


@pytest.mark.parametrize(
    ("files", "limit"),
    [
        ({"cpu.max": "400000 100000\n"}, 4.0),  # cgroup v2, a pod's `limits.cpu: 4`
        ({"cpu.max": "150000 100000\n"}, 1.5),
        ({"cpu.max": "max 100000\n"}, None),  # no limit
        ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.0),  # cgroup v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),  # no cgroup files at all
    ],
)
def test_cgroup_cpu_limit(tmp_path: Path, files: dict[str, str], limit: float | None) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpu_priority.cgroup_cpu_limit(str(tmp_path)) == limit


def test_usable_cores_follow_a_containers_limit(tmp_path: Path) -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    assert cpu_priority.usable_cores(str(tmp_path)) == cores  # no limit: the affinity
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a core: one, rounded up
    assert cpu_priority.usable_cores(str(tmp_path)) == 1
    (tmp_path / "cpu.max").write_text(f"{(cores + 8) * 100000} 100000\n")  # above the affinity: the affinity
    assert cpu_priority.usable_cores(str(tmp_path)) == cores


def test_a_decoder_waits_only_while_its_router_is_busy_and_the_cores_are_taken() -> None:
    flag, taken, asked = [True], [False], []

    def cores() -> bool:
        asked.append(flag[0])
        return taken[0]

    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    busy = cpu_priority.when_contended(lambda: flag[0], cores)
    pacer = Pacer(every_s=1.0, clock=lambda: now[0], sleep=sleep, busy=busy, max_yield_s=0.005)
    pacer.pace()  # urgent work in flight, but a core is free: no wait
    assert now[0] == 0.0 and pacer.yields == 0
    taken[0] = True
    pacer.pace()  # and now every core is taken: the decoder waits, up to its limit
    assert now[0] == pytest.approx(0.005, abs=2e-4) and pacer.yields == 1
    flag[0], asked[:] = False, []
    pacer.pace()  # nothing urgent: the count is not even read
    assert asked == [] and pacer.yields == 1


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd is Linux's")
@pytest.mark.parametrize("taken", [False, True])
def test_a_worker_yields_to_its_routers_flag_only_on_taken_cores(monkeypatch: pytest.MonkeyPatch, taken: bool) -> None:
    monkeypatch.setattr(images, "yield_while", None)  # restored after: serve sets it for the process
    monkeypatch.setattr(decoders, "lower_thread_priority", lambda: None)  # this test's own thread
    monkeypatch.setattr(decoders, "cores_taken", lambda: lambda: taken)
    flag = BusyFlag()
    fd = flag.fd()
    assert fd is not None
    router, worker = socket.socketpair()
    router.close()  # the worker's loop ends at once; what it set up stays
    decoders.serve(worker, fd)
    worker.close()
    busy = images.yield_while
    assert busy is not None and busy() is False  # nothing in flight
    with flag.held():
        assert busy() is taken


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd is Linux's")
def test_busy_flag_is_seen_by_a_child_while_any_batch_is_out() -> None:
    flag = BusyFlag()
    with flag.held():  # held before the file exists: the file starts busy
        fd = flag.fd()
        assert fd is not None
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(fd)], pass_fds=[fd], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "True"
        with flag.held():
            pass  # a second batch ending leaves the first one's mark
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "True"
    child.stdin.write("\n")
    child.stdin.flush()
    assert child.stdout.readline().strip() == "False"
    child.stdin.close()
    assert child.wait(timeout=10) == 0


CHILD = """
import sys
from serve_app.process.cpu_priority import busy_reader
busy = busy_reader(int(sys.argv[1]))
for _ in range(3):
    print(busy(), flush=True)
    sys.stdin.readline()
"""


def test_batches_out_mark_the_routers_model_work() -> None:
    seen: list[int] = []

    async def send(payloads: list[Any], queued: int, lane: str, traces: list[str | None] | None) -> Any:
        seen.append(cpu_priority.MODEL_WORK.count)
        return "reply"

    marked = MarkedSender(send)
    assert asyncio.run(marked([1], 0, "bulk", None)) == "reply"
    assert seen == [1] and cpu_priority.MODEL_WORK.count == 0


def test_classifications_but_encoded_images_mark_the_routers_model_work() -> None:
    text, image = codecs.TEXT_CLASSIFIER, codecs.IMAGE_CLASSIFIER

    def body(name: str, shape: list[int], datatype: str, data: list[Any]) -> v2.InferRequest:
        return v2.request_of({"inputs": [{"name": name, "shape": shape, "datatype": datatype, "data": data}]})

    texts = body("text", [1], "BYTES", ["a review"])
    pixels = body("image", [1, 3, 2, 2], "UINT8", [0] * 12)
    pngs = body("image", [1], "BYTES", ["not decoded here"])
    cases = [(text, texts, Priority.NORMAL, 1), (image, pixels, Priority.HIGH, 1), (image, pngs, Priority.HIGH, 0)]
    cases.append((text, texts, Priority.LOW, 0))  # low priority's text yields to images of any class
    for codec, request, priority, held in cases:
        with codecs.urgent(codec, request, priority):
            assert cpu_priority.MODEL_WORK.count == held
        assert cpu_priority.MODEL_WORK.count == 0


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd is Linux's")
def test_a_request_cancelled_inside_the_flag_leaves_it_clear() -> None:
    flag = BusyFlag()
    fd = flag.fd()
    assert fd is not None and flag.fd() == fd  # made once
    view = mmap.mmap(fd, 1, prot=mmap.PROT_READ)
    entered = asyncio.Event()

    async def request() -> None:
        with flag.held(), flag.held():  # a batch out inside its request's hold
            entered.set()
            await asyncio.sleep(60)

    async def go() -> None:
        task = asyncio.create_task(request())
        await entered.wait()
        assert flag.count == 2 and view[0] == 1
        task.cancel()  # the client left, or the call's time limit passed
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert flag.count == 0 and view[0] == 0
    view.close()


def test_a_requests_images_share_one_limit_on_their_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Pacer] = []

    def recorded(busy: Callable[[], bool] | None = None) -> Pacer:
        made.append(Pacer(busy=busy))
        return made[-1]

    monkeypatch.setattr(images, "Pacer", recorded)
    pixels = images.decode_images([_png(_noisy(64, s)) for s in range(5)], 32)
    assert pixels.shape == (5, 3, 32, 32) and len(made) == 1
    # A request's waits for urgent work leave most of the router's time limit for its decoding.
    assert cpu_priority.MAX_YIELD_TOTAL_S * 4 <= decoders.CALL_TIMEOUT_S


def test_the_status_page_sees_the_link_under_the_marking() -> None:
    class Linked(LinkedSender):
        def __init__(self) -> None:  # no handle, no node: only what the status page reads
            pass

        def snapshot(self) -> dict[str, Any]:
            return {"over_link": 3}

    assert _transport(MarkedSender(Linked())) == {"over_link": 3}
    assert _transport(MarkedSender(lambda *_: None)) is None  # type: ignore[arg-type]


def test_a_models_resize_then_centre_crop_is_torchvisions_and_reaches_the_worker() -> None:
    """`image.resize` (from preprocessor_config.json, say): the shorter side to 24, then the
    centre 16x16, as torchvision's Resize(24) + CenterCrop(16); the decoder process does the same."""
    wide = np.ascontiguousarray(_noisy(40)[:20])  # 20 rows, 40 columns
    png = _png(wide)
    expected = Image.fromarray(wide).resize((48, 24), Image.Resampling.BILINEAR).crop((16, 4, 32, 20))
    got = images.decode_images([png], 16, resize=24)
    np.testing.assert_array_equal(got[0], np.asarray(expected).transpose(2, 0, 1))
    pool = decoders.DecoderPool(1)
    try:
        np.testing.assert_array_equal(asyncio.run(pool.decode([png], 16, 24)), got)
    finally:
        pool.shutdown()
