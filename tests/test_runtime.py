"""The %%fsdp runtime on a real cluster: namespace in and out, cluster reuse, status."""

from __future__ import annotations

import os

import psutil
import pytest
import torch
from torch.distributed.tensor import DTensor

import nbfsdp
from nbfsdp.kernel.cluster.world import cpu_threads_per_rank
from tests.conftest import run_ok

pytestmark = pytest.mark.timeout(120)


def test_rank_world_size_device_and_nbfsdp_are_defined(shell):
    run_ok(
        shell,
        """%%fsdp --world-size 2
import torch.distributed as dist
seen = [None] * world_size
dist.all_gather_object(seen, (rank, world_size, str(device), nbfsdp.__name__))
""",
    )
    assert shell.user_ns["seen"] == [(0, 2, "cpu", "nbfsdp"), (1, 2, "cpu", "nbfsdp")]


def test_notebook_names_arrive_as_they_are_in_the_notebook(shell):
    run_ok(
        shell,
        """
import numpy as np, torch
class Scaler:
    def __init__(self, k): self.k = k
    def __call__(self, v): return v * self.k
def double(v): return 2 * v
scale = Scaler(3)
offset = 7
weights = torch.arange(4.0)
""",
    )
    run_ok(
        shell,
        """%%fsdp --world-size 2
got_function = double(offset)
got_instance = scale(offset)
got_tensor = weights.sum().item()
module_imported_again = np is __import__("sys").modules["numpy"]
class_by_value = type(scale).__name__ == "Scaler" and type(scale).__module__ == "__main__"
same_scale = scale
""",
    )
    ns = shell.user_ns
    assert ns["got_function"] == 14
    assert ns["got_instance"] == 21
    assert ns["got_tensor"] == 6.0
    assert ns["module_imported_again"] is True
    assert ns["class_by_value"] is True
    # a notebook class that went to the engines and back is the notebook's class again
    assert type(ns["same_scale"]) is ns["Scaler"]


def test_assigned_names_come_back_from_rank_0(shell):
    run_ok(
        shell,
        """%%fsdp --world-size 2
from_rank = rank
tensor_back = torch.full((2,), float(rank))
def made_on_engine(v):
    return v + 1
""",
    )
    ns = shell.user_ns
    assert ns["from_rank"] == 0
    assert torch.equal(ns["tensor_back"], torch.zeros(2))
    assert ns["made_on_engine"](1) == 2


def test_unpicklable_results_are_named_in_one_line_and_dtensors_come_back_full(shell, tiny_model, capsys):
    shell.user_ns.pop("lock", None)
    run_ok(
        shell,
        """%%fsdp --world-size 2
lock = __import__("threading").Lock()
first_param = next(model.parameters())
doubled = [p.detach() * 2 for p in model.parameters()]
first_doubled = first_param.detach() * 2
""",
    )
    err = capsys.readouterr().err
    warning = [line for line in err.splitlines() if line.startswith("nbfsdp: kept on the engines only")]
    assert len(warning) == 1, err
    assert "lock" in warning[0] and "doubled" in warning[0] and "DTensor" in warning[0]
    assert "lock" not in shell.user_ns and "doubled" not in shell.user_ns
    first = shell.user_ns["first_param"]
    assert first is next(tiny_model.parameters())  # the notebook's own parameter, as in a plain cell
    first_doubled = shell.user_ns["first_doubled"]
    assert not isinstance(first_doubled, DTensor)
    assert first_doubled.shape == first.shape  # full, not one rank's shard
    torch.testing.assert_close(first_doubled, first.detach() * 2)
    # "kept on the engines only" is a promise: the next cell still finds the lock where it was made
    run_ok(shell, "%%fsdp --world-size 2\nlock_still_there = lock.acquire(blocking=False)\n")
    assert shell.user_ns["lock_still_there"] is True


def test_state_survives_between_cells_on_the_engines(shell, tiny_model):
    run_ok(
        shell,
        """%%fsdp --world-size 2
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
x, y = batch_for(rank, 0)
loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
""",
    )
    run_ok(
        shell,
        """%%fsdp --world-size 2
steps_in_optimizer = [s["step"].item() for s in opt.state.values()][:1]
x, y = batch_for(rank, 1)
loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
""",
    )
    # the optimizer made on the engines in the first cell kept its state and
    # still drives the engines' model in the second
    assert shell.user_ns["steps_in_optimizer"] == [1.0]


