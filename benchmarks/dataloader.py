"""Step time of the FSDP loop reading a DataLoader: the notebook's loader split by ``%%fsdp`` against torchrun
with a ``DistributedSampler`` (CPU, gloo).

``step_time``'s comparison (same model, FSDP units, mixed precision and loop text, ``nbfsdp.log`` each step
with the dashboard on, torchrun and the cell alternating rounds, each alone, ratio of the medians of round
medians with its bootstrap interval; target at most 1.03), with the loop's head ``for step, (x, y) in
enumerate(loader)``: one epoch of an in-memory ``TensorDataset`` of ``STEPS`` global batches of ``TOKENS``
rows per rank (as many as ``step_time``'s batches). In the notebook the loader has the global batch and
shuffles from a seeded generator, and nbfsdp splits each batch across the ranks; on torchrun each rank's
loader takes ``GLOBAL_BATCH // world_size`` from a ``DistributedSampler(shuffle=True, seed=SEED)``. A step's
time includes getting its batch. After the timed epoch both sides count the samples all ranks read at each
step of another: the row beside the ratio says whether the global batches are the same. World sizes 2 and 4
(``--quick``: 2, one round). Rank 0's losses differ between the sides (it reads other samples), so no loss row.

Run alone: ``python -m benchmarks --only dataloader``.
"""

from __future__ import annotations

import dataclasses

from benchmarks import loops, step_time
from benchmarks.context import Context
from benchmarks.measurement import Measurement

NAME = "dataloader"


def same_global_batch(result: dict, label: str) -> Measurement:
    """Samples all ranks read at each step, torchrun against %%fsdp: the largest difference (0 when the same)."""
    torchrun, fsdp = result["global_batches_torchrun"], result["global_batches_fsdp"]
    differences = [abs(a - b) for a, b in zip(torchrun, fsdp, strict=False)]
    plan = result["loader_plan_fsdp"]
    return Measurement(
        what=f"{label}: samples all ranks read per step, max |torchrun - %%fsdp| ({len(fsdp)} steps)",
        value=max(differences, default=0) if len(torchrun) == len(fsdp) else float("inf"),
        unit="",
        target=0,
        op="<=",
        a_label="torchrun",
        a=max(torchrun, default=None),
        b_label="%%fsdp",
        b=max(fsdp, default=None),
        note=(
            f"torchrun: {result['sizes']['tokens']} a rank from a DistributedSampler; %%fsdp: the notebook's "
            f"batches of {plan['batch_size']} split {plan['per_rank']} a rank, {plan['steps_per_epoch']} steps"
        ),
    )


def run(ctx: Context) -> dict:
    sizes = dataclasses.replace(loops.CPU_QUICK if ctx.quick else loops.CPU_FULL, from_loader=True)
    # 8 rounds, not step_time's 16, to keep it a few minutes long; its interval is the wider for it (there, 8
    # rounds' median moved by +-4% from run to run on the 2-core VM)
    rounds = ctx.rounds(full=8, quick=1)  # the quick run: that it runs and agrees (step_time's takes turns)
    worlds = (2,) if ctx.quick else (2, 4)
    results = {f"ws{ws}": step_time.compare(ctx.warm_kernel(), ws, sizes, rounds) for ws in worlds}
    rows = []
    for key, result in results.items():
        label = f"CPU {key} DataLoader"
        rows += [*step_time.timing_rows(result, label), same_global_batch(result, label)]
    return {"measurements": rows, "rounds": rounds, "by_world_size": results}
