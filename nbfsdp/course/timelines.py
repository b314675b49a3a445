"""A rank's own FSDP on nbfsdp's timeline (the ranks). A from-scratch FSDP labels its work with the names FSDP2
gives its own spans for the profiler (``fsdp_span``); ``captured_step`` profiles one step of it and reads the
events as ``%%fsdp --timeline`` reads FSDP2's (``nbfsdp.shared.profiled_steps``), so the capture is the same dict
(``nbfsdp.last_run().timeline``'s), drawn by ``nbfsdp.course.timeline`` and measured by ``hidden_percent``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from nbfsdp.shared.profiled_steps import parse
from nbfsdp.shared.timeline import exposure
from nbfsdp.shared.torch_private import profiler_events, release_profiler_results

#: FSDP2's spans the timeline reads, by what they hold: a unit's forward runs from the end of its ``pre_forward``
#: to the start of its ``post_forward``, its backward from the end of ``pre_backward`` to the start of
#: ``post_backward_reduce``; each ``all_gather`` span issues one gather, each ``post_backward_reduce`` one reduction.
SPANS = ("pre_forward", "all_gather", "post_forward", "pre_backward", "post_backward_reduce")


def fsdp_span(what: str, unit: str) -> record_function:
    """The profiler's span FSDP2 opens for ``what`` on ``unit`` (``FSDP::all_gather (blocks.1)``): work done
    inside it reads as FSDP2's on the timeline."""
    if what not in SPANS:
        raise ValueError(f"fsdp_span: {what!r} is not one of FSDP2's spans the timeline reads: {', '.join(SPANS)}")
    return record_function(f"FSDP::{what} ({unit})")


@contextmanager
def captured_step(
    rank: int,
    device: torch.device | str = "cpu",
    *,
    step: int = 0,
    settings: dict[str, Any] | None = None,
    gathered_bytes: dict[str, int] | None = None,
) -> Iterator[dict[str, Any]]:
    """Profiles the code inside as one step of this rank and fills the dict it yields with the step's capture:
    ``events`` by lane, ``comm_ms`` and ``exposed_comm_ms`` (the communication no compute covered), ``step_ms``.
    ``gathered_bytes``: each unit's bytes an all-gather returns, for the events' ``bytes``; ``settings``: shown
    where two captures are drawn side by side."""
    device = torch.device(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    capture: dict[str, Any] = {}
    began = time.perf_counter()
    with profile(activities=activities) as profiler:
        yield capture
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    step_ms = (time.perf_counter() - began) * 1000
    raw, start_ns = profiler_events(profiler)
    release_profiler_results(profiler)
    sizes = {unit: (nbytes, 0) for unit, nbytes in (gathered_bytes or {}).items()}
    events = parse(raw, start_ns, sizes)
    comm, exposed = exposure(events)
    capture.update(
        rank=rank,
        step=step,
        forward=step,
        step_ms=step_ms,
        comm_ms=comm,
        exposed_comm_ms=exposed,
        device=device.type,
        clock_ns=start_ns,  # one host: the ranks' clocks are the same clock
        settings=dict(settings or {}),
        events=events,
    )
