"""Checkpoints: ``%fsdp save`` / ``%fsdp load`` against DCP called directly on the same engines and state.

One kernel (``NBFSDP_PREWARM=0``), world size 2: the notebook builds ``nn.Sequential`` of ``Linear(W, W)``
layers and an AdamW, and one ``%%fsdp`` cell trains a step, so the engines hold the sharded model and its
optimizer state (params + 2x AdamW moments: what a checkpoint writes). Then rounds, each in ``in_turn``'s
order, every save into a fresh directory under the kernel's working directory (same file system):

- save, A: a ``%%fsdp --no-gather`` cell that builds the state dict ``%fsdp save`` writes (models,
  optimizers, per-rank RNG, by ``get_model_state_dict`` / ``get_optimizer_state_dict``) and calls
  ``dcp.save`` on it; timed on the ranks from a barrier to a barrier after ``dcp.save`` (slowest rank):
  DCP alone, without the cell's round trip. B: ``%fsdp save DIR``, timed as the kernel round trip (what
  the notebook waits for: the state dict, DCP, the manifest, the rename, the fsyncs, the messages).
- load, A: a ``%%fsdp --no-gather`` cell: state dict, ``dcp.load``, ``set_model_state_dict`` /
  ``set_optimizer_state_dict``, timed on the ranks. B: ``%fsdp load DIR``, kernel round trip (the
  same, plus the notebook's own objects given the loaded weights and optimizer state, as the issue
  asks: the kernel reads the same files meanwhile). Before each load the checkpoint's pages are
  dropped from the page cache (``posix_fadvise(DONTNEED)``, after an fsync), so both sides read from
  the disk.
- async: ``%fsdp save DIR --async``, kernel round trip (the time the notebook is blocked: every rank's
  snapshot taken), then ``%fsdp wait`` (the write's end), against the blocking ``%fsdp save`` of the
  same round; and the engines' peak growth while it runs (the snapshot is a copy of the shard).
- disk: one process (the bench's) writes as many bytes as the checkpoint's data files, sequentially in
  8 MiB blocks, and fsyncs: the disk's own write speed in the same run.
- memory: before each save every engine's peak resident size is reset (``/proc/PID/clear_refs``) and
  its resident size taken as its baseline; afterwards its peak (``VmHWM``) is read. The growth, worst
  rank, is compared with that rank's shard: the local bytes of its parameters and optimizer state.

Throughput is the checkpoint's data bytes (``bytes_per_rank`` summed) over the time. Rows: save and load
throughput B / A (target at least 0.9x, with the 95% bootstrap interval over rounds), ``%fsdp save``'s
throughput / the disk's (no target), the engines' peak growth while ``%fsdp save`` and ``%fsdp save
--async`` run / their shard (at most 1.1x; the direct side's in the note), the seconds ``--async`` blocks
the notebook / a blocking save's (no target). The direct cells take the optimizer from the ranks'
namespace (``globals()["opt"]``), as nbfsdp's own cells now do when the ranks hold it as the notebook
does. The machine is shared: figures are medians of the rounds.

``--quick``: a small model, two rounds. Run alone: ``python -m benchmarks --only checkpoint``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path

from benchmarks import procmem
from benchmarks.context import CPU_ONLY, NO_PREWARM, Context
from benchmarks.kernel import Kernel
from benchmarks.measurement import Measurement, in_turn, median, round_interval

NAME = "checkpoint"
WORLD_SIZE = 2
RATIO_TARGET = 0.9
MEMORY_TARGET = 1.1
MiB = 2**20
GiB = 2**30
BLOCK = 8 * MiB

SETUP = """%load_ext nbfsdp
import json, torch, torch.nn as nn, nbfsdp
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear({width}, {width}) for _ in range({depth})])
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
"""
TRAIN = """%%fsdp --world-size {ws}
model(torch.ones(4, {width})).sum().backward()
opt.step()
opt.zero_grad()
nbfsdp.log(step=0, shard_bytes=sum(p.to_local().numel() * p.element_size() for p in model.parameters())
           + sum(v.to_local().numel() * v.element_size() for s in opt.state.values() for v in s.values()
                 if torch.is_tensor(v) and v.dim() > 0))
"""
#: The state dict ``%fsdp save`` writes (nbfsdp.shared.checkpoints' format), built and saved by hand; the
#: direct cells' ``PATH`` is replaced by the checkpoint's directory.
STATE = """import time, random, numpy as np, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
_opt = globals()["opt"]  # not by its name: a cell that names it is sent the notebook's copy, state and all
def _state():
    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    return {"models": {"model": get_model_state_dict(model)},
            "optimizers": {"opt": get_optimizer_state_dict(model, _opt)},
            "schedulers": {}, "rng": {f"rank{dist.get_rank()}": rng}, "loaders": {}}
