"""Each rank's peak memory in one training step, traced before anything runs: ``Plan.peak`` of ``%fsdp explain``.

The step runs for real, on the **meta device**: a copy of the model with no storage computes forward and
backward on each rank's share of the batch, so every tensor an operator makes has its true shape and dtype and
costs nothing (``recording``: a dispatch counter of the live bytes, hooks on the FSDP units). What FSDP2
allocates around the units is then replayed from that recording (``ledger``), and AdamW's step on shard-sized
tensors added. The model computes in ``param_dtype`` (FSDP2 casts the gathered parameters and the root's
floating inputs), so activations come out in it. Scaled dot-product attention runs the kernel the device would:
flash attention (no ``s x s`` scores kept) on a GPU in bf16 or fp16, memory-efficient attention in fp32 there,
and on the CPU the kernel PyTorch picks for those shapes. The second training step is the one measured (the
optimizer's state exists by then); the optimizer's own step runs on shard-sized meta tensors, foreach on a GPU
as PyTorch's default is there, so its temporaries are counted too.

What makes it fast enough for ``--suggest``: a ``TraceCache`` keeps each recording for the settings that leave
it unchanged (sharding, strategy, prefetch, the reduce dtype, CPU offload: a replay each), and the optimizer's
step by its shards; a deep stack of identical layers is recorded cut to a few layers and stretched to its depth
(``stretch``), checked against a third cut before it is trusted.

Runs in the notebook's kernel; allocates nothing but Python objects.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from nbfsdp.kernel.planning import stretch
from nbfsdp.kernel.planning.ledger import CATEGORIES, Ledger, Peak, element_size, ledger_units, optimizer_state
from nbfsdp.kernel.planning.recording import Recorder, Recording, Split, optimizer_events, optimizer_peak, ref_by_name
from nbfsdp.kernel.planning.workload import StepInputs, Workload, loss_of_step, step_inputs
from nbfsdp.shared import transfer
from nbfsdp.shared.config import FSDPConfig
from nbfsdp.shared.devices import Devices
from nbfsdp.shared.torch_private import tree_flatten
from nbfsdp.shared.units import activation_modules, wrap_key, wrap_units

__all__ = ["CATEGORIES", "Failure", "Peak", "RecordingsSpent", "TraceCache", "crossing", "rank_peaks"]


class RecordingsSpent(Exception):
    """A ``TraceCache``'s budget of recordings is spent: a plan that needs another is not made."""


