"""Moves: a model living on the ranks taken to another world size (issue 59, point 6), against ``%fsdp save`` +
``%fsdp load`` of the same and against DCP's own save and load called on the ranks.

One kernel (``NBFSDP_PREWARM=0``, CPU ranks). The notebook builds, on the meta device, ``nn.Sequential`` of
``Linear(W, W)`` layers in bf16 and an AdamW over them; a first ``%%fsdp --world-size 4 --keep-on-ranks`` cell
initializes it on the ranks and takes one step, so the ranks hold the weights and AdamW's two moments (bf16,
as the parameters): what a move carries. Then rounds, each in ``in_turn``'s order:

- move (B): ``%%fsdp --world-size 2`` then ``--world-size 4``, each an empty cell: the model moves there and
  back (the old world writes into ``/dev/shm``, the new one starts and reads under the cell's settings). The
  kernel's round trip of both cells, and the parts each move's line reports (written, started and read).
- save and load (A): ``%fsdp save DIR``, ``%fsdp load DIR --world-size 2`` and the same empty cell, then the
  same back to 4, with ``DIR`` in ``/dev/shm`` too (the same medium: the comparison is of the paths, not of
  disks); the kernel's round trip of the six, the directories removed after each load, as a move removes its
  own.
- DCP direct: inside the round's 4-rank world a ``--no-gather`` cell builds the state dict ``%fsdp save``
  writes and calls ``dcp.save`` into ``/dev/shm`` (timed on the ranks, barrier to barrier, slowest rank), and
  another calls ``dcp.load`` and sets the state (likewise; in the same world, so that its files need not sit
  beside a move's): DCP alone, with no world to start, the floor under both paths.

Rows: the move there and back / save and load there and back (target at most 1.05x: a move is that save and
load, with no kernel round trip between them); the move's write / DCP's save (at most 1.25x: ``%fsdp save``'s
state dict, manifest and rename around the same write); the kernel's growth over every round (at most
300 MiB: nothing passes through it). The machine is shared: figures are medians of the rounds.

Full: W 8192, 16 layers (1.07B parameters, 2.1 GiB of bf16 weights, 6.4 GiB with AdamW's moments), 4 <-> 2
ranks, 3 rounds. ``--quick``: W 256, 4 layers, 2 <-> 1 ranks, 1 round. Run alone:
``python -m benchmarks --only weight_moves``.
"""

from __future__ import annotations

import re
import shutil
import statistics
from pathlib import Path

from benchmarks.context import CPU_ONLY, NO_PREWARM, Context
from benchmarks.kernel import Kernel
from benchmarks.measurement import Measurement, in_turn, median

NAME = "weight_moves"
SHARED_MEMORY = Path("/dev/shm")
RATIO_TARGET = 1.05
WRITE_TARGET = 1.25
GROWTH_TARGET_MIB = 300
MiB = 2**20

SETUP = """%load_ext nbfsdp
import gc, json, os, psutil, torch, torch.nn as nn, nbfsdp
with torch.device("meta"):
    model = nn.Sequential(*[nn.Linear({width}, {width}, bias=False) for _ in range({depth})]).to(torch.bfloat16)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)  # foreach: a copy of every moment at once
"""
#: Each Linear its own unit (the default rule would make the root of them all one: every rank would gather the whole
#: model in each forward); every cell keeps them, so that a move changes the world size only.
UNITS = "--wrap-cls Linear"
TRAIN = """%%fsdp --world-size {ws} --keep-on-ranks {units}
model(torch.ones(2, {width}, dtype=torch.bfloat16)).float().pow(2).mean().backward()
opt.step()
opt.zero_grad()
"""
RSS = "gc.collect()\nprint(json.dumps(psutil.Process().memory_info().rss))"
#: DCP's own save and load of the state ``%fsdp save`` writes, timed on the ranks; ``PATH`` is replaced.
STATE = """import time, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
_opt = globals()["opt"]  # the ranks' own optimizer, not the notebook's (whose state stayed on the ranks)
dist.barrier()
_began = time.perf_counter()
_model_state, _opt_state = get_state_dict(model, _opt)
"""
DIRECT_SAVE = """%%fsdp --world-size {ws} --no-gather {units}
{state}dcp.save({{"models": {{"model": _model_state}}, "optimizers": {{"opt": _opt_state}}}}, checkpoint_id=PATH)
dist.barrier()
nbfsdp.log(step=0, seconds=time.perf_counter() - _began)
del _opt, _model_state, _opt_state
"""
DIRECT_LOAD = """%%fsdp --world-size {ws} --no-gather {units}
{state}_loaded = {{"models": {{"model": _model_state}}, "optimizers": {{"opt": _opt_state}}}}
dcp.load(_loaded, checkpoint_id=PATH)
set_state_dict(model, _opt, model_state_dict=_loaded["models"]["model"], optim_state_dict=_loaded["optimizers"]["opt"])
dist.barrier()
nbfsdp.log(step=0, seconds=time.perf_counter() - _began)
del _opt, _model_state, _opt_state, _loaded
"""
RANK_SECONDS = "print(json.dumps(max(m['seconds'] for m in nbfsdp.last_run().metrics if 'seconds' in m)))"
#: What a move's line says it cost: its whole, its write, and the new world's start with its read.
MOVED = re.compile(r"moved model .* in ([\d.]+) s: .* in ([\d.]+) s, .*read into the new layout in ([\d.]+) s")


