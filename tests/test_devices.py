"""``--device {auto,cuda,cpu}``: the placement rule as a function, the flag and its errors, and plans for GPUs
made from this CPU-only kernel. What needs a GPU (ranks sharing one over NCCL) is in tests/test_gpu.py."""

from __future__ import annotations

import pytest
import torch
from IPython.core.error import UsageError

import nbfsdp
from nbfsdp.kernel.cluster import world as cluster_module
from nbfsdp.kernel.cluster.world import nccl_host_environment
from nbfsdp.shared.config import ConfigError
from nbfsdp.shared.devices import DEFAULT_DEVICE_VARIABLE, Devices, choose
from tests.conftest import run_failing, run_ok

CELL = (
    "%%fsdp --world-size 2 {flags}\nx, y = batch_for(rank, 0)\nloss_fn(model(x.to(device)), y.to(device)).backward()\n"
)


def test_cuda_puts_rank_r_on_gpu_r_mod_g_and_ranks_of_one_gpu_on_different_nccl_hosts():
    four_on_one = choose("cuda", 4, 1)
    assert (four_on_one.type, four_on_one.gpus, four_on_one.rank_gpus) == ("cuda", 1, (0, 0, 0, 0))
    assert four_on_one.nccl_hosts == ("0", "1", "2", "3") and four_on_one.backend == "nccl"
    assert str(four_on_one) == "4 ranks on 1 GPU (shared)"
    four_on_two = choose("cuda", 4, 2)
    # ranks 0 and 1 on GPUs 0 and 1 are NCCL's host 0 (NVLink between them), ranks 2 and 3 host 1
    assert four_on_two.rank_gpus == (0, 1, 0, 1) and four_on_two.nccl_hosts == ("0", "0", "1", "1")
    assert str(four_on_two) == "4 ranks on 2 GPUs (shared)"
    two_on_eight = choose("cuda", 2, 8)
    assert (two_on_eight.gpus, two_on_eight.rank_gpus, two_on_eight.shared) == (2, (0, 1), False)
    assert str(two_on_eight) == "2 ranks on 2 GPUs"


def test_auto_takes_a_gpu_a_rank_only_when_there_are_enough_and_says_why_it_chose_the_cpu():
    assert choose(None, 2, 2) == Devices("cuda", 2, 2, rank_gpus=(0, 1))
    assert choose("auto", 2, 0) == Devices("cpu", 2)  # no GPU: nothing to explain
    fewer = choose(None, 4, 1)
    assert (fewer.type, fewer.backend, str(fewer)) == ("cpu", "gloo", "4 ranks on the CPU (gloo)")
    assert fewer.why == (
        "4 ranks and 1 GPU: auto takes a GPU a rank only when there are enough, so the CPU (gloo); "
        "--device cuda puts the ranks on the 1 GPU, shared"
    )
    assert choose("cpu", 2, 8) == Devices("cpu", 2)


def test_cuda_without_a_gpu_is_an_error_except_in_a_plan_which_takes_a_gpu_a_rank():
    with pytest.raises(ConfigError, match=r"^--device cuda: this machine has no GPU .*; choose auto or cpu$"):
        choose("cuda", 2, 0)
    planned = choose("cuda", 4, 0, planning=True)
    assert (planned.type, planned.planned, planned.shared) == ("cuda", True, False)
    assert str(planned) == "4 ranks, a GPU each (planned: this kernel sees no GPU)"


def test_nccl_hostid_only_where_ranks_share_a_gpu_and_unique_to_the_cluster():
    assert nccl_host_environment(choose("cuda", 2, 2), 1, "/tmp/nbfsdp-a") == {}
    shared = choose("cuda", 2, 1)
    first, second = (nccl_host_environment(shared, rank, "/tmp/nbfsdp-a")["NCCL_HOSTID"] for rank in (0, 1))
    assert first != second and first.startswith("nbfsdp-nbfsdp-a-")
    assert nccl_host_environment(shared, 0, "/tmp/nbfsdp-b") != {"NCCL_HOSTID": first}


def test_the_default_device_comes_from_the_environment_where_nothing_asks(monkeypatch):
    monkeypatch.setenv(DEFAULT_DEVICE_VARIABLE, "cpu")
    assert choose(None, 2, 2).type == "cpu"
    assert choose("auto", 2, 2).type == "cuda"  # asked for explicitly: the variable is only a default
    monkeypatch.setenv(DEFAULT_DEVICE_VARIABLE, "tpu")
    with pytest.raises(ConfigError, match=r"^\$NBFSDP_DEVICE must be one of auto, cuda, cpu; got 'tpu'$"):
        choose(None, 2, 2)


@pytest.mark.parametrize(
    ("flags", "before", "message"),
    [
        ("--device cuda", "", "--device cuda: this machine has no GPU"),
        ("--device tpu", "", "argument --device: invalid choice: 'tpu' (choose from 'auto', 'cuda', 'cpu')"),
        ("--config placement", "", "device must be one of auto, cuda, cpu; got 'gpu'"),
        ("", "device=cuda", "--device cuda: this machine has no GPU"),
    ],
)
def test_a_device_this_machine_lacks_fails_before_anything_runs(shell, tiny_model, flags, before, message):
    session = nbfsdp._magics.session
    shell.user_ns["placement"] = {"device": "gpu"}
    runs_before, world_before = len(nbfsdp.runs()), session.cluster.world
    try:
        if before:
            shell.run_line_magic("fsdp", f"set {before}")
        error, elapsed = run_failing(shell, CELL.format(flags=flags))
    finally:
        session.panel.clear()
        del shell.user_ns["placement"]
    assert isinstance(error, UsageError) and message in str(error), str(error)
    assert elapsed < 1 and len(nbfsdp.runs()) == runs_before and session.cluster.world is world_before


