"""The live view of a ``%%fsdp`` cell: a status row per rank and figures that redraw as ranks log.

Metrics arrive while the cell runs (each engine publishes its new records
with ipyparallel's ``datapub``; ``runner`` hands them here). Figures are
drawn with matplotlib's Agg backend into an ``ipywidgets.Image`` by a worker
process of the lowest CPU priority (``nbfsdp.ui.renderer``), so a fast training
loop never waits for drawing. Even time the ranks leave idle is not free
(a core's sibling thread, its caches, waking ranks): drawings come at most
once a second, and use at most a tenth of a core while the machine has a
core to spare, a hundredth while the ranks keep every core busy (but come at
least every 3 s). The same display
carries a PNG of the last drawing, so nbconvert, nbval and a terminal
IPython, which cannot show widgets, still get the figures as a static image.
"""

from __future__ import annotations

import html
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import ipywidgets as widgets
import psutil
from IPython.display import display
from ipywidgets.widgets.widget_string import HTMLStyle
from matplotlib.figure import Figure

from nbfsdp.shared import figures
from nbfsdp.shared.devices import Devices
from nbfsdp.ui import renderer
from nbfsdp.ui.controls import GAP, SettingsControls, shared
from nbfsdp.ui.timeline_panel import TimelinePanel
from nbfsdp.ui.widget_events import answer_while_cells_run

#: Live drawings start at least this long apart...
REDRAW_SECONDS = 1.0
#: ... and at most this long, however busy the cores: a live plot must stay live.
MAX_REDRAW_SECONDS = 3.0
#: Live drawings use at most this share of a core (the next waits 1/share times the last one's CPU time)
#: while the machine left a core idle since the last drawing...
DRAWING_CPU_SHARE = 0.1
#: ... and this much while the ranks kept every core busy. Measured at two ranks on two cores: a worker
#: drawing with 12% of a core slowed every step by 6%, though the ranks preempt it whenever they wake.
#: A blitted live drawing (about 28 ms) then comes every 2.8 s, as a whole one (61 ms) did at a fiftieth.
BUSY_DRAWING_CPU_SHARE = 0.01
#: The mimetype of a widget's view in a display (ipywidgets 8's ``Widget._repr_mimebundle_``).
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
#: How long the end of a cell waits for its last drawing before drawing it in the kernel instead, at most: a
#: worker seen to get no CPU is not waited for (``renderer.done_unless_starved``).
FINAL_DRAWING_SECONDS = 10.0
#: A live drawing the worker has not answered after this long is drawn in the kernel instead. The worker draws
#: with the CPU time nothing else wants (SCHED_IDLE): on a machine whose every core other programs keep busy it
#: gets none at all (seen: one live figure in 40 s of a test suite run beside two busy loops), and a dashboard
#: that stops changing looks like a hung cell. Drawn here, a figure costs the kernel about 0.1 s of CPU each time:
#: at most a sixtieth of a core.
STARVED_SECONDS = 2 * MAX_REDRAW_SECONDS


def _html(value: str = "") -> widgets.HTML:
    return widgets.HTML(value, layout=shared(widgets.Layout), style=shared(HTMLStyle))


@dataclass(frozen=True, kw_only=True)
class DashboardCalls:
    """What the dashboard's controls call: a settings change (what to say of it comes back), Stop, and Where?
    (None: the button stays disabled)."""

    on_change: Callable[[dict[str, Any]], str]
    on_stop: Callable[[], None]
    on_where: Callable[[], str] | None = None


@dataclass(frozen=True, kw_only=True)
class RankHosts:
    """Where ranks run on several hosts: each rank's host (a column of the ranks' table) and the plan's lines on
    the mesh over those hosts and what crosses between them (``Plan.hosts_lines``), shown above the ranks."""

    each: list[str]
    across: list[str]


