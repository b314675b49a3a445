"""Fixtures: a real IPython shell with nbfsdp loaded, on a real ipyparallel cluster.

One shell and its world-size-2 cluster serve the whole session (starting
engines costs seconds); tests that must restart or kill the world say so and
leave a working one behind.
"""

from __future__ import annotations

import _thread
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil
import pytest
import torch
from IPython.testing.globalipapp import start_ipython

import nbfsdp
from tests.scheduling import longest_files_first

# `%load_ext nbfsdp` starts engines in the background unless NBFSDP_PREWARM says not to. The tests here,
# and the kernels they and nbval start (which inherit this environment), expect the extension to load in
# the foreground and the first cell to start the engines: a prewarm would race their own starts, add
# engines to tests that count processes, and slow every kernel. tests/test_prewarm.py sets its own value.
os.environ["NBFSDP_PREWARM"] = "0"

# A run started in the background of a non-interactive shell (`make test &`, a CI runner's script) inherits
# SIGINT ignored, and Python then leaves it ignored: `_thread.interrupt_main`, the tests' stand-in for the
# user's interrupt, would do nothing and those tests would hang to their timeout. They need Python's handler.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def shell():
    ip = start_ipython()
    ip.run_line_magic("load_ext", "nbfsdp")
    yield ip
    ip.run_line_magic("unload_ext", "nbfsdp")


@pytest.fixture(autouse=True)
def leave_the_shared_shell_clean(request):
    """After each test that used the shared shell, pass or fail: a cell still running there is ended and
    the cluster stopped with it (the next cell starts one), and the controls' defaults are cleared, so one
    test's failure is not the next test's "a cell is running" or another default precision."""
    yield
    if "shell" not in request.fixturenames or nbfsdp._magics is None:
        return
    session = nbfsdp._magics.session
    if session.active is not None:
        with contextlib.suppress(BaseException):
            session.stop()
        session.active = None
    session.panel.clear()
    session.panel_world_size = None


@pytest.fixture(autouse=True)
def no_hang_report_from_a_healthy_cell():
    """Issue 45's target, over every cell the suite runs in its own process: a cell that ended well never
    printed a hang report (``--hang-report``'s false alarm). Cells that hang on purpose fail, and may report."""
    before = len(nbfsdp.runs())
    yield
    alarms = [run.hang_report for run in nbfsdp.runs()[before:] if run.ok and run.hang_report]
    assert not alarms, f"a healthy cell reported a hang: {alarms[0]}"


@pytest.fixture(scope="session")
def cluster(shell):
    """The running FSDPCluster behind ``%%fsdp`` (for pids and world state)."""
    return nbfsdp._magics.session.cluster


def forget_after_each_test(*names: str):
    """An autouse fixture for a test module: the shell is shared, so the names its tests make go after each
    (a later test must not find them: a model that fits its checkpoint, an optimizer over another model)."""

    @pytest.fixture(autouse=True)
    def forget(shell):
        yield
        for name in names:
            shell.user_ns.pop(name, None)

    return forget


def run_ok(shell, code: str):
    """Run a cell; fail the test with the cell's own error if it raised."""
    result = shell.run_cell(code)
    result.raise_error()
    return result


def run_failing(shell, code: str) -> tuple[BaseException, float]:
    """Run a cell that must fail; return its error and how long it took."""
    started = time.monotonic()
    result = shell.run_cell(code)
    elapsed = time.monotonic() - started
    error = result.error_in_exec or result.error_before_exec
    assert error is not None, "the cell was expected to fail"
    return error, elapsed


@dataclass
class Interrupt:
    """What ``interrupt_main_when`` did: whether its condition held, and when it interrupted."""

    held: bool = False
    at: float | None = None
    """``time.monotonic()`` at the interrupt."""

    def seconds_since(self) -> float:
        assert self.at is not None, "not interrupted yet"
        return time.monotonic() - self.at


