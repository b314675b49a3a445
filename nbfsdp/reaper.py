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

``ProcessRef`` is how every part of nbfsdp signals a process: by pid and start
time, so that a pid the system has since given to another process is skipped.
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
from dataclasses import dataclass
from pathlib import Path

import psutil

KERNEL_FILE = "kernel.json"
PRIVATE_DIR_PREFIX = "nbfsdp-"
POLL_SECONDS = 1.0
#: ``end_cluster`` looks again this long after its kills, and gives up on processes that outlast this limit
SWEEP_PAUSE_SECONDS = 0.2
SWEEP_LIMIT_SECONDS = 10.0
#: psutil's start time is the boot time plus the start in clock ticks since boot, and it reads the boot time
#: as whole seconds each time, which a clock adjustment can move by one: one process's start times may differ
#: by that second, and a pid reused within it (the pid space wrapped in a second) is not told apart
START_TIME_SLACK_SECONDS = 1.0 + 1e-3


@dataclass(frozen=True, slots=True)
class ProcessRef:
    """A process as its pid and start time: once it ends, the system may give its pid to another process,
    which a signal by pid alone would hit."""

    pid: int
    started: float
    """psutil's ``create_time()``, taken when the process was first known (NaN: unknown, never signalled)."""

    @classmethod
    def of(cls, pid: int) -> ProcessRef | None:
        """The process that has ``pid`` now; None if none has."""
        try:
            return cls(pid, psutil.Process(pid).create_time())
        except psutil.Error:
            return None

    def process(self) -> psutil.Process | None:
        """This process, while ``pid`` is still its own (a zombie not yet reaped included)."""
        try:
            process = psutil.Process(self.pid)
            same = abs(process.create_time() - self.started) <= START_TIME_SLACK_SECONDS
        except psutil.Error:
            return None
        return process if same else None

    def alive(self) -> bool:
        """It runs (it has not exited, and ``pid`` is not another process's now)."""
        process = self.process()
        try:
            return process is not None and process.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def signal(self, signum: int) -> bool:
        """Send ``signum`` if ``pid`` is still this process's; False if it is gone or another's now.

        On Linux a pidfd pins the process before its start time is checked, so nothing can take the pid
        between the check and the signal."""
        try:
            pidfd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            return False
        except (AttributeError, OSError):  # no pidfds here: psutil's own check of the pid, then the signal
            if (process := self.process()) is None:
                return False
            try:
                process.send_signal(signum)
            except psutil.Error:
                return False
            return True
        try:
            if self.process() is None:
                return False
            signal.pidfd_send_signal(pidfd, signum)
            return True
        except ProcessLookupError:
            return False
        finally:
            os.close(pidfd)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def note_kernel(private_dir: str, kernel_pid: int) -> None:
    """Write whose cluster the directory is, for ``clean_stale`` (atomically: another kernel may be reading)."""
    target = Path(private_dir, KERNEL_FILE)
    partial = target.with_suffix(".tmp")
    kernel = ProcessRef.of(kernel_pid)
    partial.write_text(json.dumps({"kernel": kernel_pid, "started": kernel.started if kernel else None}))
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


def end_cluster(private_dir: str | Path) -> None:
    """Kill the cluster's processes (see ``cluster_processes``), then remove the directory.

    It looks again after each round of kills until it finds none: a process can fork between the look and
    its kill (the controller forks its schedulers early in its start), and one still starting must not
    create the directory again after it is removed."""
    deadline = time.monotonic() + SWEEP_LIMIT_SECONDS
    while (processes := cluster_processes(str(private_dir))) and time.monotonic() < deadline:
        for process in processes:
            with contextlib.suppress(psutil.Error):
                ProcessRef(process.pid, process.create_time()).signal(signal.SIGKILL)
        time.sleep(SWEEP_PAUSE_SECONDS)
    shutil.rmtree(private_dir, ignore_errors=True)


def clean_stale() -> None:
    """End the clusters of kernels that no longer run (this user's only)."""
    for candidate in Path(tempfile.gettempdir()).glob(f"{PRIVATE_DIR_PREFIX}*"):
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
        [sys.executable, "-m", "nbfsdp.reaper", str(kernel_pid), private_dir],
        start_new_session=True,
        stdin=psutil.subprocess.DEVNULL,
        stdout=psutil.subprocess.DEVNULL,
        stderr=psutil.subprocess.DEVNULL,
    )


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
