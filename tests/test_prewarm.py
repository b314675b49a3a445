"""``%load_ext nbfsdp`` starting the engines in the background (``NBFSDP_PREWARM``), in real kernels.

Each test starts its own kernel with its own ``NBFSDP_PREWARM`` (the rest of the suite runs with 0, see
conftest.py), and leaves no engine behind: every ipyparallel process a kernel started must be gone once the
kernel is. The values that start nothing share one kernel instead: ``%load_ext`` reads the variable when it
runs, so each of those tests sets it in that kernel, loads nbfsdp, and unloads it after.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import psutil
import pytest

import nbfsdp
from nbfsdp.kernel.cluster.local import FSDPCluster
from nbfsdp.shared import processes
from tests.conftest import gone, left_behind, removed
from tests.test_kernel import Kernel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

READY_TIMEOUT = 150.0
#: The cell of these tests: one collective, so the answer needs every rank of a working world.
ALL_REDUCE = """%%fsdp --world-size {n}
import torch
import torch.distributed as dist
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
total, seen = total.item(), world_size
"""


class PrewarmKernel(Kernel):
    """A kernel whose environment sets ``NBFSDP_PREWARM``."""

    def __init__(self, prewarm: str) -> None:
        super().__init__({**os.environ, "NBFSDP_PREWARM": prewarm})
        self.pid = self.manager.provisioner.pid
        self.seen: set[int] = set()  # every ipyparallel process this kernel started, as they appear
        self.ended = False

    def shutdown(self) -> None:
        if self.ended:
            return
        self.ended = True
        self.client.stop_channels()
        if self.manager.is_alive():
            self.manager.shutdown_kernel(now=True)
        else:
            self.manager.cleanup_resources()

    def cluster_processes(self) -> list[psutil.Process]:
        """The kernel's cluster descendants alive now: controller, fork server, engines, their nannies."""
        try:
            children = psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        found = []
        for child in children:
            try:
                if processes.is_cluster_process(child) and not gone(child.pid):
                    found.append(child)
            except psutil.Error:
                continue
        self.seen.update(p.pid for p in found)
        return found

    def output(self, code: str) -> str:
        reply, messages = self.execute(code)
        assert reply["content"]["status"] == "ok", reply["content"]
        return self.stdout(messages)

    def stderr(self, messages: list) -> str:
        return "".join(
            m["content"]["text"] for _, m in messages if m["msg_type"] == "stream" and m["content"]["name"] == "stderr"
        )

    def value(self, expression: str):
        return json.loads(self.output(f"import json as _json, nbfsdp; print(_json.dumps({expression}))"))

    def wait_until_ready(self, world_size: int) -> list[str]:
        """Poll ``%fsdp status`` until it shows the world; every answer it gave on the way."""
        answers = []
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            answers.append(self.output("%fsdp status"))
            self.cluster_processes()
            if f"world size {world_size}, backend gloo" in answers[-1]:
                return answers
            time.sleep(0.25)
        raise AssertionError(f"no world of {world_size} after {READY_TIMEOUT:g}s; last status: {answers[-1:]}")


@pytest.fixture
def kernels():
    """Start kernels with ``kernels(prewarm)``; afterwards each is shut down and none leaves an engine behind."""
    started: list[PrewarmKernel] = []

    def start(prewarm: str) -> PrewarmKernel:
        started.append(PrewarmKernel(prewarm))
        return started[-1]

    yield start
    for kernel in started:
        kernel.cluster_processes()
        kernel.shutdown()
    for kernel in started:
        assert left_behind(kernel.seen, 30) == [], "engines or a controller outlived their kernel"


@pytest.fixture(scope="module")
def foreground_kernel():
    """The kernel the values that start nothing share (a kernel's start and its first import of torch cost
    seconds of CPU); at the end it is shut down and leaves no engine behind."""
    kernel = PrewarmKernel("0")
    yield kernel
    kernel.cluster_processes()
    kernel.shutdown()
    assert left_behind(kernel.seen, 30) == [], "engines or a controller outlived their kernel"


