"""What ``nbfsdp.log`` every step and the live dashboard's redraws cost a training loop.

The same ``%%fsdp`` loop as ``step_time`` (world size 2, about 10 steps a second on the project's 2-core
machine), run alternately without (A) and with (B) ``nbfsdp.log(step=..., loss=...)`` each step, dashboard
on in both, in the order A B, B A, A B, ... so that a drift over the run weighs on both sides alike. With
logging the ranks stream records to the kernel every 0.5 s and a worker process redraws the figures every
1 to 3 s, on the same cores: a cost that lands on a step now and then, so this compares the **mean** step
time after the warm-up (throughput), and reports the median-based figure beside it.
Target: overhead (B/A - 1) at most 2% of step time.

Run alone: ``python -m benchmarks --only log_overhead``.
"""

from __future__ import annotations

import dataclasses
import statistics

from benchmarks import loops, notebook_loop
from benchmarks.context import Context
from benchmarks.measurement import Measurement, in_turn, median

NAME = "log_overhead"
TARGET_PERCENT = 2.0
WORLD_SIZE = 2


def overhead_percent(no_log: list[float], log: list[float]) -> float:
    """What logging adds, in percent of the step, from rounds of step times without and with it (medians)."""
    return (statistics.median(log) / statistics.median(no_log) - 1) * 100


def run(ctx: Context) -> dict:
    base = loops.CPU_QUICK if ctx.quick else loops.CPU_FULL
    sizes = dataclasses.replace(base, steps=base.warmup + (10 if ctx.quick else 30))
    # single rounds spread from -9% to +14% on the 2-core machine: 12 rounds left the figure a standard error
    # of about 1.5 points against a 2-point target
    rounds = ctx.rounds(full=20, quick=2)
    kernel = ctx.warm_kernel()
    notebook_loop.start_world(kernel, WORLD_SIZE, sizes)
    means = {False: [], True: []}
    medians = {False: [], True: []}
    records = 0
    for index in range(rounds):
        for log_each_step in in_turn(False, True, index):
            result = notebook_loop.run(kernel, WORLD_SIZE, sizes, log_each_step=log_each_step)
            steps = result["step_times"][sizes.warmup :]
            means[log_each_step].append(statistics.fmean(steps) * 1000)
            medians[log_each_step].append(statistics.median(steps) * 1000)
            if log_each_step:
                records = result["records"]
    per_round = [overhead_percent([a], [b]) for a, b in zip(means[False], means[True], strict=True)]
    overhead_median = overhead_percent(medians[False], medians[True])
    rows = [
        Measurement.compared(
            f"CPU ws{WORLD_SIZE}: nbfsdp.log each step + live plot, overhead of mean step time",
            overhead_percent,
            ("no log", means[False]),
            ("log", means[True]),
            unit="%",
            target=TARGET_PERCENT,
            op="<=",
            ab_unit="ms",
            samples_value=per_round,
            note=(
                f"by median step instead: {overhead_median:+.2f}%; per-round overheads (each round's two cells "
                f"back to back): median {median(per_round):+.2f}%, {min(per_round):+.2f} to {max(per_round):+.2f}%"
            ),
        )
    ]
    return {
        "measurements": rows,
        "rounds": rounds,
        "world_size": WORLD_SIZE,
        "sizes": sizes.as_dict(),
        "mean_step_ms": {"no_log": means[False], "log": means[True]},
        "median_step_ms": {"no_log": medians[False], "log": medians[True]},
        "overhead_percent_by_median": overhead_median,
        "records_per_logged_cell": records,
    }
