"""Ends a cluster once the kernel that started it is gone, however it went.

A kernel killed with SIGKILL runs no cleanup, and its engines and controller
would live on (measured: ipyparallel leaves them running). The cluster starts
this watcher in its own session, so it survives the kernel:

    python -m nbfsdp.reaper KERNEL_PID PRIVATE_DIR

It checks once a second; when the kernel has exited it kills the processes
listed in ``PRIVATE_DIR/pids.json``, with what they started (the controller's
schedulers are processes of their own), and removes the directory. When the
cluster is stopped normally the directory disappears and the watcher exits.
The same clean-up runs for stale directories of dead kernels when the next
cluster starts (``clean_stale``), in case a watcher itself was killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import psutil

PIDS_FILE = "pids.json"
PRIVATE_DIR_PREFIX = "nbfsdp-"
POLL_SECONDS = 1.0


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def record(private_dir: str, kernel_pid: int, pids: list[int]) -> None:
    """Write the processes to end if ``kernel_pid`` dies (atomically: the watcher may be reading)."""
    target = Path(private_dir, PIDS_FILE)
    partial = target.with_suffix(".tmp")
    partial.write_text(json.dumps({"kernel": kernel_pid, "pids": pids}))
    partial.chmod(0o600)
    partial.replace(target)


def is_cluster_process(process: psutil.Process) -> bool:
    """ipyparallel's controller and schedulers, the engine fork server and the engines it forked."""
    return any("ipyparallel" in part or "nbfsdp.forkserver" in part for part in process.cmdline())


def cluster_processes(pids: list[int]) -> list[psutil.Process]:
    """The recorded processes and everything they started, orphans included.

    ipyparallel starts the controller and each engine in a session of its own,
    and the controller's schedulers are processes of that session: they live
    on, orphaned, when the controller dies before ending them (killed, or
    stopped while still starting them up), but keep the session id. A pid
    recorded long ago may be another process now: only the cluster's are ended,
    with their children.
    """
    found: dict[int, psutil.Process] = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            if is_cluster_process(process):
                found.update((p.pid, p) for p in [process, *process.children(recursive=True)])
    sessions = set(pids)
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if process.pid not in found and os.getsid(process.pid) in sessions and is_cluster_process(process):
                found[process.pid] = process
    return list(found.values())


def end_cluster(private_dir: Path) -> None:
    """Kill the processes the directory lists (see ``cluster_processes``), then remove it."""
    try:
        pids = json.loads((private_dir / PIDS_FILE).read_text())["pids"]
    except (OSError, ValueError, KeyError):
        pids = []
    for process in cluster_processes(pids):
        with contextlib.suppress(psutil.Error):
            process.send_signal(signal.SIGKILL)
    shutil.rmtree(private_dir, ignore_errors=True)


def clean_stale() -> None:
    """End the clusters of kernels that no longer run (this user's only)."""
    for candidate in Path(tempfile.gettempdir()).glob(f"{PRIVATE_DIR_PREFIX}*"):
        try:
            if candidate.stat().st_uid != os.getuid():
                continue
            kernel = json.loads((candidate / PIDS_FILE).read_text())["kernel"]
        except (OSError, ValueError, KeyError):
            continue
        if not alive(kernel):
            end_cluster(candidate)


def start(kernel_pid: int, private_dir: str) -> None:
    """Start the watcher for this cluster, detached from the kernel's session."""
    psutil.Popen(
        [sys.executable, "-m", "nbfsdp.reaper", str(kernel_pid), private_dir],
        start_new_session=True,
        stdin=psutil.subprocess.DEVNULL,
        stdout=psutil.subprocess.DEVNULL,
        stderr=psutil.subprocess.DEVNULL,
    )


def main(kernel_pid: int, private_dir: str) -> None:
    directory = Path(private_dir)
    while directory.exists():
        if not alive(kernel_pid):
            end_cluster(directory)
            return
        time.sleep(POLL_SECONDS)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