@pytest.fixture
def kernel_with_prewarm(foreground_kernel):
    """``kernel_with_prewarm(value)``: the shared kernel, its ``NBFSDP_PREWARM`` set to ``value`` for the next
    ``%load_ext nbfsdp``; afterwards nbfsdp is unloaded and every cluster process it started is gone, so the
    next test loads it afresh."""

    def set_prewarm(value: str) -> PrewarmKernel:
        foreground_kernel.output(f"import os as _os\n_os.environ['NBFSDP_PREWARM'] = {value!r}")
        return foreground_kernel

    yield set_prewarm
    foreground_kernel.cluster_processes()
    foreground_kernel.output("%unload_ext nbfsdp")
    assert left_behind(foreground_kernel.seen, 30) == [], "engines or a controller outlived the unload"


def _timed(kernel: PrewarmKernel, code: str) -> tuple[str, float]:
    started = time.monotonic()
    out = kernel.output(code)
    return out, time.monotonic() - started


def test_load_ext_returns_at_once_and_the_engines_come_up_without_a_cell(kernels):
    kernel = kernels("2")
    started = time.monotonic()
    _, load_seconds = _timed(kernel, "%load_ext nbfsdp")
    answers = kernel.wait_until_ready(2)
    warm_up = time.monotonic() - started
    # torch and the engines load behind it: a small part of the warm-up, however busy the machine (relative: an
    # absolute bound holds only on an idle one; the seconds a user waits are benchmarks/cold_start.py's figure)
    assert load_seconds < warm_up / 4, f"%load_ext took {load_seconds:.2f}s of a {warm_up:.2f}s warm-up"
    assert "nbfsdp: starting 2 engines in the background (since " in answers[0]
    status = answers[-1]
    lines = status.splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:1] == ["rank"])  # after the world and hosts lines
    header, rows = lines[at], lines[at + 1 :]
    pids = [int(row.split()[header.split().index("pid")]) for row in rows]
    assert len(pids) == 2 and len(kernel.cluster_processes()) >= 3  # the controller and both engines

    out, cell_seconds = _timed(kernel, ALL_REDUCE.format(n=2) + "print(total, seen)")
    assert "3.0 2" in out
    assert kernel.value("nbfsdp._magics.session.cluster.world.pids") == pids  # the same engines, no restart
    assert kernel.value("nbfsdp._magics.session.cluster.processes_started") == 2
    assert cell_seconds < warm_up / 2, f"first cell {cell_seconds:.2f}s against a warm-up of {warm_up:.2f}s"


def test_a_cell_right_after_load_ext_runs_once_the_background_imports_are_done(kernels):
    """A cell importing torch while the background start imported it could find torch half-initialized."""
    kernel = kernels("2")
    kernel.output("%load_ext nbfsdp")
    assert kernel.value("'nbfsdp.engines.engine' in __import__('sys').modules") is True
    kernel.output("import torch.distributed.fsdp")  # what failed: a circular-import error from inside torch


def test_prewarm_off_starts_nothing_and_a_cell_still_works(kernel_with_prewarm):
    kernel = kernel_with_prewarm("0")
    kernel.output("%load_ext nbfsdp")
    time.sleep(3)
    assert kernel.cluster_processes() == []
    assert kernel.output("%fsdp status").strip() == "nbfsdp: no cluster running"
    kernel.output(ALL_REDUCE.format(n=2))
    assert kernel.value("[total, seen]") == [3.0, 2]


def test_a_cell_sent_while_the_engines_start_waits_for_them_and_is_right(kernels):
    kernel = kernels("2")
    assert "in the background" in kernel.output("%load_ext nbfsdp\n%fsdp status")
    kernel.output(ALL_REDUCE.format(n=2))
    assert kernel.value("[total, seen]") == [3.0, 2]
    assert kernel.value("nbfsdp._magics.session.cluster.processes_started") == 2  # the background's engines


def test_a_cell_of_another_world_size_than_prewarmed_runs_on_its_own(kernels):
    kernel = kernels("1")
    kernel.output("%load_ext nbfsdp")
    kernel.wait_until_ready(1)
    one = kernel.value("nbfsdp._magics.session.cluster.world.pids")
    kernel.output(ALL_REDUCE.format(n=2))
    assert kernel.value("[total, seen]") == [3.0, 2]
    two = kernel.value("nbfsdp._magics.session.cluster.world.pids")
    assert len(two) == 2 and not set(one) & set(two)
    assert "world size 2, backend gloo" in kernel.output("%fsdp status")
    assert all(gone(pid) for pid in one)


