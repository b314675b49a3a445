"""Each rank receives and holds only its own shard of the notebook's model."""

from __future__ import annotations

import pytest
import torch.nn as nn

from nbfsdp import transfer
from tests.conftest import run_ok

pytestmark = pytest.mark.timeout(180)


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
        flat, _ = transfer.pack_shards({"m": model}, rank, 4)
        assert abs(flat.nbytes - full / 4) <= 0.05 * full / 4


def _peak_and_current(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return int(fields["VmHWM"].split()[0]) * 1024, int(fields["VmRSS"].split()[0]) * 1024


def test_engine_memory_while_receiving_stays_near_its_shard(shell, cluster):
    run_ok(shell, "%%fsdp --world-size 2\npass\n")
    shell.user_ns["big"] = model = _big_model()
    shard = sum(p.numel() * p.element_size() for p in model.parameters()) / 2
    before = {}
    for pid in cluster.world.pids:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # restart the kernel's high-water mark from the current RSS
        before[pid] = _peak_and_current(pid)[1]
    run_ok(
        shell,
        """%%fsdp --world-size 2 --no-gather
local_bytes = sum(p.to_local().nbytes for p in big.parameters())
""",
    )
    assert shell.user_ns["local_bytes"] == shard
    for pid in cluster.world.pids:
        growth = _peak_and_current(pid)[0] - before[pid]
        # measured ~2.5x: the received shard, the FSDP storage it is copied into, a transient
        # copy on the receive path; a whole model would be 2x shard received plus 2x materialized
        assert growth < 3 * shard, f"engine {pid} grew {growth / 2**20:.0f} MiB for a {shard / 2**20:.0f} MiB shard"
    del shell.user_ns["big"]
