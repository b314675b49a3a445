"""The results of a run, written three ways under the output directory, and the table printed.

- ``results.json``: the machine, and per benchmark its measurements (raw per-round samples, medians, value,
  target, ok) and the raw data it kept (``{"skipped": why}`` or ``{"error": traceback}`` otherwise);
- ``results.md``: one table row per measurement, ``what | A | B | ratio/value | target | ok``, notes below;
  a figure from rounds shows its 95% interval after the value, and ``ok`` says when that interval spans the
  target (the rounds cannot tell which side of it the figure is on);
- ``results.png``: each measured figure against its target (matplotlib, Agg), the same rows as the table,
  with the interval as an error bar.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402

from benchmarks.measurement import Measurement, format_value  # noqa: E402

HEADER = "| what | A | B | ratio/value | target | ok |\n|---|---|---|---|---|---|"


def _rows(results: dict[str, dict]) -> list[tuple[str, Measurement | None, str]]:
    """(benchmark, measurement or None, text for a benchmark that has no measurement) in table order."""
    rows = []
    for name, result in results.items():
        if "skipped" in result:
            rows.append((name, None, f"skipped: {result['skipped']}"))
        elif "error" in result:
            rows.append((name, None, "ERROR: " + result["error"].strip().splitlines()[-1][:150]))
        else:
            rows += [(name, m, "") for m in result["measurements"]]
    return rows


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def _cell(label: str, value: float | None, unit: str) -> str:
    return _escape(f"{label} {format_value(value, unit)}".strip()) if value is not None else ""


def _value_cell(m: Measurement) -> str:
    text = format_value(m.value, m.unit)
    if m.interval is not None:
        low, high = (format_value(bound, m.unit) for bound in m.interval)
        text += f" (95%: {low} to {high})"
    return text


def _ok_cell(m: Measurement) -> str:
    text = {True: "yes", False: "**NO**", None: "n/a"}[m.ok]
    return text + (", but the 95% interval spans the target" if m.interval_spans_target else "")


def markdown(results: dict[str, dict], machine: dict) -> str:
    lines = [
        f"nbfsdp benchmarks, {machine['date']}: {machine['device']}, {machine['cpus_usable']} CPUs, "
        f"torch {machine['torch']}, Python {machine['python']}, commit {(machine['git_commit'] or '?')[:10]}"
        f"{' (dirty)' if machine['git_dirty'] else ''}",
        "",
        HEADER,
    ]
    notes = []
    for name, m, text in _rows(results):
        if m is None:
            lines.append(f"| {name}: {text} |  |  | {text.split(':')[0]} |  | n/a |")
            continue
        lines.append(
            f"| {_escape(m.what)} | {_cell(m.a_label, m.a, m.ab_unit)} | {_cell(m.b_label, m.b, m.ab_unit)} "
            f"| {_value_cell(m)} | {m.target_text} | {_ok_cell(m)} |"
        )
        if m.note:
            notes.append(f"- {_escape(m.what)}: {m.note}")
    if notes:
        lines += ["", "Notes:", *notes]
    return "\n".join(lines) + "\n"


def _score(m: Measurement, value: float | None) -> float | None:
    """A value of ``m`` against its target, so that 1 is the target and less is better."""
    if value is None or m.target is None or m.op is None or math.isnan(value):
        return None
    if m.op == "<=":
        return value / m.target if m.target else (0.0 if value <= 0 else math.inf)
    if m.op == ">=":
        return m.target / value if value > 0 else math.inf
    return abs(value - 1.0) / m.target


def plot(results: dict[str, dict], path: Path) -> None:
    rows = _rows(results)
    figure = Figure(figsize=(11, 0.45 * len(rows) + 1.4), dpi=100)
    axes = figure.subplots()
    limit = 2.0
    for y, (_, m, text) in enumerate(reversed(rows)):
        score = _score(m, m.value) if m is not None else None
        if score is None:
            label = text or ("not measured" if m is None or m.value is None else format_value(m.value, m.unit))
            axes.text(0.02, y, label, va="center", fontsize=8, color="grey")
            continue
        color = "tab:green" if m.ok else "tab:red"
        bar = min(max(score, 0.0), limit)  # a negative overhead draws as no bar
        axes.barh(y, bar, color=color, alpha=0.8)
        text_at = bar
        if m.interval is not None and m.op != "±":  # a band's score folds the interval at 1x
            ends = sorted(min(max(_score(m, bound), 0.0), limit) for bound in m.interval)
            axes.plot(ends, [y, y], color="black", linewidth=1.5, marker="|", markersize=8)
            text_at = max(bar, ends[1])
        axes.text(
            text_at + 0.02, y, f"{format_value(m.value, m.unit)} (target {m.target_text})", va="center",
            fontsize=8,
        )  # fmt: skip
    labels = [(m.what if m is not None else f"{name}") for name, m, _ in reversed(rows)]
    axes.set_yticks(range(len(rows)), [label if len(label) < 70 else label[:67] + "..." for label in labels])
    axes.tick_params(axis="y", labelsize=7)
    axes.axvline(1.0, color="black", linestyle="--", linewidth=1)
    axes.set_xlim(0, limit + 0.9)
    axes.set_ylim(-0.6, len(rows) - 0.4)
    axes.set_xlabel("measured / target (at most 1 meets it; for 'at least' targets target / measured)")
    axes.set_title("nbfsdp benchmarks: each figure against its target")
    figure.subplots_adjust(
        left=0.42, right=0.98, top=1 - 0.5 / figure.get_figheight(), bottom=0.7 / figure.get_figheight()
    )
    figure.savefig(path)


def _jsonable(result: dict[str, Any]) -> dict[str, Any]:
    out = dict(result)
    if "measurements" in out:
        out["measurements"] = [m.as_dict() for m in out["measurements"]]
    return out


def write(results: dict[str, dict], machine: dict, out: Path, extra: dict | None = None) -> str:
    """Write results.json, results.md and results.png under ``out``; return the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    document = {"machine": machine, **(extra or {}), "benchmarks": {k: _jsonable(v) for k, v in results.items()}}
    (out / "results.json").write_text(json.dumps(document, indent=1, default=str) + "\n")
    text = markdown(results, machine)
    (out / "results.md").write_text(text)
    plot(results, out / "results.png")
    return text
