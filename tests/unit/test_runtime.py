import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from serve_app.models.runtime import create_session
from serve_app.process.cpu_priority import is_background, lower_thread_priority

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")


@linux_only
def test_background_session_threads_run_at_the_lowest_priority(tiny_model_dir):
    path = tiny_model_dir / "resnet-heavy" / "model.onnx"
    before = {int(t) for t in os.listdir("/proc/self/task")}
    normal = create_session(path, ["CPUExecutionProvider"], threads=2, spinning=False)
    normal_threads = {int(t) for t in os.listdir("/proc/self/task")} - before
    background = create_session(path, ["CPUExecutionProvider"], threads=2, spinning=False, background=True)
    background_threads = {int(t) for t in os.listdir("/proc/self/task")} - before - normal_threads
    assert background_threads, "a 2-thread session starts a pool thread"
    assert all(is_background(t) for t in background_threads)
    assert normal_threads and not any(is_background(t) for t in normal_threads)
    image = np.zeros((1, 3, 32, 32), dtype=np.float32)
    np.testing.assert_allclose(background.run(None, {"image": image})[0], normal.run(None, {"image": image})[0])


def test_one_session_answers_calls_from_two_threads_at_once_as_it_answers_them_one_by_one(tiny_model_dir):
    """The urgent lane runs two batches at once on its one session (serve_app.models.classifier)."""
    session = create_session(tiny_model_dir / "resnet-heavy" / "model.onnx", ["CPUExecutionProvider"], threads=1)
    images = [np.random.default_rng(seed).random((2, 3, 32, 32), dtype=np.float32) for seed in (1, 2)]
    alone = [session.run(None, {"image": image})[0] for image in images]
    together: list[np.ndarray] = [np.empty(0), np.empty(0)]
    both = threading.Barrier(2)

    def call(i: int) -> None:
        both.wait()
        for _ in range(20):
            together[i] = session.run(None, {"image": images[i]})[0]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, want in zip(together, alone, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)


@linux_only
def test_lower_thread_priority_changes_only_the_calling_thread():
    seen: dict[str, int] = {}

    def worker() -> None:
        lower_thread_priority()
        seen["worker"] = is_background(threading.get_native_id())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["worker"] is True
    assert not is_background(threading.get_native_id())


RENICE_PROBE = """
import json, os, threading
from serve_app.process.cpu_priority import renice_process

def ask(out):
    out["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

idle = threading.Event()
running = threading.Thread(target=idle.wait)
running.start()
target = min(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + 2, 19)
renice_process(target)
existing = os.getpriority(os.PRIO_PROCESS, running.native_id or 0)
later = {}
t = threading.Thread(target=ask, args=(later,))
t.start()
t.join()
idle.set()
running.join()
print(json.dumps({"existing": existing, "later": later["nice"], "target": target}))
"""


@linux_only
def test_renice_process_lowers_every_thread_including_later_ones():
    # In a fresh process: niceness cannot be raised back without privilege, and forking this
    # one (threads and all) can deadlock the child.
    done = subprocess.run([sys.executable, "-c", RENICE_PROBE], capture_output=True, text=True, timeout=60, check=True)
    out = json.loads(done.stdout)
    assert out["existing"] == out["later"] == out["target"]
