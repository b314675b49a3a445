"""The dashboard's figures: loss, memory per rank, step time, drawn from a run's records.

``DashboardFigure`` keeps its axes, lines and bars from one drawing to the
next and moves them to the records added since: building them anew (axes,
ticks, legends) was half of each drawing's CPU time. ``nbfsdp.ui.renderer``
keeps one per live dashboard in a process of its own. A live one also keeps
the picture of what does not move (axes, ticks, titles) and draws only the
moving parts over it (matplotlib's blitting), with limits that leave room to
grow, so the picture is drawn again only when the records outgrow them. Such a
drawing draws no text: the rank legends, which lines may pass under, are
copied back over the lines from the still picture. It makes 4,800 function calls
and takes 7-11 ms of CPU, against 15,900 calls and 16-22 ms while it drew the
legends again, and 70-120 ms for the same figure drawn whole (two ranks, 300
steps, on the 2-core machine).
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Annotation
from PIL import Image

#: Memory categories drawn per rank, in stacking order (``other``: what the peak held beyond the tensors the meter
#: counts by category, its temporaries and gathered parameters: a GPU's allocator peak, or on the CPU a captured
#: step's, all its allocations counted).
MEMORY_CATEGORIES = ("mem_params", "mem_grads", "mem_optim", "mem_activations", "mem_other")
#: explain's traced peak drawn the same way: its categories, in the measured bars' colours (its temporaries and
#: communication buffers in ``other``'s).
TRACED_CATEGORIES = (("params",), ("grads",), ("optim",), ("activations",), ("temporaries", "comm_buffers"))
_MEMORY_LABELS = {
    "mem_params": "params",
    "mem_grads": "grads",
    "mem_optim": "optim",
    "mem_activations": "activations",
    "mem_other": "temporaries, comm buffers",
}
#: The peak's lines, measured (solid) and explain's (dashed): a colour no category's bar has.
PEAK_COLOR = "C4"
#: With explain's prediction, each rank's measured bar stands left of its rank and explain's right of it, this
#: wide each, so that no bar mixes a measurement with a prediction; alone, the measured bar is centred, wider.
PAIRED_BAR_WIDTH = 0.38
PAIRED_OFFSET = 0.2
ALONE_BAR_WIDTH = 0.8
#: Up to this many ranks each bar is labelled under it ("measured", "explain"); beyond, the axis' label says it.
MOST_LABELLED_RANKS = 4
#: A live figure's limits leave this much room beyond its records (a share of their range): steps ahead,
#: values above and below. The still picture is drawn again only when records leave the limits.
STEPS_AHEAD = 0.5
VALUES_MARGIN = 0.25
#: ... and at least room for the steps of this many seconds at the fastest recent pace (three live drawings at
#: the dashboard's slowest pace), so that fast steps do not outgrow the limits at every drawing.
SECONDS_AHEAD = 10.0
#: Steps per rank that give the fastest recent pace, and the shortest step it counts (records logged twice
#: in a step would otherwise ask for room for millions of steps).
RECENT_STEPS = 10
SHORTEST_STEP_MS = 1.0
#: ... and room for the loss to fall to this share of its lowest value: it falls fastest in the first steps,
#: while its range is still small.
LOSS_FALL = 0.5
#: Step times (slowest in the first steps) are drawn from zero, with room for a step this much slower again
#: than the slowest so far.
SLOW_STEP_ROOM = 0.5
#: Below lines, above bars: where setting-change markers sit, so a live drawing layers as a full one does.
MARKER_ZORDER = 1.5
#: A setting change's label sits in one of this many rows above the loss and step-time axes (under their titles),
#: where no line passes under it; a row this many points high, labels at least this many points apart in a row.
MARKER_ROWS = 2
MARKER_ROW_POINTS = 11.0
MARKER_GAP_POINTS = 6.0
MARKER_FONT_SIZE = 8
#: The memory legend's column, between the memory and step-time axes, as a share of an axes' width.
LEGEND_COLUMN = 0.5


class DashboardFigure:
    """The loss, memory and step-time figures of one run; ``add`` its records as they come."""

    def __init__(self, world_size: int, predicted: list[dict[str, Any]] | None, *, live: bool = False) -> None:
        """``predicted``: ``explain``'s memory per rank, drawn beside the measured bars. ``live``: drawn
        again and again as records come (blitted, limits with room to grow); else drawn whole, limits fit."""
        self.figure = Figure(figsize=(12, 3.6), dpi=72)
        self._canvas = FigureCanvasAgg(self.figure)
        self._live = live
        self._still: Any = None  # a live figure's picture without its moving parts, while its limits hold
        self._still_legends: list[tuple[int, int, int, int]] = []  # where its rank legends lie
        self.records = 0
        # fixed margins: tight_layout would draw the whole figure once more just to measure it. The memory legend
        # has a column of its own, and the loss and step-time titles leave room for the change labels under them.
        grid = self.figure.add_gridspec(
            1, 4, width_ratios=(1, 1, LEGEND_COLUMN, 1), left=0.045, right=0.985, bottom=0.15, top=0.82, wspace=0.3
        )
        self._loss_axes, self._memory_axes, self._time_axes = (self.figure.add_subplot(grid[i]) for i in (0, 1, 3))
        self._marker_labels: dict[Axes, list[Annotation]] = {self._loss_axes: [], self._time_axes: []}
        ranks = range(world_size)
        self._loss = [self._loss_axes.plot([], [], label=f"rank {rank}")[0] for rank in ranks]
        self._time = [self._time_axes.plot([], [], label=f"rank {rank}")[0] for rank in ranks]
        self._series: list[dict[str, list[float]]] = [
            {"steps": [], "ms": [], "loss_steps": [], "loss": []} for _ in ranks
        ]
        self.memory = MemoryPanel(self._memory_axes, world_size, predicted or [], live=live)
        # titles at a fixed height: placing them above the tick labels measured every axis at each drawing
        title_pad = 2 + MARKER_ROWS * MARKER_ROW_POINTS + 4
        self._loss_axes.set_title("loss", y=1.0, pad=title_pad)
        self._memory_axes.set_title("memory per rank (MiB, at its peak)", y=1.0, pad=title_pad)
        self._time_axes.set_title("step time (ms)", y=1.0, pad=title_pad)
        for axes in (self._loss_axes, self._time_axes):
            axes.set_xlabel("step")
        self._legend_ranks: dict[str, tuple[int, ...]] = {}
        if live:
            for _, artist in self._moving_parts():
                artist.set_animated(True)  # left out of the still picture; drawn over it each time

    def predict_peaks(self, predicted: list[dict[str, Any]]) -> None:
        """explain's traced peak of each rank, once its trace is done (a live figure takes it when it comes)."""
        if self.memory.predict_peaks(predicted):
            self._still = None

    def add(self, records: list[dict[str, Any]]) -> DashboardFigure:
        """Take these records (in the order they were made) into the figures."""
        highest: dict[int, dict[str, Any]] = {}  # each rank's record of the highest peak among these
        for record in records:
            rank, series = record["rank"], self._series[record["rank"]]
            series["steps"].append(record["step"])
            series["ms"].append(record["step_time"] * 1000)
            if "loss" in record:
                series["loss_steps"].append(record["step"])
                series["loss"].append(record["loss"])
            if record.get("mem_peak", 0) >= highest.get(rank, {}).get("mem_peak", 0):
                highest[rank] = record
            if "changed" in record and rank == 0:  # a setting changed mid-run, marked where it took effect
                self._mark(record["step"], record["changed"])
        for rank, record in highest.items():
            self.memory.stack(rank, record)
        self.records += len(records)
        for rank, series in enumerate(self._series):
            self._loss[rank].set_data(series["loss_steps"], series["loss"])
            self._time[rank].set_data(series["steps"], series["ms"])
        self._legend(self._loss_axes, self._loss, "loss_steps")
        self._legend(self._time_axes, self._time, "steps")
        for axes in (self._loss_axes, self._memory_axes, self._time_axes):
            axes.relim()
            if self._live:
                self._keep_in_view(axes)
            else:
                axes.autoscale_view()
        if self._still is None:  # the limits or the markers changed: a live figure draws its still picture again
            self._place_marker_labels()
        return self

    def _keep_in_view(self, axes: Axes) -> None:
        """Limits with room for the records to come, changed (and the still picture with them) only when the
        records leave them."""
        data, view = axes.dataLim, axes.viewLim
        if not np.isfinite(data.get_points()).all():  # no records yet
            return
        inside = view.x0 <= data.x0 and data.x1 <= view.x1 and view.y0 <= data.y0 and data.y1 <= view.y1
        if inside and self._still is not None:
            return
        y_room = max(data.height, abs(data.y1) * 0.1, 1e-6) * VALUES_MARGIN
        if axes is self._memory_axes:  # bars stand on zero, one per rank
            axes.set_ylim(0.0, data.y1 + y_room)
        else:
            x_room = max(data.width, 1.0)
            steps_ahead = max(STEPS_AHEAD * x_room, SECONDS_AHEAD * 1000 / self._recent_step_ms())
            axes.set_xlim(data.x0 - 0.02 * x_room, data.x1 + steps_ahead)
            if axes is self._loss_axes:
                axes.set_ylim(data.y0 - max(y_room, abs(data.y0) * LOSS_FALL), data.y1 + y_room)
            else:
                axes.set_ylim(0.0, data.y1 * (1 + SLOW_STEP_ROOM))
        self._still = None

    def _recent_step_ms(self) -> float:
        """The shortest of the last few steps of any rank (ms): the first steps are the slowest."""
        return max(min(ms for series in self._series for ms in series["ms"][-RECENT_STEPS:]), SHORTEST_STEP_MS)

    def _mark(self, step: int, changed: str) -> None:
        for axes, labels in self._marker_labels.items():
            axes.axvline(step, color="grey", linestyle=":", zorder=MARKER_ZORDER)
            label = axes.annotate(
                f"step {step}: {changed}",
                (step, 1),
                xycoords=("data", "axes fraction"),
                xytext=(0, 2),
                textcoords="offset points",
                va="bottom",
                fontsize=MARKER_FONT_SIZE,
                color="0.25",
                annotation_clip=False,
            )
            labels.append(label)
        self._still = None  # markers are part of the still picture

    def _place_marker_labels(self) -> None:
        """Each change's label above its axes, starting at its marker (ending there where it would pass the axes'
        right edge), in the lowest row where it keeps clear of the labels already placed. The newest are placed
        first: where the rows are full, the oldest labels are left out (``last_run().changes`` lists every change)."""
        points = self.figure.dpi / 72
        gap, renderer = MARKER_GAP_POINTS * points, self._canvas.get_renderer()

        def clear(start: float, width: float, span: tuple[float, float]) -> bool:
            return start + width + gap <= span[0] or span[1] + gap <= start

        for axes, labels in self._marker_labels.items():
            rows: list[list[tuple[float, float]]] = [[] for _ in range(MARKER_ROWS)]
            for label in reversed(labels):
                x = axes.transData.transform((label.xy[0], 0))[0]
                label.set_visible(True)  # a hidden text measures nothing
                width = self._fit(label, axes.bbox.width, renderer)
                start = x if x + width <= axes.bbox.x1 else max(x - width, axes.bbox.x0)
                free = [index for index, row in enumerate(rows) if all(clear(start, width, span) for span in row)]
                label.set_visible(bool(free))
                if free:
                    rows[free[0]].append((start, start + width))
                    label.xyann = ((start - x) / points, 2 + free[0] * MARKER_ROW_POINTS)

    @staticmethod
    def _fit(label: Annotation, room: float, renderer: Any) -> float:
        """Shorten a label wider than its axes (several settings changed at once) to fit, ending in an ellipsis;
        its width. ``last_run().changes`` keeps the whole text."""
        text, width = label.get_text(), label.get_window_extent(renderer).width
        while width > room and len(text) > 1:
            text = text.removesuffix("\u2026")
            text = text[: max(1, int(len(text) * room / width) - 1)] + "\u2026"
            label.set_text(text)
            width = label.get_window_extent(renderer).width
        return width

    def _legend(self, axes: Any, lines: list[Any], key: str) -> None:
        """A legend of the ranks that have points, made anew only when that set changes."""
        ranks = tuple(rank for rank, series in enumerate(self._series) if series[key])
        if ranks and self._legend_ranks.get(key) != ranks:
            self._legend_ranks[key] = ranks
            # "best" would search the plot for a place at every drawing
            # opaque, so that a live drawing can copy it from the still picture over the lines passing under it
            axes.legend(handles=[lines[rank] for rank in ranks], fontsize=7, loc="upper right", framealpha=1)
            self._still = None  # the legend is part of the still picture

    def _moving_parts(self) -> list[tuple[Axes, Artist]]:
        """What a live drawing draws over the still picture, in the order a whole drawing layers it (by
        zorder): bars, lines, the axes' frame (over bars that stand on it). Not the rank legends: they are copied
        back over the lines from the still picture (``_legend_boxes``)."""
        memory = self._memory_axes
        parts: list[tuple[Axes, Artist]] = [(memory, artist) for artist in self.memory.artists()]
        parts += [(self._loss_axes, line) for line in self._loss] + [(self._time_axes, line) for line in self._time]
        for axes in (self._loss_axes, memory, self._time_axes):
            parts += [(axes, spine) for spine in axes.spines.values()]
        return parts

    def _legend_boxes(self) -> list[tuple[int, int, int, int]]:
        """Where the rank legends lie in the still picture (whose rows count from the top), a pixel wider on each
        side so that their frames' antialiased edges come too. Copying them over the lines, rather than drawing
        them again, saves about half a live drawing's CPU (their texts); a line passing under a frame's edge
        stops a pixel short of it."""
        height, boxes = self.figure.bbox.height, []
        for axes in (self._loss_axes, self._time_axes):
            if axes.legend_ is not None:
                x0, y0, x1, y1 = axes.legend_.get_window_extent().extents
                boxes.append(
                    (math.floor(x0) - 1, math.floor(height - y1) - 1, math.ceil(x1) + 1, math.ceil(height - y0) + 1)
                )
        return boxes

    def png(self) -> bytes:
        buffer = io.BytesIO()
        if not self._live:
            # compression level 1: 15 ms less than the default 6, for a few KiB more
            self._canvas.print_png(buffer, pil_kwargs={"compress_level": 1})
            return buffer.getvalue()
        if self._still is None:
            self._canvas.draw()  # leaves out the animated moving parts
            self._still = self._canvas.copy_from_bbox(self.figure.bbox)
            self._still_legends = self._legend_boxes()
        else:
            self._canvas.restore_region(self._still)
        for axes, artist in self._moving_parts():
            axes.draw_artist(artist)
        for box in self._still_legends:
            self._canvas.restore_region(self._still, bbox=box, xy=(0, 0))  # xy: where the still's corner goes
        width, height = self._canvas.get_width_height(physical=True)
        image = Image.frombuffer("RGBA", (width, height), self._canvas.buffer_rgba(), "raw", "RGBA", 0, 1)
        image.save(buffer, format="png", compress_level=1)  # print_png would draw the whole figure again
        return buffer.getvalue()


