"""FSDP2 on a GPU, profiled: where the all-gathers run against the compute, with and without prefetch.

The course's prefetch notebook draws and checks its GPU picture from what this script writes; it
needs a CUDA GPU and plain PyTorch (no nbfsdp, no ipyparallel), and ran on a lent H100:

    python notebooks/gpu/overlap_trace.py OUT_DIR [WORLD_SIZE [BACKEND]]

Each rank runs the same small GPT (bf16 parameters, fp32 gradient reduction), sharded with plain
``fully_shard`` per block, in four ways: FSDP2's defaults (``implicit``), explicit forward and
backward prefetch (``explicit``), and each of those with the CPU made to wait for the GPU after
every block (``*_cpu_bound``, a ``torch.cuda.synchronize()`` in a forward hook, as a ``.item()``
or a slow data pipeline would). Per way it records one profiled step's GPU kernels with their
streams, the peak memory of a step, the bytes allocated while the middle block computes, and the
step time. With one GPU the world is one rank (NCCL refuses two ranks on one GPU:
"Duplicate GPU detected"): its collectives are then local copies, so the
trace shows the streams and the order FSDP2 issues work in, not a network's bandwidth.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.profiler import ProfilerActivity, profile

VOCAB, WIDTH, HEADS, DEPTH, SEQ, BATCH = 8192, 2048, 16, 8, 1024, 8
WAYS = ("implicit", "explicit", "implicit_cpu_bound", "explicit_cpu_bound")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, WIDTH // HEADS).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, WIDTH))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(DEPTH)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx):
        x = self.tokens(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).flatten(0, 1))


def build(way: str, mesh) -> GPT:
    torch.manual_seed(0)
    model = GPT().cuda()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    blocks = list(model.blocks)
    if way.startswith("explicit"):
        for this, following in zip(blocks, blocks[1:], strict=False):
            this.set_modules_to_forward_prefetch([following])
        for this, previous in zip(blocks[1:], blocks, strict=False):
            this.set_modules_to_backward_prefetch([previous])
    if way.endswith("cpu_bound"):
        for block in blocks:
            block.register_forward_hook(wait_for_gpu)
    return model


def wait_for_gpu(*_) -> None:
    torch.cuda.synchronize()


def step(model, opt, idx, target) -> None:
    loss = F.cross_entropy(model(idx), target.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def kernels(prof, rank: int) -> list[dict]:
    """The step's GPU kernels and copies: name, stream, start and duration in microseconds."""
    found = []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        found.append(
            {
                "name": event.name[:120],
                "stream": getattr(event, "device_resource_id", None),
                "start_us": event.time_range.start,
                "duration_us": event.time_range.elapsed_us(),
                "rank": rank,
            }
        )
    return found


def run_way(way: str, rank: int, world: int, mesh) -> dict:
    model = build(way, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator(device="cuda").manual_seed(rank)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=g)
    target = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda", generator=g)
    middle = model.blocks[DEPTH // 2]
    during_middle = {}

    def note_allocated(*_) -> None:
        during_middle.setdefault("bytes", torch.cuda.memory_allocated())

    middle.register_forward_pre_hook(note_allocated)
    for _ in range(3):
        step(model, opt, idx, target)
    torch.cuda.synchronize()
    during_middle.clear()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(10):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(model, opt, idx, target)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() - base
    during = during_middle["bytes"] - base
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(model, opt, idx, target)
        torch.cuda.synchronize()
    block_bytes = sum(p.numel() for p in model.blocks[0].parameters()) * 2  # gathered in bf16
    return {
        "way": way,
        "step_ms": sorted(times)[len(times) // 2] * 1e3,
        "peak_bytes_over_steady": peak,
        "allocated_at_middle_block_over_steady": during,
        "gathered_block_bytes": block_bytes,
        "kernels": kernels(prof, rank),
    }


def worker(rank: int, world: int, port: int, out: str, backend: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=world)
    mesh = init_device_mesh("cuda", (world,))
    results = [run_way(way, rank, world, mesh) for way in WAYS]
    if rank == 0:
        summary = {
            "device": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "backend": backend,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "world_size": world,
            "model": {"vocab": VOCAB, "width": WIDTH, "heads": HEADS, "depth": DEPTH, "seq": SEQ, "batch": BATCH},
            "policy": "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)",
            "ways": results,
        }
        with open(os.path.join(out, f"overlap-ws{world}-{backend}.json"), "w") as f:
            json.dump(summary, f)
        for r in results:
            print(
                f"ws{world} {r['way']:<20} step {r['step_ms']:7.2f} ms  peak {r['peak_bytes_over_steady'] / 2**20:8.1f} MiB"
                f"  at middle block {r['allocated_at_middle_block_over_steady'] / 2**20:8.1f} MiB"
                f"  (one gathered block {r['gathered_block_bytes'] / 2**20:.1f} MiB), {len(r['kernels'])} kernels"
            )
    dist.destroy_process_group()


def main() -> None:
    out = sys.argv[1]
    world = int(sys.argv[2]) if len(sys.argv) > 2 else torch.cuda.device_count()
    backend = sys.argv[3] if len(sys.argv) > 3 else "nccl"
    os.makedirs(out, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(world, port, out, backend), nprocs=world)


if __name__ == "__main__":
    main()
