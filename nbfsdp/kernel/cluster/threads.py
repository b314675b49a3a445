"""The kernel's own threads, whose end the notebook's thread may wait for with Ctrl-C allowed.

CPython before 3.13 breaks ``Thread.join`` interrupted by a KeyboardInterrupt while the thread still runs: it
releases the thread's state lock and marks it stopped (python/cpython#90882), so ``is_alive()`` says False and
every later ``join()`` returns at once while the thread goes on. ``%fsdp wait`` interrupted that way finished a
background run whose thread had not yet written its outcome (an ``AssertionError`` from nbfsdp's own code). A
``KernelThread`` says it has ended through an ``Event`` set when its target returns, which an interrupt cannot
corrupt; ``join`` and ``is_alive`` read that.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

#: How often a wait for a thread lets a KeyboardInterrupt through.
JOIN_SLICE_SECONDS = 0.1


class KernelThread(threading.Thread):
    """A daemon thread of the kernel's; ``join`` waits in short slices, so Ctrl-C reaches the waiting thread
    and leaves this one's state true."""

    def __init__(self, target: Callable[..., Any], name: str, args: tuple = ()) -> None:
        super().__init__(target=target, name=name, args=args, daemon=True)
        self.ended = threading.Event()

    def run(self) -> None:
        try:
            super().run()
        finally:
            self.ended.set()

    def is_alive(self) -> bool:
        return self.ident is not None and not self.ended.is_set()

    def join(self, timeout: float | None = None) -> None:
        """Until the thread has ended or ``timeout`` seconds have passed; a KeyboardInterrupt propagates."""
        if timeout is not None:
            self.ended.wait(timeout)
            return
        while not self.ended.wait(JOIN_SLICE_SECONDS):
            pass
