"""``%fsdp compare`` and ``nbfsdp.compare``: what changed between recent runs, and what it did.

A row per run: the settings that differ among the runs compared, each rank's
peak memory, the median step time, rank 0's final loss and the settings changed
while it ran (the dashboard's controls, ``%fsdp set``); plus the loss
curves of those runs overlaid in one figure.
"""

from __future__ import annotations

import io
import statistics
from typing import Any

from IPython.display import Image, display
from matplotlib.figure import Figure

from nbfsdp.kernel.run import history

#: Run-record settings that describe the run rather than choose it.
_NOT_SETTINGS = frozenset({"fsdp_units", "ignored", "why"})


def compare(last: int = 5) -> list[dict[str, Any]]:
    """One row per recent run (oldest first): differing settings, peak memory, step time, final loss."""
    runs = history.runs()[-last:]
    keys = sorted({key for run in runs for key in run.config} - _NOT_SETTINGS)
    differing = [key for key in keys if len({repr(run.config.get(key)) for run in runs}) > 1]
    first = len(history.runs()) - len(runs) + 1
    rows = []
    for number, run in enumerate(runs, start=first):
        ranks = sorted({m["rank"] for m in run.metrics})
        losses = run.metric("loss", rank=0)
        step_times = [m["step_time"] for m in run.metrics if m["step"] > 0] or [m["step_time"] for m in run.metrics]
        rows.append(
            {
                "run": number,
                "ok": run.ok,
                "settings": {key: run.config.get(key) for key in differing},
                "peak_memory": [max(m["mem_peak"] for m in run.metrics if m["rank"] == r) for r in ranks],
                "median_step_time": statistics.median(step_times) if step_times else None,
                "final_loss": losses[-1] if losses else None,
                "changes": [f"step {step}: {change}" for step, change in run.changes],
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as aligned text."""
    setting_keys = list(rows[0]["settings"]) if rows else []
    changed = any(row["changes"] for row in rows)
    header = ["run", *setting_keys, "peak memory per rank", "median step", "final loss"] + ["changed mid-run"] * changed
    lines = []
    for row in rows:
        peak = " ".join(f"{value / 2**20:.1f}" for value in row["peak_memory"]) + " MiB" if row["peak_memory"] else "-"
        step = f"{row['median_step_time'] * 1000:.1f} ms" if row["median_step_time"] is not None else "-"
        loss = f"{row['final_loss']:.4g}" if row["final_loss"] is not None else "-"
        status = "" if row["ok"] else " (failed)"
        settings = [str(row["settings"][key]) for key in setting_keys]
        mid_run = ["; ".join(row["changes"]) or "-"] if changed else []
        lines.append([f"{row['run']}{status}", *settings, peak, step, loss, *mid_run])
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *lines, strict=True)]
    render = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True))  # noqa: E731
    return "\n".join([render(header), *(render(line) for line in lines)])


def loss_figure(last: int = 5) -> Figure | None:
    """Rank 0's loss curves of the recent runs, overlaid; None when no run logged a loss."""
    runs = history.runs()[-last:]
    first = len(history.runs()) - len(runs) + 1
    figure = Figure(figsize=(6, 3.2), dpi=80)
    axes = figure.subplots()
    drawn = False
    for number, run in enumerate(runs, start=first):
        steps = [m["step"] for m in run.metrics if m["rank"] == 0 and "loss" in m]
        if steps:
            axes.plot(steps, run.metric("loss", rank=0), label=f"run {number}")
            drawn = True
    if not drawn:
        return None
    axes.set(xlabel="step", ylabel="loss (rank 0)", title="recent runs")
    axes.legend(fontsize=8)
    figure.tight_layout()
    return figure


def show(last: int, *, with_figure: bool) -> None:
    """``%fsdp compare``: the table of the last runs, and where a frontend shows images, their losses."""
    rows = compare(last)
    if not rows:
        print("nbfsdp: no runs yet")
        return
    print(table(rows))
    figure = loss_figure(last) if with_figure else None
    if figure is not None:
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png")
        display(Image(data=buffer.getvalue()))
