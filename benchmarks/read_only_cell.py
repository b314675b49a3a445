"""A cell that moves no weights, on a model the notebook holds, at two sizes (issue 43's target: it costs what
``--no-gather`` costs, whatever the model's size, and the kernel's memory does not grow with the model).

Each size is a fresh kernel (``NBFSDP_PREWARM=0``, CPU ranks, world size 2) whose world is up before the
model is built. The notebook builds ``nn.Sequential`` of ``Linear(W, W)`` (50.4M parameters, and 1.01B:
3.8 GiB fp32), a first cell sends the shards, then the same read-only cell (``mode = model.training``)
alternates with that cell under ``--no-gather``:

- B / A: the read-only cell's median kernel round trip over ``--no-gather``'s; target at most 1.1 at each
  size (before issue 43 a read-only cell gathered the whole model back: 1.15 s at 50M, 7.1 s at 201M);
- the kernel's resident size after the cells above its size once the model was built (the model itself not
  counted), in MiB; target at most 300 MiB at each size (before: 2.8 models' worth over 8 cells).

``--quick``: 16.8M parameters alone, fewer cells (the suite's smoke run: each size is a kernel of its own).
Run alone: ``python -m benchmarks --only read_only_cell``.
"""

from __future__ import annotations

from benchmarks import procmem
from benchmarks.context import CPU_ONLY, NO_PREWARM, Context
from benchmarks.kernel import Kernel
from benchmarks.measurement import Measurement, median

NAME = "read_only_cell"
RATIO_TARGET = 1.1
GROWTH_TARGET_MIB = 300
MiB = 2**20
#: (width, depth) per size: 48 x Linear(1024) is 50.4M parameters, 60 x Linear(4096) 1.007B.
SIZES = ((1024, 48), (4096, 60))
QUICK_SIZES = ((1024, 16),)


def one_size(ctx: Context, width: int, depth: int, samples: int) -> dict:
    kernel = Kernel(env={**NO_PREWARM, **CPU_ONLY})
    try:
        kernel.execute("%load_ext nbfsdp\nimport gc, json, torch, torch.nn as nn")
        kernel.execute("%%fsdp --world-size 2\nready = 1")  # the world up, with no model
        kernel.execute(f"model = nn.Sequential(*[nn.Linear({width}, {width}) for _ in range({depth})])\ngc.collect()")
        built = procmem.read(kernel.pid)["rss"]
        params = kernel.execute("print(json.dumps(sum(p.numel() for p in model.parameters())))").json()
        read_only = "%%fsdp --world-size 2\nmode = model.training"
        no_gather = "%%fsdp --world-size 2 --no-gather\nmode = model.training"
        kernel.execute(read_only, timeout=600)  # the shards sent: every later cell finds them on the ranks
        a, b = [], []
        for index in range(samples):  # alternating, each side first in turn
            for cell, times in ((no_gather, a), (read_only, b)) if index % 2 == 0 else ((read_only, b), (no_gather, a)):
                times.append(kernel.execute(cell).elapsed * 1000)
        kernel.execute("gc.collect()")
        growth = (procmem.read(kernel.pid)["rss"] - built) / MiB
    finally:
        ctx.shutdown(kernel)
    return {"params": params, "a": a, "b": b, "growth_mib": growth, "cells": 1 + 2 * samples}


def run(ctx: Context) -> dict:
    samples = 4 if ctx.quick else 8
    rows, sizes = [], {}
    for width, depth in QUICK_SIZES if ctx.quick else SIZES:
        found = one_size(ctx, width, depth, samples)
        label = f"{found['params'] / 1e6:,.1f}M parameters"
        sizes[label] = found
        rows.append(
            Measurement(
                what=f"read-only cell / the same cell with --no-gather, {label}, 2 CPU ranks (median)",
                value=median(found["b"]) / median(found["a"]),
                unit="x",
                target=RATIO_TARGET,
                op="<=",
                a_label="--no-gather",
                a=median(found["a"]),
                b_label="read-only cell",
                b=median(found["b"]),
                ab_unit="ms",
                samples_a=found["a"],
                samples_b=found["b"],
            )
        )
        rows.append(
            Measurement(
                what=f"kernel memory growth beyond the model over {found['cells']} cells, {label}",
                value=found["growth_mib"],
                unit="MiB",
                target=GROWTH_TARGET_MIB,
                op="<=",
            )
        )
    return {"measurements": rows, "sizes": sizes}
