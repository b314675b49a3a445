"""A rank's timeline of chosen steps (``%%fsdp --timeline``): FSDP2's all-gathers, compute and reduce-scatters per
unit, measured on the ranks while a cell trains.

Captured with ``torch.profiler`` on the chosen steps only: FSDP2 names its work for the profiler with the unit's
name (``FSDP::pre_forward (blocks.1)``, ``FSDP::all_gather (blocks.1)``, ``FSDP::post_backward_reduce ...``), and
the transfers themselves run where no hook can time them, on gloo's threads (``gloo:all_gather``) or as NCCL's
kernels on a GPU, whose times only the profiler's CUDA activity gives. Hooks on every unit would cost each step
(the profiler costs nothing off the captured steps) and still not see the transfers. A capture costs its step
the profiler's bookkeeping, and the next step a parse of a few thousand events (``make bench``'s ``timeline`` row)
into lanes (``nbfsdp.shared.profiled_steps``).

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
from nbfsdp.shared.profiled_steps import parse
from nbfsdp.shared.timeline import exposure
from nbfsdp.shared.torch_private import (
    profiled_allocation_peak,
    profiler_events,
    profiler_running,
    release_profiler_results,
)

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