class MemoryPanel:
    """Each rank's memory at one moment, its peak so far: the measured categories at that moment as a bar whose
    height is the peak (the line over it), and beside it explain's traced peak by category with its line.

    A record's figures are each read at their own moment (the gradients before the optimizer's step, the
    activations at their peak): the peak holds the activations or the gradients, not both (``at_peak``). explain's
    bar is its trace of the step by category (activations included), where the kernel traced it with the batch
    the ranks used; before that, its states alone (``Plan.memory``) and its communication buffers' lower bound.
    """

    def __init__(self, axes: Axes, world_size: int, predicted: list[dict[str, Any]], *, live: bool) -> None:
        self.axes, self._live = axes, live
        ranks = range(world_size)
        self.bars = [
            axes.bar(
                ranks, [0.0] * world_size, ALONE_BAR_WIDTH, color=f"C{index}", label=category.removeprefix("mem_")
            ).patches
            for index, category in enumerate(MEMORY_CATEGORIES)
        ]
        self.peaks = [0.0] * world_size  # each rank's measured peak so far (MiB)
        self.peak_lines = [
            axes.plot(
                _span(rank, ALONE_BAR_WIDTH),
                [np.nan, np.nan],
                color=PEAK_COLOR,
                linewidth=2,
                label="peak so far (measured)" if rank == 0 else None,
            )[0]
            for rank in ranks
        ]
        axes.set_xlabel("rank")
        axes.set_xticks(ranks)
        self._paired = False  # measured and explain's bars side by side, once there is a prediction
        self.predicted_bars: list[Any] = []
        self.predicted_lines: list[Any] = []
        self.predicted_peaks: list[int] = []
        self._plan_bars(predicted)
        self.predict_peaks(predicted)
        self._legend()

    def artists(self) -> list[Artist]:
        return [
            *(bar for bars in self.bars for bar in bars),
            *self.predicted_bars,
            *self.predicted_lines,
            *self.peak_lines,
        ]

    def stack(self, rank: int, record: dict[str, Any]) -> None:
        """A rank's record: its bar shows the moment of its peak so far (a new one from this record, if higher)."""
        if "mem_peak" not in record or record["mem_peak"] / 2**20 < self.peaks[rank] and self.peaks[rank] > 0:
            return
        bottom = 0.0
        for bars, value in zip(self.bars, at_peak(record).values(), strict=True):
            bars[rank].set_y(bottom)
            bars[rank].set_height(value / 2**20)
            bottom += value / 2**20
        self.peaks[rank] = record["mem_peak"] / 2**20
        self.peak_lines[rank].set_ydata([self.peaks[rank]] * 2)

    def _plan_bars(self, predicted: list[dict[str, Any]]) -> None:
        """explain's states per rank, beside the measured bar, hatched: params, grads and optim in the measured
        categories' colours, then its communication buffers (a lower bound, not measurable on CPU), outlined."""
        plans = [expected for expected in predicted if "params" in expected and "peak_parts" not in expected]
        for rank, expected in enumerate(plans):
            self._pair()
            parts = [("params",), ("grads",), ("optim",), ("comm_buffers",)]
            self._bar(rank, [expected[key[0]] for key in parts], outlined_last=True)

    def _bar(self, rank: int, values: list[float], *, outlined_last: bool = False) -> None:
        bottom, x = 0.0, rank + PAIRED_OFFSET
        for index, value in enumerate(values):
            last = outlined_last and index == len(values) - 1
            color = "none" if last else f"C{index}"
            (bar,) = self.axes.bar(
                x,
                value / 2**20,
                PAIRED_BAR_WIDTH,
                bottom,
                color=color,
                alpha=1.0 if last else 0.45,
                edgecolor="grey",
                hatch="//",
                label="comm buffers (explain)" if last and rank == 0 else None,
            ).patches
            if self._live:
                bar.set_animated(True)
            self.predicted_bars.append(bar)
            bottom += value / 2**20

    def _pair(self) -> None:
        """Measured bars to the left of each rank, leaving the right to explain's, each bar labelled."""
        if self._paired:
            return
        self._paired = True
        for rank, line in enumerate(self.peak_lines):
            line.set_xdata(_span(rank - PAIRED_OFFSET, PAIRED_BAR_WIDTH))
            for bars in self.bars:
                bars[rank].set_x(rank - PAIRED_OFFSET - PAIRED_BAR_WIDTH / 2)
                bars[rank].set_width(PAIRED_BAR_WIDTH)
        ranks = len(self.peak_lines)
        if ranks > MOST_LABELLED_RANKS:
            self.axes.set_xlabel("rank (left: measured, right: explain)")
            return
        self.axes.set_xlabel("")
        self.axes.set_xticks([r + side for r in range(ranks) for side in (-PAIRED_OFFSET, PAIRED_OFFSET)], minor=True)
        self.axes.set_xticklabels(["measured", "explain"] * ranks, minor=True, fontsize=7)
        self.axes.set_xticks(range(ranks), [f"rank {rank}" for rank in range(ranks)])
        self.axes.tick_params(axis="x", which="major", length=0, pad=12)

    def _legend(self) -> None:
        self.axes.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))

    def predict_peaks(self, predicted: list[dict[str, Any]]) -> bool:
        """Each rank's peak as explain traced it (``peak``), a dashed line beside the measured one, and where the
        trace gives its categories (``peak_parts``) its bar by them; whether anything changed."""
        peaks = [expected["peak"] for expected in predicted if "peak" in expected]
        if not peaks or peaks == self.predicted_peaks:
            return False
        self.predicted_peaks = peaks
        self._pair()
        parts: list[dict[str, int]] = [expected.get("peak_parts") or {} for expected in predicted if "peak" in expected]
        if all(parts):  # the traced moment replaces the states-only bars
            for bar in self.predicted_bars:
                bar.remove()
            self.predicted_bars = []
            for rank, moment in enumerate(parts):
                self._bar(rank, [sum(moment.get(key, 0) for key in keys) for keys in TRACED_CATEGORIES])
        for rank, peak in enumerate(peaks):
            mib = peak / 2**20
            line = self.axes.plot(
                _span(rank + PAIRED_OFFSET, PAIRED_BAR_WIDTH),
                [mib, mib],
                color=PEAK_COLOR,
                linestyle="--",
                linewidth=1.5,
                label="peak (explain)" if rank == 0 else None,
            )
            self.predicted_lines.extend(line)
            if self._live:
                line[0].set_animated(True)
        self._legend()
        return True