def test_warm_cell_reuses_engines_and_process_group(shell, cluster):
    run_ok(shell, "%%fsdp --world-size 2\npass\n")
    pids, generation, started = list(cluster.world.pids), cluster.world.generation, cluster.processes_started
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    run_ok(shell, "%%fsdp --world-size 2\npass\n")
    assert cluster.world.pids == pids
    assert cluster.world.generation == generation  # same process group
    assert cluster.processes_started == started
    assert {p.pid for p in psutil.Process().children(recursive=True)} == children


def test_default_world_size_is_two_on_cpu(shell):
    run_ok(shell, "%%fsdp\nsize_seen = world_size\n")
    assert shell.user_ns["size_seen"] == 2


def test_engines_share_the_cores_without_oversubscription(shell, cluster):
    run_ok(shell, "%%fsdp --world-size 2\nthreads = torch.get_num_threads()\n")
    assert shell.user_ns["threads"] == cpu_threads_per_rank(2) == max(1, len(os.sched_getaffinity(0)) // 2)
    assert all(e.threads == shell.user_ns["threads"] for e in cluster.world.engines)


def test_status_shows_ranks_pids_devices_and_backend(shell, cluster, capsys):
    run_ok(shell, "%%fsdp --world-size 2\npass\n")
    capsys.readouterr()
    shell.run_line_magic("fsdp", "status")
    out = capsys.readouterr().out
    assert "world size 2, backend gloo" in out
    for rank, pid in enumerate(cluster.world.pids):
        assert any(line.split()[:1] == [str(rank)] and str(pid) in line and "cpu" in line for line in out.splitlines())


def test_run_record(shell, tiny_model):
    run_ok(
        shell,
        """%%fsdp --world-size 2 --min-params 1000
for step in range(3):
    x, y = batch_for(rank, step)
    loss_fn(model(x), y).backward()
    nbfsdp.log(step=step, loss=float(step + rank))
""",
    )
    run = nbfsdp.last_run()
    assert run.world_size == 2
    assert run.config["sharding_strategy"] == "FULL_SHARD" and run.config["backend"] == "gloo"
    assert run.config["mixed_precision"] == "FULL" and run.config["min_params"] == 1000  # Composer's on CPU
    # Composer's size rule, bottom-up: each MLP (1,072 parameters) reaches 1,000 first
    assert run.config["fsdp_units"]["model"] == ["blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp", ""]
    assert [(m["rank"], m["step"], m["loss"]) for m in run.metrics] == [
        (0, 0, 0.0),
        (1, 0, 1.0),
        (0, 1, 1.0),
        (1, 1, 2.0),
        (0, 2, 2.0),
        (1, 2, 3.0),
    ]
    assert all({"mem_params", "mem_grads", "mem_optim", "mem_activations", "mem_peak"} <= m.keys() for m in run.metrics)
    assert 0 < run.elapsed < 60
    assert nbfsdp.runs()[-1] is run


def test_two_names_for_one_model_are_one_sharded_model_on_the_engines(shell, tiny_model):
    shell.user_ns["alias"] = tiny_model
    run_ok(shell, "%%fsdp --world-size 2\nsame_object = alias is model\n")
    assert shell.user_ns["same_object"] is True
    assert len(nbfsdp.last_run().config["fsdp_units"]) == 1  # sharded and gathered once
    del shell.user_ns["alias"]


@pytest.mark.timeout(180)
def test_a_different_world_size_restarts_and_stop_ends_the_cluster(shell, cluster):
    run_ok(shell, "%%fsdp --world-size 2\npass\n")
    two = list(cluster.world.pids)
    run_ok(shell, "%%fsdp --world-size 1\nsize_seen = world_size\n")
    assert shell.user_ns["size_seen"] == 1 and len(cluster.world.pids) == 1
    assert not set(cluster.world.pids) & set(two)
    one = cluster.world.pids[0]
    shell.run_line_magic("fsdp", "stop")
    assert cluster.world is None and not cluster.running
    assert not psutil.pid_exists(one) or psutil.Process(one).status() == psutil.STATUS_ZOMBIE
    run_ok(shell, "%%fsdp --world-size 2\nsize_seen = world_size\n")  # and it starts again
    assert shell.user_ns["size_seen"] == 2
