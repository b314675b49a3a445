"""Per-rank metrics: what ``nbfsdp.log`` records, and the memory each record carries.

Memory is measured, not predicted, by category:

- ``mem_params``: this rank's parameter storage (its FSDP shards);
- ``mem_grads``: its gradient storage, read when the optimizer steps (after
  ``backward``, before ``zero_grad`` frees it), else as it is at the log call;
- ``mem_optim``: its optimizer state, read after each optimizer step;
- ``mem_activations``: the peak since the last record of tensors autograd
  saved for backward (FSDP's unsharded parameters excluded), counted through
  saved-tensor hooks. Those cost ~20 us per saved tensor (1-3% of a small
  CPU step), and while they are in force every gloo collective takes the GIL
  in gloo's own threads (to copy the hooks with the thread's state), so
  the ranks wait on one another longer. They count a cell's first steps, the
  step after a settings change, and then one step about every second; a
  counted step ends at the optimizer's step or at the next record, whichever
  comes first, so a cell that seldom logs is not counted in between. Records
  between counted steps repeat the last figure counted;
- ``mem_peak``: on GPU the allocator's peak since the last record
  (``cuda_max_allocated``); on CPU, which has no allocator statistics,
  ``mem_params + mem_optim + max(mem_activations, mem_grads)``: the tracked
  tensors at their peak, without backward temporaries or communication buffers;
  on a step the timeline captured (``nbfsdp.engines.timeline``), at least
  ``mem_captured_peak``: every CPU tensor the step allocated, counted by the
  profiler, on top of the shards and the optimizer's state.

Each figure counts storages once, as ``FSDPMemTracker`` does, so padding of
uneven shards is included. ``FSDPMemTracker`` instruments every operator and
is kept as the oracle that tests compare these numbers with.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.profiler import record_function

from nbfsdp.engines.control import RankControl
from nbfsdp.shared import torch_private
from nbfsdp.shared.torch_private import (
    local_tensor,
    pop_saved_tensors_hooks,
    push_saved_tensors_hooks,
    top_saved_tensors_hooks,
)

#: Steps at the start of a cell whose activations are all counted.
COUNTED_FIRST_STEPS = 3
#: After those, activations are counted on one step about this often.
ACTIVATIONS_EVERY_SECONDS = 1.0


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor counts its local shard)."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        if isinstance(tensor, DTensor):
            tensor = local_tensor(tensor)
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


class _SavedTensor:
    """A tensor saved for backward; its meter counts it until autograd drops it."""

    __slots__ = ("tensor", "_meter", "_key")

    def __init__(self, tensor: torch.Tensor, meter: MemoryMeter, key: int) -> None:
        self.tensor, self._meter, self._key = tensor, meter, key

    def __del__(self) -> None:
        self._meter._release(self._key)


class MemoryMeter:
    """Measures one rank's memory by category for every ``nbfsdp.log`` record."""

    def __init__(self, device: torch.device, params: Iterable[torch.Tensor]) -> None:
        self._device = device
        self._params = {id(p): p for p in params}
        self._params_bytes = storage_bytes(self._params.values())
        self._grads_bytes: int | None = None
        self._optimizers: dict[int, torch.optim.Optimizer] = {}
        self._state_bytes_by_layout: dict[int, tuple[tuple[int, int], int]] = {}  # by id(optimizer)
        self._live: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self._activations = 0
        self._activations_peak = 0
        self._activations_figure = 0  # the peak of the last step whose activations were counted
        self._counting = False
        self._steps_to_count = 0  # optimizer steps to count before the hooks go
        self._packed = False  # a tensor was counted since the last figure was taken
        self._reads = 0
        self._counted_step_began = 0.0

    # -- installing the hooks for the duration of a cell
    def __enter__(self) -> MemoryMeter:
        self._handles = [
            register_optimizer_step_pre_hook(self._before_step),
            register_optimizer_step_post_hook(self._after_step),
        ]
        push_saved_tensors_hooks(self._pack, self._unpack)
        self._counting, self._counted_step_began = True, time.perf_counter()
        self._steps_to_count = COUNTED_FIRST_STEPS
        if self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._counting:  # the cell's own hooks, if it pushed any, were popped as its blocks ended
            pop_saved_tensors_hooks()
        for handle in self._handles:
            handle.remove()

    def count_next_step(self) -> None:
        """Count the activations of the step after this record (a setting changed: they may too)."""
        self._count_activations(on=True)

    def _count_activations(self, *, on: bool) -> None:
        """Between steps, push or pop the saved-tensor hooks. Hooks are a stack and a cell's own
        ``with saved_tensors_hooks(...)`` must pop its own, so this happens only while none of the cell's
        are pushed. torch before 2.8 cannot tell: there every step is counted."""
        if top_saved_tensors_hooks() is False:
            return
        if on:
            self._steps_to_count = max(self._steps_to_count, 1)
            if not self._counting and top_saved_tensors_hooks() is None:
                push_saved_tensors_hooks(self._pack, self._unpack)
                self._counting, self._activations_peak = True, self._activations
        elif self._counting and self._hooks_on_top():
            pop_saved_tensors_hooks()
            self._counting = False

    def _hooks_on_top(self) -> bool:
        """The meter's hooks are the top of the stack: no hooks of the cell's own were pushed after them."""
        return top_saved_tensors_hooks() == (self._pack, self._unpack)

    # -- autograd's saved tensors: activations
    def _pack(self, tensor: torch.Tensor) -> Any:
        if isinstance(tensor, (nn.Parameter, DTensor)) or isinstance(torch_private.view_base(tensor), nn.Parameter):
            return tensor
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested, ...: not counted, never in the way
            return tensor
        key = storage.data_ptr()
        self._packed = True
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [1, storage.nbytes()]
            self._activations += storage.nbytes()
            self._activations_peak = max(self._activations_peak, self._activations)
        else:
            entry[0] += 1
        return _SavedTensor(tensor, self, key)

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _SavedTensor) else saved

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is not None:
            entry[0] -= 1
            if entry[0] == 0:
                self._activations -= entry[1]
                del self._live[key]

    # -- the optimizer: gradients before its step, its state after
    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if any(id(p) not in self._params for p in params):
            self._params.update((id(p), p) for p in params)
            self._params_bytes = storage_bytes(self._params.values())
        self._grads_bytes = storage_bytes(p.grad for p in params)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._optimizers[id(optimizer)] = optimizer  # its state is measured when a record is made
        if self._counting and self._packed:  # a counted forward and backward ended: one step fewer to count
            self._packed = False
            self._steps_to_count -= 1
            if self._steps_to_count <= 0 and self._hooks_on_top():  # else the next record ends the count
                self._take_activations_figure()
                self._count_activations(on=False)

    def _take_activations_figure(self) -> None:
        """The peak counted since the last figure becomes the figure; the next peak starts from now."""
        self._activations_figure, self._activations_peak = self._activations_peak, self._activations
        self._packed = False

    def _optim_state_bytes(self) -> int:
        return sum(self._state_bytes(optimizer) for optimizer in self._optimizers.values())

    def held(self) -> int:
        """What a step starts with and keeps: the shards and the optimizer's state (a captured step's allocations
        come on top: ``Recorder.captured_peak``)."""
        return self._params_bytes + self._optim_state_bytes()

    def _state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        """Bytes of ``optimizer``'s state, counted again only when its layout changes (a parameter's first
        step, ``load_state_dict``'s new state): optimizers update their state in place, and
        counting ~150 storages for AdamW on 50 parameters took 70% of a record's time, which on a GPU sits
        between ``loss.item()`` and the next step's first kernel."""
        state = optimizer.state
        layout = (id(state), len(state))
        known = self._state_bytes_by_layout.get(id(optimizer))
        if known is None or known[0] != layout:
            tensors = (t for entries in state.values() for t in entries.values() if isinstance(t, torch.Tensor))
            known = self._state_bytes_by_layout[id(optimizer)] = (layout, storage_bytes(tensors))
        return known[1]

    # -- one record's figures
    def read(self) -> dict[str, int]:
        """This step's figures; peaks restart from here, and whether the next step's activations are counted
        is decided."""
        if self._counting:  # this step's activations were counted: a new figure
            self._take_activations_figure()
        grads = self._grads_bytes
        if grads is None:
            grads = storage_bytes(p.grad for p in self._params.values())
        figures = {
            "mem_params": self._params_bytes,
            "mem_grads": grads,
            "mem_optim": self._optim_state_bytes(),
            "mem_activations": self._activations_figure,
        }
        if self._device.type == "cuda":
            # one read of the allocator's statistics, unflattened: each of memory_allocated, memory_reserved
            # and max_memory_allocated flattens all of them (~160 Python calls) to return one number
            stats = torch.cuda.memory_stats_as_nested_dict(self._device)
            figures["cuda_allocated"] = stats["allocated_bytes"]["all"]["current"]
            figures["cuda_reserved"] = stats["reserved_bytes"]["all"]["current"]
            figures["cuda_max_allocated"] = stats["allocated_bytes"]["all"]["peak"]
            figures["mem_peak"] = figures["cuda_max_allocated"]
            torch.cuda.reset_peak_memory_stats(self._device)
        else:
            figures["mem_peak"] = figures["mem_params"] + figures["mem_optim"] + max(figures["mem_activations"], grads)
        self._grads_bytes = None
        self._reads += 1
        now = time.perf_counter()
        count = self._reads < COUNTED_FIRST_STEPS or now - self._counted_step_began >= ACTIVATIONS_EVERY_SECONDS
        self._count_activations(on=count)
        if count:
            self._counted_step_began = now
        return figures