def at_peak(record: dict[str, Any]) -> dict[str, float]:
    """A record's memory by category at its peak (``mem_peak``), summing to it: the shards, the optimizer's state,
    and the activations (a peak at the end of forward) or the unsharded gradients (a peak before the optimizer
    steps), whichever is larger, as the CPU's peak counts them (``nbfsdp.engines.metrics``); on a GPU the
    allocator's peak beyond those is ``other``."""
    activations, grads = record.get("mem_activations", 0), record.get("mem_grads", 0)
    moment = {
        "mem_params": record.get("mem_params", 0),
        "mem_grads": grads if grads > activations else 0,
        "mem_optim": record.get("mem_optim", 0),
        "mem_activations": activations if activations >= grads else 0,
    }
    moment["mem_other"] = max(0, record.get("mem_peak", 0) - sum(moment.values()))
    return moment


def _span(x: float, width: float) -> list[float]:
    """A peak's line across the bar centred at ``x``, a little wider than it."""
    return [x - width / 2 - 0.05, x + width / 2 + 0.05]


def figure(records: list[dict[str, Any]], world_size: int, predicted: list[dict[str, Any]] | None) -> Figure:
    """The loss, memory and step-time figures of ``records``, drawn at once."""
    return DashboardFigure(world_size, predicted).add(records).figure


def png(records: list[dict[str, Any]], world_size: int, predicted: list[dict[str, Any]] | None) -> bytes:
    """The same as a PNG."""
    return DashboardFigure(world_size, predicted).add(records).png()
