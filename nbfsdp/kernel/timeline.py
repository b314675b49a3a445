"""``%fsdp timeline`` and ``%fsdp trace``: the last cell's captured steps (``--timeline``), drawn in the notebook
or written as one Chrome trace. Runs in the kernel.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from IPython.core.error import UsageError
from IPython.display import Image, display

from nbfsdp.kernel.run import history
from nbfsdp.shared.timeline import chrome_trace
from nbfsdp.shared.timeline_figure import collectives_table, png


def _captures() -> list[dict[str, Any]]:
    run = history.last_run()
    if run is None or not run.timeline:
        raise UsageError(
            "no captured step: a %%fsdp cell over a model captures its second step, the first after each change, "
            "then one every --timeline seconds (10 by default)"
        )
    return run.timeline


def step_of(step: int | None, rank: int | None) -> list[dict[str, Any]]:
    """The captures of one step (the last captured where ``step`` is None), of every rank or of ``rank``."""
    captures = _captures()
    steps = sorted({c["step"] for c in captures})
    chosen = steps[-1] if step is None else step
    if chosen not in steps:
        raise UsageError(f"--step {step}: no such captured step; captured: {', '.join(map(str, steps))}")
    # the last capture of that step (a step number a cell logs twice is the later forward's)
    forward = max(c["forward"] for c in captures if c["step"] == chosen)
    found = [c for c in captures if c["forward"] == forward]
    ranks = sorted(c["rank"] for c in found)
    if rank is not None:
        if rank not in ranks:
            raise UsageError(f"--rank {rank}: no capture of that rank; ranks: {', '.join(map(str, ranks))}")
        found = [c for c in found if c["rank"] == rank]
    return sorted(found, key=lambda c: c["rank"])


def show(step: int | None, rank: int | None) -> None:
    """Draw one captured step and print its collectives (rank 0's, or ``rank``'s)."""
    captures = step_of(step, rank)
    display(Image(png([captures])))
    first = captures[0]
    print(
        f"step {first['step']} on rank {first['rank']}: {first['step_ms']:.1f} ms, communication "
        f"{first['comm_ms']:.1f} ms, exposed {first['exposed_comm_ms']:.1f} ms"
    )
    print(f"{'collective':<15}{'unit':<24}{'MiB':>9}{'ms':>9}{'bus GB/s':>10}")
    for row in collectives_table(first):
        print(
            f"{row['kind']:<15}{row['unit']:<24}{row['bytes'] / 2**20:>9.2f}{row['ms']:>9.2f}{row['bus_gb_s']:>10.2f}"
        )


def write_trace(path: str) -> str:
    """Every captured step of the last cell, every rank, as one Chrome trace at ``path``; what to say of it."""
    captures = _captures()
    target = Path(path)
    if target.suffix != ".json":
        raise UsageError(f"%fsdp trace {path}: a Chrome trace is a .json file (e.g. trace.json)")
    if not target.parent.exists():
        raise UsageError(f"%fsdp trace {path}: no directory {target.parent}")
    trace = chrome_trace(captures)
    target.write_text(json.dumps(trace))
    ranks = len({c["rank"] for c in captures})
    steps = len({c["forward"] for c in captures})
    return (
        f"nbfsdp: wrote {target} ({steps} captured steps, {ranks} ranks, {len(trace['traceEvents'])} events): "
        "open it in https://ui.perfetto.dev or chrome://tracing"
    )
