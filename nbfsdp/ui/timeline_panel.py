"""The dashboard's timeline panel: the latest step every rank captured (``--timeline``), drawn lane by lane, and a
table of its collectives; after a change of the settings, the step before it and the step after, side by side.
Runs in the kernel; the drawing is the worker's (``nbfsdp.ui.renderer``), as the dashboard's other figures are.

Its two widgets are made when the first captured step arrives: a cell too short to capture one (fewer than two
steps) costs the dashboard nothing more.
"""

from __future__ import annotations

import html
import threading
from concurrent.futures import Future
from typing import Any

import ipywidgets as widgets
from ipywidgets.widgets.widget_string import HTMLStyle

from nbfsdp.shared import timeline_figure
from nbfsdp.shared.timeline_figure import collectives_table, settings_words
from nbfsdp.ui import renderer
from nbfsdp.ui.controls import shared

#: The CSS class of the panel's picture and table.
PANEL_CLASS = "nbfsdp-timeline"


class TimelinePanel:
    """Captured steps as they arrive, shown in ``box`` (the dashboard's) once every rank's capture of a step is
    there."""

    def __init__(self, box: widgets.Box, world_size: int) -> None:
        self._box, self._world_size = box, world_size
        self._steps: dict[int, dict[int, dict[str, Any]]] = {}  # forward -> rank -> capture
        self.shown: list[int] = []
        """The forwards of the steps drawn last: one, or the one before a change and the one after."""
        self._image: widgets.Image | None = None
        self._table: widgets.HTML | None = None
        self._lock = threading.Lock()
        self._drawing: Future | None = None
        self._drawn_steps: list[list[dict[str, Any]]] = []  # what the last drawing asked for

    def add(self, capture: dict[str, Any]) -> None:
        """One rank's captured step; drawn once every rank's of that step has come."""
        with self._lock:
            ranks = self._steps.setdefault(capture["forward"], {})
            ranks[capture["rank"]] = capture
            if len(ranks) < self._world_size:
                return
            complete = sorted(f for f, r in self._steps.items() if len(r) == self._world_size)
            latest = complete[-1]
            if capture["forward"] != latest:  # a late rank's capture of an older step
                return
            # after a change of the settings: the last step before it beside this one
            before = [f for f in complete[:-1] if self._settings(f) != self._settings(latest)]
            self.shown = [before[-1], latest] if before else [latest]
            steps = [sorted(self._steps[f].values(), key=lambda c: c["rank"]) for f in self.shown]
        self._show(steps)

    def _settings(self, forward: int) -> dict[str, Any]:
        return next(iter(self._steps[forward].values()))["settings"]

    def _show(self, steps: list[list[dict[str, Any]]]) -> None:
        if self._image is None:
            self._image = widgets.Image(format="png", layout=shared(widgets.Layout, max_width="100%"))
            self._table = widgets.HTML(layout=shared(widgets.Layout), style=shared(HTMLStyle))
            self._image.add_class(PANEL_CLASS)  # what the browser test and the docs' picture find it by
            self._table.add_class(PANEL_CLASS)
            self._box.children = (*self._box.children, self._image, self._table)
        assert self._table is not None  # made with the image
        self._table.value = table_html(steps[-1][0], steps[0][0] if len(steps) > 1 else None)
        drawing = renderer.render_timeline(steps)
        self._drawing, self._drawn_steps = drawing, steps
        drawing.add_done_callback(self._drawn)

    def _drawn(self, drawing: Future) -> None:
        if drawing is self._drawing and drawing.exception() is None and self._image is not None:
            self._image.value = drawing.result()

    def wait(self, seconds: float) -> None:
        """Until the last drawing is shown (the end of a cell, so the output keeps it), at most ``seconds``; then,
        or as soon as the worker is seen to get no CPU (it draws with the CPU time nothing else wants, and a
        machine whose every core is busy gives it none), it is drawn here, once, as the dashboard's final figure
        is."""
        drawing = self._drawing
        if drawing is None or self._image is None:
            return
        if not renderer.done_unless_starved(drawing, seconds):
            self._drawing = None  # a late answer from the worker no longer replaces this one
            self._image.value = timeline_figure.png(self._drawn_steps)


def table_html(capture: dict[str, Any], before: dict[str, Any] | None = None) -> str:
    """Rank ``capture['rank']``'s collectives of its step, with the step's time and exposed communication (and,
    after a change, the step before's)."""
    lines = []
    for label, step in (("before", before), ("now", capture)):
        if step is None:
            continue
        lines.append(
            f"<div><b>{label}</b>: step {step['step']}, {step['step_ms']:.1f} ms, communication "
            f"{step['comm_ms']:.1f} ms, exposed {step['exposed_comm_ms']:.1f} ms "
            f"({html.escape(settings_words(step['settings']))})</div>"
        )
    rows = "".join(
        f"<tr><td>{row['kind']}</td><td>{html.escape(row['unit'])}</td><td>{row['bytes'] / 2**20:.2f}</td>"
        f"<td>{row['ms']:.2f}</td><td>{row['bus_gb_s']:.2f}</td></tr>"
        for row in collectives_table(capture)
    )
    return (
        "".join(lines)
        + f"<table><tr><th>rank {capture['rank']}</th><th>unit</th><th>MiB</th><th>ms</th><th>bus GB/s</th></tr>"
        + rows
        + "</table>"
    )
