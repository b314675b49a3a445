"""The kernel's threads waited for with Ctrl-C allowed (``nbfsdp.kernel.cluster.threads``): an interrupted wait
leaves the thread's state true, where CPython 3.11's own ``Thread.join`` marks a running thread ended."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from nbfsdp.kernel.cluster.threads import KernelThread

pytestmark = pytest.mark.timeout(60)


def _interrupted_wait(thread: threading.Thread) -> None:
    """``thread.join()`` in slices, as the kernel waits, until a real SIGINT interrupts it."""
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        while thread.is_alive():
            thread.join(0.1)


def test_an_interrupted_join_leaves_a_kernel_thread_running_and_joinable():
    release = threading.Event()
    ended = []
    thread = KernelThread(target=lambda: (release.wait(30), ended.append(True)), name="test-kernel-thread")
    thread.start()
    _interrupted_wait(thread)
    assert thread.is_alive() and not ended
    threading.Timer(0.3, release.set).start()
    started = time.monotonic()
    thread.join()
    assert ended == [True] and not thread.is_alive() and time.monotonic() - started >= 0.2
