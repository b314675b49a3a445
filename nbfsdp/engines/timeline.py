"""A rank's timeline of chosen steps (``%%fsdp --timeline``): FSDP2's all-gathers, compute and reduce-scatters per
unit, measured on the ranks while a cell trains.

Captured with ``torch.profiler`` on the chosen steps only: FSDP2 names its work for the profiler with the unit's
name (``FSDP::pre_forward (blocks.1)``, ``FSDP::all_gather (blocks.1)``, ``FSDP::post_backward_reduce ...``), and
the transfers themselves run where no hook can time them, on gloo's threads (``gloo:all_gather``) or as NCCL's
kernels on a GPU, whose times only the profiler's CUDA activity gives. Hooks on every unit would cost each step
(the profiler costs nothing off the captured steps) and still not see the transfers. A capture costs its step
the profiler's bookkeeping, and the next step a parse of a few thousand events (``make bench``'s ``timeline`` row).

Which steps: the cell's second (the first warms caches and allocates), the first after each live change of the
settings, then one every ``every_seconds`` (``--timeout``'s sibling ``--timeline N``; 0 captures none). A step runs
from one forward of the cell's models to the next (``control.StepBoundaries``), the last to the cell's end.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

from nbfsdp.engines.sharding import ShardedModel
from nbfsdp.engines.world import World
from nbfsdp.shared.timeline import exposure, union
from nbfsdp.shared.torch_private import (
    profiled_allocation_peak,
    profiler_events,
    profiler_running,
    release_profiler_results,
)

#: Compute shorter than this between two hooks is not an event of its own (it is counted in the exposure).
SHORTEST_MS = 0.02
#: One profiler event: (name, start_ns, end_ns, thread, on_device, correlation, linked correlation).
RawEvent = tuple[str, int, int, int, bool, int, int]
#: The settings a capture says were in force.
SHOWN_SETTINGS = (
    "sharding_strategy",
    "reshard_after_forward",
    "mixed_precision",
    "forward_prefetch",
    "backward_prefetch",
    "activation_checkpointing",
    "cpu_offload",
)


def unit_sizes(models: list[ShardedModel]) -> dict[str, tuple[int, int]]:
    """Each FSDP unit's bytes an all-gather returns (every rank's padded shard, in the compute dtype) and a
    reduce-scatter takes (the unit's trained gradients, padded, in the reduce dtype), by the unit's name."""
    sizes: dict[str, tuple[int, int]] = {}
    for sharded in models:
        names = {id(m): n for n, m in sharded.module.named_modules()}
        param_dtype, reduce_dtype, _ = sharded.config.dtypes()
        units = [cast(nn.Module, unit) for unit in sharded.units]
        owner: dict[int, nn.Module] = {}
        for unit in reversed(units):  # the deepest unit owns a parameter
            for param in unit.parameters():
                owner.setdefault(id(param), unit)
        for unit in units:
            gathered = reduced = 0
            for param in unit.parameters():
                if owner.get(id(param)) is not unit:
                    continue
                shards = param.device_mesh.size(-1) if isinstance(param, DTensor) else 1
                rows = param.shape[0] if param.dim() else 1
                padded = math.ceil(rows / shards) * shards * (param.numel() // rows if rows else 0)
                gathered += padded * _itemsize(param_dtype or param.dtype)
                if param.requires_grad:
                    reduced += padded * _itemsize(reduce_dtype or param_dtype or param.dtype)
            sizes[names[id(unit)]] = (gathered, reduced)
    return sizes


def clock_offset_ns(device: torch.device, rounds: int = 5) -> int:
    """This rank's clock less rank 0's (nanoseconds), where the world's ranks are on several hosts: every rank
    reads its clock as it leaves a barrier, which the ranks leave within a network round trip of one another;
    the median of ``rounds`` such readings. A collective of the new world's, at its set-up."""
    differences = []
    for _ in range(rounds):
        dist.barrier()
        now = torch.tensor([time.time_ns()], dtype=torch.int64, device=device)
        dist.broadcast(reference := now.clone(), src=0)
        differences.append(int(now.item() - reference.item()))
    return sorted(differences)[len(differences) // 2]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class StepTimeline:
    """Captures chosen steps of one cell on this rank, each sent to the notebook as soon as it ends."""

    def __init__(
        self,
        world: World,
        models: list[ShardedModel],
        *,
        every_seconds: float,
        publish: Callable[[dict], None] | None,
        on_allocated: Callable[[int, int], None] | None = None,
    ) -> None:
        """``on_allocated(step, bytes)``: on the CPU, the most bytes a captured step allocated at once above what it
        began with (the memory meter then counts the step's true peak)."""
        self.every_seconds, self.rank, self.device = every_seconds, world.rank, world.device
        self._models = models
        self._sizes: dict[str, tuple[int, int]] | None = None  # at the first capture: --timeline 0 never needs them
        self._publish = publish
        self._offset = world.clock_offset_ns  # this rank's clock against rank 0's, over several hosts
        self.on_allocated = on_allocated
        self.captures: list[dict[str, Any]] = []
        self._profiler: profile | None = None
        self._forward = 0
        self._logged: int | None = None
        self._last_capture = time.monotonic()  # the periodic captures count from the cell's start
        self._replicated = any(m.config.mesh_shape(_world(m))[0] > 1 for m in models)
        self._shards = max((m.config.mesh_shape(_world(m))[1] for m in models), default=1)
        self._post_forward_group = next(
            (m.config.reshard_after_forward for m in models if m.config.reshard_after_forward), None
        )

    def at_forward(self, forward: int, *, changed: bool) -> None:
        """Forward number ``forward`` of the cell's models begins (``changed``: settings changed at it): the
        step captured so far ends here, and this one is captured if it is due."""
        if self._profiler is not None:
            self._finish()
        due = forward == 1 or changed or time.monotonic() - self._last_capture >= self.every_seconds
        if self.every_seconds > 0 and self._models and due:
            self._start(forward)

    def logged(self, step: int) -> None:
        """The cell logged ``step``: a capture under way is named by it."""
        if self._profiler is not None and self._logged is None:
            self._logged = step

    def end(self) -> None:
        """The cell ended: a capture under way ends with it."""
        if self._profiler is not None:
            self._finish()

    def _start(self, forward: int) -> None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        # the CPU's allocations too: the step's true peak, which the memory meter's categories leave short of
        on_cpu = self.device.type == "cpu"
        if profiler_running():  # the cell profiles this step itself: a second session would end its own
            return
        profiler = profile(activities=activities, record_shapes=False, profile_memory=on_cpu, with_stack=False)
        profiler.__enter__()
        self._profiler, self._forward, self._logged = profiler, forward, None
        self._settings = {key: _plain(getattr(self._models[0].config, key)) for key in SHOWN_SETTINGS}
        self._settings["backward_prefetch"] = self._models[0].config.effective_backward_prefetch
        self._began = time.perf_counter()

    def _finish(self) -> None:
        profiler, self._profiler = self._profiler, None
        assert profiler is not None  # a capture is under way
        if not profiler_running():  # a profiler the cell started inside the step ended this one with its own
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        step_ms = (time.perf_counter() - self._began) * 1000
        profiler.__exit__(None, None, None)
        self._last_capture = time.monotonic()
        raw, start_ns = profiler_events(profiler)
        step_threads = {r[3] for r in raw if r[0].startswith("FSDP::")}  # the step's, not gloo's workers
        allocated = profiled_allocation_peak(profiler, step_threads) if self.device.type == "cpu" else None
        release_profiler_results(profiler)
        clock_ns = start_ns - self._offset
        if self._sizes is None:
            self._sizes = unit_sizes(self._models)
        events = parse(raw, start_ns, self._sizes, two_reductions=self._replicated and _sharded(self._models))
        comm, exposed = exposure(events)
        step = self._logged if self._logged is not None else self._forward
        capture = {
            "rank": self.rank,
            "step": step,
            "forward": self._forward,
            "step_ms": step_ms,
            "comm_ms": comm,
            "exposed_comm_ms": exposed,
            "device": self.device.type,
            "shards": self._shards,
            "post_forward_group": self._post_forward_group,
            "clock_ns": clock_ns,
            "clock_offset_ms": self._offset / 1e6,
            "settings": self._settings,
            "events": events,
            "allocated_peak": allocated,
        }
        self.captures.append(capture)
        if allocated is not None and self.on_allocated is not None:
            self.on_allocated(step, allocated)
        if self._publish is not None:
            self._publish({f"timeline{len(self.captures) - 1}": capture})


def _world(model: ShardedModel) -> int:
    mesh = next((p.device_mesh for p in model.module.parameters() if isinstance(p, DTensor)), None)
    return mesh.size() if mesh is not None else 1


def _sharded(models: list[ShardedModel]) -> bool:
    return any(m.config.mesh_shape(_world(m))[1] > 1 for m in models)


def _plain(value: Any) -> Any:
    return value if isinstance(value, (bool, int, float, str, type(None))) else str(value)


# -- the profiler's events as lanes


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
