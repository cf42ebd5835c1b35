"""Image decoding in worker processes of the router's own.

A request of large PNGs takes long to decode. In threads of the router's process
the decoders hold the router's GIL between Pillow's blocks, and a decoder that the kernel has set
aside (it runs under SCHED_IDLE) then holds up the event loop of every other request. In worker
processes the loop shares no lock with them; the workers run under SCHED_IDLE and nap often
(serve_app.process.cpu_priority.Pacer), so they take the cycles the requests around them leave.

Each worker is a child process with one end of a socket pair. For each request the router's I/O
thread copies the encoded images into an anonymous memory file (`memfd_create`; numpy copies
without holding the GIL), passes the worker its descriptor, and reads back the pixels or the
error. The file has no name and is freed when both ends close it, so a router or worker that dies
leaves nothing behind; a worker ends when its socket closes, so none outlives its router. Where
there is no memfd (not Linux), the images go through the socket itself.

The workers also see whether the router has latency-sensitive work in flight
(cpu_priority.MODEL_WORK: model batches out, other classifications being handled). They wait
between blocks while it does and they would take the last free core they may run on, up to a
limit per request (cpu_priority.MAX_YIELD_TOTAL_S): they share SCHED_IDLE with the models' bulk
lanes, and would otherwise take half a core from a batch beside them. With cores to spare (a node
of many cores, or models on a GPU) they go on decoding; a container counts only the cores its CPU
limit gives it (cpu_priority.usable_cores).

Run as `python -m serve_app.protocols.decoders SOCKET_FD [BUSY_FD]`: a worker.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import mmap
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from serve_app.errors import InvalidInput, ModelFailure
from serve_app.process.cpu_priority import MODEL_WORK, busy_reader, cores_taken, lower_thread_priority, when_contended
from serve_app.protocols import images
from serve_app.protocols.images import decode_images, encoded

logger = logging.getLogger("ray.serve")

LENGTH = struct.Struct("!Q")
MEMFD = hasattr(os, "memfd_create")  # Linux
# A call still unanswered after this has a worker stuck on something no request should cost
# (MAX_REQUEST_PIXELS bounds an honest request's decoding far below it): the worker is replaced.
CALL_TIMEOUT_S = 30.0


class WorkerDied(ConnectionError):
    """The worker's socket closed under a call: the worker is gone."""


