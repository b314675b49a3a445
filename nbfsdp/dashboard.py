"""The live view of a ``%%fsdp`` cell: a status row per rank and figures that redraw as ranks log.

Metrics arrive while the cell runs (each engine publishes its new records
with ipyparallel's ``datapub``; ``runner`` hands them here). Figures are
drawn with matplotlib's Agg backend into an ``ipywidgets.Image`` at most once
a second, so a fast training loop never waits for drawing. The same display
carries a PNG of the last drawing, so nbconvert, nbval and a terminal
IPython, which cannot show widgets, still get the figures as a static image.
"""

from __future__ import annotations

import html
import io
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import ipywidgets as widgets
from IPython.display import display
from matplotlib.figure import Figure

from nbfsdp.controls import SettingsControls
from nbfsdp.widget_events import answer_while_cells_run

#: Memory categories drawn per rank, in stacking order.
MEMORY_CATEGORIES = ("mem_params", "mem_grads", "mem_optim", "mem_activations")
REDRAW_SECONDS = 1.0


class LiveDashboard:
    """One cell's dashboard; ``add`` records as they stream in, ``refresh`` redraws when due.

    Its controls change the settings of the running cell at the next step (and the
    defaults of later cells); Stop ends the cell cleanly at the next step.
    """

    def __init__(
        self,
        world_size: int,
        device: str,
        predicted: list[dict[str, int]] | None,
        settings: dict[str, Any],
        on_change: Callable[[dict[str, Any]], str],
        on_stop: Callable[[], None],
        with_output: bool = False,
    ) -> None:
        self.world_size = world_size
        self.predicted = predicted
        self.records: list[dict[str, Any]] = []
        self.redraws = 0
        self._last_draw = 0.0
        self._states = ["running"] * world_size
        self._notes: list[str] = []
        self._device = device
        self.controls = SettingsControls(settings, lambda change: self.note(on_change(change)))
        self._stop = widgets.Button(description="Stop", button_style="danger", tooltip="end at the next step")
        self._stop.on_click(lambda _: on_stop())
        self._notes_area = widgets.HTML()
        self._status = widgets.HTML(self._status_table())
        self._figure = widgets.Image(format="png", layout=widgets.Layout(max_width="100%"))
        # a background run's output lines go here: the cell that started it has ended
        self.output = widgets.Output() if with_output else None
        rows = [widgets.HBox([self.controls.box, self._stop]), self._notes_area, self._status, self._figure]
        self._box = widgets.VBox(rows + ([self.output] if self.output else []))
        self._handle = display(self._bundle(), raw=True, display_id=True)
        answer_while_cells_run([*self.controls.widgets.values(), self._stop])

    def add(self, records: list[dict[str, Any]]) -> None:
        self.records.extend(records)
        for record in records:
            if "changed" in record and record["rank"] == 0:
                self.note(f"step {record['step']}: {record['changed']} on every rank from the next step")

    def rank_state(self, rank: int, state: str) -> None:
        self._states[rank] = state

    def note(self, message: str) -> None:
        """A line under the controls: what was asked for, and when it took effect."""
        if message:
            self._notes.append(html.escape(message))
            self._notes_area.value = "<br>".join(self._notes[-4:])

    def write(self, text: str, stderr: bool) -> None:
        """Ranks' output of a background run."""
        if stderr:
            self.output.append_stderr(text)
        else:
            self.output.append_stdout(text)

    def finish(self, records: list[dict[str, Any]] | None, state: str) -> None:
        """The cell is over: draw its complete records (as ``last_run`` has them) one last time."""
        if records is not None:
            self.records = list(records)
        self._states = [state if s == "running" else s for s in self._states]
        self._stop.disabled = True
        self.refresh(final=True)

    def refresh(self, final: bool = False) -> None:
        """Redraw if a second has passed since the last drawing; at once for the first points and the end."""
        now = time.monotonic()
        first_points = self.records and not self.redraws
        if not (final or first_points or now - self._last_draw >= REDRAW_SECONDS):
            return
        self._last_draw = now
        self._status.value = self._status_table()
        if self.records:
            self._figure.value = self._draw()
            self.redraws += 1
        if final and self._handle is not None:
            self._handle.update(self._bundle(), raw=True)

    # -- drawing
    def _bundle(self) -> dict[str, Any]:
        bundle = self._box._repr_mimebundle_() or {}
        if self._figure.value:
            bundle["image/png"] = bytes(self._figure.value)
        bundle["text/plain"] = f"nbfsdp dashboard: {self.world_size} ranks, {len(self.records)} records"
        return bundle

    def _status_table(self) -> str:
        latest: dict[int, dict[str, Any]] = {}
        for record in self.records:
            latest[record["rank"]] = record
        rows = ""
        for rank in range(self.world_size):
            record = latest.get(rank)
            step = record["step"] if record else ""
            step_time = f"{record['step_time'] * 1000:.0f} ms" if record else ""
            rows += (
                f"<tr><td>{rank}</td><td>{step}</td><td>{step_time}</td><td>{self._device}</td>"
                f"<td>{self._states[rank]}</td></tr>"
            )
        return (
            f"<table><tr><th>rank</th><th>step</th><th>step time</th><th>device</th><th>state</th></tr>{rows}</table>"
        )

    def _draw(self) -> bytes:
        buffer = io.BytesIO()
        self.figure().savefig(buffer, format="png")
        return buffer.getvalue()

    def figure(self) -> Figure:
        """The loss, memory and step-time figures of the records so far."""
        by_rank: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for record in self.records:
            by_rank[record["rank"]].append(record)
        figure = Figure(figsize=(12, 3.2), dpi=72)
        loss_axes, memory_axes, time_axes = figure.subplots(1, 3)
        for rank, records in sorted(by_rank.items()):
            steps = [r["step"] for r in records]
            if any("loss" in r for r in records):
                loss_axes.plot(
                    [r["step"] for r in records if "loss" in r],
                    [r["loss"] for r in records if "loss" in r],
                    label=f"rank {rank}",
                )
            time_axes.plot(steps, [r["step_time"] * 1000 for r in records], label=f"rank {rank}")
            bottom = 0.0
            for category in MEMORY_CATEGORIES:
                value = records[-1].get(category, 0) / 2**20
                memory_axes.bar(
                    rank,
                    value,
                    bottom=bottom,
                    color=f"C{MEMORY_CATEGORIES.index(category)}",
                    label=category.removeprefix("mem_") if rank == min(by_rank) else None,
                )
                bottom += value
        if self.predicted:
            for rank, predicted in enumerate(self.predicted):
                if rank in by_rank and predicted["comm_buffers"]:  # not measurable on CPU: explain's figure
                    measured = sum(by_rank[rank][-1].get(c, 0) for c in MEMORY_CATEGORIES) / 2**20
                    memory_axes.bar(
                        rank, predicted["comm_buffers"] / 2**20, bottom=measured, color="none", edgecolor="grey",
                        hatch="//", label="comm buffers (explain)" if rank == min(by_rank) else None,
                    )  # fmt: skip
                total = (predicted["params"] + predicted["grads"] + predicted["optim"]) / 2**20
                memory_axes.hlines(
                    total,
                    rank - 0.4,
                    rank + 0.4,
                    colors="black",
                    linestyles="--",
                    label="explain: params+grads+optim" if rank == 0 else None,
                )
        for record in self.records:  # the settings changed mid-run, marked where they took effect
            if "changed" in record and record["rank"] == 0:
                for axes in (loss_axes, time_axes):
                    axes.axvline(record["step"], color="grey", linestyle=":")
                    axes.annotate(
                        record["changed"], (record["step"], 1), xycoords=("data", "axes fraction"),
                        rotation=90, va="top", ha="right", fontsize=6, color="grey",
                    )  # fmt: skip
        loss_axes.set(title="loss", xlabel="step")
        memory_axes.set(title="memory per rank (MiB, last step)", xlabel="rank")
        memory_axes.set_xticks(range(self.world_size))
        time_axes.set(title="step time (ms)", xlabel="step")
        for axes in (loss_axes, time_axes):
            if axes.get_legend_handles_labels()[0]:
                axes.legend(fontsize=7)
        if memory_axes.get_legend_handles_labels()[0]:
            memory_axes.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
        figure.tight_layout()
        return figure
