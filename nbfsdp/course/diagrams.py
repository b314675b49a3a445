"""Pictures the course draws in the notebook (kernel side): each returns its matplotlib ``Figure``.

``collective`` shows one collective's buffers on every rank before and after it runs, with the
bytes a rank sends under the ring algorithm; ``strategy_timeline`` shows the parameters one rank
holds through a step under FULL_SHARD, SHARD_GRAD_OP and NO_SHARD; ``timeline`` draws captured steps
(``nbfsdp.course.captured_step``'s, or ``nbfsdp.last_run().timeline``'s) as ``%fsdp timeline`` does.
"""

from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING, Any

from nbfsdp.shared.collectives import ring_bytes, size_text

if TYPE_CHECKING:  # matplotlib is imported when a picture is drawn, so the ranks never load it
    from matplotlib.figure import Figure

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def collective(kind: str, world_size: int = 4, tensor_bytes: int = 2**20) -> Figure:
    """Each rank's buffer before and after ``kind`` (all_gather, reduce_scatter, all_reduce) over ``world_size`` ranks.

    The buffer is drawn as ``world_size`` chunks, coloured by the rank whose data a chunk holds;
    a chunk striped in every colour holds the sum over all ranks. ``tensor_bytes`` is the size of the
    tensor the collective handles (gathered output, unreduced input, or the all-reduced tensor).
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    n = world_size
    colours = [plt.get_cmap("tab10")(r % 10) for r in range(n)]
    summed = "sum"  # a chunk holding every rank's contribution, added up

    def before(rank: int, chunk: int) -> int | str | None:
        if kind == "all_gather":
            return rank if chunk == rank else None
        return rank  # reduce-scatter and all-reduce start from each rank's own full, unreduced tensor

    def after(rank: int, chunk: int) -> int | str | None:
        if kind == "all_gather":
            return chunk
        if kind == "reduce_scatter":
            return summed if chunk == rank else None
        return summed

    fig, axes = plt.subplots(1, 2, figsize=(9, 0.75 * n + 1.4), sharey=True)
    for ax, title, holds in ((axes[0], "before", before), (axes[1], "after", after)):
        for rank in range(n):
            y = n - 1 - rank
            for chunk in range(n):
                what = holds(rank, chunk)
                x = chunk + 0.05
                if what is None:
                    ax.add_patch(Rectangle((x, y + 0.15), 0.9, 0.6, fill=False, ls=":", ec="grey"))
                elif what == summed:
                    for s in range(n):  # stripes: every rank's colour
                        ax.add_patch(Rectangle((x + 0.9 * s / n, y + 0.15), 0.9 / n, 0.6, color=colours[s]))
                    ax.add_patch(Rectangle((x, y + 0.15), 0.9, 0.6, fill=False, ec="black", lw=1.2))
                else:
                    assert isinstance(what, int)  # one rank's data
                    ax.add_patch(Rectangle((x, y + 0.15), 0.9, 0.6, color=colours[what]))
            ax.text(-0.1, y + 0.45, f"rank {rank}", ha="right", va="center", fontsize=9)
        ax.set(xlim=(-0.9, n), ylim=(-0.1, n), title=title)
        ax.axis("off")
    sent = ring_bytes(kind, tensor_bytes, n)
    factor = Fraction(sent, tensor_bytes).limit_denominator(4 * n) if tensor_bytes else Fraction(0)
    what_tensor = {"all_gather": "gathered", "reduce_scatter": "unreduced", "all_reduce": "reduced"}[kind]
    fig.text(
        0.5,
        0.02,
        f"ring {kind.replace('_', '-')}: each rank sends {size_text(sent)} (and receives as many) = {factor} "
        f"of the {size_text(tensor_bytes)} {what_tensor} tensor",
        ha="center",
        fontsize=10,
    )
    fig.legend(
        handles=[Patch(color=colours[r], label=f"rank {r}'s data") for r in range(n)]
        + [Patch(fill=False, ec="black", label="summed over all ranks (striped)")],
        loc="upper center",
        bbox_to_anchor=(0.5, 0.93),
        ncol=n + 1,
        fontsize=8,
        frameon=False,
    )
    fig.suptitle(kind.replace("_", "-"), y=0.99, fontsize=12, weight="bold")
    fig.tight_layout(rect=(0, 0.06, 1, 0.86))
    return fig


def strategy_timeline(units: int = 4, world_size: int = 4) -> Figure:
    """Parameters one rank holds (stored, gathered on top) through a step of ``units`` equal units, per strategy."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = world_size
    phases = [f"F{u}" for u in range(1, units + 1)] + [f"B{u}" for u in range(units, 0, -1)]
    # (stored, gathered, collectives) while each unit computes its forward (F) or backward (B)
    timeline: dict[str, list[tuple[float, int, str]]] = {
        "FULL_SHARD": [(units / n, 1, "AG" if p[0] == "F" else "AG\nRS") for p in phases],
        "SHARD_GRAD_OP": [(units / n, u, "AG") for u in range(1, units + 1)]
        + [(units / n, u, "RS") for u in range(units, 0, -1)],
        "NO_SHARD": [(units, 0, "" if p[0] == "F" else "AR") for p in phases],
    }
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), sharey=True)
    for ax, (strategy, slots) in zip(axes, timeline.items(), strict=True):
        stored = [s for s, _, _ in slots]
        gathered = [g for _, g, _ in slots]
        ax.bar(phases, stored, color="tab:blue")
        ax.bar(phases, gathered, bottom=stored, color="lightsteelblue", hatch="//", edgecolor="tab:blue")
        for x, (s, g, comm) in enumerate(slots):
            ax.text(x, s + g + 0.1, comm, ha="center", va="bottom", fontsize=8)
        ax.axhline(units, color="grey", ls=":", lw=1)
        ax.set(title=strategy, xlabel=f"forward F1..F{units}, then backward B{units}..B1", ylim=(0, 1.7 * units))
    axes[0].set_ylabel("parameters held (units)")
    axes[0].text(-0.4, units + 0.1, "one full copy", color="grey", fontsize=8)
    fig.legend(
        handles=[
            Patch(color="tab:blue", label="stored (its shards, or a full copy)"),
            Patch(facecolor="lightsteelblue", hatch="//", edgecolor="tab:blue", label="gathered, unsharded"),
        ],
        loc="lower center",
        ncol=2,
    )
    fig.suptitle("AG: all-gather a unit   RS: reduce-scatter its gradients   AR: all-reduce its gradients")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def timeline(steps: list[list[dict[str, Any]]]) -> Figure:
    """One captured step (a list of the ranks' captures), or two side by side titled by the settings that differ:
    ``%fsdp timeline``'s picture, hatched where a rank waited for communication."""
    import matplotlib.pyplot as plt

    from nbfsdp.shared.timeline_figure import figure

    return figure(steps, new=plt.figure)
