"""A failing rank ends the cell fast, names itself, and leaves a cluster that works."""

from __future__ import annotations

import pytest
import torch

from nbfsdp.kernel.cluster.rank_calls import RankError
from tests.conftest import run_failing, run_ok

pytestmark = pytest.mark.timeout(120)


def _assert_next_cell_works(shell):
    run_ok(
        shell,
        """%%fsdp --world-size 2
import torch, torch.distributed as dist
t = torch.ones(1)
dist.all_reduce(t)
summed = t.item()
""",
    )
    assert shell.user_ns["summed"] == 2.0


def test_exception_on_one_rank_while_the_other_waits_in_all_reduce(shell, capsys):
    error, elapsed = run_failing(
        shell,
        """%%fsdp --world-size 2
import torch, torch.distributed as dist
if rank == 1:
    raise ValueError("rank one is broken")
dist.all_reduce(torch.ones(1))
""",
    )
    assert isinstance(error, RankError)
    assert str(error) == "rank 1: ValueError: rank one is broken"
    assert elapsed < 15
    shown = capsys.readouterr().out
    assert '[rank 1]     raise ValueError("rank one is broken")' in shown  # that rank's own traceback
    _assert_next_cell_works(shell)


def test_different_errors_on_several_ranks_are_all_named(shell):
    error, _ = run_failing(
        shell,
        """%%fsdp --world-size 2
if rank == 0:
    raise KeyError("zero")
raise ValueError("one")
""",
    )
    assert str(error) == "rank 0: KeyError: 'zero' (rank 1: ValueError: one)"
    _assert_next_cell_works(shell)


def test_exception_during_fsdp_training_while_the_other_rank_is_in_a_collective(shell, tiny_model):
    before = {n: p.detach().clone() for n, p in tiny_model.named_parameters()}
    shell.user_ns.pop("partial", None)
    error, elapsed = run_failing(
        shell,
        """%%fsdp --world-size 2
partial = "assigned before the error"
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    x, y = batch_for(rank, step)
    loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
    if rank == 0 and step == 1:
        raise RuntimeError("diverged")
""",
    )
    assert str(error) == "rank 0: RuntimeError: diverged"
    assert elapsed < 15
    # nothing in the notebook changed
    assert "partial" not in shell.user_ns
    for name, param in tiny_model.named_parameters():
        assert torch.equal(param.detach(), before[name]), name
    _assert_next_cell_works(shell)


def test_timeout_bounds_a_collective_that_a_peer_never_joins(shell):
    error, elapsed = run_failing(
        shell,
        """%%fsdp --world-size 2 --timeout 3
import torch, torch.distributed as dist
if rank == 0:
    dist.all_reduce(torch.ones(1))
""",
    )
    assert str(error).startswith("rank 0: ")
    assert "timed out" in str(error).lower() or "timeout" in str(error).lower()
    assert elapsed < 10
    _assert_next_cell_works(shell)


@pytest.mark.parametrize(
    ("how", "expected"),
    [("os._exit(3)", "engine died: exited with code 3"), ("os.kill(os.getpid(), 9)", "engine died: killed by SIGKILL")],
)
def test_a_rank_that_dies_is_named_and_the_next_cell_restarts_the_world(shell, cluster, how, expected):
    run_ok(shell, "%%fsdp --world-size 2\npass\n")
    old_pids = list(cluster.world.pids)
    error, elapsed = run_failing(
        shell,
        f"""%%fsdp --world-size 2
import os, time
if rank == 1:
    {how}
time.sleep(30)
""",
    )
    assert str(error).startswith(f"rank 1: {expected}"), str(error)
    assert elapsed < 10
    _assert_next_cell_works(shell)
    assert not set(cluster.world.pids) & set(old_pids)  # a fresh set of engines
