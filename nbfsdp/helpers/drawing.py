"""The drawing worker: a process of the lowest CPU priority, in a session of its own, that draws the dashboards.

The kernel starts it and submits drawings to it through ``nbfsdp.ui.renderer``:

    python -m nbfsdp.helpers.drawing KERNEL_PID

Requests ``(number, function, args)`` come pickled on its stdin, replies ``(number, ok, value)`` go pickled to
its stdout; it ends when its stdin closes (the kernel ended) or its kernel is gone.

The ranks share the machine's cores with the notebook, and a drawing costs
about 100 ms of CPU. Drawn in the kernel, that time was taken from the ranks
(measured: steps 50-100% slower whenever a drawing ran, 6% over a run at two
ranks on two cores). A low nice value for a drawing thread does not help:
the kernel and every engine each run in a session of their own, and Linux's
scheduler with autogroup (the default on many distributions) shares the CPU
equally between sessions, whatever a thread's nice value. So drawings are
made by one worker process that starts a session of its own and lowers that
session's priority to the minimum, under the SCHED_IDLE policy: a rank waking
from a collective preempts it at once (at nice 19 alone it kept the CPU to the
end of its time slice, and steps were still 7% slower). It draws with the CPU
time the ranks leave, and keeps each live dashboard's figure, so that a
drawing only adds the records that arrived since the last one.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import threading
import time
from typing import Any

from nbfsdp.shared.processes import die_with_parent


def serve(kernel: int) -> None:
    """The worker's loop: each request run and answered in turn, until the kernel's end of the pipe closes."""
    start_worker(kernel)
    requests = sys.stdin.buffer
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print goes to stderr, not into the replies
    while True:
        try:
            number, function, args = pickle.load(requests)
        except EOFError:
            return
        try:
            reply = pickle.dumps((number, True, function(*args)))
        except Exception as error:  # the kernel's future raises it (LostFigure, a drawing's own error)
            try:
                reply = pickle.dumps((number, False, error))
            except Exception:  # an error that does not pickle, said in words
                reply = pickle.dumps((number, False, RuntimeError(f"{type(error).__name__}: {error}")))
        try:
            replies.write(reply)
            replies.flush()
        except BrokenPipeError:  # the kernel ended while this drawing ran: nobody left to answer
            # what stays buffered goes nowhere at exit, without a traceback (Python's own advice for SIGPIPE)
            os.dup2(os.open(os.devnull, os.O_WRONLY), replies.fileno())
            return


def start_worker(kernel: int) -> None:
    """In the worker (started in a session of its own, so lowering it leaves the kernel's alone): nice 19, and
    an end when the kernel ends even if its pipe stays open somewhere."""
    # ended by Linux with its kernel: at idle priority on a machine whose every core is busy, the worker gets no CPU
    # to read its pipe's end or to run ``_end_with`` (a drawing's C code holds the GIL), and outlived a killed
    # kernel by minutes in a suite run beside a busy program
    die_with_parent(kernel)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.setpriority(os.PRIO_PROCESS, 0, 19)
    if hasattr(os, "SCHED_IDLE"):  # Linux: any waking rank preempts it at once, not at the end of its time slice
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    # the session's share against other sessions (Linux with autogroup): only where this worker leads a session of
    # its own. Started in its caller's session, it would lower every process of that session (a test that did so
    # left the whole suite's session at nice 19, its engines starved beside the kernels' sessions)
    if os.getsid(0) == os.getpid():
        with contextlib.suppress(OSError), open("/proc/self/autogroup", "w") as autogroup:
            autogroup.write("19")
    threading.Thread(target=_end_with, args=(kernel,), name="nbfsdp-end-with-kernel", daemon=True).start()


def _end_with(kernel: int) -> None:
    """Every second, whether the kernel has ended: for systems without Linux's parent-death signal."""
    while os.getppid() == kernel:
        time.sleep(1.0)
    os._exit(0)


_warm = False  # in the worker: it has drawn once


def warm_up() -> None:
    global _warm
    if not _warm:
        from nbfsdp.shared.figures import DashboardFigure

        DashboardFigure(1, None).add([{"rank": 0, "step": 0, "step_time": 0.0, "loss": 0.0}]).png()
        _warm = True


class LostFigure(Exception):
    """The worker no longer has this dashboard's figure (it was replaced): send every record again."""


#: In the worker: the figure of each live dashboard, so a drawing only adds the records since the last one.
_figures: dict[str, Any] = {}
#: Dashboards whose final drawing never came (their kernel cell was interrupted) are dropped beyond this many.
MAX_FIGURES = 8


def draw(key: str, world_size: int, predicted: Any, records: list[dict[str, Any]], first: int, *, final: bool) -> tuple:
    # imported here, once the worker has left the kernel's session: matplotlib takes a second to load,
    # and a Ctrl-C sent to the kernel's process group meanwhile would end the worker
    from nbfsdp.shared.figures import DashboardFigure

    started = time.process_time()
    if final:
        _figures.pop(key, None)
        return DashboardFigure(world_size, predicted).add(records).png(), time.process_time() - started
    if first == 0:
        _figures.pop(key, None)
        while len(_figures) >= MAX_FIGURES:
            _figures.pop(next(iter(_figures)))
        _figures[key] = DashboardFigure(world_size, predicted, live=True)
    drawing = _figures.get(key)
    if drawing is None or drawing.records != first:
        raise LostFigure(key)
    drawing.predict_peaks(predicted or [])  # a peak traced while the cell ran comes with a later drawing
    png = drawing.add(records).png()
    return png, time.process_time() - started


if __name__ == "__main__":
    from nbfsdp.helpers.drawing import serve as serve_in_module  # the functions requests name live there

    serve_in_module(int(sys.argv[1]))
