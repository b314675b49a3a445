"""The GPU path: one engine per GPU, ranks sharing GPUs (``--device cuda``), NCCL, CUDA memory figures.
Skipped without a GPU; ``make test-gpu`` runs them (with the course) where there is one."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time

import ipyparallel as ipp
import pytest
import torch
from IPython.core.error import UsageError

import nbfsdp
from tests.conftest import gpu, interrupt_main_when, one_process_losses, run_failing, run_ok
from tests.test_fsdp_code import printed_code_against_the_cell

pytestmark = [gpu, pytest.mark.timeout(180)]


def test_each_rank_gets_its_own_gpu_and_nccl(shell, cluster, tiny_model):
    world_size = torch.cuda.device_count()
    run_ok(
        shell,
        f"""%%fsdp --world-size {world_size}
import os, torch.distributed as dist
mine = (str(device), os.environ["CUDA_VISIBLE_DEVICES"], torch.cuda.device_count(), dist.get_backend())
seen = [None] * world_size
dist.all_gather_object(seen, mine)
x, y = batch_for(rank, 0)
loss_fn(model(x.to(device)).float(), y.to(device)).backward()  # DEFAULT: the output is bf16, the target fp32
nbfsdp.log(step=0)
""",
    )
    seen = shell.user_ns["seen"]
    assert [s[1] for s in seen] == [str(gpu_index) for gpu_index in range(world_size)]
    assert all(s[0] == "cuda:0" and s[2] == 1 and s[3] == "nccl" for s in seen)
    assert cluster.world.backend == "nccl"
    record = nbfsdp.last_run().metrics[0]
    assert record["cuda_max_allocated"] >= record["cuda_allocated"] > 0
    assert record["mem_peak"] == record["cuda_max_allocated"]


def test_printed_fsdp2_code_on_gpus_trains_like_the_cell(shell, tiny_model, capsys):
    """On GPUs the code says cuda and Composer's GPU default (DEFAULT: bf16 compute, fp32 reduction); same
    training."""
    printed = printed_code_against_the_cell(shell, capsys, "--wrap-cls Block", torch.cuda.device_count())
    assert 'init_device_mesh("cuda"' in printed
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)" in printed


def test_a_live_change_applies_on_gpus(shell, tiny_model):
    """On GPUs too the ranks switch at the start of a forward (every parameter sharded then), here to PURE bf16;
    with one rank more than there are GPUs, so two ranks share one."""
    world_size = torch.cuda.device_count() + 1
    run_ok(
        shell,
        f"""%%fsdp --world-size {world_size} --device cuda --mixed-precision FULL --wrap-cls Block --async
import time
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
dtypes = []
for step in range(40):
    x, y = batch_for(rank, step)
    out = model(x.to(device))
    dtypes.append(str(out.dtype))
    loss_fn(out.float(), y.to(device)).backward(); opt.step(); opt.zero_grad()
    time.sleep(0.05)
