"""The GPU path: one engine per GPU, NCCL, CUDA memory figures. Skipped without a GPU."""

from __future__ import annotations

import time

import pytest
import torch

import nbfsdp
from tests.conftest import gpu, run_ok
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
loss_fn(model(x.to(device)), y.to(device)).backward()
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
    """On GPUs the code says cuda and Composer's GPU default (DEFAULT: bf16 gradient reduction); same training."""
    printed = printed_code_against_the_cell(shell, capsys, "--wrap-cls Block", torch.cuda.device_count())
    assert 'init_device_mesh("cuda"' in printed
    assert "MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.bfloat16)" in printed


def test_a_live_change_applies_on_gpus(shell, tiny_model):
    """On GPUs too the ranks switch at the start of a forward (every parameter sharded then), here to PURE bf16."""
    world_size = torch.cuda.device_count()
    run_ok(
        shell,
        f"""%%fsdp --world-size {world_size} --wrap-cls Block --async
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
    shell.run_line_magic("fsdp", "set mixed_precision=PURE")
    shell.run_line_magic("fsdp", "wait")
    dtypes = shell.user_ns["dtypes"]
    switched = dtypes.index("torch.bfloat16")
    assert switched > 0 and set(dtypes[switched:]) == {"torch.bfloat16"}, dtypes
    assert nbfsdp.last_run().ok
