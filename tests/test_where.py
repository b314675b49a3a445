"""``%fsdp where``: each rank's stack and collectives while a cell hangs, which rank left the others
waiting, and ``%fsdp interrupt`` ending the hang; real ranks, real gloo collectives."""

from __future__ import annotations

import dataclasses
import time

import pytest
from IPython.core.error import UsageError

import nbfsdp
from nbfsdp.shared.config import FSDPConfig, for_device
from nbfsdp.shared.devices import Devices
from nbfsdp.ui.dashboard import DashboardCalls, LiveDashboard
from tests.conftest import run_failing, run_ok

pytestmark = pytest.mark.timeout(240)

BRANCH = """%%fsdp --world-size 2 --async
import torch.distributed as dist
t = torch.ones(3)
dist.all_reduce(t)
if rank == 0:
    dist.all_reduce(t)  # rank 1 never joins
"""
REORDERED = """%%fsdp --world-size 2 --async
import torch.distributed as dist
a, b = torch.ones(4), torch.ones(4)
if rank == 0:
    dist.all_reduce(a); dist.broadcast(b, src=0)
else:
    dist.broadcast(b, src=0); dist.all_reduce(a)
"""


def _asked_while_it_hangs(shell, cell: str) -> tuple[nbfsdp.kernel.diagnostics.where.Where, float]:
    run_ok(shell, "import torch")
    run_ok(shell, "%%fsdp --world-size 2\nwarm = rank")
    run_ok(shell, cell)
    time.sleep(1.0)  # the ranks reach the hang
    started = time.monotonic()
    where = nbfsdp.where()
    return where, time.monotonic() - started


def test_a_rank_waiting_in_a_collective_the_other_never_issued_is_named(shell, capsys):
    where, seconds = _asked_while_it_hangs(shell, BRANCH)
    assert seconds < 2.0  # the watcher answers while the main thread is blocked in gloo
    first, second = where.positions
    done = second.count((0, 1))  # numbered since the world began: the shared cluster may have run others
    assert first.in_cell and first.inside["op"] == "all_reduce" and first.inside["seq"] == done + 1
    assert first.inside["at"].startswith("<fsdp-cell-") and first.inside["group"] == [0, 1]
    assert not second.in_cell and done >= 1
    said = str(where)
    assert f"rank 0: waiting in all_reduce #{done + 1} of group (0, 1)" in said
    assert "dist.all_reduce(t)  # rank 1 never joins" in said  # the cell's own line, in rank 0's stack
    assert (
        f"rank 0 issued all_reduce #{done + 1} on group (0, 1), which rank 1 did not (rank 1 issued {done} there)"
        in said
    )
    capsys.readouterr()
    run_ok(shell, "%fsdp interrupt")  # ends the hang: SIGINT, then a kill for the rank blocked in gloo
    out = capsys.readouterr().out
    assert f"nbfsdp: interrupted; rank 0 was in all_reduce #{done + 1} (issued at <fsdp-cell-" in out, out
    assert "The run ended on every rank" in out
    run_ok(shell, "%%fsdp --world-size 2\nprint('back', rank)")
    out = capsys.readouterr().out
    assert all(f"[rank {r}] back {r}" in out for r in range(2)), out


def test_collectives_issued_in_another_order_are_named_with_their_number(shell):
    where, _ = _asked_while_it_hangs(shell, REORDERED)
    assert [p.inside["op"] for p in where.positions] == ["all_reduce", "broadcast"]
    number = where.positions[0].count((0, 1))  # the cell's first collective on the group, each rank's last
    assert (
        f"collectives out of order on group (0, 1): #{number} is rank 0 all_reduce, rank 1 broadcast" in where.findings
    )
    run_ok(shell, "%fsdp interrupt")


def test_after_a_cell_that_trained_every_rank_issued_the_same_collectives(shell, capsys):
    run_ok(shell, "import torch, torch.nn as nn\nnet = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))")
    run_ok(
        shell,
        "%%fsdp --world-size 2 --wrap-cls Linear\nfor _ in range(3):\n    net(torch.randn(4, 8)).sum().backward()",
    )
    capsys.readouterr()
    run_ok(shell, "%fsdp where")
    said = capsys.readouterr().out
    assert "rank 0: idle" in said and "rank 1: idle" in said
    assert "every rank has issued the same collectives" in said and "no rank is waiting" in said
    counts = {p.count((0, 1)) for p in nbfsdp.where().positions}
    assert len(counts) == 1 and counts.pop() >= 3 * 2  # FSDP2's gathers and reductions, counted on both ranks


def test_where_the_flight_recorder_records_each_ranks_last_collectives_are_shown(shell, monkeypatch):
    """torch's flight recorder (on by default on NCCL worlds; asked for here on gloo, which torch 2.13 records
    too): its last entries come with each rank's answer, so ``%fsdp where`` and the hang report show them."""
    if not hasattr(__import__("torch")._C._distributed_c10d, "_dump_fr_trace"):
        pytest.skip("this torch's flight recorder records NCCL only")
    # the last of the hangs: it stops the world at its start and at its end, and the tests below start none
    run_ok(shell, "%fsdp stop")  # the engines take the variable when they start
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "64")
    try:
        where, _ = _asked_while_it_hangs(shell, BRANCH)
        first, second = where.positions
        assert first.flights and second.flights
        ours = first.flights[-1]
        assert ours["op"] == "gloo:all_reduce" and ours["sizes"] == [[3]]
        assert ours["seq"] == second.flights[-1]["seq"] + 1  # rank 0 issued one more than rank 1
        assert "    flight recorder: " in str(where) and f"gloo:all_reduce #{ours['seq']} of group" in str(where)
        run_ok(shell, "%fsdp interrupt")
    finally:
        run_ok(shell, "%fsdp stop")


def test_where_and_interrupt_without_a_run_say_so(shell, capsys):
    run_ok(shell, "%fsdp stop")
    error, _ = run_failing(shell, "%fsdp where")
    assert isinstance(error, UsageError) and "no world is running" in str(error)
    capsys.readouterr()
    run_ok(shell, "%fsdp interrupt")
    assert "no background run" in capsys.readouterr().out


def test_the_dashboard_asks_where_the_ranks_are_from_a_button(shell):
    settings = {**dataclasses.asdict(for_device(FSDPConfig(), Devices("cpu", 2))), "world_size": 2}
    asked = []
    calls = DashboardCalls(
        on_change=lambda change: "",
        on_stop=lambda: None,
        on_where=lambda: asked.append(1) or "rank 0: waiting in all_reduce #2 <here>",
    )
    dashboard = LiveDashboard(Devices("cpu", 2), settings=settings, calls=calls)
    dashboard._where.click()
    assert asked == [1] and "rank 0: waiting in all_reduce #2 &lt;here&gt;" in dashboard._where_text.value
    dashboard.finish([], "done")
    assert dashboard._where.disabled