""",
    )
    time.sleep(1.0)
    try:
        shell.run_line_magic("fsdp", "set mixed_precision=PURE")
        shell.run_line_magic("fsdp", "wait")
    finally:
        nbfsdp._magics.session.panel.clear()  # `%fsdp set` is the next cells' default too: not the next test's
    dtypes = shell.user_ns["dtypes"]
    assert dtypes[0] == "torch.float32"  # FULL until the change
    switched = dtypes.index("torch.bfloat16")
    assert switched > 0 and set(dtypes[switched:]) == {"torch.bfloat16"}, dtypes
    assert nbfsdp.last_run().ok


@pytest.mark.timeout(300)
def test_an_attached_cluster_over_hosts_runs_nccl_from_each_hosts_local_gpu(
    shell, tiny_model, tmp_path, capsys, monkeypatch
):
    """The multi-host GPU path on one GPU: two engines of a cluster the user started, each told it is on a host
    of its own (``NBFSDP_HOST_ID`` for nbfsdp, ``NCCL_HOSTID`` for NCCL, which then connects them over its
    network transport as it would two machines). Each takes GPU ``LOCAL_RANK`` (0), the world runs NCCL over
    the interface toward the controller, and training is the same as one process (to 1e-4: GPU against CPU).
    A third host whose engine sees no GPU is named in a UsageError, and ``--world-size 2`` leaves it out."""
    reference = copy.deepcopy(tiny_model)
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    cluster = ipp.Cluster(profile="gpus", n=0, log_level=40)
    engines: list[subprocess.Popen] = []
    try:
        cluster.start_controller_sync()
        profile = [f"--profile-dir={cluster.profile_dir}", f"--cluster-id={cluster.cluster_id}"]
        argv = [sys.executable, "-m", "ipyparallel.engine", *profile]
        client = cluster.connect_client_sync()
        # engines 0 and 1 on hosts with a GPU, then engine 2 on a host without one (registered last)
        for count, (host, gpus) in enumerate((("gpu-host-a", "0"), ("gpu-host-b", "0"), ("cpu-host-c", "")), 1):
            environment = dict(os.environ, NBFSDP_HOST_ID=host, NCCL_HOSTID=host, CUDA_VISIBLE_DEVICES=gpus)
            engines.append(subprocess.Popen(argv, env=environment))
            client.wait_for_engines(count, timeout=120)
        client.close()
        run_ok(shell, f"%fsdp attach --profile gpus --cluster-id {cluster.cluster_id}")
        assert "attached to 3 engines on 3 hosts" in capsys.readouterr().out
        error, _ = run_failing(shell, "%%fsdp --device auto\nx = 1")  # every engine: the third host has no GPU
        assert isinstance(error, UsageError), error
        assert str(error).startswith("every rank needs a GPU of its own") and "has 1 rank and 0 GPUs" in str(error)
        error, _ = run_failing(shell, "%%fsdp --device cuda\nx = 1")
        assert isinstance(error, UsageError) and str(error).startswith("--device cuda: "), error
        assert str(error).endswith("has 1 rank and 0 GPUs"), error  # named by its hostname, as the first
        run_ok(
            shell,
            """%%fsdp --world-size 2 --device auto --mixed-precision FULL --wrap-cls Block
import os
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for step in range(4):
    x, y = batch_for(rank, step)
    loss = loss_fn(model(x.to(device)), y.to(device))
    loss.backward(); opt.step(); opt.zero_grad()
    nbfsdp.log(step=step, loss=loss.item())
mine = (str(device), os.environ["LOCAL_RANK"], os.environ["NCCL_SOCKET_IFNAME"], torch.distributed.get_backend())
seen = [None] * world_size
torch.distributed.all_gather_object(seen, mine)
""",
        )
        assert shell.user_ns["seen"] == [("cuda:0", "0", "lo", "nccl")] * 2
        run = nbfsdp.last_run()
        assert run.world_size == 2 and run.metrics[0]["cuda_allocated"] > 0
        sharded = [sum(run.metric("loss", rank=r)[step] for r in range(2)) / 2 for step in range(4)]
        opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        expected = one_process_losses(shell, reference, opt, 2, 4)
        torch.testing.assert_close(torch.tensor(sharded), torch.tensor(expected), rtol=1e-4, atol=1e-4)
        for trained, wanted in zip(tiny_model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(trained.cpu(), wanted, rtol=1e-4, atol=1e-4)
    finally:
        nbfsdp._magics.session.detach()
        for process in engines:
            process.kill()
        cluster.stop_controller_sync()


PARITY = """%%fsdp --world-size {world_size} --device cuda --mixed-precision FULL --wrap-cls Block
import os, torch.distributed as dist
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for step in range(4):
    x, y = batch_for(rank, step)
    loss = loss_fn(model(x.to(device)), y.to(device))
    loss.backward(); opt.step(); opt.zero_grad()
    nbfsdp.log(step=step, loss=loss.item())
