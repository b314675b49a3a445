"""The dashboard's figures: a live drawing (blitted over a still picture) shows what a whole drawing shows."""

from __future__ import annotations

import io

import numpy as np
import pytest
from matplotlib.text import Text
from PIL import Image

from nbfsdp.shared import figures
from nbfsdp.shared.figures import DashboardFigure
from nbfsdp.ui import renderer

pytestmark = pytest.mark.timeout(120)

MIB = 2**20
PREDICTED = [{"params": MIB, "grads": MIB, "optim": 2 * MIB, "comm_buffers": MIB // 2}] * 2
# a CPU rank's figures: its peak holds the shards, the optimizer's state and the larger of the activations and the
# gradients (``nbfsdp.engines.metrics``)
MEMORY = {"mem_params": MIB, "mem_grads": MIB, "mem_optim": 2 * MIB, "mem_activations": MIB // 2, "mem_peak": 4 * MIB}


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


def _changes(*changes: str) -> list[dict]:
    """A setting changed every 30 steps, from step 30 (close enough that their labels would meet)."""
    records = _records(range(0, 30))
    for index, change in enumerate(changes):
        records += _records(range(30 * index + 30, 30 * index + 60), change)
    return records


@pytest.mark.parametrize("live", [False, True], ids=["whole", "live"])
@pytest.mark.parametrize(
    "changes",
    [
        ("activation_checkpointing=True", "mixed_precision=PURE"),
        ("activation_checkpointing=True, cpu_offload=True, mixed_precision=PURE", "sharding_strategy=SHARD_GRAD_OP"),
        ("activation_checkpointing=True", "mixed_precision=PURE", "backward_prefetch=BACKWARD_POST"),
    ],
    ids=["two changes", "a long change", "three changes"],
)
def test_the_memory_legend_and_the_change_labels_keep_clear_of_the_axes_and_of_every_other_text(live, changes):
    """As drawn, not as placed: the memory legend stays out of the step-time axes (ticks included), and each
    change's label is inside the figure, above its axes (where no line passes under it), clear of every tick
    label, title, legend and other change label. Where the rows above the axes are full, the newest are shown."""
    drawing = DashboardFigure(2, PREDICTED, live=live)
    drawing.add(_changes(*changes)).png()
    figure = drawing.figure
    renderer = figure.canvas.get_renderer()
    loss_axes, memory_axes, time_axes = figure.axes
    legend = memory_axes.get_legend().get_window_extent(renderer)
    assert figure.bbox.x0 <= legend.x0 and legend.x1 <= figure.bbox.x1
    for axes in (loss_axes, time_axes):
        assert not legend.overlaps(axes.get_tightbbox(renderer))

    labels = {axes: [text for text in axes.texts if text.get_visible()] for axes in (loss_axes, time_axes)}
    newest = [f"step {30 * index + 30}: {change}" for index, change in enumerate(changes)][-figures.MARKER_ROWS :]
    for shown in labels.values():
        assert sorted(text.get_text()[:25] for text in shown) == sorted(text[:25] for text in newest)
    others = {f"{axes.get_title()!r} title": axes.title.get_window_extent(renderer) for axes in figure.axes}
    others |= {f"{axes.get_title()!r} legend": axes.get_legend().get_window_extent(renderer) for axes in figure.axes}
    for axes in figure.axes:  # tick labels and axis labels, as drawn
        others[f"{axes.get_title()!r} x axis"] = axes.xaxis.get_tightbbox(renderer)
        others[f"{axes.get_title()!r} y axis"] = axes.yaxis.get_tightbbox(renderer)
    for axes, shown in labels.items():
        for label in shown:
            box = label.get_window_extent(renderer)
            assert box.x0 >= axes.bbox.x0 - 1 and box.x1 <= axes.bbox.x1 + 1, (label.get_text(), box, axes.bbox)
            assert box.y0 >= axes.bbox.y1 and box.y1 <= figure.bbox.y1, (label.get_text(), box, axes.bbox)
            near = others | {text.get_text(): text.get_window_extent(renderer) for text in shown if text is not label}
            for name, extent in near.items():
                assert not box.overlaps(extent), (label.get_text(), name)


@pytest.mark.parametrize("world_size", [2, 8])
def test_measured_and_predicted_memory_stand_side_by_side_and_are_labelled(world_size):
    """No bar mixes a measurement with a prediction: each rank's measured categories stack left of it, explain's
    (hatched, its comm buffers on top) right of it, and each bar is labelled under it (the axis says it, past a
    few ranks); explain's peak is dashed across its own bar, the measured peak across the measured bar."""
    predicted = [{**PREDICTED[0], "peak": 5 * MIB}] * world_size
    memory_axes = DashboardFigure(world_size, predicted).add(_records(range(3))).figure.axes[1]
    for rank in range(world_size):
        bars = [bar for bar in memory_axes.patches if rank - 0.5 < bar.get_x() < rank + 0.5]
        measured = [bar for bar in bars if not bar.get_hatch()]
        explained = [bar for bar in bars if bar.get_hatch()]
        assert max(bar.get_x() + bar.get_width() for bar in measured) <= rank <= min(bar.get_x() for bar in explained)
        if rank < 2:  # the ranks the records name
            assert max(bar.get_y() + bar.get_height() for bar in measured) == pytest.approx(4.0)  # MEMORY's peak, MiB
        assert max(bar.get_y() + bar.get_height() for bar in explained) == pytest.approx(4.5)  # 4 + comm buffers
        peaks = {
            line.get_linestyle(): line.get_xdata()
            for line in memory_axes.lines
            if rank - 0.5 < line.get_xdata()[0] < rank + 0.5
        }
        assert peaks["--"][0] >= rank - 0.05 and peaks["-"][1] <= rank + 0.05
    labels = [label.get_text() for label in memory_axes.get_xticklabels(minor=True)]
    if world_size <= figures.MOST_LABELLED_RANKS:
        assert labels == ["measured", "explain"] * world_size
    else:
        assert labels == [] and "measured" in memory_axes.get_xlabel() and "explain" in memory_axes.get_xlabel()
    assert "comm buffers (explain)" in memory_axes.get_legend_handles_labels()[1]


def test_each_measured_bar_is_its_ranks_peak_by_category_and_explains_is_its_traced_peak():
    """Issue 56: a bar stacked from categories each at its own peak (gradients and activations both) stood above
    the peak line it explained. Now a rank's bar is the moment of its peak so far, summing to that line: the
    activations or the gradients, whichever the peak held, and on a GPU what the allocator held beyond the tensors
    counted (``other``). explain's bar, once traced with the batch the ranks used, is its peak's categories,
    activations included, summing to its own peak line."""
    cpu = [
        {"rank": 0, "step": 0, "step_time": 0.1, "mem_params": MIB, "mem_optim": 0, "mem_grads": MIB,
         "mem_activations": 3 * MIB, "mem_peak": 4 * MIB},
        {"rank": 0, "step": 1, "step_time": 0.1, "mem_params": MIB, "mem_optim": 2 * MIB, "mem_grads": 2 * MIB,
         "mem_activations": MIB, "mem_peak": 5 * MIB},  # the peak: the gradients, not the activations, with it
        {"rank": 0, "step": 2, "step_time": 0.1, "mem_params": MIB, "mem_optim": 2 * MIB, "mem_grads": MIB,
         "mem_activations": MIB // 2, "mem_peak": 4 * MIB},  # lower: the bar stays at step 1's moment
        {"rank": 1, "step": 0, "step_time": 0.1, "mem_params": MIB, "mem_optim": MIB, "mem_grads": MIB,
         "mem_activations": 2 * MIB, "mem_peak": 7 * MIB},  # a GPU's allocator peak: 3 MiB beyond what is counted
    ]  # fmt: skip
    parts = {"params": MIB, "grads": 0, "optim": 2 * MIB, "activations": 3 * MIB, "temporaries": MIB // 4,
             "comm_buffers": MIB // 4}  # fmt: skip
    predicted = [{**PREDICTED[0], "peak": 6.5 * MIB, "peak_parts": parts}] * 2
    figure = DashboardFigure(2, predicted).add(cpu)
    heights = {
        rank: [bars[rank].get_height() for bars in figure.memory.bars] for rank in (0, 1)
    }  # params, grads, optim, activations, other (MiB)
    assert heights[0] == pytest.approx([1, 2, 2, 0, 0]) and heights[1] == pytest.approx([1, 0, 1, 2, 3])
    for rank in (0, 1):
        top = max(bars[rank].get_y() + bars[rank].get_height() for bars in figure.memory.bars)
        assert top == pytest.approx(figure.memory.peak_lines[rank].get_ydata()[0]) == pytest.approx((5, 7)[rank])
    explained = [bar for bar in figure.memory.predicted_bars if bar.get_x() < 0.5]
    assert [bar.get_height() for bar in explained] == pytest.approx([1, 0, 2, 3, 0.5])  # traced: activations in
    assert max(bar.get_y() + bar.get_height() for bar in explained) == pytest.approx(6.5)
