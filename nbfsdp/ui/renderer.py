"""The kernel's handle on the drawing worker (``nbfsdp.helpers.drawing``): start it, submit drawings to it.

Why drawings are made in a process of their own, at the lowest priority: see ``nbfsdp.helpers.drawing``.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from nbfsdp.helpers import drawing

_worker: ProcessPoolExecutor | None = None


def _pool() -> ProcessPoolExecutor:
    global _worker
    if _worker is None:
        # spawn: a fork of a kernel would copy its threads' locks mid-use
        context = multiprocessing.get_context("spawn")
        _worker = ProcessPoolExecutor(1, mp_context=context, initializer=drawing.start_worker, initargs=(os.getpid(),))
    return _worker


def _submit(function: Any, *args: Any) -> Future:
    """Run ``function(*args)`` in the worker; a worker that died is replaced first."""
    global _worker
    try:
        return _pool().submit(function, *args)
    except BrokenProcessPool:
        _worker = None
        return _pool().submit(function, *args)


def start() -> None:
    """Start the worker now and have it draw once (importing matplotlib and loading its fonts take a second),
    so that the first live drawing is not late and costs what later ones do."""
    _submit(drawing.warm_up)


def render(
    key: str,
    world_size: int,
    predicted: list[dict[str, int]] | None,
    records: list[dict[str, Any]],
    first: int,
    final: bool = False,
) -> Future[tuple[bytes, float]]:
    """A PNG of dashboard ``key``'s figures with ``records`` added, and the CPU seconds it cost, drawn by the
    worker. ``records`` start at index ``first`` of the dashboard's records: 0 draws a new figure, more adds
    to the figure the worker kept (``drawing.LostFigure`` if it has no such figure). ``final``: every record, drawn
    whole with limits that fit them; the worker then drops the dashboard's figure."""
    return _submit(drawing.draw, key, world_size, predicted, records, first, final)


def worker_pid() -> int:
    """The worker's process id (starting it if need be)."""
    return _submit(os.getpid).result()
