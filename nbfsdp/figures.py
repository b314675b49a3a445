"""The dashboard's figures: loss, memory per rank, step time, drawn from a run's records.

``DashboardFigure`` keeps its axes, lines and bars from one drawing to the
next and moves them to the records added since: building them anew (axes,
ticks, legends) was half of each drawing's CPU time. ``nbfsdp.renderer``
keeps one per live dashboard in a process of its own.
"""

from __future__ import annotations

import io
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

#: Memory categories drawn per rank, in stacking order.
MEMORY_CATEGORIES = ("mem_params", "mem_grads", "mem_optim", "mem_activations")


class DashboardFigure:
    """The loss, memory and step-time figures of one run; ``add`` its records as they come."""

    def __init__(self, world_size: int, predicted: list[dict[str, int]] | None) -> None:
        """``predicted``: ``explain``'s memory per rank, drawn beside the measured bars."""
        self.figure = Figure(figsize=(12, 3.2), dpi=72)
        self._canvas = FigureCanvasAgg(self.figure)
        self.records = 0
        self._loss_axes, self._memory_axes, self._time_axes = self.figure.subplots(1, 3)
        ranks = range(world_size)
        self._loss = [self._loss_axes.plot([], [], label=f"rank {rank}")[0] for rank in ranks]
        self._time = [self._time_axes.plot([], [], label=f"rank {rank}")[0] for rank in ranks]
        self._series: list[dict[str, list[float]]] = [
            {"steps": [], "ms": [], "loss_steps": [], "loss": []} for _ in ranks
        ]
        self._bars = [
            self._memory_axes.bar(
                ranks, [0.0] * world_size, color=f"C{index}", label=category.removeprefix("mem_")
            ).patches
            for index, category in enumerate(MEMORY_CATEGORIES)
        ]
        self._comm_buffers = self._predicted(predicted or [])
        # titles at a fixed height: placing them above the tick labels measured every axis at each drawing
        self._loss_axes.set_title("loss", y=1.0)
        self._memory_axes.set_title("memory per rank (MiB, last step)", y=1.0)
        self._time_axes.set_title("step time (ms)", y=1.0)
        for axes in (self._loss_axes, self._time_axes):
            axes.set_xlabel("step")
        self._memory_axes.set_xlabel("rank")
        self._memory_axes.set_xticks(ranks)
        self._memory_axes.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
        self._legend_ranks: dict[str, tuple[int, ...]] = {}
        # fixed margins: tight_layout would draw the whole figure once more just to measure it
        self.figure.subplots_adjust(left=0.04, right=0.97, bottom=0.16, top=0.9, wspace=0.45)

    def _predicted(self, predicted: list[dict[str, int]]) -> dict[int, Any]:
        """explain's figures: params+grads+optim as a dashed line per rank, its communication buffers
        (not measurable on CPU) as a hatched bar on top of the measured ones. Returns those bars by rank."""
        axes, comm_buffers = self._memory_axes, {}
        for rank, expected in enumerate(predicted):
            total = (expected["params"] + expected["grads"] + expected["optim"]) / 2**20
            label = "explain: params+grads+optim" if rank == 0 else None
            axes.plot([rank - 0.4, rank + 0.4], [total, total], color="black", linestyle="--", label=label)
            if expected["comm_buffers"]:
                comm_buffers[rank] = axes.bar(
                    rank, expected["comm_buffers"] / 2**20, color="none", edgecolor="grey", hatch="//",
                    label="comm buffers (explain)" if not comm_buffers else None,
                ).patches[0]  # fmt: skip
        return comm_buffers

    def add(self, records: list[dict[str, Any]]) -> DashboardFigure:
        """Take these records (in the order they were made) into the figures."""
        latest: dict[int, dict[str, Any]] = {}
        for record in records:
            rank, series = record["rank"], self._series[record["rank"]]
            series["steps"].append(record["step"])
            series["ms"].append(record["step_time"] * 1000)
            if "loss" in record:
                series["loss_steps"].append(record["step"])
                series["loss"].append(record["loss"])
            latest[rank] = record
            if "changed" in record and rank == 0:  # a setting changed mid-run, marked where it took effect
                self._mark(record["step"], record["changed"])
        for rank, record in latest.items():
            self._stack_memory(rank, record)
        self.records += len(records)
        for rank, series in enumerate(self._series):
            self._loss[rank].set_data(series["loss_steps"], series["loss"])
            self._time[rank].set_data(series["steps"], series["ms"])
        self._legend(self._loss_axes, self._loss, "loss_steps")
        self._legend(self._time_axes, self._time, "steps")
        for axes in (self._loss_axes, self._memory_axes, self._time_axes):
            axes.relim()
            axes.autoscale_view()
        return self

    def _stack_memory(self, rank: int, record: dict[str, Any]) -> None:
        bottom = 0.0
        for bars, category in zip(self._bars, MEMORY_CATEGORIES, strict=True):
            value = record.get(category, 0) / 2**20
            bars[rank].set_y(bottom)
            bars[rank].set_height(value)
            bottom += value
        if rank in self._comm_buffers:
            self._comm_buffers[rank].set_y(bottom)

    def _mark(self, step: int, changed: str) -> None:
        for axes in (self._loss_axes, self._time_axes):
            axes.axvline(step, color="grey", linestyle=":")
            axes.annotate(
                changed, (step, 1), xycoords=("data", "axes fraction"),
                rotation=90, va="top", ha="right", fontsize=6, color="grey",
            )  # fmt: skip

    def _legend(self, axes: Any, lines: list[Any], key: str) -> None:
        """A legend of the ranks that have points, made anew only when that set changes."""
        ranks = tuple(rank for rank, series in enumerate(self._series) if series[key])
        if ranks and self._legend_ranks.get(key) != ranks:
            self._legend_ranks[key] = ranks
            # "best" would search the plot for a place at every drawing
            axes.legend(handles=[lines[rank] for rank in ranks], fontsize=7, loc="upper right")

    def png(self) -> bytes:
        buffer = io.BytesIO()
        # compression level 1: 15 ms less than the default 6, for a few KiB more
        self._canvas.print_png(buffer, pil_kwargs={"compress_level": 1})
        return buffer.getvalue()


def figure(records: list[dict[str, Any]], world_size: int, predicted: list[dict[str, int]] | None) -> Figure:
    """The loss, memory and step-time figures of ``records``, drawn at once."""
    return DashboardFigure(world_size, predicted).add(records).figure


def png(records: list[dict[str, Any]], world_size: int, predicted: list[dict[str, int]] | None) -> bytes:
    """The same as a PNG."""
    return DashboardFigure(world_size, predicted).add(records).png()
