"""The dashboard's figures: loss, memory per rank, step time, drawn from a run's records.

Pure functions of the records, so ``nbfsdp.renderer`` can draw them in a
process of its own.
"""

from __future__ import annotations

import io
from collections import defaultdict
from typing import Any

from matplotlib.figure import Figure

#: Memory categories drawn per rank, in stacking order.
MEMORY_CATEGORIES = ("mem_params", "mem_grads", "mem_optim", "mem_activations")


def png(records: list[dict[str, Any]], world_size: int, predicted: list[dict[str, int]] | None) -> bytes:
    buffer = io.BytesIO()
    # compression level 1: 15 ms less than the default 6, for a few KiB more
    figure(records, world_size, predicted).savefig(buffer, format="png", pil_kwargs={"compress_level": 1})
    return buffer.getvalue()


def figure(records: list[dict[str, Any]], world_size: int, predicted: list[dict[str, int]] | None) -> Figure:
    """The loss, memory and step-time figures of ``records``; ``predicted``: ``explain``'s memory per rank."""
    by_rank: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        by_rank[record["rank"]].append(record)
    drawing = Figure(figsize=(12, 3.2), dpi=72)
    loss_axes, memory_axes, time_axes = drawing.subplots(1, 3)
    for rank, of_rank in sorted(by_rank.items()):
        steps = [r["step"] for r in of_rank]
        if any("loss" in r for r in of_rank):
            loss_axes.plot(
                [r["step"] for r in of_rank if "loss" in r],
                [r["loss"] for r in of_rank if "loss" in r],
                label=f"rank {rank}",
            )
        time_axes.plot(steps, [r["step_time"] * 1000 for r in of_rank], label=f"rank {rank}")
        bottom = 0.0
        for category in MEMORY_CATEGORIES:
            value = of_rank[-1].get(category, 0) / 2**20
            memory_axes.bar(
                rank,
                value,
                bottom=bottom,
                color=f"C{MEMORY_CATEGORIES.index(category)}",
                label=category.removeprefix("mem_") if rank == min(by_rank) else None,
            )
            bottom += value
    if predicted:
        for rank, expected in enumerate(predicted):
            if rank in by_rank and expected["comm_buffers"]:  # not measurable on CPU: explain's figure
                measured = sum(by_rank[rank][-1].get(c, 0) for c in MEMORY_CATEGORIES) / 2**20
                memory_axes.bar(
                    rank, expected["comm_buffers"] / 2**20, bottom=measured, color="none", edgecolor="grey",
                    hatch="//", label="comm buffers (explain)" if rank == min(by_rank) else None,
                )  # fmt: skip
            total = (expected["params"] + expected["grads"] + expected["optim"]) / 2**20
            memory_axes.hlines(
                total,
                rank - 0.4,
                rank + 0.4,
                colors="black",
                linestyles="--",
                label="explain: params+grads+optim" if rank == 0 else None,
            )
    for record in records:  # the settings changed mid-run, marked where they took effect
        if "changed" in record and record["rank"] == 0:
            for axes in (loss_axes, time_axes):
                axes.axvline(record["step"], color="grey", linestyle=":")
                axes.annotate(
                    record["changed"], (record["step"], 1), xycoords=("data", "axes fraction"),
                    rotation=90, va="top", ha="right", fontsize=6, color="grey",
                )  # fmt: skip
    loss_axes.set(title="loss", xlabel="step")
    memory_axes.set(title="memory per rank (MiB, last step)", xlabel="rank")
    memory_axes.set_xticks(range(world_size))
    time_axes.set(title="step time (ms)", xlabel="step")
    for axes in (loss_axes, time_axes):
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize=7, loc="upper right")  # "best" would search the plot for a place
    if memory_axes.get_legend_handles_labels()[0]:
        memory_axes.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    # fixed margins: tight_layout would draw the whole figure once more just to measure it
    drawing.subplots_adjust(left=0.04, right=0.97, bottom=0.16, top=0.9, wspace=0.45)
    return drawing