def test_device_cpu_runs_gloo_and_the_run_and_status_say_where(shell, tiny_model, capsys):
    run_ok(shell, CELL.format(flags="--device cpu"))
    config = nbfsdp.last_run().config
    assert (config["device"], config["backend"], config["devices"]) == ("cpu", "gloo", "2 ranks on the CPU (gloo)")
    capsys.readouterr()
    shell.run_line_magic("fsdp", "status")
    assert "backend gloo, collective timeout 30s: 2 ranks on the CPU (gloo)" in capsys.readouterr().out


def test_auto_on_a_machine_with_too_few_gpus_says_once_why_the_ranks_run_on_the_cpu(
    shell, tiny_model, capsys, monkeypatch
):
    """The kernel's count of GPUs is what auto reads: one GPU for two ranks means the CPU, said once per world
    (the world here runs on this machine's CPU for real)."""
    monkeypatch.setattr(cluster_module, "visible_gpus", lambda: 1)
    shell.run_line_magic("fsdp", "stop")
    capsys.readouterr()
    run_ok(shell, CELL.format(flags=""))
    run_ok(shell, CELL.format(flags=""))
    err = capsys.readouterr().err
    assert err.count("nbfsdp: 2 ranks and 1 GPU: auto takes a GPU a rank only when there are enough") == 1, err
    assert "--device cuda puts the ranks on the 1 GPU, shared" in err
    assert nbfsdp.last_run().config["why"]["device"].startswith("2 ranks and 1 GPU")


def test_explain_plans_for_gpus_from_a_kernel_that_has_none(shell, tiny_model, capsys):
    """The dtypes (Composer's DEFAULT on GPU: bf16 compute, fp32 reduction), the code and the memory, for GPUs
    this kernel does not have; nothing runs."""
    runs_before = len(nbfsdp.runs())
    shell.run_line_magic("fsdp", "explain --device cuda --wrap-cls Block -n 4 model")
    out = capsys.readouterr().out
    assert out.startswith(
        "FSDP plan at world size 4, 4 ranks, a GPU each (planned: this kernel sees no GPU): FULL_SHARD, "
        "mixed precision DEFAULT (params bfloat16, reduce float32, buffers float32)"
    ), out
    plan = nbfsdp.explain(tiny_model, world_size=4, device="cuda", wrap_cls="Block")
    assert 'init_device_mesh("cuda", (4,))' in plan.code
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)" in plan.code
    on_cpu = nbfsdp.explain(tiny_model, world_size=4, device="cpu", wrap_cls="Block")
    # the same shards either way; the gathered units travel in bf16 on GPU, in fp32 on CPU (FULL)
    assert plan.memory[0]["params"] == on_cpu.memory[0]["params"]
    assert plan.communication["all_gather"] * 2 == on_cpu.communication["all_gather"]
    assert plan.communication["reduce_scatter"] == on_cpu.communication["reduce_scatter"]  # fp32 both
    assert len(nbfsdp.runs()) == runs_before
    assert torch.cuda.device_count() == 0  # the point: planned from a kernel without a GPU


def test_a_plan_for_ranks_sharing_a_gpu_says_so_and_its_code_sets_nccl_hostid(shell, tiny_model, monkeypatch):
    monkeypatch.setattr(cluster_module, "visible_gpus", lambda: 1)
    plan = nbfsdp.explain(tiny_model, world_size=4, device="cuda", wrap_cls="Block")
    assert plan.devices == "4 ranks on 1 GPU (shared)"
    assert "# Ranks share GPUs: before init_process_group each rank set NCCL_HOSTID" in plan.code
    compile(plan.code, "<explain --code>", "exec")


class _GpuHosts:
    """Where an attached cluster of two hosts with 2 GPUs each would put its ranks: only ``devices``, the one
    call a plan makes of the notebook's cluster (a real attached cluster on GPU hosts cannot run here)."""

    def devices(self, world_size, device=None, *, planning=False):
        from nbfsdp.shared.devices import choose

        return choose(device or "cuda", world_size, 4, planning=planning)


def test_a_plan_asks_the_notebooks_cluster_where_its_ranks_run_not_the_kernel(shell, tiny_model):
    """One answer to "GPU or CPU?": explain and the panel ask the cluster the cells run on, as %%fsdp does
    (an attached GPU cluster driven from a CPU kernel plans for its GPUs)."""
    from nbfsdp.kernel.cluster import world

    assert nbfsdp.explain(tiny_model, world_size=4, wrap_cls="Block").devices == "4 ranks on the CPU (gloo)"
    session = nbfsdp._magics.session
    world.plan_with(_GpuHosts())
    try:
        planned = nbfsdp.explain(tiny_model, world_size=4, wrap_cls="Block")
    finally:
        world.plan_with(session.cluster)
    assert planned.devices == "4 ranks on 4 GPUs"
    assert "mixed precision DEFAULT" in str(planned)  # the GPU default, decided for the cluster's GPUs
