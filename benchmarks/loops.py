"""The training loop every step-time benchmark runs, as source text, and the FSDP settings both sides use.

The ``%%fsdp`` cell and ``torchrun_loop.py`` execute literally the same text:
``setup_source(sizes)`` (sizes, the model class, the batch function) and then
``loop_source(sizes)`` (AdamW, forward, backward, step, ``loss.item()`` every
step, ``nbfsdp.log`` every step when ``LOG_EACH_STEP`` is true). The cell gets
its names from the notebook the way nbfsdp sends them; the torchrun script
builds the same namespace itself and shards the same modules with plain FSDP2
calls. With ``sizes.from_loader`` the loop reads its batches from a
``DataLoader`` over one epoch of data (``dataset_source``) instead of making
them: in the notebook one loader of the global batch, which nbfsdp splits
(``NOTEBOOK_LOADER_SOURCE``); under torchrun each rank's own loader with a
``DistributedSampler`` (``TORCHRUN_LOADER_SOURCE``).

Sharding is pinned on both sides rather than left to defaults: every ``Block``
is its own FSDP unit (``--wrap-cls Block``; torchrun: ``fully_shard`` on each
``Block``, then on the root), mixed precision as the sizes say (the CPU loops:
``FULL``, nbfsdp's default on CPU; the GPU loops: ``PURE``), implicit backward
prefetch, no forward prefetch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

#: The model and the batch of every rank and step, seeded so that both sides see the same numbers.
MODEL_SOURCE = '''
import time

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, width, depth):
        super().__init__()
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, width)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batch_for(rank, step, device):
    """This rank's batch at this step: TOKENS rows of WIDTH features, the same on every launcher."""
    g = torch.Generator(device=device).manual_seed(1000 * step + rank)
    x = torch.randn(TOKENS, WIDTH, generator=g, device=device)
    return x, torch.randn(TOKENS, WIDTH, generator=g, device=device)