mine = (str(device), os.environ["CUDA_VISIBLE_DEVICES"], os.environ.get("NCCL_HOSTID"), dist.get_backend(), os.getpid())
seen = [None] * world_size
dist.all_gather_object(seen, mine)
"""


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_sharing_the_gpus_train_as_one_process_each_on_its_own_allocator(shell, tiny_model, capsys, world_size):
    """``--device cuda``: rank r on GPU r mod G, each rank a process of its own, ranks of one GPU told apart for
    NCCL by NCCL_HOSTID; the same training as one process (to 1e-4: GPU against CPU), and each rank's memory
    read from its own allocator (its shards, as explain predicts them)."""
    gpus = torch.cuda.device_count()
    reference = copy.deepcopy(tiny_model)
    run_ok(shell, PARITY.format(world_size=world_size))
    seen = shell.user_ns["seen"]
    assert [s[1] for s in seen] == [str(rank % gpus) for rank in range(world_size)]
    assert all(s[0] == "cuda:0" and s[3] == "nccl" for s in seen) and len({s[4] for s in seen}) == world_size
    for gpu_index in range(min(gpus, world_size)):
        sharing = [s[2] for rank, s in enumerate(seen) if rank % gpus == gpu_index]
        assert len(set(sharing)) == len(sharing), seen  # NCCL sees the ranks of one GPU on different hosts
    run = nbfsdp.last_run()
    shared = " (shared)" if world_size > gpus else ""
    where = f"{world_size} ranks on {min(gpus, world_size)} GPU{'s' if min(gpus, world_size) > 1 else ''}{shared}"
    assert (run.config["devices"], run.config["backend"]) == (where, "nccl")
    capsys.readouterr()
    shell.run_line_magic("fsdp", "status")
    assert f"backend nccl, collective timeout 30s: {where}" in capsys.readouterr().out

    sharded = [sum(run.metric("loss", rank=r)[step] for r in range(world_size)) / world_size for step in range(4)]
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    expected = one_process_losses(shell, reference, opt, world_size, 4)
    torch.testing.assert_close(torch.tensor(sharded), torch.tensor(expected), rtol=1e-4, atol=1e-4)
    for trained, wanted in zip(tiny_model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(trained.cpu(), wanted, rtol=1e-4, atol=1e-4)

    planned = nbfsdp.explain(tiny_model, world_size=world_size, device="cuda", mixed_precision="FULL", wrap_cls="Block")
    assert planned.devices == where
    for rank in range(world_size):
        record = [m for m in run.metrics if m["rank"] == rank][-1]
        assert record["cuda_max_allocated"] >= record["cuda_allocated"] > 0, record
        assert abs(record["mem_params"] - planned.memory[rank]["params"]) <= 0.05 * planned.memory[rank]["params"]


def test_an_interrupt_ends_a_cell_of_ranks_sharing_a_gpu_and_the_next_cell_runs(shell, tiny_model, capsys):
    world_size = torch.cuda.device_count() + 1
    run_ok(shell, f"%%fsdp --world-size {world_size} --device cuda\nwarm = rank")
    previous = nbfsdp.last_run()
    interrupt = interrupt_main_when(
        lambda: nbfsdp.last_run() is not previous and len(nbfsdp.last_run().metrics) == world_size, within=60
    )
    error, _ = run_failing(
        shell,
        f"%%fsdp --world-size {world_size} --device cuda\nimport time\nnbfsdp.log(running=1)\n"
        "while True:\n    time.sleep(0.01)",
    )
    assert isinstance(error, KeyboardInterrupt), error
    assert interrupt.held, "the ranks had not all logged within 60 s (interrupted all the same)"
    assert interrupt.seconds_since() < 30  # a hang guard: the interrupt ends the cell within seconds
    capsys.readouterr()
    run_ok(shell, f"%%fsdp --world-size {world_size} --device cuda\nprint('back', rank, device)")
    out = capsys.readouterr().out
    assert all(f"[rank {r}] back {r} cuda:0" in out for r in range(world_size)), out


def test_a_rank_sharing_a_gpu_that_dies_is_named_and_the_next_cell_restarts_on_the_gpu(shell, cluster):
    world_size = torch.cuda.device_count() + 1
    run_ok(shell, f"%%fsdp --world-size {world_size} --device cuda\npass")
    old_pids = list(cluster.world.pids)
    started = time.monotonic()
    error, _ = run_failing(
        shell,
        f"%%fsdp --world-size {world_size} --device cuda\nimport os, time\n"
        "if rank == 1:\n    os.kill(os.getpid(), 9)\ntorch.distributed.barrier()\ntime.sleep(60)",
    )
    assert str(error).startswith("rank 1: engine died: killed by SIGKILL"), str(error)
    assert time.monotonic() - started < 30  # a hang guard: the others wait in NCCL, the kernel does not
    run_ok(
        shell, f"%%fsdp --world-size {world_size} --device cuda\nwhere = (str(device), torch.distributed.get_backend())"
    )
    assert shell.user_ns["where"] == ("cuda:0", "nccl")
    assert not set(cluster.world.pids) & set(old_pids)  # a fresh set of engines


def test_a_checkpoint_of_ranks_sharing_a_gpu_saves_and_loads_every_shard(shell, tiny_model, tmp_path):
    world_size = torch.cuda.device_count() + 1
    train = f"""%%fsdp --world-size {world_size} --device cuda --wrap-cls Block
for step in range(3):
    x, y = batch_for(rank, step)
    loss_fn(model(x.to(device)).float(), y.to(device)).backward(); opt.step(); opt.zero_grad()