def _moved(kernel: Kernel, world_size: int) -> tuple[float, float]:
    """An empty cell at ``world_size``: the kernel's round trip, and the write its move's line reports."""
    reply = kernel.execute(f"%%fsdp --world-size {world_size} {UNITS}\npass\n")
    found = MOVED.search(reply.stdout)
    assert found, reply.stdout
    return reply.elapsed, float(found.group(2))


def _saved_and_loaded(kernel: Kernel, directory: Path, world_size: int) -> float:
    """``%fsdp save``, ``%fsdp load`` at ``world_size``, then the same empty cell a move runs after its load."""
    saved = kernel.execute(f"%fsdp save {directory}").elapsed
    loaded = kernel.execute(f"%fsdp load {directory} --world-size {world_size}").elapsed
    ran = kernel.execute(f"%%fsdp --world-size {world_size} {UNITS}\npass\n").elapsed
    shutil.rmtree(directory)
    return saved + loaded + ran


def _direct(kernel: Kernel, cell: str, ws: int, directory: Path) -> float:
    kernel.execute(cell.format(ws=ws, state=STATE, units=UNITS).replace("PATH", repr(str(directory))))
    return float(kernel.execute(RANK_SECONDS).json())  # type: ignore[arg-type]


def run(ctx: Context) -> dict:
    if not SHARED_MEMORY.is_dir():
        return {"skipped": f"no {SHARED_MEMORY}"}
    width, depth, big, small = (256, 4, 2, 1) if ctx.quick else (8192, 16, 4, 2)
    rounds = ctx.rounds(full=3, quick=1)
    kernel = Kernel(env={**NO_PREWARM, **CPU_ONLY})
    data: dict[str, list[float]] = {key: [] for key in ("move", "saved", "move_write", "dcp_save", "dcp_load")}
    try:
        kernel.execute(SETUP.format(width=width, depth=depth))
        kernel.execute(TRAIN.format(ws=big, width=width, units=UNITS))
        before = int(kernel.execute(RSS).json())  # type: ignore[arg-type]
        for index in range(rounds):
            direct = SHARED_MEMORY / f"nbfsdp-bench-direct-{index}"
            kernel.execute(f"%%fsdp --world-size {big} {UNITS}\npass\n")  # the model on the big world, after either
            data["dcp_save"].append(_direct(kernel, DIRECT_SAVE, big, direct))
            data["dcp_load"].append(_direct(kernel, DIRECT_LOAD, big, direct))
            shutil.rmtree(direct)  # at 1B, its 6.4 GiB beside a move's would crowd the machine's 24 GiB

            def move() -> None:
                there, write_there = _moved(kernel, small)
                back, _ = _moved(kernel, big)
                data["move"].append(there + back)
                data["move_write"].append(write_there)

            def save_and_load(index: int = index) -> None:
                there = _saved_and_loaded(kernel, SHARED_MEMORY / f"nbfsdp-bench-saved-{index}-a", small)
                back = _saved_and_loaded(kernel, SHARED_MEMORY / f"nbfsdp-bench-saved-{index}-b", big)
                data["saved"].append(there + back)

            for side in in_turn(move, save_and_load, index):
                side()
        growth = int(kernel.execute(RSS).json()) - before  # type: ignore[arg-type]
    finally:
        ctx.shutdown(kernel)
        for left in SHARED_MEMORY.glob("nbfsdp-bench-*"):
            shutil.rmtree(left, ignore_errors=True)
    params = width * width * depth
    size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.2f}M"
    what = f"{NAME}: {size} bf16 params + AdamW, {big} <-> {small} ranks"
    return {
        "measurements": [
            Measurement.compared(
                f"{what}: a move there and back / %fsdp save + %fsdp load there and back",
                _ratio,
                ("save + load", data["saved"]),
                ("move", data["move"]),
                unit="x",
                ab_unit="s",
                target=RATIO_TARGET,
                op="<=",
                note=f"kernel round trips, both through {SHARED_MEMORY}, median of {rounds} rounds",
            ),
            Measurement.compared(
                f"{what}: the move's write / DCP's dcp.save on the ranks (both into {SHARED_MEMORY})",
                _ratio,
                ("dcp.save", data["dcp_save"]),
                ("the move's write", data["move_write"]),
                unit="x",
                ab_unit="s",
                target=WRITE_TARGET,
                op="<=",
                note=f"DCP's load on the same ranks took {median(data['dcp_load']):.2f} s (no world to start)",
            ),
            Measurement(
                f"{what}: the kernel's growth over {rounds} rounds of moves, saves and loads",
                value=growth / MiB,
                unit="MiB",
                target=GROWTH_TARGET_MIB,
                op="<=",
            ),
        ],
        "model": f"{depth} x Linear({width}, {width}), bf16, + AdamW",
        **{f"{key}_s": value for key, value in data.items()},
        "kernel_growth_bytes": growth,
    }


def _ratio(a: list[float], b: list[float]) -> float:
    """B's seconds / A's, medians of the rounds."""
    return statistics.median(b) / statistics.median(a)