class TraceCache:
    """Recordings of one model's step, kept while one plan and the plans of its suggestions are made: by what
    the recording depends on (the units, what is checkpointed, the compute dtype, autocast, the device, the
    rank's inputs), and AdamW's step by its shards. A new plan of the model makes a new cache (its weights'
    shapes may have changed since)."""

    def __init__(self, *, cut_stacks: bool = True, most: int | None = None) -> None:
        """``cut_stacks``: a deep stack of identical layers may be recorded cut and stretched (False: every layer
        is traced). ``most``: at most this many recordings, then ``RecordingsSpent`` (a budget that does not
        depend on the machine's speed, as a search in seconds would)."""
        self.cut_stacks, self.most = cut_stacks, most
        self._recordings: dict[tuple, tuple[Recording, Any]] = {}
        self._units: dict[tuple, tuple[list[nn.Module], list[nn.Module], stretch.Stack | None]] = {}
        self._optimizer: dict[tuple, Split] = {}
        self.traced = 0
        """Recordings made (each a trace of forward and backward, whole or cut)."""
        self.stretched = 0
        """Recordings stretched from cut ones."""

    def units(self, model: nn.Module, config: FSDPConfig) -> tuple[list[nn.Module], list[nn.Module], Any]:
        """``model``'s units, its checkpointed modules, and how recordings name units (``recording.Ref``)."""
        key = (id(model), wrap_key(config))
        if key not in self._units:
            units = wrap_units(model, config)
            stack = stretch.find_stack(model, config)
            self._units[key] = units, activation_modules(model, units, config), stack
        units, checkpointed, stack = self._units[key]
        return units, checkpointed, stack

    def recording(
        self, model: nn.Module, config: FSDPConfig, devices: Devices, workload: Workload, inputs: StepInputs
    ) -> tuple[Recording, Any]:
        """The step's forward and backward, and how it names units."""
        units, checkpointed, stack = self.units(model, config)
        ref = ref_by_name(stack.path if stack else None)
        names = {id(m): n for n, m in model.named_modules()}
        key = (
            tuple(names[id(u)] for u in units),
            tuple(names[id(m)] for m in checkpointed),
            config.dtypes()[0],
            workload.autocast,
            devices.type,
            _shapes(inputs),
        )
        if key not in self._recordings:
            if self.most is not None and len(self._recordings) >= self.most:
                raise RecordingsSpent(f"{self.most} recordings made")
            self._recordings[key] = self._record(model, config, devices, workload, inputs, stack), ref
        return self._recordings[key]

    def _record(
        self,
        model: nn.Module,
        config: FSDPConfig,
        devices: Devices,
        workload: Workload,
        inputs: StepInputs,
        stack: stretch.Stack | None,
    ) -> Recording:
        ref = ref_by_name(stack.path if stack else None)

        def record(copy: nn.Module) -> Recording:
            self.traced += 1
            recorder = Recorder(copy, config, devices, workload.autocast, ref)
            return recorder.run(inputs.args, inputs.kwargs, loss_of_step(workload.loss, inputs.target))

        cuts = stack.cuts() if stack is not None and self.cut_stacks else None
        if stack is not None and cuts is not None:
            try:
                whole = stretch.stretched([record(stretch.cut(model, stack, layers)) for layers in cuts], stack)
            except Exception:  # a model whose forward needs all its layers: traced whole below
                whole = None
            if whole is not None:
                self.stretched += 1
                return whole
        return record(transfer.meta_copy(model))  # the trace changes the modules it runs (hooks, dtypes)

    def optimizer(self, others: list[Shape], layers: list[list[Shape]], *, foreach: bool) -> Split:
        """AdamW's temporaries at their largest, on shards of ``others`` and of each layer's ``layers``: where the
        layers are alike, stepped on one, two and three of them and extrapolated (AdamW's work is per tensor, and
        what it keeps alive adds up over tensors: checked to grow by the same bytes each layer)."""
        key = (tuple(others), tuple(map(tuple, layers)), foreach)
        if key not in self._optimizer:
            if len(layers) > 3 and all(layer == layers[0] for layer in layers):
                peaks = [optimizer_peak([*others, *layers[0] * copies], foreach=foreach) for copies in (1, 2, 3)]
                step = tuple(b - a for a, b in zip(peaks[0], peaks[1], strict=True))
                if tuple(b - a for a, b in zip(peaks[1], peaks[2], strict=True)) == step:
                    more = len(layers) - 1
                    self._optimizer[key] = tuple(a + more * d for a, d in zip(peaks[0], step, strict=True))  # type: ignore[assignment]
            if key not in self._optimizer:
                self._optimizer[key] = optimizer_peak(
                    [*others, *(s for layer in layers for s in layer)], foreach=foreach
                )
        return self._optimizer[key]


#: A shard's shape.
Shape = tuple[int, ...]


def _shapes(inputs: StepInputs) -> tuple:
    leaves = tree_flatten((inputs.args, inputs.kwargs, inputs.target))[0]
    return tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t) for t in leaves)


