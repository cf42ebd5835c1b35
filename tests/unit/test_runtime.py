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
