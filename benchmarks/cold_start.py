"""Cold start: the first ``%%fsdp`` cell in a fresh kernel against torchrun starting the same world.

A: the wall time of ``torchrun --standalone --nproc-per-node N -m benchmarks.torchrun_cold`` (import torch,
join a gloo world, one all_reduce), launcher included.
B: a fresh kernel (started and answering before the clock starts), then, timed, ``%load_ext nbfsdp`` and the
first ``%%fsdp --world-size N`` cell doing one all_reduce, in three variants, each its own kernel:

- B0, ``NBFSDP_PREWARM=0``: the cell starts everything (context, no target);
- B1, ``NBFSDP_PREWARM=N``: the cell sent right after ``%load_ext``, while the background start runs;
- B2, ``NBFSDP_PREWARM=N``: ``%fsdp status`` polled until it reports ``world size N``, then only the cell
  is timed (the time until ready is recorded too).

Each round runs A, B0, B1, B2. Target: B1/A and B2/A at most 1.0. N is 4. ``--quick`` (the suite's smoke run): N is
2, and B2 alone of the three kernels, which runs every step the other two do (a prewarmed ``%load_ext``, then a
cell) and polls ``%fsdp status`` besides; B0 and B1 only change its arguments, and their starts are
``tests/test_prewarm.py``'s. Each kernel is about 12 s of CPU on 2 cores.

Run alone: ``python -m benchmarks --only cold_start``.
"""

from __future__ import annotations

import time

from benchmarks import launch
from benchmarks.context import CPU_ONLY, Context
from benchmarks.kernel import Kernel
from benchmarks.measurement import Measurement, median

NAME = "cold_start"
TARGET_RATIO = 1.0
READY_TIMEOUT_S = 180.0
POLL_S = 0.25


def cold_cell(world_size: int) -> str:
    body = "import torch\nimport torch.distributed as dist\ndist.all_reduce(torch.ones(1))"
    return f"%%fsdp --world-size {world_size}\n{body}"


def first_cell(ctx: Context, world_size: int, prewarm: int, wait_until_ready: bool) -> dict:
    """One fresh kernel: ``%load_ext nbfsdp`` then the first cell, timed as the variant says."""
    kernel = Kernel(env={"NBFSDP_PREWARM": str(prewarm), **CPU_ONLY})
    try:
        started = time.perf_counter()
        kernel.execute("%load_ext nbfsdp")
        ready_s, polls = None, 0
        if wait_until_ready:
            while f"world size {world_size}" not in kernel.execute("%fsdp status").stdout:
                polls += 1
                if time.perf_counter() - started > READY_TIMEOUT_S:
                    raise TimeoutError(f"%fsdp status never reported world size {world_size}")
                time.sleep(POLL_S)
            ready_s = time.perf_counter() - started
        cell_started = time.perf_counter()
        kernel.execute(cold_cell(world_size))
        ended = time.perf_counter()
    finally:
        ctx.shutdown(kernel)
    return {"total_s": ended - started, "cell_s": ended - cell_started, "ready_s": ready_s, "status_polls": polls}


def run(ctx: Context) -> dict:
    world_size = 2 if ctx.quick else 4
    rounds = ctx.rounds(full=3, quick=1)
    a, b0, b1, b2, raw = [], [], [], [], []
    for _ in range(rounds):
        a.append(launch.torchrun(world_size, "benchmarks.torchrun_cold", [], cpu_only=True))
        r0 = r1 = None
        if not ctx.quick:
            r0 = first_cell(ctx, world_size, prewarm=0, wait_until_ready=False)
            r1 = first_cell(ctx, world_size, prewarm=world_size, wait_until_ready=False)
            b0.append(r0["total_s"])
            b1.append(r1["total_s"])
        r2 = first_cell(ctx, world_size, prewarm=world_size, wait_until_ready=True)
        b2.append(r2["cell_s"])
        raw.append({"torchrun_s": a[-1], "B0": r0, "B1": r1, "B2": r2})
    ready = median([r["B2"]["ready_s"] for r in raw])

    def row(what: str, label: str, samples: list, target: bool, note: str = "") -> Measurement:
        if not samples:
            note = "not measured under --quick (B2 runs every step of it); run `python -m benchmarks --only cold_start`"
            return Measurement(what=what, value=None, unit="x", target=TARGET_RATIO if target else None,
                               op="<=" if target else None, note=note)  # fmt: skip
        present = median(samples)
        return Measurement(
            what=what,
            value=present / median(a),
            unit="x",
            target=TARGET_RATIO if target else None,
            op="<=" if target else None,
            a_label="torchrun",
            a=median(a),
            b_label=label,
            b=present,
            ab_unit="s",
            samples_a=a,
            samples_b=samples,
            samples_value=[s / t for s, t in zip(samples, a, strict=True)],
            note=note,
        )

    rows = [
        row(f"cold start ws{world_size}, B0: PREWARM=0, load_ext + first cell", "B0", b0, target=False),
        row(f"cold start ws{world_size}, B1: PREWARM={world_size}, first cell right after load_ext", "B1", b1, True),
        row(
            f"cold start ws{world_size}, B2: PREWARM={world_size}, first cell once ready (cell only)",
            "B2",
            b2,
            target=True,
            note=f"ready {ready:.1f} s after load_ext",
        ),
    ]
    return {"measurements": rows, "rounds": rounds, "world_size": world_size, "raw": raw}
