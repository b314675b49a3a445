"""nbfsdp in a real Jupyter kernel, driven through jupyter_client as a notebook would."""

from __future__ import annotations

import sys
import time

import psutil
import pytest
from jupyter_client.manager import start_new_kernel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


class Kernel:
    """A kernel and its client; ``execute`` returns the cell's iopub messages with arrival times."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        """``env``: the kernel's whole environment (default: this process's)."""
        self.manager, self.client = start_new_kernel(kernel_name="python3", **({} if env is None else {"env": env}))
        self.comm_messages: list[dict] = []
        """Every comm message seen on iopub, whatever request it answers: a widget's update sent from a thread
        after a click carries the click's message as its parent, not the cell's."""

    def execute(
        self, code: str, timeout: float = 120, interrupt_after: float | None = None, on_message=None
    ) -> tuple[dict, list]:
        """Run a cell; ``on_message(msg)`` sees each of its iopub messages as it arrives (to act mid-cell)."""
        msg_id = self.client.execute(code)
        started = time.monotonic()
        messages: list[tuple[float, dict]] = []
        interrupted = False
        while True:
            if interrupt_after is not None and not interrupted and time.monotonic() - started > interrupt_after:
                self.manager.interrupt_kernel()
                interrupted = True
            try:
                msg = self.client.get_iopub_msg(timeout=0.1)
            except Exception:
                assert time.monotonic() - started < timeout, f"cell did not finish in {timeout}s"
                continue
            if msg["msg_type"].startswith("comm_"):
                self.comm_messages.append(msg)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            messages.append((time.monotonic() - started, msg))
            if on_message is not None:
                on_message(msg)
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        while (reply := self.client.get_shell_msg(timeout=timeout))["parent_header"].get("msg_id") != msg_id:
            pass  # a reply to an earlier request (kernel_info, say): not this cell's
        return reply, messages

    def send_widget_message(self, comm_id: str, data: dict) -> None:
        """What the browser sends when a person changes or clicks a widget."""
        self.client.shell_channel.send(self.client.session.msg("comm_msg", {"comm_id": comm_id, "data": data}))

    def stdout(self, messages: list) -> str:
        return "".join(m["content"]["text"] for _, m in messages if m["msg_type"] == "stream")

    def shutdown(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def warm_kernel(setup: str) -> Kernel:
    """A kernel that ran ``setup`` (which loads nbfsdp) and one cell, so its 2-rank cluster is up."""
    k = Kernel()
    reply, _ = k.execute(setup)
    assert reply["content"]["status"] == "ok"
    reply, _ = k.execute("%%fsdp --world-size 2\npass")  # start the cluster once
    assert reply["content"]["status"] == "ok", reply["content"]
    return k


@pytest.fixture(scope="module")
def kernel():
    k = warm_kernel("import sys; print(sys.executable)\n%load_ext nbfsdp\nimport torch, nbfsdp")
    yield k
    k.shutdown()


@pytest.mark.floor
def test_kernel_runs_this_environment(kernel):
    _, messages = kernel.execute("import sys; print(sys.executable)")
    assert kernel.stdout(messages).strip() == sys.executable


@pytest.mark.floor
def test_rank_output_streams_line_by_line_while_the_cell_runs(kernel):
    _, messages = kernel.execute("""%%fsdp --world-size 2
import time
for i in range(4):
    print(f"tick {i}")
    time.sleep(0.5)
""")
    end = messages[-1][0]
    arrivals = {}
    for at, msg in messages:
        if msg["msg_type"] == "stream":
            for line in msg["content"]["text"].splitlines():
                arrivals.setdefault(line, at)
    for rank in (0, 1):
        assert [f"[rank {rank}] tick {i}" in arrivals for i in range(4)] == [True] * 4
        # the first line arrived while the cell still had most of its 2 s to run
        assert arrivals[f"[rank {rank}] tick 0"] < end - 1.0


@pytest.mark.floor
def test_help_shows_every_flag(kernel):
    reply, _ = kernel.execute("%%fsdp?")
    page = reply["content"]["payload"][0]["data"]["text/plain"]
    for flag in ("--world-size", "--timeout", "--no-gather"):
        assert flag in page


def test_a_failing_rank_shows_its_own_traceback_and_name(kernel):
    reply, messages = kernel.execute("%%fsdp --world-size 2\nif rank == 1:\n    1 / 0\n")
    error = next(m for _, m in messages if m["msg_type"] == "error")["content"]
    assert error["ename"] == "RankError"
    assert error["evalue"] == "rank 1: ZeroDivisionError: division by zero"
    assert any("[rank 1]     1 / 0" in line for line in error["traceback"])
    reply, _ = kernel.execute("%%fsdp --world-size 2\nok = True")
    assert reply["content"]["status"] == "ok"


def test_interrupt_ends_the_cell_and_the_next_cell_works(kernel):
    started = time.monotonic()
    reply, _ = kernel.execute("%%fsdp --world-size 2\nimport time\ntime.sleep(60)\n", interrupt_after=2.0)
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    assert time.monotonic() - started < 2.0 + 20.0  # a hang guard: the cell would sleep 60 s
    reply, messages = kernel.execute("%%fsdp --world-size 2\nprint('alive', rank)")
    assert reply["content"]["status"] == "ok"
    assert "[rank 1] alive 1" in kernel.stdout(messages)


@pytest.mark.floor
def test_unload_stops_the_engines(kernel):
    _, messages = kernel.execute("print(nbfsdp._magics.session.cluster.world.pids)")
    pids = eval(kernel.stdout(messages))
    assert all(psutil.pid_exists(pid) for pid in pids)
    reply, messages = kernel.execute("%unload_ext nbfsdp")
    assert reply["content"]["status"] == "ok"
    assert "engine set stopped" not in kernel.stdout(messages)  # no ipyparallel logs of engines ended on purpose
    deadline = time.monotonic() + 15
    while any(psutil.pid_exists(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(psutil.pid_exists(pid) for pid in pids)
    reply, _ = kernel.execute("%load_ext nbfsdp")  # and it loads again
    assert reply["content"]["status"] == "ok"
