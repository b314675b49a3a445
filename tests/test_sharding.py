"""Each rank receives and holds only its own shard of the notebook's model."""

from __future__ import annotations

import os
import signal
import time

import ipyparallel as ipp
import pytest
import torch.nn as nn
from IPython.core.error import UsageError

import nbfsdp
from benchmarks import procmem
from nbfsdp.kernel.cluster import local
from nbfsdp.shared import transfer
from tests.conftest import run_failing, run_ok

pytestmark = [pytest.mark.floor, pytest.mark.timeout(180)]


def test_each_rank_holds_only_its_dim0_shard(shell, tiny_model):
    run_ok(
        shell,
        """%%fsdp --world-size 2 --wrap-cls Block
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
mine = {
    "locals": {n: (isinstance(p, DTensor), p.to_local().shape[0], p.numel()) for n, p in model.named_parameters()},
    "units": [n for n, m in model.named_modules() if isinstance(m, FSDPModule)],
}
per_rank = [None] * world_size
dist.all_gather_object(per_rank, mine)
""",
    )
    per_rank = shell.user_ns["per_rank"]
    for name, param in tiny_model.named_parameters():
        rows = param.shape[0]
        for rank, seen in enumerate(per_rank):
            is_dtensor, local_rows, full_numel = seen["locals"][name]
            assert is_dtensor, name
            assert full_numel == param.numel()
            assert local_rows == len(range(rows)[rank * -(-rows // 2) : (rank + 1) * -(-rows // 2)]), name
        assert sum(seen["locals"][name][1] for seen in per_rank) == rows
    # each Block is a unit (--wrap-cls), then the root
    assert all(seen["units"] == ["", "blocks.0", "blocks.1", "blocks.2"] for seen in per_rank)


def _big_model(width: int = 2048) -> nn.Module:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(8)])  # at 2048: 33.6M parameters, 134 MB


def test_what_is_sent_to_a_rank_is_a_quarter_of_the_model_at_world_size_4():
    model = _big_model()
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    for rank in range(4):
        pieces = list(transfer.pieces({"m": transfer.rank_tensors(model, rank, 4)}, 2**20))
        sent = sum(data.nbytes for piece in pieces for _, data in piece)
        assert abs(sent - full / 4) <= 0.05 * full / 4
        assert all(sum(data.nbytes for _, data in piece) <= 2**20 for piece in pieces)


def test_pieces_are_views_of_the_notebooks_tensors_not_copies():
    model = _big_model()
    first_weight = model[0].weight
    (key, data), *_ = next(transfer.pieces({"m": transfer.rank_tensors(model, 1, 2)}, 2**20))
    assert key == ("m", "0.weight", 0)
    # rank 1's chunk starts half-way into the weight's storage: the bytes are the notebook's own
    assert data.ctypes.data == first_weight.data_ptr() + first_weight.nbytes // 2


def test_transfer_memory_engines_near_their_shard_notebook_near_nothing(shell, cluster):
    """Issue 7's transfer targets: each engine peaks at most 1.3x its shard above its baseline, the
    notebook at most 0.1x the model above what holding the model costs, and each rank receives its half."""
    # the engines' baseline: FSDP2 already used once (its first use costs ~30 MB of its own)
    shell.user_ns["small"] = nn.Linear(4, 4)
    run_ok(shell, "%%fsdp --world-size 2\nimport torch\nsmall(torch.ones(2, 4)).sum().backward()\n")
    shell.user_ns["big"] = model = _big_model()
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    shard = full / 2
    engines = {pid: procmem.reset_peak(pid) for pid in cluster.world.pids}
    notebook = procmem.reset_peak(os.getpid())
    run_ok(
        shell,
        """%%fsdp --world-size 2 --no-gather
local_bytes = sum(p.to_local().nbytes for p in big.parameters())
""",
    )
    notebook_growth = procmem.read(os.getpid())["hwm"] - notebook
    assert shell.user_ns["local_bytes"] == shard
    for pid, before in engines.items():
        growth = procmem.read(pid)["hwm"] - before
        # the shards' own storage plus one piece in flight (before: ~2.5x, the whole shard as
        # received beside the storage FSDP2 allocated for it)
        assert growth <= 1.3 * shard, f"engine {pid} grew {growth / 2**20:.0f} MiB for a {shard / 2**20:.0f} MiB shard"
    assert notebook_growth <= 0.1 * full, f"notebook grew {notebook_growth / 2**20:.0f} MiB sending {full / 2**20:.0f}"
    sent = nbfsdp.last_run().sent_bytes
    assert len(sent) == 2 and all(abs(n - shard) <= 0.05 * shard for n in sent), sent
    del shell.user_ns["big"], shell.user_ns["small"]


def _killed_and_unregistered(cluster) -> None:
    """Kill rank 1's engine and wait until the controller has let it go: ipyparallel then refuses a call to it
    outright, before any message is sent. Local engines run without ipyparallel's nanny, so the controller would
    let go after 30 s of missed heartbeats; the test sends the hub the message a nanny sends when its engine ends
    (``unregistration_request``, which the hub's heartbeat failure also ends in), and waits seconds, not 30."""
    engine_id = cluster.world.engine_ids[1]
    os.kill(cluster.world.pids[1], signal.SIGKILL)
    client = cluster.client
    client.session.send(client._query_socket, "unregistration_request", content={"id": engine_id})
    deadline = time.monotonic() + 60
    while engine_id in cluster.client.ids:
        assert time.monotonic() < deadline, "the controller kept a killed engine for a minute"
        time.sleep(0.2)


@pytest.mark.parametrize("cell", ["out = fresh.weight.shape", "out = 1"])
def test_a_cell_after_an_engine_the_controller_let_go_fails_at_once_and_the_next_runs(shell, cluster, cell):
    """Delivering shards, or starting the cell itself, to an engine the controller no longer has: that rank named
    as dead (not ipyparallel's ``IndexError: No such engine``), and the next cell runs on a new world."""
    run_ok(shell, "%%fsdp --world-size 2\npass\n")
    _killed_and_unregistered(cluster)
    shell.user_ns["fresh"] = nn.Linear(64, 64)  # a model the engines have not seen: its shards are delivered
    error, _ = run_failing(shell, f"%%fsdp --world-size 2\n{cell}\n")
    doing = "receiving its shards" if "fresh" in cell else "before the cell started"
    assert "rank 1" in str(error) and doing in str(error) and "is gone" in str(error), error
    run_ok(shell, f"%%fsdp --world-size 2\n{cell}\n")  # the next cell restarts the world
    assert shell.user_ns["out"] in ((64, 64), 1)
    del shell.user_ns["fresh"], shell.user_ns["out"]


def test_an_engine_that_died_before_its_shards_arrive_fails_the_cell_at_once(shell, cluster):
    run_ok(shell, "%%fsdp --world-size 2\npass\n")
    os.kill(cluster.world.pids[1], signal.SIGKILL)
    shell.user_ns["fresh"] = nn.Linear(64, 64)  # a model the engines have not seen: its shards are delivered
    error, elapsed = run_failing(shell, "%%fsdp --world-size 2\nout = fresh.weight.shape\n")
    assert "rank 1" in str(error) and "died while receiving its shards" in str(error), error
    assert elapsed < 10
    run_ok(shell, "%%fsdp --world-size 2\nout = fresh.weight.shape\n")  # the next cell restarts the world
    assert shell.user_ns["out"] == (64, 64)
    del shell.user_ns["fresh"], shell.user_ns["out"]


def test_engines_not_registered_in_time_are_said_in_one_line_and_the_next_cell_starts_them(shell, monkeypatch):
    """An engine start past its time (seen once in a fresh-clone run, torch 2.6's engines on a busy machine): a
    UsageError saying so, not ipyparallel's TimeoutError from inside nbfsdp; the next cell starts them again."""
    run_ok(shell, "%fsdp stop")
    monkeypatch.setattr(local, "ENGINE_START_TIMEOUT", 0.001)
    # a client that learns of no engine (not from its connection's reply, a registration's notice or the
    # controller's record), as a busy machine's late engines look: a start that took over a second (fork server,
    # controller) had its engines registered before the first look, and the cell ran
    monkeypatch.setattr(ipp.Client, "_update_engines", lambda client, engines: None)
    error, _ = run_failing(shell, "%%fsdp --world-size 2\nout = 1\n")
    assert isinstance(error, UsageError), error
    assert "nbfsdp: 0 of 2 engines registered with the controller within 0 s" in str(error), error
    assert "the next cell starts them again" in str(error)
    monkeypatch.undo()
    run_ok(shell, "%%fsdp --world-size 2\nout = 1\n")
    assert shell.user_ns.pop("out") == 1