def _send_frame(sock: socket.socket, body: Any) -> None:
    data = pickle.dumps(body, protocol=5)
    sock.sendall(LENGTH.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise WorkerDied("end of stream")
        got += k
    return buf


def _recv_frame(sock: socket.socket) -> Any:
    (length,) = LENGTH.unpack(_recv_exact(sock, LENGTH.size))
    return pickle.loads(_recv_exact(sock, length))


def _in_memory_file(blobs: Sequence[bytes | memoryview], total: int) -> int:
    """A new anonymous memory file holding `blobs` end to end; the caller closes the descriptor."""
    fd = os.memfd_create("serve-app-images", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, max(1, total))
        with mmap.mmap(fd, max(1, total)) as mapped:
            target, start = np.frombuffer(mapped, dtype=np.uint8), 0
            try:
                for blob in blobs:
                    target[start : start + len(blob)] = np.frombuffer(blob, dtype=np.uint8)  # without the GIL
                    start += len(blob)
            finally:
                del target  # the map closes only once no view of it is left
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_request(sock: socket.socket) -> tuple[list[memoryview], int, int | None, mmap.mmap | None]:
    """A request's images (views of the file the router passed, or read from the socket), the
    model's input size and resize, and the file's map (for the caller to close once they are decoded)."""
    data, fds, _, _ = socket.recv_fds(sock, LENGTH.size, 1)
    if not data:
        raise WorkerDied("end of stream")
    (with_file,) = LENGTH.unpack(bytes(data) + _recv_exact(sock, LENGTH.size - len(data)))
    lengths, size, resize = _recv_frame(sock)
    if not with_file:
        return [memoryview(_recv_exact(sock, n)) for n in lengths], size, resize, None
    if len(fds) != 1:  # the descriptor did not arrive (this process is out of them, say)
        for fd in fds:
            os.close(fd)
        raise WorkerDied("no file descriptor with the request")
    (fd,) = fds
    try:
        mapped = mmap.mmap(fd, max(1, sum(lengths)), prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    whole = memoryview(mapped)
    bounds = np.cumsum([0, *lengths]).tolist()
    return [whole[a:b] for a, b in itertools.pairwise(bounds)], size, resize, mapped


class DecoderWorker:
    """One worker process, and the router's end of its socket. Used by one thread at a time."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        ours.settimeout(CALL_TIMEOUT_S)
        fds = [theirs.fileno()]
        if (busy := MODEL_WORK.fd()) is not None:
            fds.append(busy)
        # The router's own import path: the worker imports this module as the router did (and, with
        # -P, nothing from its working directory).
        path = os.pathsep.join(p for p in sys.path if isinstance(p, str) and p)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-P", "-m", __name__, *map(str, fds)],
                pass_fds=fds,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONPATH": path},
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours

    def call(self, blobs: Sequence[bytes | memoryview], size: int, resize: int | None = None) -> tuple[bool, Any]:
        """(True, pixels) or (False, the exception the worker raised); WorkerDied if it is gone."""
        lengths = [len(b) for b in blobs]
        fd = None
        if MEMFD:
            try:
                fd = _in_memory_file(blobs, sum(lengths))
            except OSError:  # no memory file here (a descriptor limit, a sandbox): through the socket
                logger.warning("no memory file for the images; sending them through the socket", exc_info=True)
        try:
            if fd is not None:
                socket.send_fds(self.sock, [LENGTH.pack(1)], [fd])
            else:
                self.sock.sendall(LENGTH.pack(0))
            _send_frame(self.sock, (lengths, size, resize))
            if fd is None:
                for blob in blobs:
                    self.sock.sendall(blob)  # from the body itself: no copy in this process
            ok, value = _recv_frame(self.sock)
        except OSError as e:  # a reset, a broken pipe, or no answer in time: the worker is lost
            raise WorkerDied(str(e)) from e
        finally:
            if fd is not None:
                os.close(fd)  # the worker holds its own descriptor once sent
        return ok, value

    def close(self) -> None:
        self.sock.close()
        self.proc.kill()
        self.proc.wait()


class DecoderPool:
    """Up to `workers` decoder processes, started as requests first need them. One I/O thread per
    worker feeds it; a request waits for a free thread."""

    def __init__(self, workers: int = 2) -> None:
        self.workers = workers
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="image-decode", initializer=lower_thread_priority)
        self._idle: list[DecoderWorker] = []
        self._lock = threading.Lock()
        self.restarts = 0  # workers found dead and replaced

    async def decode(self, values: Sequence[bytes | memoryview | str], size: int, resize: int | None = None) -> np.ndarray:
        """A request's images as uint8 (N, 3, size, size); `resize`: images.decode_images's."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, self._decode, values, size, resize)

    def _decode(self, values: Sequence[bytes | memoryview | str], size: int, resize: int | None) -> np.ndarray:
        blobs = [encoded(v, i) for i, v in enumerate(values)]  # base64 is decoded here, off the loop
        for _ in range(2):
            try:
                worker = self._take()
            except OSError:  # no process could start (a process limit, say): the images still decode
                logger.warning("no image decoder process could start; decoding in the router", exc_info=True)
                return decode_images(blobs, size, resize)
            try:
                ok, value = worker.call(blobs, size, resize)
            except WorkerDied:
                # Killed, out of memory, or stuck: the images go once more, to a new worker.
                logger.warning("an image decoder process died or hung; starting another")
                with self._lock:
                    self.restarts += 1
                worker.close()
                continue
            except BaseException:  # the worker's state is unknown: it is not reused
                worker.close()
                raise
            with self._lock:
                self._idle.append(worker)
            if not ok:
                raise value
            return value  # type: ignore[no-any-return]  # the worker sends an ndarray with True
        raise ModelFailure("the image decoder process died twice on this request's images")

    def _take(self) -> DecoderWorker:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return DecoderWorker()

    def pids(self) -> list[int]:
        """The idle workers' process ids (for tests and diagnostics)."""
        with self._lock:
            return [w.proc.pid for w in self._idle]

    def shutdown(self) -> None:
        self._threads.shutdown(wait=True)
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.close()


DECODERS = DecoderPool()


def serve(sock: socket.socket, busy_fd: int | None = None) -> None:
    """A worker's life: requests in, pixels or an error out, until the router's end closes. With
    `busy_fd` (the router's MODEL_WORK), decoding waits while the router's urgent work is in flight
    and none of the worker's cores is left free (cpu_priority.cores_taken)."""
    lower_thread_priority()
    if busy_fd is not None:
        images.yield_while = when_contended(busy_reader(busy_fd), cores_taken())
    while True:
        try:
            blobs, size, resize, mapped = _read_request(sock)
        except WorkerDied:  # the router closed its end, or ended
            return
        try:
            reply: tuple[bool, Any] = (True, decode_images(blobs, size, resize))
        except InvalidInput as e:
            reply = (False, e)
        except Exception as e:  # a bug, not the client's input: the router answers 500
            logger.exception("image decoding failed")
            reply = (False, ModelFailure(f"image decoding failed: {type(e).__name__}"))
        finally:
            for blob in blobs:
                blob.release()
            if mapped is not None:
                mapped.close()
        try:
            _send_frame(sock, reply)
        except OSError:  # the router ended while this request decoded
            return


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])), int(sys.argv[2]) if len(sys.argv) > 2 else None)