'''

#: Every Block is an FSDP unit on both sides (the root is always one).
WRAP_CLS = "Block"
#: nbfsdp's mixed-precision names -> FSDP2's (param_dtype, reduce_dtype), as nbfsdp maps them (bf16).
MIXED_PRECISION_DTYPES = {"FULL": ("float32", "float32"), "DEFAULT": ("bfloat16", "float32")}
MIXED_PRECISION_DTYPES["PURE"] = ("bfloat16", "bfloat16")


@dataclass(frozen=True)
class LoopSizes:
    """One configuration of the loop: model size, per-rank batch, steps, and FSDP mixed precision."""

    width: int
    depth: int
    tokens: int
    """Rows of each rank's batch (per-rank batch: the same at every world size)."""
    steps: int
    warmup: int
    """Leading steps left out of the median (FSDP's lazy init, AdamW's state allocation)."""
    seed: int = 0
    lr: float = 1e-3
    mixed_precision: str = "FULL"
    from_loader: bool = False
    """Read the batches from a DataLoader over ``dataset_source``'s data rather than make them each step."""

    @property
    def params(self) -> int:
        """Parameter count of ``Net(width, depth)``."""
        w = self.width
        block = 2 * w + (w * 4 * w + 4 * w) + (4 * w * w + w)
        return self.depth * block + 2 * w + w * w + w

    def flops_per_step(self, world_size: int) -> float:
        """Model FLOPs of one step over all ranks: 6 * parameters * tokens (forward 2, backward 4)."""
        return 6.0 * self.params * self.tokens * world_size

    def as_dict(self) -> dict:
        return {**asdict(self), "params": self.params}


#: How each step gets its batch: made for this rank and step, or read from ``loader``.
_MADE_BATCHES = "for step in range(STEPS):\n    x, y = batch_for(rank, step, device)\n"
_LOADER_BATCHES = "for step, (x, y) in enumerate(loader):\n    x, y = x.to(device), y.to(device)\n"

#: The loop itself, after one of the heads above. Reads model, rank, device (nbfsdp injects them;
#: torchrun_loop.py defines them), the sizes and batch_for from setup_source, and LOG_EACH_STEP. Leaves losses,
#: step_times and step_cpu_times (the CPU seconds of the whole rank process, every thread, in each step; rank
#: 0's come back from a %%fsdp cell as names), and deletes the optimizer so nothing big stays on the engines.
#: A step's time runs from the end of the one before, so that it includes getting its batch either way.
_LOOP_SOURCE = """
opt = torch.optim.AdamW(model.parameters(), lr=LR)
losses, step_times, step_cpu_times = [], [], []
started, cpu_started = time.perf_counter(), time.process_time()
{batches}    loss = nn.functional.mse_loss(model(x).float(), y)  # under PURE the output is bf16, the target fp32
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
    if LOG_EACH_STEP:
        nbfsdp.log(step=step, loss=losses[-1])
    step_times.append(time.perf_counter() - started)
    step_cpu_times.append(time.process_time() - cpu_started)
    started, cpu_started = time.perf_counter(), time.process_time()
del opt, x, y, loss
"""

#: After a loop from a loader, untimed, on both sides: the samples all ranks together read at each step of
#: another epoch (summed with the process group), so that a run shows its global batch rather than assume it.
_GLOBAL_BATCHES_SOURCE = """
_rows = torch.tensor([len(x) for x, _ in loader])
torch.distributed.all_reduce(_rows)
global_batches = _rows.tolist()
del _rows
"""


def loop_source(sizes: LoopSizes) -> str:
    """The loop both sides run, reading its batches as ``sizes.from_loader`` says."""
    if sizes.from_loader:
        return _LOOP_SOURCE.format(batches=_LOADER_BATCHES) + _GLOBAL_BATCHES_SOURCE
    return _LOOP_SOURCE.format(batches=_MADE_BATCHES)


#: ~100 ms a step at world size 2 on the project's 2-core CPU machine (1 thread a rank). FULL, what a CPU cell
#: runs by default (until issue 35 these loops ran Composer 0.11's DEFAULT, fp32 compute with bf16 reduction).
CPU_FULL = LoopSizes(width=256, depth=4, tokens=192, steps=40, warmup=8)
CPU_QUICK = LoopSizes(width=128, depth=3, tokens=128, steps=8, warmup=3)
#: One GPU, bf16 compute (PURE): ~270M parameters, 8192 tokens a step.
GPU_FULL = LoopSizes(width=2048, depth=8, tokens=8192, steps=40, warmup=10, mixed_precision="PURE")
GPU_QUICK = LoopSizes(width=1024, depth=4, tokens=4096, steps=15, warmup=5, mixed_precision="PURE")


def setup_source(sizes: LoopSizes) -> str:
    """The notebook's set-up cell: sizes as globals, then the model class and batch function."""
    constants = (
        f"WIDTH = {sizes.width}\nDEPTH = {sizes.depth}\nTOKENS = {sizes.tokens}\n"
        f"STEPS = {sizes.steps}\nLR = {sizes.lr!r}\nSEED = {sizes.seed}\n"
    )
    return constants + MODEL_SOURCE


#: Builds the model in the notebook (and on each torchrun rank, before sharding): same seed, same weights.
NEW_MODEL_SOURCE = "torch.manual_seed(SEED)\nmodel = Net(WIDTH, DEPTH)\n"


def dataset_source(sizes: LoopSizes, world_size: int) -> str:
    """One epoch of data for a loop from a loader: ``STEPS`` global batches of ``TOKENS`` rows per rank,
    made from the seed (in the notebook; on every torchrun rank, as a torchrun script loads its data)."""
    return (
        f"GLOBAL_BATCH = {sizes.tokens * world_size}\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "_data = torch.Generator().manual_seed(SEED)\n"
        "dataset = TensorDataset(*(torch.randn(STEPS * GLOBAL_BATCH, WIDTH, generator=_data) for _ in range(2)))\n"
        "del _data\n"
    )


#: The notebook's loader: the global batch, shuffled by a seeded generator; nbfsdp splits each batch N ways.
NOTEBOOK_LOADER_SOURCE = (
    "loader = DataLoader(\n"
    "    dataset, batch_size=GLOBAL_BATCH, shuffle=True, generator=torch.Generator().manual_seed(SEED)\n"
    ")\n"
)
#: Each torchrun rank's loader: its share of the global batch from a DistributedSampler, as torchrun scripts do.
TORCHRUN_LOADER_SOURCE = (
    "from torch.utils.data.distributed import DistributedSampler\n"
    "loader = DataLoader(\n"
    "    dataset, batch_size=GLOBAL_BATCH // world_size, sampler=DistributedSampler(dataset, shuffle=True, seed=SEED)\n"
    ")\n"
)


def cell_flags(world_size: int, sizes: LoopSizes) -> str:
    """The ``%%fsdp`` line: the sharding torchrun_loop.py applies by hand, spelled as flags."""
    return (
        f"--world-size {world_size} --no-gather --wrap-cls {WRAP_CLS} --mixed-precision {sizes.mixed_precision} "
        "--precision bf16 --backward-prefetch BACKWARD_PRE"
    )


def fsdp_cell(world_size: int, sizes: LoopSizes) -> str:
    """The whole ``%%fsdp`` training cell."""
    return f"%%fsdp {cell_flags(world_size, sizes)}\n{loop_source(sizes)}"


def median_step(step_times: list[float], sizes: LoopSizes) -> float:
    """Median of the steps after the warm-up."""
    import statistics

    return statistics.median(step_times[sizes.warmup :])