def interrupt_main_when(ready: Callable[[], bool], within: float) -> Interrupt:
    """Interrupt the main thread (what the notebook's interrupt button does to a kernel) once ``ready()``
    holds, or after ``within`` seconds whether it holds or not: a cell that never gets ready is still
    ended, rather than left running into the next test."""
    interrupt = Interrupt()

    def watch() -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline and not interrupt.held:
            interrupt.held = ready()
            time.sleep(0.05)
        interrupt.at = time.monotonic()
        _thread.interrupt_main()

    threading.Thread(target=watch, name="interrupt-main", daemon=True).start()
    return interrupt


def gone(pid: int) -> bool:
    """The process has ended (a zombie waiting for its parent counts as ended)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def left_behind(pids: list[int] | set[int], seconds: float) -> list[int]:
    """The processes of ``pids`` still running after waiting up to ``seconds`` for all of them to end."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(gone(p) for p in pids):
        time.sleep(0.25)
    return sorted(p for p in pids if not gone(p))


def removed(path: str, seconds: float) -> bool:
    """``path`` no longer exists, after waiting up to ``seconds`` for it to go."""
    deadline = time.monotonic() + seconds
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not os.path.exists(path)


TINY_MODEL = """
import torch, torch.nn as nn, nbfsdp

class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
    def forward(self, x):
        return x + self.mlp(self.norm(x))

class Net(nn.Module):
    def __init__(self, width=16, depth=3):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 1)
    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

def batch_for(rank, step, per_rank=4):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(per_rank, 8, generator=g), torch.randn(per_rank, 1, generator=g)

loss_fn = nn.MSELoss()
"""


@pytest.fixture
def tiny_model(shell):
    """Defines Net, batch_for and loss_fn in the notebook and a fresh ``model``."""
    run_ok(shell, TINY_MODEL + "\ntorch.manual_seed(0)\nmodel = Net()\n")
    return shell.user_ns["model"]


#: A test that needs a CUDA GPU: skipped without one (``pytest_collection_modifyitems``); ``make test-gpu``
#: selects them by this marker (``-m gpu``).
gpu = pytest.mark.gpu


def pytest_collection_modifyitems(config, items):
    longest_files_first(items)
    if torch.cuda.is_available():
        return
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


def one_process_losses(shell, model, optimizer, world_size: int, steps: int, **batch_args) -> list[float]:
    """The steps a sharded cell of ``batch_for`` runs, in this process on the ranks' global batch: the
    losses, and ``model`` trained (the reference a parity test compares the ranks with)."""
    ns = shell.user_ns
    losses = []
    for step in range(steps):
        batches = [ns["batch_for"](rank, step, **batch_args) for rank in range(world_size)]
        loss = ns["loss_fn"](model(torch.cat([b[0] for b in batches])), torch.cat([b[1] for b in batches]))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def torchrun(script, ranks: int = 2, cwd=None) -> str:
    """A script's standard output under a real ``torchrun --standalone --nproc-per-node ranks``, run from ``cwd``."""
    # torchrun makes a log directory under the temporary directory at each launch and leaves it there
    with tempfile.TemporaryDirectory(prefix="nbfsdp-test-torchrun-") as scratch:
        ran = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(script)],
            capture_output=True, text=True, timeout=240, cwd=cwd, env={**os.environ, "TMPDIR": scratch},
        )  # fmt: skip
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
    return ran.stdout


def logged_losses(stdout: str, ranks: int = 2) -> list[list[float]]:
    """Each rank's ``nbfsdp.log(loss=...)`` from an exported script's JSON lines."""
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return [[line["loss"] for line in lines if line["rank"] == rank] for rank in range(ranks)]


def soon(value: Callable, within: float = 60.0, every: float = 0.01):
    """``value()`` once it is neither None nor False (polled every ``every`` s)."""
    deadline = time.monotonic() + within
    while (found := value()) is None or found is False:
        assert time.monotonic() < deadline, "not within a minute"
        time.sleep(every)
    return found


def child_with(parent: psutil.Process, *words: str) -> psutil.Process | None:
    """``parent``'s running child whose command line holds every word."""
    for child in parent.children():
        with contextlib.suppress(psutil.Error):
            if all(any(word in part for part in child.cmdline()) for word in words):
                return child
    return None
