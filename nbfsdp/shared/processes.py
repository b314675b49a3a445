"""Processes by pid and start time, and a cluster's processes found by its private directory.

Used by the kernel (stopping a cluster), the fork server (its children), the
drawing worker (its end with the kernel) and the reaper (a dead kernel's
cluster): ``ProcessRef`` is how every part of nbfsdp signals a process, so
that a pid the system has since given to another process is skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

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


def die_with_parent(parent: int) -> None:
    """Have Linux kill this process (SIGKILL) when ``parent`` ends, even killed by SIGKILL, which runs no clean-up;
    exit at once if it has already ended. The kernel delivers it: it ends a process that gets no CPU to run its own
    exit (a SCHED_IDLE drawing worker on a busy machine; a stopped one). Linux counts the parent's *thread* that
    started this process: it must be one that lives as long as the parent."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1  # <linux/prctl.h>
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent ended before the signal was asked for
        os._exit(1)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def is_cluster_process(process: psutil.Process) -> bool:
    """ipyparallel's controller and schedulers, the engine fork server and the engines it forked."""
    return _is_cluster_command(process.cmdline())


def _is_cluster_command(cmdline: list[str]) -> bool:
    return any("ipyparallel" in part or "nbfsdp.helpers.forkserver" in part for part in cmdline)


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


#: In a private directory: the Slurm job the cluster's engines run in (``nbfsdp.kernel.cluster.slurm``), by name.
SLURM_JOB_FILE = "slurm-job.json"


def end_cluster(private_dir: str | Path) -> None:
    """Kill the cluster's processes (see ``cluster_processes``), cancel its Slurm job if it has one, then remove
    the directory.

    It looks again after each round of kills until it finds none: a process can fork between the look and
    its kill (the controller forks its schedulers early in its start), and one still starting must not
    create the directory again after it is removed."""
    deadline = time.monotonic() + SWEEP_LIMIT_SECONDS
    while (processes := cluster_processes(str(private_dir))) and time.monotonic() < deadline:
        for process in processes:
            with contextlib.suppress(psutil.Error):
                ProcessRef(process.pid, process.create_time()).signal(signal.SIGKILL)
        time.sleep(SWEEP_PAUSE_SECONDS)
    _cancel_slurm_job(Path(private_dir, SLURM_JOB_FILE))
    shutil.rmtree(private_dir, ignore_errors=True)


def _cancel_slurm_job(noted: Path) -> None:
    """``scancel --name`` the job the file names, with the Slurm configuration the kernel had."""
    try:
        job = json.loads(noted.read_text())
    except (OSError, ValueError):
        return
    env = {**os.environ, **({"SLURM_CONF": job["slurm_conf"]} if job.get("slurm_conf") else {})}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(["scancel", "--name", job["name"]], env=env, capture_output=True, timeout=30)
