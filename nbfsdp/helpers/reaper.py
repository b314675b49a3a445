"""Ends a cluster once the kernel that started it is gone, however it went.

A kernel killed with SIGKILL runs no cleanup, and its engines and controller
would live on (measured: ipyparallel leaves them running). The cluster starts
this watcher in its own session, so it survives the kernel:

    python -m nbfsdp.helpers.reaper KERNEL_PID PRIVATE_DIR

It checks once a second; when the kernel has exited it kills the cluster's
processes and removes the directory. It finds them by name, not by process ids
the kernel noted: every process the cluster launches has the private directory
on its command line (the controller's ``--profile-dir``, the fork server's
argument), and what they fork keeps it (the controller's schedulers, the
engines). A list of ids misses what the kernel launched but had not yet noted:
a kernel killed in the 10 ms between launching the controller and noting it
left the controller and its schedulers running, 15 times in 40. When the
cluster is stopped normally the directory disappears and the watcher exits.
The same clean-up runs for stale directories of dead kernels when the next
cluster starts (``nbfsdp.kernel.cluster.reaping.clean_stale``), in case a watcher itself was killed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from nbfsdp.shared.processes import ProcessRef, end_cluster

POLL_SECONDS = 1.0


def main(kernel_pid: int, private_dir: str) -> None:
    directory = Path(private_dir)
    kernel = ProcessRef.of(kernel_pid)  # the kernel that started this watcher, not a later owner of its pid
    while directory.exists():
        if kernel is None or not kernel.alive():
            end_cluster(directory)
            return
        time.sleep(POLL_SECONDS)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
