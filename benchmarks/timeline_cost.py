"""timeline: what capturing steps (``%%fsdp --timeline``, on by default) costs a training loop.

The step-time loop (``loops``, world size 2, about 10 steps a second here) run alternately with ``--timeline 0``
(A) and with the default capture (B: the cell's second step, then one every 10 s), 200 steps a cell, in the order
A B, B A, ...: the mean step after the warm-up, B / A (target: at most 1.02x). And the captured steps themselves:
a captured step (the profiler on) and the step after it (the capture's events parsed at its start) against the
median step of its cell (target: a captured step at most 1.5x).

Run alone: ``python -m benchmarks --only timeline``.
"""

from __future__ import annotations

import dataclasses
import statistics

from benchmarks import loops, notebook_loop
from benchmarks.context import Context
from benchmarks.measurement import Measurement, in_turn, median

NAME = "timeline"
TARGET_RATIO = 1.02
CAPTURED_TARGET = 1.5
WORLD_SIZE = 2

_CAPTURED = """
import json as _json, nbfsdp as _nbfsdp
print(_json.dumps(sorted({c["forward"] for c in _nbfsdp.last_run().timeline if c["rank"] == 0})))
"""


def ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(b) / statistics.median(a)


def run(ctx: Context) -> dict:
    base = loops.CPU_QUICK if ctx.quick else loops.CPU_FULL
    sizes = dataclasses.replace(base, steps=base.warmup + (20 if ctx.quick else 200))
    rounds = ctx.rounds(full=8, quick=2)
    kernel = ctx.warm_kernel()
    notebook_loop.start_world(kernel, WORLD_SIZE, sizes)
    means: dict[bool, list[float]] = {False: [], True: []}
    captured, following = [], []
    for index in range(rounds):
        for capturing in in_turn(False, True, index):
            flag = "" if capturing else "--timeline 0 "
            result = notebook_loop.run(kernel, WORLD_SIZE, sizes, flags=flag)
            steps = result["step_times"]
            means[capturing].append(statistics.fmean(steps[sizes.warmup :]) * 1000)
            if capturing:
                typical = statistics.median(steps[sizes.warmup :])
                for forward in kernel.execute(_CAPTURED).json():
                    if forward >= 1 and forward + 1 < len(steps):
                        captured.append(steps[forward] / typical)
                        following.append(steps[forward + 1] / typical)
    rows = [
        Measurement.compared(
            f"CPU ws{WORLD_SIZE}: a {sizes.steps}-step loop with the default --timeline (a step captured every "
            "10 s) / --timeline 0, mean step",
            ratio,
            ("--timeline 0", means[False]),
            ("default", means[True]),
            unit="x",
            target=TARGET_RATIO,
            op="<=",
            ab_unit="ms",
        ),
        Measurement(
            what=f"CPU ws{WORLD_SIZE}: a captured step (the profiler on) / its cell's median step",
            value=median(captured),
            unit="x",
            target=CAPTURED_TARGET,
            op="<=",
            samples_value=captured,
            note=f"{len(captured)} captured steps; the step after each (its capture's events parsed at its start): "
            f"median {median(following) or 0:.2f}x, at most {max(following, default=0):.2f}x",
        ),
    ]
    return {"measurements": rows, "rounds": rounds, "sizes": sizes.as_dict(), "captured_ratios": captured}
