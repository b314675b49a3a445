"""The kernel's side of the reaper (``nbfsdp.helpers.reaper``): start it for a cluster, note whose cluster
a directory is, and end the clusters of kernels that no longer run."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import psutil

from nbfsdp.shared.processes import ProcessRef, alive, end_cluster

KERNEL_FILE = "kernel.json"
PRIVATE_DIR_PREFIX = "nbfsdp-"
#: Memory every process of the host shares (Linux), where a move of weights between worlds writes them
#: (``nbfsdp.kernel.checkpoints.moves``): swept for dead kernels' directories as the temporary directory is.
SHARED_MEMORY = Path("/dev/shm")


def note_kernel(private_dir: str, kernel_pid: int) -> None:
    """Write whose cluster the directory is, for ``clean_stale`` (atomically: another kernel may be reading)."""
    target = Path(private_dir, KERNEL_FILE)
    partial = target.with_suffix(".tmp")
    kernel = ProcessRef.of(kernel_pid)
    partial.write_text(json.dumps({"kernel": kernel_pid, "started": kernel.started if kernel else None}))
    partial.chmod(0o600)
    partial.replace(target)


def clean_stale() -> None:
    """End the clusters of kernels that no longer run, and free what their moves left (this user's only)."""
    candidates = [*Path(tempfile.gettempdir()).glob(f"{PRIVATE_DIR_PREFIX}*")]
    if SHARED_MEMORY.is_dir():
        candidates += SHARED_MEMORY.glob(f"{PRIVATE_DIR_PREFIX}*")
    for candidate in candidates:
        try:
            if candidate.stat().st_uid != os.getuid():
                continue
            noted = json.loads((candidate / KERNEL_FILE).read_text())
            kernel, started = noted["kernel"], noted.get("started")
        except (OSError, ValueError, KeyError):
            continue
        # without a start time (the kernel had gone when it was noted), the pid alone
        if not (ProcessRef(kernel, started).alive() if started is not None else alive(kernel)):
            end_cluster(candidate)


def start(kernel_pid: int, private_dir: str) -> psutil.Popen:
    """Start the watcher for this cluster, detached from the kernel's session (the caller reaps it)."""
    return psutil.Popen(
        [sys.executable, "-m", "nbfsdp.helpers.reaper", str(kernel_pid), private_dir],
        start_new_session=True,
        stdin=psutil.subprocess.DEVNULL,
        stdout=psutil.subprocess.DEVNULL,
        stderr=psutil.subprocess.DEVNULL,
    )
