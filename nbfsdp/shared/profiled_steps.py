"""A profiled step's events read into the timeline's lanes: each unit's all-gathers and reduce-scatters (the
transfers themselves, on gloo's threads or as NCCL's kernels, named by the FSDP2 span that issued them), FSDP2's
copies in and out, the optimizer, and the compute between them, named by the unit whose forward or backward it is
in. Runs on the ranks: ``nbfsdp.engines.timeline`` reads nbfsdp's captured steps with it, and the course reads a
from-scratch FSDP whose work is labelled with FSDP2's span names (``nbfsdp.course.timelines``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nbfsdp.shared.timeline import union

#: Compute shorter than this between two hooks is not an event of its own (it is counted in the exposure).
SHORTEST_MS = 0.02
#: One profiler event: (name, start_ns, end_ns, thread, on_device, correlation, linked correlation).
RawEvent = tuple[str, int, int, int, bool, int, int]


def _outside(span: tuple[float, float], busy: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of ``span`` no interval of ``busy`` (merged, in order) covers."""
    gaps, cursor = [], span[0]
    for start, end in busy:
        if start > cursor:
            gaps.append((cursor, min(start, span[1])))
        cursor = max(cursor, end)
    if cursor < span[1]:
        gaps.append((cursor, span[1]))
    return [(a, b) for a, b in gaps if b > a]


def _unit(name: str) -> str:
    """``FSDP::pre_forward (blocks.1)`` -> ``blocks.1``; FSDP2 names the root's work without a unit."""
    return name[name.index("(") + 1 : -1] if name.endswith(")") and " (" in name else ""


def _is(name: str, label: str) -> bool:
    """``name`` is FSDP2's ``label`` span (of any unit): ``FSDP::all_gather (x)`` is, ``FSDP::all_gather_copy_out``
    is not."""
    return name == label or name.startswith(label + " (")


def parse(
    raw: list[RawEvent],
    start_ns: int,
    sizes: dict[str, tuple[int, int]],
    *,
    two_reductions: bool = False,
) -> list[dict[str, Any]]:
    """A captured step's events by lane, from the profiler's ``(name, start_ns, end_ns, thread, on_device,
    correlation, linked correlation)`` (``torch_private.profiler_events``); ``two_reductions``: HSDP, whose
    every unit reduce-scatters its gradients and then all-reduces the shard."""

    def event(lane: str, name: str, unit: str, start: int, end: int, size: int = 0) -> dict[str, Any]:
        return {
            "lane": lane,
            "name": name,
            "unit": unit,
            "start_ms": (start - start_ns) / 1e6,
            "ms": (end - start) / 1e6,
            "bytes": size,
        }

    host = [r for r in raw if not r[4]]
    fsdp_threads = {r[3] for r in host if r[0].startswith("FSDP::")}
    on_threads = sorted((r for r in host if r[3] in fsdp_threads), key=lambda r: (r[1], -r[2]))
    device = sorted((r for r in raw if r[4]), key=lambda r: r[1])
    events = _collectives(host, device, on_threads, sizes, two_reductions=two_reductions, event=event)
    events += _host_spans(on_threads, event)
    on_device = [r for r in device if "nccl" not in r[0].lower()]
    events += _compute(on_threads, on_device, event)
    return sorted(events, key=lambda e: (e["start_ms"], e["lane"]))