#: How often a rank sends its new records to the notebook while a cell runs. The dashboard draws at most once
#: a second, so each drawing still finds new records; every batch costs the controller and the kernel CPU that
#: the ranks lack at four ranks on two cores (both together: 0.021 cores at 0.25 s, 0.015 at 0.5 s with the
#: kernel's look at the ranks at 10 Hz instead of 20).
PUBLISH_SECONDS = 0.5


class Recorder:
    """The records of one rank for one cell, streamed to the notebook as they are made.

    Each batch goes out with ipyparallel's ``datapub`` under its own key
    (``records0``, ``records1``, ...): the client merges published dicts by
    key, so no batch overwrites another. ``publish`` is None off the engines.
    ``control`` is given for a cell without a model, whose log calls are its
    step boundaries (a cell with models has ``control.StepBoundaries``).
    ``on_log`` hears each record's step once it is recorded (``--save-interval``
    saves there, on every rank together).
    """

    def __init__(
        self,
        rank: int,
        meter: MemoryMeter,
        publish: Callable[[dict], None] | None = None,
        control: RankControl | None = None,
        on_log: Callable[[int], None] | None = None,
    ) -> None:
        self.rank = rank
        self._on_log = on_log
        self.meter = meter
        self.records: list[dict[str, Any]] = []
        self._publish = publish
        self._control = control
        self._changed: list[str] = []
        self.fields: dict[str, Any] = {}
        """What every record carries besides the logged names and memory, read at the log call (a tensor as its
        value then): ``grad_scale`` where nbfsdp scales fp16 losses (``nbfsdp.engines.scaling``)."""
        self.on_step: Callable[[int], None] | None = None
        """Hears each record's step (a captured step of the timeline is named by it)."""
        self._unsent: list[dict[str, Any]] = []
        self._batches = 0
        self._sent_at = 0.0
        self._last = time.perf_counter()

    def changed(self, changes: list[str]) -> None:
        """Settings changed at a step boundary: the next record says so, and counts that step's activations."""
        self._changed += changes
        self.meter.count_next_step()

    def record(self, scalars: dict[str, Any]) -> None:
        """One step's record; in a cell without a model, then what the notebook asked for (a cancel)."""
        with record_function("nbfsdp::log"):  # its own lane of a captured step's timeline
            self._record(scalars)

    def _record(self, scalars: dict[str, Any]) -> None:
        now = time.perf_counter()
        step = scalars.pop("step", len(self.records))
        entry: dict[str, Any] = {"rank": self.rank, "step": int(step), "step_time": now - self._last}
        for name, value in {**self.fields, **scalars}.items():  # a name the cell logs wins
            entry[name] = value.item() if isinstance(value, torch.Tensor) else value
        entry.update(self.meter.read())
        if self._changed:  # in force for this record's step
            entry["changed"], self._changed = ", ".join(self._changed), []
        self.records.append(entry)
        self._unsent.append(entry)
        if self.on_step is not None:
            self.on_step(entry["step"])
        try:
            if self._on_log is not None:  # before a cancel: a save due at this step is still taken
                self._on_log(entry["step"])
            if self._control is not None:
                self._control.at_boundary(len(self.records) - 1)
        finally:  # a cancel raises here: its last record still goes out
            if now - self._sent_at >= PUBLISH_SECONDS or "changed" in entry:
                self.send()
            self._last = time.perf_counter()

    def captured_peak(self, step: int, peak: int) -> None:
        """A captured step's peak on the CPU, all its tensors counted (the step's allocations the profiler saw on
        top of what it began with: ``nbfsdp.engines.timeline``): that step's record says it, and its ``mem_peak``
        is at least it (the meter's categories leave out temporaries and gathered parameters). A record already
        sent keeps its figure in the notebook until the cell ends and the complete records come."""
        entry = next((e for e in reversed(self.records) if e["step"] == step), None)
        if entry is not None:
            entry["mem_captured_peak"] = peak
            entry["mem_peak"] = max(entry["mem_peak"], peak)

    def send(self) -> None:
        """Publish the records not sent yet."""
        if self._publish is None or not self._unsent:
            return
        self._publish({f"records{self._batches}": self._unsent})
        self._batches += 1
        self._unsent = []
        self._sent_at = time.perf_counter()


#: The recorder of the cell running on this engine; None elsewhere.
active_recorder: Recorder | None = None


def log(**scalars: Any) -> None:
    """Record this rank's scalars for a step (``step=`` names it), with its memory.

    Inside a ``%%fsdp`` cell the record joins ``nbfsdp.last_run().metrics``;
    anywhere else it does nothing, so a cell's code also runs unchanged alone.
    """
    if active_recorder is not None:
        active_recorder.record(scalars)
