"""The kernel's handle on the drawing worker (``nbfsdp.helpers.drawing``): start it, submit drawings to it.

Why drawings are made in a process of their own, at the lowest priority: see ``nbfsdp.helpers.drawing``.

The worker is a child process with two pipes, not a ``ProcessPoolExecutor``: a pool's queues are
``multiprocessing``'s named POSIX semaphores (five ``sem.mp-*`` files in ``/dev/shm`` under ``spawn``), which only
the pool's shutdown or multiprocessing's resource tracker removes, and Jupyter ends a kernel with its process
group, the tracker included: every kernel left five behind, until reboot. Pipes leave nothing, and the worker
ends when the kernel's end of its pipe closes, however the kernel ended.
"""

from __future__ import annotations

import functools
import itertools
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import psutil

from nbfsdp.helpers import drawing
from nbfsdp.shared import timeline_figure

#: How often a wait for the worker looks at the CPU time it has had, and the least share of a core it must have
#: had in that while not to count as starved: at SCHED_IDLE on a machine whose every core is busy it gets none.
STARVED_WINDOW_SECONDS = 0.25
STARVED_CPU_SHARE = 0.05


#: The one thread that starts drawing workers, idle until the kernel exits (an executor's thread never ends before).
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nbfsdp-drawing-spawner")


class WorkerDied(RuntimeError):
    """The drawing worker ended before it answered (the next drawing starts a new one)."""


class _Worker:
    """One drawing process: requests ``(number, function, args)`` pickled to its stdin by a writer thread (a
    submission never waits for the worker to read), replies ``(number, ok, value)`` read from its stdout by a
    reader thread that settles each request's future."""

    def __init__(self) -> None:
        # started from a thread that lives as long as the kernel: Linux ends the worker when the thread that
        # started it ends (``processes.die_with_parent``), and a drawing may first be asked for from any thread
        self.process = _SPAWNER.submit(
            subprocess.Popen,
            [sys.executable, "-m", "nbfsdp.helpers.drawing", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # out of the kernel's process group: a Ctrl-C in the notebook is not for it
        ).result()
        self._numbers = itertools.count()
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._requests: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self.alive = True
        self.usage = psutil.Process(self.process.pid)
        threading.Thread(target=self._write_requests, name="nbfsdp-drawing-requests", daemon=True).start()
        threading.Thread(target=self._read_replies, name="nbfsdp-drawing-replies", daemon=True).start()

    def submit(self, function: Any, args: tuple) -> Future:
        future: Future = Future()
        with self._lock:
            if not self.alive:
                future.set_exception(WorkerDied("the drawing worker has ended"))
                return future
            number = next(self._numbers)
            self._pending[number] = future
        self._requests.put(pickle.dumps((number, function, args)))
        return future

    def _write_requests(self) -> None:
        stdin = self.process.stdin
        assert stdin is not None
        try:
            while request := self._requests.get():  # empty: the worker has ended
                stdin.write(request)
                stdin.flush()
        except OSError:  # the worker has died (BrokenPipeError): the reader fails what is pending
            self.process.kill()

    def _read_replies(self) -> None:
        stdout = self.process.stdout
        assert stdout is not None
        while True:
            try:
                number, ok, value = pickle.load(stdout)
            except Exception:  # EOF: the worker ended
                break
            with self._lock:
                future = self._pending.pop(number, None)
            if future is not None:
                future.set_result(value) if ok else future.set_exception(value)
        with self._lock:
            self.alive = False
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future.set_exception(WorkerDied("the drawing worker ended before it answered"))
        self._requests.put(b"")
        self.process.wait()


_worker: _Worker | None = None
_worker_lock = threading.Lock()


def _submit(function: Any, *args: Any) -> Future:
    """Run ``function(*args)`` in the worker; a worker that died is replaced first."""
    global _worker
    with _worker_lock:
        if _worker is None or not _worker.alive:
            _worker = _Worker()
        worker = _worker
    return worker.submit(function, args)


def start() -> None:
    """Start the worker now and have it draw once (importing matplotlib and loading its fonts take a second),
    so that the first live drawing is not late and costs what later ones do."""
    _submit(drawing.warm_up)


def render(
    key: str,
    world_size: int,
    predicted: list[dict[str, Any]] | None,
    records: list[dict[str, Any]],
    first: int,
    *,
    final: bool = False,
) -> Future[tuple[bytes, float]]:
    """A PNG of dashboard ``key``'s figures with ``records`` added, and the CPU seconds it cost, drawn by the
    worker. ``records`` start at index ``first`` of the dashboard's records: 0 draws a new figure, more adds
    to the figure the worker kept (``drawing.LostFigure`` if it has no such figure). ``final``: every record, drawn
    whole with limits that fit them; the worker then drops the dashboard's figure."""
    # bound by keyword in a partial: the worker calls a request's function with its arguments positionally
    return _submit(functools.partial(drawing.draw, final=final), key, world_size, predicted, records, first)


def render_timeline(steps: list[list[dict[str, Any]]]) -> Future[bytes]:
    """A PNG of captured steps (``nbfsdp.shared.timeline_figure``), drawn by the worker."""
    return _submit(timeline_figure.png, steps)


def worker_pid() -> int:
    """The worker's process id (starting it if need be)."""
    return _submit(os.getpid).result()


def done_unless_starved(drawing: Future, seconds: float) -> bool:
    """Whether the worker's ``drawing`` is done within ``seconds``, given up on as soon as the worker has had less
    than ``STARVED_CPU_SHARE`` of a core over ``STARVED_WINDOW_SECONDS`` while it was due: at the end of a cell the
    kernel waits for its last figures, and a worker the machine gives no CPU would hold every cell for ``seconds``
    (10 s a figure, measured beside two busy loops), where the kernel draws them in about 0.1 s of CPU."""
    worker = _worker
    deadline = time.monotonic() + seconds
    used = _cpu_seconds(worker)
    while True:
        try:
            drawing.result(max(0.0, min(STARVED_WINDOW_SECONDS, deadline - time.monotonic())))
            return True
        except FutureTimeout:
            pass
        except Exception:  # the worker died, or the drawing failed: not drawn
            return False
        now_used = _cpu_seconds(worker)
        if time.monotonic() >= deadline or now_used - used < STARVED_CPU_SHARE * STARVED_WINDOW_SECONDS:
            return drawing.done() and drawing.exception() is None
        used = now_used


def _cpu_seconds(worker: _Worker | None) -> float:
    """The CPU time the worker process has had (user and system); 0 where it has ended."""
    if worker is None:
        return 0.0
    try:
        times = worker.usage.cpu_times()
    except psutil.Error:
        return 0.0
    return times.user + times.system
