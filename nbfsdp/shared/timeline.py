"""A captured step's timeline, as every process reads it: its lanes and events, the communication no compute
covered, and the Chrome trace of several ranks' captures. Runs on the ranks (which make the captures) and in the
kernel (which draws and writes them).

A captured step is a dict, the same on the wire and in ``nbfsdp.last_run().timeline``::

    {"rank": 0, "step": 1, "forward": 1, "step_ms": 84.2, "comm_ms": 31.0, "exposed_comm_ms": 12.5,
     "device": "cpu", "clock_ns": ..., "settings": {...}, "events": [
        {"lane": "all_gather", "name": "all_gather", "unit": "blocks.1", "start_ms": 3.1, "ms": 2.2, "bytes": ...},
        ...]}

``start_ms`` counts from ``clock_ns`` (nanoseconds since the epoch on the rank's host, less the offset the world
measured to rank 0's clock at its set-up), so the ranks' captures of one step line up. ``step`` is the step the
rank logged during the capture (``nbfsdp.log(step=...)``), else its count of forwards.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

#: ``--timeline``'s default: after a cell's second step and the first after each change, one step every this many
#: seconds is captured.
DEFAULT_EVERY_SECONDS = 10.0
#: The lanes of a rank's timeline, top to bottom.
LANES = ("compute", "all_gather", "reduce_scatter", "optimizer", "nbfsdp")
#: Of those, what moves bytes between ranks.
COMMUNICATION = ("all_gather", "reduce_scatter")
#: Events that are communication in flight (not the rank's own copies around it).
TRANSFERS = ("all_gather", "reduce_scatter", "all_reduce")
#: Events during which a rank computes (its model's forward and backward, the rest of its step's code, the
#: optimizer): communication under them is hidden. FSDP2's copies in and out of a gather's buffer are not: the
#: copy-out waits on the gather first, and a synchronous gather or reduce-scatter runs inside the span that issues it.
WORKING = ("forward", "backward", "other", "optimizer", "zero_grad")

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The intervals merged where they overlap, in order."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def covered(intervals: list[Interval], cover: list[Interval]) -> float:
    """How much of ``intervals`` (merged) ``cover`` (merged) covers."""
    total, j = 0.0, 0
    for start, end in intervals:
        while j < len(cover) and cover[j][1] <= start:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < end:
            total += max(0.0, min(end, cover[k][1]) - max(start, cover[k][0]))
            k += 1
    return total


def exposure(events: list[dict[str, Any]]) -> tuple[float, float]:
    """The communication in flight (ms, overlaps counted once) and the part of it while the rank did no work:
    what the step waited for."""
    transfers = union((e["start_ms"], e["start_ms"] + e["ms"]) for e in events if e["name"] in TRANSFERS)
    working = union((e["start_ms"], e["start_ms"] + e["ms"]) for e in events if e["name"] in WORKING)
    total = sum(end - start for start, end in transfers)
    return total, total - covered(transfers, working)


def hidden_percent(capture: dict[str, Any]) -> float:
    """The share of the step's communication that work covered, in percent (100 with no communication)."""
    return 100.0 * (1 - capture["exposed_comm_ms"] / capture["comm_ms"]) if capture["comm_ms"] else 100.0


def chrome_trace(captures: list[dict[str, Any]]) -> dict[str, Any]:
    """Captured steps as one Chrome trace (what Perfetto and ``chrome://tracing`` open): a process per rank, a
    thread per lane, each event a complete event (``"ph": "X"``, microseconds) with its unit and bytes as args.
    Each capture keeps its time on the ranks' shared clock, so the ranks' rows of one step line up."""
    events: list[dict[str, Any]] = []
    origin = min((c["clock_ns"] for c in captures), default=0)
    for rank in sorted({c["rank"] for c in captures}):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
        for tid, lane in enumerate(LANES):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": lane}})
    for capture in captures:
        base_us = (capture["clock_ns"] - origin) / 1000
        step = {"step": capture["step"], "exposed_comm_ms": capture["exposed_comm_ms"], **capture["settings"]}
        for event in capture["events"]:
            args = {"unit": event["unit"], "bytes": event["bytes"], **step}
            events.append(
                {
                    "ph": "X",
                    "name": f"{event['name']} {event['unit']}".strip(),
                    "cat": event["lane"],
                    "pid": capture["rank"],
                    "tid": LANES.index(event["lane"]),
                    "ts": round(base_us + event["start_ms"] * 1000, 3),
                    "dur": round(event["ms"] * 1000, 3),
                    "args": args,
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}
