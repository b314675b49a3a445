"""Latency of a trivial ``%%fsdp`` cell on a warm cluster, against a raw ipyparallel execute.

A: ``view.execute("pass", block=True)`` on the bench's own ipyparallel cluster of as many engines
(controller on 127.0.0.1): what any cell on that many engines costs at least.
B: ``%%fsdp --world-size N`` + ``pass`` sent to a kernel whose world already runs, timed from sending the
execute request to having its reply and the idle status (what a notebook waits for), dashboard included.
Alternating A B after a warm-up; medians of the samples. Target: B's median at most 36 ms (what an older
commit measured; issue 38), aiming at 1.5x A; the note gives B / A. N is 4 (``--quick``: 2).

Run alone: ``python -m benchmarks --only warm_cell``.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import time

import ipyparallel as ipp
import psutil

from benchmarks.context import Context
from benchmarks.measurement import Measurement, median

NAME = "warm_cell"
TARGET_MS = 36.0
#: What B aims at beyond the target: this many times A (said in the row's note).
AIM_RATIO = 1.5


class RawCluster:
    """An ipyparallel cluster of ``n`` engines on 127.0.0.1, with nothing of nbfsdp in it."""

    def __init__(self, n: int) -> None:
        self._dir = tempfile.mkdtemp(prefix="nbfsdp-bench-ipp-")
        self.cluster = ipp.Cluster(n=n, profile_dir=self._dir, controller_ip="127.0.0.1", log_level=logging.ERROR)
        self.client = self.cluster.start_and_connect_sync()
        self.client.wait_for_engines(n, timeout=120, interactive=False)
        self.view = self.client[:]

    def execute(self) -> float:
        started = time.perf_counter()
        self.view.execute("pass", block=True)
        return time.perf_counter() - started

    def stop(self) -> None:
        """Stop the cluster and every process it made. ipyparallel's stop ends the controller and engines it
        launched, but schedulers the controller forked outlive a controller that had to be killed (seen: five
        of them, orphaned, 40 minutes after a loaded test run), and a nanny may linger: end them here."""
        tree = []  # the controller, the schedulers it forked, the engines (their nannies) and what they started
        launchers = [self.cluster.controller, *(e for s in self.cluster.engines.values() for e in s.launchers.values())]
        for launcher in launchers:
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(launcher.pid)
                tree += [process, *process.children(recursive=True)]
        self.client.close()
        self.cluster.stop_cluster_sync()
        _, alive = psutil.wait_procs(tree, timeout=10)
        for process in alive:
            with contextlib.suppress(psutil.Error):
                process.kill()
        psutil.wait_procs(alive, timeout=10)
        shutil.rmtree(self._dir, ignore_errors=True)


def run(ctx: Context) -> dict:
    world_size = 2 if ctx.quick else 4
    samples, warmup = (10, 3) if ctx.quick else (30, 5)
    cell = f"%%fsdp --world-size {world_size}\npass"
    kernel = ctx.warm_kernel()
    kernel.execute(cell)  # the world of this size is up before anything is timed
    raw = RawCluster(world_size)
    try:
        a, b = [], []
        for index in range(warmup + samples):
            a_time = raw.execute()
            b_time = kernel.execute(cell).elapsed
            if index >= warmup:
                a.append(a_time * 1000)
                b.append(b_time * 1000)
    finally:
        raw.stop()
    row = Measurement(
        what=f"warm trivial `%%fsdp --world-size {world_size}` cell, kernel round trip (median)",
        value=median(b),
        unit="ms",
        target=TARGET_MS,
        op="<=",
        a_label=f"raw ipyparallel execute, {world_size} engines",
        a=median(a),
        b_label="%%fsdp",
        b=median(b),
        ab_unit="ms",
        samples_a=a,
        samples_b=b,
        note=f"%%fsdp / raw: {median(b) / median(a):.2f}x (aim: {AIM_RATIO}x)",
    )
    return {"measurements": [row], "world_size": world_size, "samples": samples, "warmup": warmup}
