"""A hang reported by itself (issue 45, point 3): a rank that waits in one collective longer than
``--hang-report`` seconds makes the cell print ``%fsdp where``'s report by itself, naming the stuck rank, the
collective and the cell's line, while the cell goes on waiting for ``--timeout``; a healthy cell reports nothing.
Real ranks, real gloo collectives."""

from __future__ import annotations

import pytest

import nbfsdp
from tests.conftest import run_failing, run_ok

pytestmark = pytest.mark.timeout(240)

HANG = """%%fsdp --world-size 2 --hang-report 2 --timeout 8
import torch.distributed as dist
t = torch.ones(3)
if rank == 0:
    dist.all_reduce(t)  # rank 1 never joins
"""


def test_a_rank_stuck_in_a_collective_is_reported_by_itself_within_the_seconds_given(shell, capsys):
    run_ok(shell, "import torch")
    run_ok(shell, "%%fsdp --world-size 2\nwarm = rank")
    capsys.readouterr()
    error, _ = run_failing(shell, HANG)  # --timeout ends it: the report did not
    run = nbfsdp.last_run()
    # from the cell's start: the ranks reach the collective a moment later, and it is reported within 2 s of 2 s
    assert 2.0 < run.hang_report_after < 2.0 + 2.0 + 0.5, run.hang_report_after
    report = run.hang_report
    assert report.startswith("nbfsdp: a rank has waited ") and " s in one collective (--hang-report 2)" in report
    assert "rank 0: waiting in all_reduce" in report and "rank 1: idle" in report
    assert "dist.all_reduce(t)  # rank 1 never joins" in report  # the cell's own line
    assert "rank 0 issued all_reduce" in report and "which rank 1 did not" in report
    assert report in capsys.readouterr().err  # printed once, by itself
    assert "Timed out waiting 8000ms" in str(error), error  # the cell waited for --timeout all the same


def test_a_healthy_cell_that_waits_outside_collectives_reports_nothing(shell):
    run_ok(shell, "import torch, time")
    run_ok(shell, "%%fsdp --world-size 2 --hang-report 1\nt = torch.ones(2)\ntorch.distributed.all_reduce(t)\n"
           "time.sleep(3)\ntorch.distributed.all_reduce(t)\n")  # fmt: skip
    assert nbfsdp.last_run().hang_report == ""


def test_hang_report_zero_is_off_and_a_negative_one_is_refused(shell):
    run_ok(shell, "import torch")
    error, _ = run_failing(shell, "%%fsdp --world-size 2 --hang-report -1\npass\n")
    assert "--hang-report must be 0 (off) or a positive number of seconds, got -1" in str(error)
    error, _ = run_failing(
        shell, HANG.replace("--hang-report 2", "--hang-report 0").replace("--timeout 8", "--timeout 4")
    )
    assert nbfsdp.last_run().hang_report == ""