@pytest.mark.parametrize(
    ("value", "world_size"),
    [(None, None), ("", None), ("3", 3), (" 64 ", 64), ("0", 0), ("off", 0), ("False", 0), ("NO", 0), ("x", 0)],
)
def test_what_each_value_asks_for(monkeypatch, capsys, value, world_size):
    if value is None:
        monkeypatch.delenv("NBFSDP_PREWARM", raising=False)
    else:
        monkeypatch.setenv("NBFSDP_PREWARM", value)
    assert nbfsdp.prewarm_world_size() == world_size  # None: the default world size; 0: nothing
    assert ("is not valid" in capsys.readouterr().err) == (value == "x")


@pytest.mark.parametrize("value", ["lots", "65", "-2"])
def test_a_bad_value_warns_with_the_valid_ones_and_starts_nothing(kernel_with_prewarm, value):
    kernel = kernel_with_prewarm(value)
    reply, messages = kernel.execute("%load_ext nbfsdp")
    assert reply["content"]["status"] == "ok", reply["content"]
    warning = kernel.stderr(messages)
    assert f"NBFSDP_PREWARM={value!r} is not valid" in warning
    for valid in ("0, off, false or no", "from 1 to 64", "unset"):
        assert valid in warning
    time.sleep(2)
    assert kernel.cluster_processes() == []
    assert kernel.output("%fsdp status").strip() == "nbfsdp: no cluster running"


def is_engine(process: psutil.Process) -> bool:
    """A process the cluster's fork server forked."""
    with contextlib.suppress(psutil.Error, AttributeError):  # AttributeError: no parent any more
        return "nbfsdp.helpers.forkserver" in " ".join(process.parent().cmdline())
    return False


@pytest.mark.parametrize("how", ["killed", "shut down"])
def test_a_kernel_gone_while_the_engines_start_leaves_none_behind(kernels, how):
    kernel = kernels("2")
    kernel.output("%load_ext nbfsdp")
    deadline = time.monotonic() + READY_TIMEOUT
    # mid-start: engine processes launched, the world not set up yet
    while not any(is_engine(p) for p in kernel.cluster_processes()):
        assert time.monotonic() < deadline, "no engine was ever launched"
        time.sleep(0.05)
    assert "in the background" in kernel.output("%fsdp status")
    kernel.cluster_processes()
    if how == "killed":
        os.kill(kernel.pid, signal.SIGKILL)  # no clean-up runs: the reaper must end the cluster
    else:
        kernel.manager.shutdown_kernel(now=False)  # a shutdown request, as a notebook sends
    assert left_behind(kernel.seen, 30) == []
    kernel.shutdown()


def _first_child_running(parent: int, module: str, within: float) -> psutil.Process:
    """``parent``'s child running ``python -m module``, seen within about a millisecond of its start: only
    processes new since the call are looked at (``psutil.Process.children`` reads every process each time), and
    the look sleeps a millisecond between rounds (without, it took a whole core from the start it waits for)."""
    deadline = time.monotonic() + within
    others = set(psutil.pids())
    while time.monotonic() < deadline:
        time.sleep(0.001)
        for pid in set(psutil.pids()) - others:
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(pid)
                if process.ppid() != parent:
                    others.add(pid)
                elif module in process.cmdline():  # else not yet exec'd: looked at again
                    return process
    raise AssertionError(f"no {module} started within {within:g}s")


def test_a_kernel_killed_the_moment_its_controller_starts_leaves_nothing_behind(kernels):
    """Killed before it can note the new controller (the kernel gets to that about 10 ms after the launch):
    the reaper must still end the controller and the schedulers it forks, and its directory must stay gone
    (a controller that lived on created it again)."""
    kernel = kernels("2")
    kernel.output("%load_ext nbfsdp")
    kernel.cluster_processes()  # the fork server
    controller = _first_child_running(kernel.pid, "ipyparallel.controller", READY_TIMEOUT)
    os.kill(kernel.pid, signal.SIGKILL)
    private_dir = controller.environ()["IPP_PROFILE_DIR"]

    def controller_session() -> list[int]:  # the controller and the schedulers it forks
        return [p.pid for p in psutil.process_iter() if not gone(p.pid) and _session(p.pid) == controller.pid]

    deadline = time.monotonic() + 30
    while controller_session() and time.monotonic() < deadline:
        time.sleep(0.25)
    assert controller_session() == [], "the controller or its schedulers outlived the kernel"
    assert removed(private_dir, 10)
    time.sleep(1.0)
    assert not os.path.exists(private_dir), "a process of the cluster created its directory again"
    assert left_behind(kernel.seen, 30) == []
    kernel.shutdown()


