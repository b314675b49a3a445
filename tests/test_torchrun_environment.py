"""A pasted torchrun script finds torchrun's environment on nbfsdp's own engines (issue 42, point 1): the
variables torchrun sets for each worker, right at world sizes 2 and 4 and after a restart; a bare
``init_process_group()`` (env://) joins the running world; ``device_id`` is taken and said; ``argparse``
sees no arguments; and the address ``MASTER_ADDR:MASTER_PORT`` names is a store a script can open, on
loopback. The attached cluster's variables are checked in ``tests/test_attach.py``."""

from __future__ import annotations

import os

import pytest

import nbfsdp
from tests.conftest import run_ok

pytestmark = [pytest.mark.floor, pytest.mark.timeout(300)]

#: torchrun's variables for one worker, as each rank reads them in a cell.
READ = """%%fsdp --world-size {n}
import os, torch.distributed as dist
NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME",
         "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
         "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "CUDA_VISIBLE_DEVICES")
mine = {{name: os.environ.get(name) for name in NAMES}}
seen = [None] * world_size
dist.all_gather_object(seen, mine)
"""


def _read(shell, world_size: int) -> list[dict[str, str | None]]:
    run_ok(shell, READ.format(n=world_size))
    return shell.user_ns["seen"]


def _assert_torchrun_layout(seen: list[dict[str, str | None]], world_size: int) -> None:
    """What ``torchrun --nproc-per-node N`` gives worker ``r`` on one host, with one rendezvous for all."""
    for rank, variables in enumerate(seen):
        assert {name: variables[name] for name in ("RANK", "LOCAL_RANK", "ROLE_RANK")} == dict.fromkeys(
            ("RANK", "LOCAL_RANK", "ROLE_RANK"), str(rank)
        ), variables
        for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE"):
            assert variables[name] == str(world_size), (name, variables)
        assert (variables["GROUP_RANK"], variables["GROUP_WORLD_SIZE"], variables["ROLE_NAME"]) == ("0", "1", "default")
        assert (variables["TORCHELASTIC_RESTART_COUNT"], variables["TORCHELASTIC_MAX_RESTARTS"]) == ("0", "0")
        assert variables["CUDA_VISIBLE_DEVICES"] == ""  # CPU ranks: the placement hid every GPU from them
    rendezvous = {(v["MASTER_ADDR"], v["MASTER_PORT"], v["TORCHELASTIC_RUN_ID"]) for v in seen}
    assert len(rendezvous) == 1, rendezvous  # one rendezvous, one run, for every rank
    address, port, run_id = rendezvous.pop()
    assert address == "127.0.0.1" and int(port) > 0 and run_id.startswith("nbfsdp-")


def test_every_rank_finds_torchruns_variables_at_two_and_four_ranks_and_after_a_restart(shell):
    two = _read(shell, 2)
    _assert_torchrun_layout(two, 2)
    four = _read(shell, 4)
    _assert_torchrun_layout(four, 4)
    nbfsdp._magics.session.cluster.kill_engines()  # a world that died: the next cell starts a new one
    again = _read(shell, 2)
    _assert_torchrun_layout(again, 2)
    runs = {seen[0]["TORCHELASTIC_RUN_ID"] for seen in (two, four, again)}
    ports = {seen[0]["MASTER_PORT"] for seen in (two, four, again)}
    assert len(runs) == 3 and len(ports) == 3  # each world its own run and rendezvous, as a new torchrun job


SCRIPT_START = """%%fsdp --world-size 2
import argparse, os
import torch, torch.distributed as dist
local_rank = int(os.environ["LOCAL_RANK"])
dist.init_process_group(device_id=torch.device("cpu"))  # the env:// default: no backend, no address
parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()
t = torch.full((1,), float(dist.get_rank() + 1))
dist.all_reduce(t)
total, steps = t.item(), args.steps
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
store.set(f"seen-{local_rank}", "yes")
dist.barrier()
both = [store.get(f"seen-{r}").decode() for r in range(world_size)]
dist.destroy_process_group()
"""


def test_a_script_start_as_torchrun_gives_it_joins_the_world(shell, capsys):
    """A bare ``init_process_group()`` joins the running world; its CPU ``device_id`` (which torch 2.13 refuses
    under torchrun) is taken, and said; ``argparse`` sees no arguments (the engine's own command line would
    fail it); the store at ``MASTER_ADDR:MASTER_PORT`` is a real one every rank reaches."""
    run_ok(shell, "import torch")
    capsys.readouterr()
    run_ok(shell, SCRIPT_START)
    said = capsys.readouterr().out
    assert shell.user_ns["total"] == 3.0 and shell.user_ns["steps"] == 3
    assert shell.user_ns["both"] == ["yes", "yes"]
    assert "init_process_group: the cell runs in the world already started (gloo, 2 ranks)" in said
    assert "init_process_group(device_id=cpu): not used, the ranks run on the CPU with gloo" in said
    assert said.count("device_id=cpu") == 1  # rank 0 says it, once


def test_the_kernel_keeps_its_own_environment(shell):
    """The variables are the ranks', set in the engines: the notebook's process is no torchrun worker."""
    run_ok(shell, "%%fsdp --world-size 2\nx = 1")
    assert "LOCAL_RANK" not in os.environ and "MASTER_PORT" not in os.environ