"""
    run_ok(shell, "opt = torch.optim.AdamW(model.parameters(), lr=1e-2)")
    run_ok(shell, train)
    saved = {name: p.detach().clone() for name, p in tiny_model.named_parameters()}
    path = tmp_path / "shared-gpu"
    run_ok(shell, f"%fsdp save {path}")
    assert sorted(p.name for p in path.glob("*.distcp")) == [f"__{rank}_0.distcp" for rank in range(world_size)]
    run_ok(shell, train)  # the weights move on
    assert not torch.equal(next(tiny_model.parameters()), next(iter(saved.values())))
    run_ok(shell, f"%fsdp load {path}")
    assert nbfsdp._magics.session.cluster.world.devices.type == "cuda"  # loaded into the running GPU world
    for name, p in tiny_model.named_parameters():
        torch.testing.assert_close(p, saved[name], rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
    run_ok(
        shell,
        f"%%fsdp --world-size {world_size} --device cuda --wrap-cls Block --no-gather\n"
        "first = next(model.parameters()).full_tensor().cpu()",
    )
    torch.testing.assert_close(shell.user_ns["first"], next(iter(saved.values())), rtol=0, atol=0)


def test_a_pasted_script_on_ranks_sharing_a_gpu_finds_torchruns_variables_and_its_device(shell, capsys):
    """Issue 42 on GPU ranks: torchrun's variables with ``CUDA_VISIBLE_DEVICES`` as the placement made it (each
    engine sees its GPU, as cuda:0), and an ``init_process_group("nccl", device_id=...)`` of the rank's own
    device taken and said."""
    run_ok(shell, "import torch")
    capsys.readouterr()
    run_ok(
        shell,
        """%%fsdp --world-size 2 --device cuda
import os, torch.distributed as dist
local_rank = int(os.environ["LOCAL_RANK"])
dist.init_process_group(backend="nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
t = torch.ones(1, device=device) * (local_rank + 1)
dist.all_reduce(t)
mine = (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["CUDA_VISIBLE_DEVICES"], t.item(), str(device))
seen = [None] * world_size
dist.all_gather_object(seen, mine)
dist.destroy_process_group()
""",
    )
    gpus = torch.cuda.device_count()
    assert shell.user_ns["seen"] == [(str(r), "2", str(r % gpus), 3.0, "cuda:0") for r in range(2)]
    said = capsys.readouterr().out
    assert "init_process_group(device_id=cuda:0): the world is bound to this rank's cuda:0 already" in said, said


@pytest.mark.parametrize("nccl2", [False, True], ids=["nccl", "TORCH_DIST_USE_NCCL2"])
def test_ranks_sharing_a_gpu_bind_their_world_to_it_and_record_flights(shell, monkeypatch, nccl2):
    """torch 2.15's ported NCCL backend (``TORCH_DIST_USE_NCCL2=1`` where the torch has it) takes a rank's GPU from
    ``LOCAL_RANK`` unless ``device_id`` is passed: two ranks on one GPU see it as cuda:0 with LOCAL_RANK 0 and 1,
    the duplicate case. nbfsdp's worlds pass ``device_id``, so each rank's world is bound to its own cuda:0, a
    collective runs, and the flight recorder (on by default on NCCL worlds) holds it."""
    run_ok(shell, "%fsdp stop")  # the engines take the variables when they start
    if nccl2:
        monkeypatch.setenv("TORCH_DIST_USE_NCCL2", "1")
    try:
        run_ok(
            shell,
            """%%fsdp --world-size 2 --device cuda
import os, torch.distributed as dist
group = dist.distributed_c10d._get_default_group()
total = torch.ones(3, device=device)
dist.all_reduce(total)
torch.cuda.synchronize()
mine = (os.environ["LOCAL_RANK"], str(group.bound_device_id), total.sum().item(),
        type(group._get_backend(device)).__name__, os.environ.get("TORCH_FR_BUFFER_SIZE"))
seen = [None] * world_size
dist.all_gather_object(seen, mine)
""",
        )
        seen = shell.user_ns["seen"]
        print("backends:", [s[3] for s in seen])  # the record: which NCCL backend the lent torch ran
        assert [s[0] for s in seen] == ["0", "1"]
        assert all(s[1] == "cuda:0" and s[2] == 6.0 for s in seen), seen
        assert all(s[4] == "20000" for s in seen)  # nbfsdp turned the flight recorder on
        where = nbfsdp.where()
        assert all(any("all_reduce" in f["op"] for f in p.flights) for p in where.positions), where
    finally:
        run_ok(shell, "%fsdp stop")