def _session(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        return os.getsid(pid)
    return None


def test_interrupting_a_cell_that_waits_for_the_background_start(kernels):
    kernel = kernels("2")
    kernel.output("%load_ext nbfsdp")
    reply, _ = kernel.execute(ALL_REDUCE.format(n=2), interrupt_after=0.5)
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
    kernel.output(ALL_REDUCE.format(n=2))  # the next cell waits again, and works
    assert kernel.value("[total, seen]") == [3.0, 2]


def test_interrupting_a_plain_cell_that_waits_for_the_background_imports_stops_that_cell(kernels):
    """IPython runs a cell whatever its pre_run_cell callbacks raise: without the rejection the cell ran after
    the Ctrl-C, alongside the imports it had waited for, and the callback's KeyboardInterrupt was printed."""
    kernel = kernels("2")
    kernel.output("%load_ext nbfsdp")
    reply, messages = kernel.execute("ran = True", interrupt_after=0.3)  # torch takes seconds to import
    assert reply["content"]["status"] == "error", "the cell ran: the interrupt did not stop it"
    assert reply["content"]["ename"] == "InputRejected"
    assert "this cell did not run" in reply["content"]["evalue"]
    assert "Error in callback" not in kernel.stdout(messages)
    assert kernel.value("'ran' in globals()") is False  # this cell waits for the imports again, then runs
    assert kernel.value("'nbfsdp.engines.engine' in __import__('sys').modules") is True
    kernel.output("ran = True")  # rejected once only
    assert kernel.value("ran") is True


def test_a_cell_that_does_not_compile_after_that_interrupt_leaves_the_next_cell_alone(kernels):
    kernel = kernels("2")
    kernel.output("%load_ext nbfsdp")
    reply, _ = kernel.execute("ran = (", interrupt_after=0.3)
    assert reply["content"]["ename"] == "SyntaxError"
    kernel.output("ran = True")  # not rejected in the stead of the cell that never compiled
    assert kernel.value("ran") is True


@pytest.mark.parametrize("action", ["%fsdp stop", "%unload_ext nbfsdp"])
def test_stop_or_unload_while_the_engines_start_waits_then_ends_them(kernels, action):
    kernel = kernels("2")
    kernel.output("%load_ext nbfsdp")
    while not kernel.cluster_processes():
        time.sleep(0.05)
    kernel.output(action)
    assert left_behind(kernel.seen, 10) == []
    assert kernel.cluster_processes() == []
    kernel.output("%load_ext nbfsdp")  # after an unload, loads again (and starts again in the background)
    kernel.output(ALL_REDUCE.format(n=2))
    assert kernel.value("[total, seen]") == [3.0, 2]


def test_a_failed_background_start_prints_nothing_and_the_next_start_tries_again(monkeypatch, capfd):
    def broken(self, devices):
        raise RuntimeError("no engines today")

    real = FSDPCluster._start_engines
    monkeypatch.setattr(FSDPCluster, "_start_engines", broken)
    cluster = FSDPCluster()
    try:
        started = time.monotonic()
        cluster.start_in_background(1, 30.0)
        assert time.monotonic() - started < 0.5
        assert not cluster.running  # waits for the background start, which failed
        assert cluster.starting is None and str(cluster.background_error) == "no engines today"
        assert capfd.readouterr() == ("", "")  # kept, not printed
        with pytest.raises(RuntimeError, match="no engines today"):
            cluster.ensure_world(cluster.plan_world(1, 30.0))  # the normal path raises it, where a cell would show it
        monkeypatch.setattr(FSDPCluster, "_start_engines", real)
        world = cluster.ensure_world(cluster.plan_world(1, 30.0))
        assert world.world_size == 1 and cluster.background_error is None
    finally:
        cluster.stop()
