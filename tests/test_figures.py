"""The dashboard's figures: a live drawing (blitted over a still picture) shows what a whole drawing shows."""

from __future__ import annotations

import io

import numpy as np
import pytest
from matplotlib.text import Text
from PIL import Image

from nbfsdp import figures, renderer
from nbfsdp.figures import DashboardFigure

pytestmark = pytest.mark.timeout(120)

MIB = 2**20
PREDICTED = [{"params": MIB, "grads": MIB, "optim": 2 * MIB, "comm_buffers": MIB // 2}] * 2
MEMORY = {"mem_params": MIB, "mem_grads": MIB, "mem_optim": 2 * MIB, "mem_activations": MIB // 2}


def _records(steps: range, changed: str = "", seconds: float = 0.05) -> list[dict]:
    records = [
        {"rank": r, "step": s, "step_time": seconds + 0.01 * ((7 * s + r) % 5), "loss": 1 / (s + 1) + r / 100, **MEMORY}
        for s in steps
        for r in (0, 1)
    ]
    if changed:
        records[0]["changed"] = changed
    return records


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGBA"))


def _whole(drawing: DashboardFigure) -> np.ndarray:
    """The same figure drawn whole, moving parts included (saving draws animated artists too)."""
    buffer = io.BytesIO()
    drawing.figure.savefig(buffer, format="png")
    return _pixels(buffer.getvalue())


def test_a_live_drawing_shows_exactly_what_a_whole_drawing_of_the_same_figure_shows():
    drawing = DashboardFigure(2, PREDICTED, live=True)
    batches = [
        _records(range(0, 10)),  # the first picture
        _records(range(10, 14)),  # within its limits: only the moving parts are drawn again
        _records(range(14, 40)),  # beyond them: new limits, a new still picture
        _records(range(40, 42), changed="mixed_precision=PURE"),  # a marker joins the still picture
    ]
    for batch in batches:
        np.testing.assert_array_equal(_pixels(drawing.add(batch).png()), _whole(drawing))


def test_a_live_figure_draws_its_still_picture_again_only_when_records_leave_its_limits_or_a_marker_comes():
    drawing = DashboardFigure(2, PREDICTED, live=True)
    whole_drawings = []
    drawing.figure.canvas.mpl_connect("draw_event", whole_drawings.append)
    drawing.add(_records(range(0, 10), seconds=1.0)).png()  # steps 0-9 of a second: room up to step 19
    drawing.add(_records(range(10, 12), seconds=1.0)).png()
    drawing.add(_records(range(12, 19), seconds=1.0)).png()
    assert len(whole_drawings) == 1
    drawing.add(_records(range(19, 40), seconds=1.0)).png()
    assert len(whole_drawings) == 2
    drawing.add(_records(range(40, 41), changed="mixed_precision=PURE")).png()
    assert len(whole_drawings) == 3


def test_a_live_drawing_within_its_limits_draws_no_text(monkeypatch):
    """Texts (ticks, titles, the rank legends) are the costliest part of a drawing: within its limits a live drawing
    copies them from the still picture, the legends over the lines included, and draws none again."""
    drawing = DashboardFigure(2, PREDICTED, live=True)
    drawing.add(_records(range(0, 10), seconds=1.0)).png()  # steps 0-9 of a second: room up to step 19
    drawn = []
    draw_text = Text.draw
    monkeypatch.setattr(Text, "draw", lambda text, renderer: drawn.append(text.get_text()) or draw_text(text, renderer))
    drawing.add(_records(range(10, 12), seconds=1.0)).png()
    assert drawn == []
    drawing.add(_records(range(12, 40), seconds=1.0)).png()  # beyond the limits: a new still picture, texts too
    assert {"rank 0", "rank 1", "loss"} <= set(drawn)


def test_a_steady_run_keeps_its_first_limits_while_slow_first_steps_and_a_falling_loss_settle():
    """As a cell's first drawing finds them: three slow steps (FSDP's lazy init) and a loss that then falls fast.
    The next drawing, at the dashboard's slowest pace (3 s of 0.1 s steps), must stay within the limits."""
    drawing = DashboardFigure(2, PREDICTED, live=True)
    whole_drawings = []
    drawing.figure.canvas.mpl_connect("draw_event", whole_drawings.append)

    def settling(steps: range) -> list[dict]:
        return [
            {**record, "step_time": 0.25 if record["step"] < 3 else 0.1, "loss": 1 + 0.3 * np.exp(-record["step"] / 3)}
            for record in _records(steps)
        ]

    drawing.add(settling(range(0, 3))).png()
    drawing.add(settling(range(3, 33))).png()
    assert len(whole_drawings) == 1
    time_axes = drawing.figure.axes[2]
    assert time_axes.get_ylim()[0] == 0.0  # step times read in proportion


def test_the_final_drawing_fits_its_limits_to_the_records_and_matches_the_kernels_own():
    """A live figure's limits leave room to grow; the drawing a cell leaves behind must not."""
    records = _records(range(0, 30))
    live_loss_axes = DashboardFigure(2, PREDICTED, live=True).add(records).figure.axes[0]
    whole_loss_axes = figures.figure(records, 2, PREDICTED).axes[0]
    assert live_loss_axes.get_xlim()[1] > 40 > whole_loss_axes.get_xlim()[1] > 29
    final = renderer.render("final-drawing-test", 2, PREDICTED, records, 0, final=True).result(60)[0]
    np.testing.assert_array_equal(_pixels(final), _pixels(figures.png(records, 2, PREDICTED)))
