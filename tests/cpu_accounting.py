"""Opt-in pytest plugin: the CPU seconds each test cost, every process it started included.

    PYTEST_ADDOPTS="-p tests.cpu_accounting" make test      # as root on Linux; writes test-artifacts/cpu.jsonl

The suite is CPU-bound on 2 cores (docs/performance.md): its length is the CPU its tests use, which their wall
times do not say (three workers share two cores, and a test waiting on Slurm or sshd uses none). Each pytest
process (an xdist worker, the floor run's) moves itself into a cgroup of its own (cgroup v1's ``cpuacct``), which
every process it starts inherits, engines, kernels and daemons alike, and which counts their CPU after they end,
where psutil sees only the living. A test's line is its process's cgroup's CPU from its setup to its teardown,
what the worker's session fixtures (the shared shell's idle engines) spent meanwhile included. Without cgroup
v1's ``cpuacct`` or root, the plugin says so and records nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
LOG = Path(os.environ.get("NBFSDP_CPU_LOG", "test-artifacts/cpu.jsonl"))

_group: Path | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _group
    if getattr(config, "workerinput", None) is None and config.getoption("numprocesses", None):
        return  # xdist's controller: its workers account for the tests
    group = CPUACCT / f"nbfsdp-tests-{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(f"{os.getpid()}\n")
    except OSError as error:
        print(f"tests.cpu_accounting: no cgroup for this run's CPU ({error}); nothing recorded")
        return
    _group = group
    LOG.parent.mkdir(parents=True, exist_ok=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    """This process back in the root group, and its group removed once empty (Linux refuses while a process a
    test left running is still in it: the group then stays, as that process's record)."""
    if _group is None:
        return
    (CPUACCT / "cgroup.procs").write_text(f"{os.getpid()}\n")
    with contextlib.suppress(OSError):
        _group.rmdir()


def _cpu_seconds() -> float:
    assert _group is not None
    return int((_group / "cpuacct.usage").read_text()) / 1e9


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if _group is None:
        yield
        return
    cpu, wall = _cpu_seconds(), time.monotonic()
    yield
    cpu, wall = _cpu_seconds() - cpu, time.monotonic() - wall
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    line = {"test": item.nodeid, "venv": Path(sys.prefix).name, "worker": worker, "cpu_s": round(cpu, 2)}
    line |= {"wall_s": round(wall, 2), "ended": round(time.time(), 1)}
    with LOG.open("a") as log:
        log.write(json.dumps(line) + "\n")
