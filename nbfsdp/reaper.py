"""Ends a cluster once the kernel that started it is gone, however it went.

A kernel killed with SIGKILL runs no cleanup, and its engines and controller
would live on (measured: ipyparallel leaves them running). The cluster starts
this watcher in its own session, so it survives the kernel:

    python -m nbfsdp.reaper KERNEL_PID PRIVATE_DIR

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

KERNEL_FILE = "kernel.json"
PRIVATE_DIR_PREFIX = "nbfsdp-"
POLL_SECONDS = 1.0
#: ``end_cluster`` looks again this long after its kills, and gives up on processes that outlast this limit
SWEEP_PAUSE_SECONDS = 0.2
SWEEP_LIMIT_SECONDS = 10.0


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def note_kernel(private_dir: str, kernel_pid: int) -> None:
    """Write whose cluster the directory is, for ``clean_stale`` (atomically: another kernel may be reading)."""
    target = Path(private_dir, KERNEL_FILE)
    partial = target.with_suffix(".tmp")
    partial.write_text(json.dumps({"kernel": kernel_pid}))
    partial.chmod(0o600)
    partial.replace(target)


def is_cluster_process(process: psutil.Process) -> bool:
    """ipyparallel's controller and schedulers, the engine fork server and the engines it forked."""
    return _is_cluster_command(process.cmdline())


def _is_cluster_command(cmdline: list[str]) -> bool:
    return any("ipyparallel" in part or "nbfsdp.forkserver" in part for part in cmdline)


def _names(cmdline: list[str], private_dir: str) -> bool:
    """The command line names ``private_dir`` (as a word or as an option's value)."""
    return any(part == private_dir or part.endswith(f"={private_dir}") for part in cmdline)


def cluster_processes(private_dir: str) -> list[psutil.Process]:
    """The cluster's live processes: those started for ``private_dir``, and everything they started (an
    engine's nanny names no directory)."""
    found: dict[int, psutil.Process] = {}
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []  # None: not ours to read, or gone
        if process.pid not in found and _is_cluster_command(cmdline) and _names(cmdline, private_dir):
            with contextlib.suppress(psutil.Error):
                found.update((p.pid, p) for p in [process, *process.children(recursive=True)])
    return [process for process in found.values() if alive(process.pid)]


def end_cluster(private_dir: Path) -> None:
    """Kill the cluster's processes (see ``cluster_processes``), then remove the directory.

    It looks again after each round of kills until it finds none: a process can fork between the look and
    its kill (the controller forks its schedulers early in its start), and one still starting must not
    create the directory again after it is removed."""
    deadline = time.monotonic() + SWEEP_LIMIT_SECONDS
    while (processes := cluster_processes(str(private_dir))) and time.monotonic() < deadline:
        for process in processes:
            with contextlib.suppress(psutil.Error):
                process.send_signal(signal.SIGKILL)
        time.sleep(SWEEP_PAUSE_SECONDS)
    shutil.rmtree(private_dir, ignore_errors=True)


def clean_stale() -> None:
    """End the clusters of kernels that no longer run (this user's only)."""
    for candidate in Path(tempfile.gettempdir()).glob(f"{PRIVATE_DIR_PREFIX}*"):
        try:
            if candidate.stat().st_uid != os.getuid():
                continue
            kernel = json.loads((candidate / KERNEL_FILE).read_text())["kernel"]
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