class LiveDashboard:
    """One cell's dashboard; ``add`` records as they stream in, ``refresh`` redraws when due.

    Its controls change the settings of the running cell at the next step (and the
    defaults of later cells); Stop ends the cell cleanly at the next step.
    """

    def __init__(
        self,
        devices: Devices,
        *,
        settings: dict[str, Any],
        calls: DashboardCalls,
        predicted: list[dict[str, Any]] | None = None,
        with_output: bool = False,
        hosts: RankHosts | None = None,
    ) -> None:
        """``devices``: where the ranks run, said above them ("4 ranks on 1 GPU (shared)") and per rank;
        ``predicted``: the plan's memory of each rank; ``with_output``: a background run's output goes here."""
        self.world_size = world_size = devices.world_size
        self._hosts = hosts.each if hosts and len(set(hosts.each)) > 1 else None
        self._across_hosts = hosts.across if hosts else []
        self.predicted = predicted
        self.records: list[dict[str, Any]] = []
        self.redraws = 0
        self._last_draw = 0.0
        self._drawing: Future[tuple[bytes, float]] | None = None
        self._drawing_cpu = 0.0  # the last live drawing's CPU seconds
        self._key = uuid.uuid4().hex  # the worker keeps this dashboard's figure under it
        self._drawn_records = self._drawing_records = 0
        self._idle_mark = time.monotonic(), psutil.cpu_times().idle
        self._idle_cores = 0.0
        self._finished = False
        self._show_lock = threading.Lock()
        renderer.start()
        self._states = ["running"] * world_size
        self._marked: set[int] = set()  # ranks a hang report named: their state in bold
        self._notes: list[str] = []
        self._devices = devices
        self.controls = SettingsControls(settings, lambda change: self.note(calls.on_change(change)))
        self._stop = widgets.Button(
            description="Stop",
            button_style="danger",
            tooltip="end at the next step",
            layout=shared(widgets.Layout, margin=GAP),
            style=shared(widgets.ButtonStyle),
        )
        self._stop.on_click(lambda _: calls.on_stop())
        # each rank's stack and collectives, and which rank left the others waiting (%fsdp where)
        self._where = widgets.Button(
            description="Where?",
            tooltip="each rank's stack and collectives, now",
            layout=shared(widgets.Layout),
            style=shared(widgets.ButtonStyle),
        )
        self._where_text = _html()
        self._where.on_click(lambda _: self._show_where(calls.on_where))
        self._where.disabled = calls.on_where is None
        self._notes_area = _html()
        self._status = _html(self._status_table())
        self._figure = widgets.Image(format="png", layout=shared(widgets.Layout, max_width="100%"))
        # a background run's output lines go here: the cell that started it has ended
        self.output = widgets.Output() if with_output else None
        self._bars: dict[str, int] = {}  # a progress bar's place among the output's entries
        rows = [
            widgets.HBox([self.controls.box, self._stop, self._where], layout=shared(widgets.Layout)),
            self._notes_area,
            self._where_text,
            self._status,
            self._figure,
        ]
        self._box = widgets.VBox(rows + ([self.output] if self.output else []), layout=shared(widgets.Layout))
        self.timeline = TimelinePanel(self._box, world_size)
        """The captured steps (``--timeline``), drawn under the figures once the first arrives."""
        self._shown = self._bundle()
        self._handle = display(self._shown, raw=True, display_id=True)
        answer_while_cells_run([*self.controls.widgets.values(), self._stop, self._where])

    def _show_where(self, on_where: Callable[[], str] | None) -> None:
        try:
            text = on_where() if on_where else ""
        except Exception as error:  # a world that cannot be asked (hosts without the shared directory)
            text = str(error)
        self._where_text.value = f"<pre>{html.escape(text)}</pre>"

    def add(self, records: list[dict[str, Any]]) -> None:
        self.records.extend(records)
        for record in records:
            if "changed" in record and record["rank"] == 0:
                self.note(f"step {record['step']}: {record['changed']} on every rank from this step")

    def add_capture(self, capture: dict[str, Any]) -> None:
        """A step a rank captured: to the timeline panel."""
        self.timeline.add(capture)

    def predict_peaks(self, peaks: list[int], described: str, parts: list[dict[str, int]] | None = None) -> None:
        """explain's peak of each rank, traced while the cell runs (``nbfsdp.kernel.planning.predicted``): drawn
        beside the measured peak from the next drawing on (``parts``: its bytes by category at that peak, its
        bar), and said under the controls."""
        memory = self.predicted or [{} for _ in peaks]
        self.predicted = [
            {**expected, "peak": peak, **({"peak_parts": parts[rank]} if parts else {})}
            for rank, (expected, peak) in enumerate(zip(memory, peaks, strict=True))
        ]
        self.note(f"explain predicts a peak of {max(peaks) / 2**20:,.0f} MiB a rank, traced with {described}")

    def rank_state(self, rank: int, state: str) -> None:
        """A rank's state in its row (stopped at a breakpoint, dead, running again), shown at once: a row is no
        drawing to pace, and a rank stopped at a breakpoint holds the kernel at its prompt, where none falls due."""
        self._states[rank] = state
        self._status.value = self._status_table()

    def mark_ranks(self, marks: dict[int, str], note: str) -> None:
        """A hang report's ranks (``--hang-report``): each marked in its row, the stuck one first, shown at once
        (no drawing is due while every rank waits), and the report's finding said under the controls."""
        for rank, mark in marks.items():
            self._states[rank] = mark
            self._marked.add(rank)
        self.note(note)
        self._status.value = self._status_table()

    def note(self, message: str) -> None:
        """A line under the controls: what was asked for, and when it took effect."""
        if message:
            self._notes.append(html.escape(message))
            self._notes_area.value = "<br>".join(self._notes[-4:])

    def write(self, text: str, *, stderr: bool) -> None:
        """Ranks' output of a background run."""
        assert self.output is not None  # a background run's dashboard has one
        if stderr:
            self.output.append_stderr(text)
        else:
            self.output.append_stdout(text)

    def progress(self, bar: str, text: str, *, ended: bool) -> None:
        """Rank 0's progress bar in a background run: one entry of the output, replaced as it moves."""
        entry = {"output_type": "display_data", "data": {"text/plain": text}, "metadata": {}}
        assert self.output is not None  # a background run's dashboard has one
        outputs = list(self.output.outputs)
        if bar in self._bars:
            outputs[self._bars[bar]] = entry
        else:
            self._bars[bar] = len(outputs)
            outputs.append(entry)
        self.output.outputs = tuple(outputs)

    def finish(self, records: list[dict[str, Any]] | None, state: str) -> None:
        """The cell is over: draw its complete records (as ``last_run`` has them) one last time."""
        if records is not None:
            self.records = list(records)
        self._states = [state if s == "running" else s for s in self._states]
        self._stop.disabled = self._where.disabled = True
        self.timeline.wait(FINAL_DRAWING_SECONDS)
        self.refresh(final=True)

    def refresh(self, *, final: bool = False) -> None:
        """Redraw once the last drawing has ended and its pause since it began has passed; at once for the
        first points; at the end waiting for it, so the cell's output holds its complete figure."""
        now = time.monotonic()
        self._watch_idle_cores(now)
        drawing = self._drawing is not None and not self._drawing.done()
        if drawing and not final and now - self._last_draw >= STARVED_SECONDS:
            self._draw_here(now)
            return
        first_points = self.records and not self.redraws
        if not final and (drawing or not (first_points or now - self._last_draw >= self._pause())):
            return
        self._last_draw = now
        self._status.value = self._status_table()
        if final:
            with self._show_lock:
                self._finished = True  # a live drawing that ends later must not replace the final one
            if self.records:
                self._show(self._final_drawing())
            bundle = self._bundle()
            if self._handle is not None and bundle != self._shown:  # the same bundle again would change nothing
                self._shown = bundle
                self._handle.update(bundle, raw=True)
        elif self.records:  # only the records since the last drawing travel to the worker's figure
            first, self._drawing_records = self._drawn_records, len(self.records)
            self._drawing = renderer.render(self._key, self.world_size, self.predicted, self.records[first:], first)
            self._drawing.add_done_callback(self._drawn)

    def _draw_here(self, now: float) -> None:
        """The worker has had no CPU for the live drawing it was given (``STARVED_SECONDS``): draw every record
        here; its drawing, when it comes, is dropped, and its next one starts the figure afresh."""
        png = figures.png(self.records, self.world_size, self.predicted)
        with self._show_lock:
            self._drawing, self._drawn_records, self._last_draw = None, 0, now
            if not self._finished:
                self._show(png)
        self._status.value = self._status_table()

    def _drawn(self, drawing: Future[tuple[bytes, float]]) -> None:
        """A live drawing is done (on the worker's result thread); a failed one leaves the last up, and the
        next one starts the figure afresh."""
        with self._show_lock:
            if drawing is not self._drawing:  # drawn here meanwhile (``_draw_here``): out of date
                return
            if drawing.exception() is not None:
                self._drawn_records = 0
            elif not self._finished:
                png, self._drawing_cpu = drawing.result()
                self._drawn_records = self._drawing_records
                self._show(png)

    def _pause(self) -> float:
        """Seconds from one live drawing's start to the next: at least a second, and long enough that
        drawings keep to their share of a core (a hundredth while no core was left idle), up to 3 s."""
        share = DRAWING_CPU_SHARE if self._idle_cores >= 1.0 else BUSY_DRAWING_CPU_SHARE
        return min(MAX_REDRAW_SECONDS, max(REDRAW_SECONDS, self._drawing_cpu / share))

    def _watch_idle_cores(self, now: float) -> None:
        """Cores the machine left idle, on average over about the last second."""
        then, idle_then = self._idle_mark
        if now - then >= 1.0:
            idle = psutil.cpu_times().idle
            self._idle_cores = (idle - idle_then) / (now - then)
            self._idle_mark = now, idle

    def _final_drawing(self) -> bytes:
        """The complete records, drawn afresh (``finish`` may have replaced the ones that streamed in)."""
        try:
            drawing = renderer.render(self._key, self.world_size, self.predicted, self.records, 0, final=True)
            if renderer.done_unless_starved(drawing, FINAL_DRAWING_SECONDS):
                return drawing.result()[0]
        except Exception:  # the request could not reach the worker: drawn here as a starved one's is
            pass
        return figures.png(self.records, self.world_size, self.predicted)  # the worker died or is starved: here

    def _show(self, png: bytes) -> None:
        self._figure.value = png
        self.redraws += 1

    # -- drawing
    def _bundle(self) -> dict[str, Any]:
        # the box's view by its model id, as its ``_repr_mimebundle_`` gives it, without the text repr of every
        # widget inside that it would build first (milliseconds a cell) and which is replaced here anyway
        bundle: dict[str, Any] = {WIDGET_VIEW: {"version_major": 2, "version_minor": 0, "model_id": self._box.model_id}}
        if self._figure.value:
            bundle["image/png"] = bytes(self._figure.value)
        bundle["text/plain"] = f"nbfsdp dashboard: {self.world_size} ranks, {len(self.records)} records"
        return bundle

    def _status_table(self) -> str:
        latest: dict[int, dict[str, Any]] = {}
        for seen in self.records:
            latest[seen["rank"]] = seen
        host = lambda rank: f"<td>{html.escape(self._hosts[rank])}</td>" if self._hosts else ""  # noqa: E731
        rows = ""
        for rank in range(self.world_size):
            record = latest.get(rank)
            step = record["step"] if record else ""
            step_time = f"{record['step_time'] * 1000:.0f} ms" if record else ""
            rows += (
                f"<tr><td>{rank}</td>{host(rank)}<td>{step}</td><td>{step_time}</td><td>{self._rank_device(rank)}</td>"
                f"<td>{self._state(rank)}</td></tr>"
            )
        header = "<th>rank</th>" + ("<th>host</th>" if self._hosts else "")
        mesh = "".join(f"<div>{html.escape(line)}</div>" for line in [str(self._devices), *self._across_hosts])
        return (
            f"{mesh}<table><tr>{header}<th>step</th><th>step time</th><th>device</th><th>state</th></tr>{rows}</table>"
        )

    def _state(self, rank: int) -> str:
        state = html.escape(self._states[rank])
        return f"<b>{state}</b>" if rank in self._marked else state

    def _rank_device(self, rank: int) -> str:
        """``cuda:0`` (the GPU as the rank's host numbers it) or ``cpu``."""
        return f"cuda:{self._devices.rank_gpus[rank]}" if self._devices.type == "cuda" else "cpu"

    def figure(self) -> Figure:
        """The loss, memory and step-time figures of the records so far."""
        return figures.figure(self.records, self.world_size, self.predicted)