dist.barrier()
_began = time.perf_counter()
"""
DIRECT_SAVE = f"""%%fsdp --world-size {WORLD_SIZE} --no-gather
{STATE}dcp.save(_state(), checkpoint_id=PATH)
dist.barrier()
nbfsdp.log(step=0, seconds=time.perf_counter() - _began)
del _opt  # left in the ranks' namespace, a later `%fsdp save` would save it as an optimizer of its own
"""
DIRECT_LOAD = f"""%%fsdp --world-size {WORLD_SIZE} --no-gather
{STATE}_loaded = _state()
dcp.load(_loaded, checkpoint_id=PATH)
set_model_state_dict(model, _loaded["models"]["model"])
set_optimizer_state_dict(model, _opt, _loaded["optimizers"]["opt"])
dist.barrier()
nbfsdp.log(step=0, seconds=time.perf_counter() - _began)
del _opt, _loaded
"""
RANK_SECONDS = "print(json.dumps(max(m['seconds'] for m in nbfsdp.last_run().metrics if 'seconds' in m)))"


def _data_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.glob("*.distcp"))


def _drop_cache(directory: Path) -> None:
    """Evict a checkpoint's files from the page cache, so the next read comes from the disk."""
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # only clean pages can be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_write_seconds(path: Path, size: int) -> float:
    """Seconds one process takes to write ``size`` bytes sequentially and fsync them (the file is removed)."""
    block = os.urandom(BLOCK)
    started = time.perf_counter()
    with open(path, "wb") as file:
        left = size
        while left > 0:
            left -= file.write(block[: min(left, BLOCK)])
        file.flush()
        os.fsync(file.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def _saved(kernel: Kernel, pids: list[int], cell: str, rank_timed: bool) -> tuple[float, list[int]]:
    """Run a save cell with every engine's peak reset first: its seconds, and each engine's peak growth."""
    baseline = [procmem.reset_peak(pid) for pid in pids]
    reply = kernel.execute(cell)
    growth = [procmem.read(pid)["hwm"] - base for pid, base in zip(pids, baseline, strict=True)]
    seconds = kernel.execute(RANK_SECONDS).json() if rank_timed else reply.elapsed
    return seconds, growth


def _saved_async(kernel: Kernel, pids: list[int], directory: Path) -> tuple[float, float, list[int]]:
    """``%fsdp save --async`` then ``%fsdp wait``: the seconds each blocks the notebook, and each engine's
    peak growth over both (the snapshot, and whatever the background write holds)."""
    baseline = [procmem.reset_peak(pid) for pid in pids]
    blocked = kernel.execute(f"%fsdp save {directory} --async").elapsed
    waited = kernel.execute("%fsdp wait").elapsed
    growth = [procmem.read(pid)["hwm"] - base for pid, base in zip(pids, baseline, strict=True)]
    return blocked, waited, growth


def _loaded(kernel: Kernel, cell: str, source: Path, rank_timed: bool) -> float:
    _drop_cache(source)
    reply = kernel.execute(cell)
    return kernel.execute(RANK_SECONDS).json() if rank_timed else reply.elapsed


def run(ctx: Context) -> dict:
    if not procmem.available():
        return {"skipped": "no /proc/PID/clear_refs to reset peak memory"}
    width, depth = (512, 4) if ctx.quick else (2048, 9)
    rounds = ctx.rounds(full=8, quick=2)
    kernel = Kernel(env={**NO_PREWARM, **CPU_ONLY})
    try:
        kernel.execute(SETUP.format(width=width, depth=depth))
        kernel.execute(TRAIN.format(ws=WORLD_SIZE, width=width))
        shard = kernel.execute(
            "print(json.dumps([m['shard_bytes'] for m in sorted(nbfsdp.last_run().metrics, key=lambda m: m['rank'])]))"
        ).json()
        pids = kernel.execute("print(json.dumps(nbfsdp._magics.session.cluster.world.pids))").json()
        root = kernel.cwd / "ckpt"
        kernel.execute(f"%fsdp save {root / 'source'}")  # what both sides load, and the first save's costs
        source = root / "source"
        size = _data_bytes(source)
        data: dict[str, list] = {
            key: []
            for key in (
                "save_a",
                "save_b",
                "load_a",
                "load_b",
                "disk",
                "async",
                "async_wait",
                "mem_a",
                "mem_b",
                "mem_async",
            )
        }
        order = []
        for index in range(rounds):
            direct = root / f"direct-{index}"
            ours = root / f"fsdp-{index}"
            saves = {
                "a": lambda d=direct: _saved(kernel, pids, DIRECT_SAVE.replace("PATH", repr(str(d))), True),
                "b": lambda d=ours: _saved(kernel, pids, f"%fsdp save {d}", False),
            }
            loads = {
                "a": lambda: _loaded(kernel, DIRECT_LOAD.replace("PATH", repr(str(source))), source, True),
                "b": lambda: _loaded(kernel, f"%fsdp load {source}", source, False),
            }
            first, second = in_turn("a", "b", index)
            order.append(first)
            for side in (first, second):
                seconds, growth = saves[side]()
                data[f"save_{side}"].append(seconds)
                data[f"mem_{side}"].append(growth)
            data["disk"].append(disk_write_seconds(root / "disk.bin", size))
            for side in (first, second):
                data[f"load_{side}"].append(loads[side]())
            background = root / f"async-{index}"
            blocked, waited, growth = _saved_async(kernel, pids, background)
            data["async"].append(blocked)
            data["async_wait"].append(waited)
            data["mem_async"].append(growth)
            written = {side: _data_bytes(path) for side, path in (("a", direct), ("b", ours), ("async", background))}
            assert set(written.values()) == {size}, (written, size)  # the same state, the same bytes
            for path in (direct, ours, background):
                shutil.rmtree(path)
    finally:
        ctx.shutdown(kernel)
    return {
        "measurements": _rows(data, size, shard, width, depth),
        "world_size": WORLD_SIZE,
        "model": f"{depth} x Linear({width}, {width}) + AdamW",
        "checkpoint_bytes": size,
        "shard_bytes": shard,
        "first_side_each_round": order,
        **{f"{key}_s" if not key.startswith("mem") else f"{key}_growth_bytes": value for key, value in data.items()},
    }


def _speed_ratio(a: list[float], b: list[float]) -> float:
    """B's throughput / A's from the rounds' seconds (the same bytes on both sides)."""
    return statistics.median(a) / statistics.median(b)


def _rows(data: dict[str, list], size: int, shard: list[int], width: int, depth: int) -> list[Measurement]:
    mib, gib = size / MiB, size / GiB
    label = f"checkpoint of {depth} x Linear({width}, {width}) + AdamW ({mib:.0f} MiB), world size {WORLD_SIZE}"
    rows = []
    for kind, name in (("save", "`dcp.save`"), ("load", "`dcp.load`")):
        a, b = data[f"{kind}_a"], data[f"{kind}_b"]
        rows.append(
            Measurement(
                what=f"{label}: `%fsdp {kind}` throughput / {name} called directly in a %%fsdp cell",
                value=_speed_ratio(a, b), unit="x", target=RATIO_TARGET, op=">=",
                a_label=f"{name} direct", a=gib / median(a), b_label=f"%fsdp {kind}", b=gib / median(b),
                ab_unit="GiB/s", samples_a=a, samples_b=b, samples_value=[x / y for x, y in zip(a, b, strict=True)],
                interval=round_interval(a, b, _speed_ratio),
                note=f"{name} timed on the ranks (barrier to barrier), `%fsdp {kind}` as the kernel round trip",
            )
        )  # fmt: skip
    disk, save_b = data["disk"], data["save_b"]
    rows.append(
        Measurement(
            what=f"{label}: `%fsdp save` throughput / the disk's (one process, sequential write + fsync)",
            value=_speed_ratio(disk, save_b), unit="x", a_label="disk write", a=gib / median(disk),
            b_label="%fsdp save", b=gib / median(save_b), ab_unit="GiB/s", samples_a=disk, samples_b=save_b,
            interval=round_interval(disk, save_b, _speed_ratio),
        )
    )  # fmt: skip
    blocked, waited = data["async"], data["async_wait"]
    rows.append(
        Measurement(
            what=f"{label}: seconds `%fsdp save --async` blocks the notebook / a blocking `%fsdp save`'s",
            value=median(blocked) / median(save_b), unit="x", a_label="%fsdp save", a=median(save_b),
            b_label="%fsdp save --async", b=median(blocked), ab_unit="s", samples_a=save_b, samples_b=blocked,
            samples_value=[x / y for x, y in zip(blocked, save_b, strict=True)],
            note=f"then `%fsdp wait` took {median(waited):.3f} s (median): the write left once the snapshot was taken",
        )
    )  # fmt: skip
    direct = [max(g / s for g, s in zip(growth, shard, strict=True)) for growth in data["mem_a"]]
    for key, how in (("mem_b", "`%fsdp save`"), ("mem_async", "`%fsdp save --async` and `%fsdp wait`")):
        worst = [max(g / s for g, s in zip(growth, shard, strict=True)) for growth in data[key]]
        rows.append(
            Measurement(
                what=f"{label}: engine peak growth while {how} run / its shard (params + AdamW state), worst rank",
                value=median(worst), unit="x", target=MEMORY_TARGET, op="<=", a_label="shard",
                a=max(shard) / MiB, b_label="peak growth", b=median([max(g) for g in data[key]]) / MiB,
                ab_unit="MiB", samples_value=worst,
                note=f"VmHWM after - VmRSS before (clear_refs); `dcp.save` called directly: {median(direct):.3f}x",
            )
        )  # fmt: skip
    return rows