def _step(
    model: nn.Module,
    config: FSDPConfig,
    devices: Devices,
    workload: Workload,
    *,
    cache: TraceCache,
    failure: Failure | None = None,
) -> tuple[Ledger, StepInputs]:
    """Rank 0's step replayed under ``config`` on ``devices``: its ledger, whose ``best`` is the peak (with a
    ``failure``, whose ``crossed`` is where it passes the limit), and the rank's inputs it replayed."""
    _, shards = config.mesh_shape(devices.world_size)
    inputs = _inputs(workload, devices.world_size)
    recording, ref = cache.recording(model, config, devices, workload, inputs)
    units = ledger_units(model, config, shards, ref, cache.units(model, config)[0])
    buffer_dtype = config.dtypes()[2]
    buffers = sum(
        b.numel() * element_size(buffer_dtype if b.is_floating_point() and buffer_dtype is not None else b.dtype)
        for b in model.buffers()
    )
    trained = [p for unit in units.values() for p in unit.trained]
    optim = 0 if failure is not None and failure.first_step else optimizer_state(trained, shards)[0]
    ledger = Ledger(
        units,
        config,
        fixed=sum(u.shard for u in units.values()) + buffers,
        optim=optim,
        accumulating=workload.micro_batches > 1,
        limit=failure.limit if failure is not None else None,
    )
    others: list[Shape] = []
    layers: dict[int, list[Shape]] = {}
    for (layer, _), unit in units.items():
        shapes = [(-(-p.shape[0] // shards), *p.shape[1:]) if p.dim() else () for p in unit.trained]
        others.extend(shapes) if layer < 0 else layers.setdefault(layer, []).extend(shapes)
    temporaries = cache.optimizer(others, [layers[j] for j in sorted(layers)], foreach=devices.type == "cuda")
    ledger.replay([*recording.events, *optimizer_events(temporaries, recording.end)])
    return ledger, inputs


def _inputs(workload: Workload, world_size: int) -> StepInputs:
    """One micro-batch of rank 0's share of the step's batch, described as a rank's share."""
    parts = 1 if workload.per_rank_batches else world_size
    inputs = step_inputs(workload.batch, parts * workload.micro_batches, per_rank_batches=False)
    if workload.per_rank_batches or workload.micro_batches > 1:
        split = f" ({'each rank' if workload.per_rank_batches else f'the global batch / {world_size}'}"
        inputs = dataclasses.replace(
            inputs,
            described=inputs.described.split(" a rank")[0]
            + (" a micro-batch" if workload.micro_batches > 1 else " a rank")
            + (f"{split}, in {workload.micro_batches} micro-batches)" if workload.micro_batches > 1 else f"{split})"),
        )
    return inputs


def rank_peaks(
    model: nn.Module,
    config: FSDPConfig,
    devices: Devices,
    workload: Workload,
    cache: TraceCache | None = None,
) -> tuple[list[Peak], StepInputs]:
    """Each rank's peak in a training step of ``model`` on ``workload`` under ``config`` (validated), on each of
    ``devices``' ranks, traced on the meta device; the rank's inputs it traced with (one micro-batch of them).
    ``cache``: the recordings of earlier plans of the same model to reuse."""
    _, shards = config.mesh_shape(devices.world_size)
    ledger, inputs = _step(model, config, devices, workload, cache=cache or TraceCache())
    traced = ledger.best
    assert traced is not None
    trained = [p for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad]
    optim = optimizer_state(trained, shards)
    peaks = [dataclasses.replace(traced, optim=optim[rank % shards]) for rank in range(devices.world_size)]
    if config.cpu_offload and devices.type == "cuda":  # shards, grads and optimizer state live in host memory
        peaks = [
            dataclasses.replace(p, params=ledger.fixed - sum(u.shard for u in ledger.order), grads=0, optim=0)
            for p in peaks
        ]
    return peaks, inputs


@dataclass(frozen=True, kw_only=True)
class Failure:
    """Where a rank ran out of memory, as ``crossing`` replays it: the two come from the failed rank's report
    together, and only the out-of-memory report asks for them."""

    limit: int
    """The rank's bytes it could not pass."""
    first_step: bool
    """It failed in the first step: the optimizer's state does not exist yet."""


def crossing(
    model: nn.Module,
    config: FSDPConfig,
    devices: Devices,
    workload: Workload,
    failure: Failure,
    *,
    cache: TraceCache | None = None,
) -> Peak | None:
    """The first moment of a training step at which rank 0's bytes pass ``failure.limit``, by category, and
    where in the step it falls (None: the step stays within it): what the planner says of a rank that ran out of
    memory there."""
    ledger, _ = _step(model, config, devices, workload, cache=cache or TraceCache(), failure=failure)
    return ledger.crossed
