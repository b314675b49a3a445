"""A captured step drawn: one row of lanes per rank, aligned on the ranks' shared clock, each phase coloured,
the communication no compute covered marked; two steps side by side where a change of the settings came between
them. Drawn by the dashboard's worker (``nbfsdp.helpers.drawing``) and by ``%fsdp timeline`` in the kernel.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from nbfsdp.shared.timeline import LANES, TRANSFERS, WORKING, union

#: Each event's colour, by its name; an event named otherwise takes its lane's.
COLORS = {
    "forward": "#4c72b0",
    "backward": "#55a868",
    "other": "#b0b7c3",
    "all_gather": "#dd8452",
    "copy_in": "#f0c9a8",
    "copy_out": "#f0c9a8",
    "reduce_scatter": "#c44e52",
    "all_reduce": "#8c2d2f",
    "optimizer": "#8172b3",
    "zero_grad": "#b3a9d6",
}
LANE_COLORS = {"nbfsdp": "#937860"}
#: Exposed communication: the hatched stripe over what no compute covered.
EXPOSED_COLOR = "#d62728"
#: Units are named on bars at least this share of the step wide.
LABELLED_SHARE = 0.04


def _exposed(events: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """Where this rank's communication ran while it computed nothing."""
    transfers = union((e["start_ms"], e["start_ms"] + e["ms"]) for e in events if e["name"] in TRANSFERS)
    working = union((e["start_ms"], e["start_ms"] + e["ms"]) for e in events if e["name"] in WORKING)
    exposed = []
    for start, end in transfers:
        cursor = start
        for w_start, w_end in working:
            if w_end <= cursor or w_start >= end:
                continue
            if w_start > cursor:
                exposed.append((cursor, w_start))
            cursor = max(cursor, w_end)
        if cursor < end:
            exposed.append((cursor, end))
    return exposed


def draw_step(axes: Axes, captures: list[dict[str, Any]], title: str = "") -> None:
    """One step's captures (a rank each) on ``axes``: a row of lanes per rank, time in ms from the first event
    of any rank."""
    origin_ns = min(c["clock_ns"] + min((e["start_ms"] for e in c["events"]), default=0) * 1e6 for c in captures)
    span = max(
        ((c["clock_ns"] - origin_ns) / 1e6 + max((e["start_ms"] + e["ms"] for e in c["events"]), default=0))
        for c in captures
    )
    ticks, labels = [], []
    lanes = len(LANES)
    for row, capture in enumerate(sorted(captures, key=lambda c: c["rank"])):
        shift = (capture["clock_ns"] - origin_ns) / 1e6
        top = row * (lanes + 1)
        for lane_index, lane in enumerate(LANES):
            y = top + lane_index
            ticks.append(y)
            labels.append(f"rank {capture['rank']} {lane}" if lane_index == 0 else lane)
            mine = [e for e in capture["events"] if e["lane"] == lane]
            for event in mine:
                color = COLORS.get(event["name"], LANE_COLORS.get(lane, "#999999"))
                start = shift + event["start_ms"]
                axes.broken_barh([(start, event["ms"])], (y - 0.4, 0.8), facecolors=color, linewidth=0)
                if event["unit"] and event["ms"] >= LABELLED_SHARE * span:
                    axes.text(start + event["ms"] / 2, y, event["unit"], ha="center", va="center", fontsize=6)
        exposed = [(shift + a, b - a) for a, b in _exposed(capture["events"])]
        if exposed:  # over the communication lanes: what the rank waited for
            band = (top + LANES.index("all_gather") - 0.5, len(("all_gather", "reduce_scatter")))
            axes.broken_barh(exposed, band, facecolors="none", edgecolor=EXPOSED_COLOR, hatch="///", linewidth=0.6)
    axes.set_yticks(ticks, labels, fontsize=7)
    axes.invert_yaxis()
    axes.set_xlim(0, span * 1.01)
    axes.set_xlabel("ms")
    first = captures[0]
    exposed_ms = ", ".join(f"{c['exposed_comm_ms']:.1f}" for c in sorted(captures, key=lambda c: c["rank"]))
    axes.set_title(
        title or f"step {first['step']}: {first['step_ms']:.0f} ms, exposed communication {exposed_ms} ms (per rank)",
        fontsize=8,
    )


def settings_words(settings: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value}" for key, value in settings.items())


def collectives_table(capture: dict[str, Any]) -> list[dict[str, Any]]:
    """Each collective of a captured step: its kind, unit, bytes, milliseconds in flight, and the bus bandwidth
    that makes (a ring's: the bytes times (n - 1) / n over the time, n the ranks of its group; nccl-tests'
    ``busbw``). Under ``reshard_after_forward`` N a unit's second gather of the step, backward's, runs in its group
    of N."""
    shards, group = capture.get("shards", 1), capture.get("post_forward_group")
    rows, gathered = [], set()
    for event in capture["events"]:
        if event["name"] not in TRANSFERS:
            continue
        n = shards
        if event["name"] == "all_gather":
            n = group if group and event["unit"] in gathered else shards
            gathered.add(event["unit"])
        seconds = event["ms"] / 1000
        bus = event["bytes"] * (n - 1) / n / seconds if seconds and n > 1 else 0.0
        rows.append(
            {
                "kind": event["name"],
                "unit": event["unit"] or "(root)",
                "bytes": event["bytes"],
                "ms": event["ms"],
                "bus_gb_s": bus / 1e9,
            }
        )
    return rows


def figure(steps: list[list[dict[str, Any]]], new: Callable[..., Figure] | None = None) -> Figure:
    """A figure of one step, or of two side by side (before and after a change of the settings, each titled
    with what changed). ``new(figsize=..., layout=...)`` makes the figure (``pyplot.figure`` in a notebook, to
    be shown as pyplot's are); by default a bare one with an Agg canvas, as a worker draws."""
    rows = max(len(step) for step in steps)
    size = (6.5 * len(steps), 0.9 + 0.75 * rows * len(LANES) / 2)
    if new is None:
        fig = Figure(figsize=size, layout="constrained")
        FigureCanvasAgg(fig)
    else:
        fig = new(figsize=size, layout="constrained")
    axes = fig.subplots(1, len(steps), squeeze=False)[0]
    changed = _changed(steps)
    for ax, step in zip(axes, steps, strict=True):
        first = step[0]
        title = (
            f"step {first['step']}: {first['step_ms']:.0f} ms, exposed comm "
            f"{max(c['exposed_comm_ms'] for c in step):.1f} ms"
            + (f"\n{settings_words({k: first['settings'][k] for k in changed})}" if changed else "")
        )
        draw_step(ax, step, title)
    handles = [Patch(color=color, label=name) for name, color in COLORS.items()]
    handles.append(Patch(facecolor="none", edgecolor=EXPOSED_COLOR, hatch="///", label="exposed"))
    fig.legend(handles=handles, loc="outside lower center", ncols=6, fontsize=7, frameon=False)
    return fig


def _changed(steps: list[list[dict[str, Any]]]) -> list[str]:
    """The settings that differ between the steps drawn."""
    if len(steps) < 2:
        return []
    a, b = steps[0][0]["settings"], steps[-1][0]["settings"]
    return [key for key in a if a.get(key) != b.get(key)]


def png(steps: list[list[dict[str, Any]]]) -> bytes:
    buffer = io.BytesIO()
    figure(steps).savefig(buffer, format="png", dpi=90)
    return buffer.getvalue()