def _collectives(
    host: list[RawEvent],
    device: list[RawEvent],
    on_threads: list[RawEvent],
    sizes: dict[str, tuple[int, int]],
    *,
    two_reductions: bool,
    event: Callable[..., dict[str, Any]],
) -> list[dict[str, Any]]:
    """The transfers themselves (gloo's spans in its threads, or NCCL's kernels), each named by the unit whose
    FSDP2 span issued it: a process group runs its collectives in the order they were issued."""
    gathers = [r for r in on_threads if _is(r[0], "FSDP::all_gather")]
    reduces = [r for r in on_threads if _is(r[0], "FSDP::post_backward_reduce")]
    transfers = [r for r in host if r[0].startswith("gloo:")] or [r for r in device if "nccl" in r[0].lower()]
    transfers.sort(key=lambda r: r[1])
    gathered = [r for r in transfers if "all_gather" in r[0] or "AllGather" in r[0]]
    reduced = [r for r in transfers if r not in gathered]
    events = []
    for issue, transfer in zip(gathers, gathered, strict=False):
        unit = _unit(issue[0])
        events.append(event("all_gather", "all_gather", unit, transfer[1], transfer[2], sizes.get(unit, (0, 0))[0]))
    per_unit = 2 if two_reductions else 1
    for index, transfer in enumerate(reduced[: per_unit * len(reduces)]):
        unit = _unit(reduces[index // per_unit][0])
        name = "all_reduce" if per_unit == 2 and index % 2 else "reduce_scatter"
        size = sizes.get(unit, (0, 0))[1] if name == "reduce_scatter" else 0
        events.append(event("reduce_scatter", name, unit, transfer[1], transfer[2], size))
    return events


def _host_spans(on_threads: list[RawEvent], event: Callable[..., dict[str, Any]]) -> list[dict[str, Any]]:
    """FSDP2's copies into and out of the gathers, the optimizer's and nbfsdp's own spans, as the host ran them."""
    events = []
    for r in on_threads:
        if _is(r[0], "FSDP::all_gather"):
            events.append(event("all_gather", "copy_in", _unit(r[0]), r[1], r[2]))
        elif _is(r[0], "FSDP::all_gather_copy_out"):
            events.append(event("all_gather", "copy_out", _unit(r[0]), r[1], r[2]))
        elif r[0].startswith("Optimizer.step"):
            events.append(event("optimizer", "optimizer", "", r[1], r[2]))
        elif r[0].startswith("Optimizer.zero_grad"):
            events.append(event("optimizer", "zero_grad", "", r[1], r[2]))
        elif r[0].startswith("nbfsdp::"):
            events.append(event("nbfsdp", r[0].removeprefix("nbfsdp::"), "", r[1], r[2]))
    return events


def _compute(
    on_threads: list[RawEvent],
    on_device: list[RawEvent],
    event: Callable[..., dict[str, Any]],
) -> list[dict[str, Any]]:
    """The compute lane: on the CPU, each thread's time outside FSDP2's hooks, the optimizer and nbfsdp's own
    work, named by the unit whose forward or backward it is in (FSDP2's pre- and post- hooks open and close them);
    on a GPU, the kernels the device ran, named by the unit their launch was in."""
    own = [r for r in on_threads if r[0].startswith(("FSDP::", "Optimizer.", "nbfsdp::"))]
    named = _labels(own)

    def label_at(at: float) -> tuple[str, str]:
        index = max(i for i, (t, _, _) in enumerate(named) if t <= at)
        return named[index][1], named[index][2]

    if on_device:  # a GPU: the kernels, named by the host code that launched them (its correlation)
        launched = {r[5]: r[1] for r in on_threads if r[5]}
        pieces: list[tuple[float, float, tuple[str, str]]] = [
            (r[1], r[2], label_at(launched.get(r[6], r[1]))) for r in on_device
        ]
    else:  # the CPU: each thread's time outside nbfsdp's, FSDP2's and the optimizer's spans, cut where units change
        pieces = []
        cuts = [t for t, _, _ in named[1:]]
        for thread in sorted({r[3] for r in on_threads}):
            mine = [r for r in on_threads if r[3] == thread]
            busy = union((r[1], r[2]) for r in own if r[3] == thread)
            for gap_start, gap_end in _outside((min(r[1] for r in mine), max(r[2] for r in mine)), busy):
                edges = [gap_start, *(t for t in cuts if gap_start < t < gap_end), gap_end]
                pieces += [(a, b, label_at(a)) for a, b in zip(edges, edges[1:], strict=False)]
    return [
        event("compute", phase, unit, start, end)
        for start, end, (phase, unit) in pieces
        if (end - start) / 1e6 >= SHORTEST_MS
    ]


def _labels(own: list[RawEvent]) -> list[tuple[int, str, str]]:
    """From each boundary where a unit's forward or backward opens or closes on: the pass and unit work is in
    (the innermost open unit), else 'other'."""
    boundaries: list[tuple[int, str, str]] = []
    for name, start, end, *_ in own:
        if _is(name, "FSDP::pre_forward"):
            boundaries.append((end, "open forward", _unit(name)))
        elif _is(name, "FSDP::post_forward"):
            boundaries.append((start, "close", _unit(name)))
        elif _is(name, "FSDP::pre_backward"):
            boundaries.append((end, "open backward", _unit(name)))
        elif name.startswith("FSDP::post_backward_"):
            boundaries.append((start, "close", _unit(name)))
    stack: list[tuple[str, str]] = []
    labels: list[tuple[int, str, str]] = [(0, "other", "")]
    for at, what, unit in sorted(boundaries):
        if what.startswith("open"):
            stack.append((what.split()[1], unit))
        elif stack and stack[-1][1] == unit:
            stack.pop()
        phase, current = stack[-1] if stack else ("other", "")
        labels.append((at, phase, current))
    return labels
