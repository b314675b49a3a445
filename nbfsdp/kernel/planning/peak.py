"""Each rank's peak memory in one training step, traced before anything runs: ``Plan.peak`` of ``%fsdp explain``.

The step runs for real, on the **meta device**: a copy of the model with no storage (``transfer``'s skeleton)
computes forward, backward and the optimizer's step on each rank's share of the batch, so every tensor an
operator makes has its true shape and dtype and costs nothing. A dispatch mode counts the bytes of the
storages operators make while they live (activations, temporaries, the unsharded gradients autograd
accumulates), and a ledger driven by hooks on the FSDP units adds what FSDP2 allocates around them, as
FSDP2 does it:

- each rank's padded shards of the parameters (their own dtype) and AdamW's state (two fp32 tensors the
  size of its unpadded shard, after the first step);
- a unit's parameters unsharded in ``param_dtype`` from its pre-forward to its post-forward (FULL_SHARD;
  the root and, under SHARD_GRAD_OP, every unit stay gathered into backward), and again from its
  pre-backward to its post-backward, the next unit's with them where prefetch gathers it early; the
  all-gather's output buffer (``param_dtype``, padded, the whole group's) while a gather is waited on;
- after a unit's backward: its unsharded gradients (``param_dtype``, from autograd), the reduce-scatter's
  input (``reduce_dtype``, padded) beside them while they are copied in, then the sharded gradient (its
  own dtype), kept to ``zero_grad``. On a GPU a unit's reduce-scatter input stays until the next unit's
  is issued (FSDP2's stream): one more unit's worth.

The model computes in ``param_dtype`` (FSDP2 casts the gathered parameters and the root's floating
inputs), so activations come out in it. Scaled dot-product attention runs the kernel the device would:
flash attention (no ``s x s`` scores kept) on a GPU in bf16 or fp16, memory-efficient attention in fp32
there, and on the CPU the kernel PyTorch picks for those shapes. The second training step is the one
measured (the optimizer's state exists by then); the optimizer's own step runs on shard-sized meta
tensors, foreach on a GPU as PyTorch's default is there, so its temporaries are counted too.

This module is the ledger and the step; the dispatch counter is ``live_bytes``, attention as the device
runs it ``attention``, autocast on the meta device ``meta_autocast``, and the rank's share of the batch
``workload``.

Runs in the notebook's kernel; allocates nothing but Python objects (a 70B model's step traces in seconds).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from nbfsdp.kernel.planning.attention import device_attention
from nbfsdp.kernel.planning.live_bytes import LiveBytes, paused
from nbfsdp.kernel.planning.meta_autocast import meta_autocast
from nbfsdp.kernel.planning.workload import StepInputs, Workload, loss_of_step, step_inputs
from nbfsdp.shared import transfer
from nbfsdp.shared.config import FSDPConfig
from nbfsdp.shared.devices import Devices
from nbfsdp.shared.torch_private import tree_flatten, tree_map
from nbfsdp.shared.units import activation_modules, forward_order, wrap_units

#: ``Plan.peak``'s categories, in the order they are shown.
CATEGORIES = ("params", "grads", "optim", "activations", "temporaries", "comm_buffers")


@dataclass(kw_only=True, slots=True)
class Peak:
    """One rank's bytes at its peak, by category, and where in the step the peak fell."""

    params: int
    grads: int
    optim: int
    activations: int
    temporaries: int
    comm_buffers: int
    at: str
    """``unit, phase``: the unit computing (or being gathered, or reduced) and forward, backward or the
    optimizer step."""

    @property
    def total(self) -> int:
        return sum(getattr(self, key) for key in CATEGORIES)

    def as_dict(self) -> dict[str, int]:
        return {**{key: getattr(self, key) for key in CATEGORIES}, "total": self.total}


def _padded(param: torch.Tensor, shards: int) -> int:
    """Elements of one rank's padded shard of ``param`` (FSDP2 pads every rank's shard to one size)."""
    rows = param.shape[0] if param.dim() else 1
    return -(-rows // shards) * (param.numel() // rows if rows else 0)


def _owned(param: torch.Tensor, shards: int, shard: int) -> int:
    """Elements rank ``shard`` owns of ``param``, unpadded (AdamW's state is this size)."""
    rows = param.shape[0] if param.dim() else 1
    per = -(-rows // shards)
    return max(0, min(per, rows - shard * per)) * (param.numel() // rows if rows else 0)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(eq=False)
class _Unit:
    """One FSDP unit as the ledger sees it: its own parameters and what FSDP2 allocates for them."""

    module: nn.Module
    name: str
    params: list[nn.Parameter]
    shard: int
    """Bytes of this rank's padded shards, in the parameters' own dtype (always held)."""
    unsharded: int
    """Bytes of the parameters gathered, in ``param_dtype``."""
    unsharded_each: list[int]
    """The same, parameter by parameter, in the order FSDP2 allocates them as it copies a gather out."""
    all_gather: int
    """The all-gather's output: every rank's padded shard, in ``param_dtype``."""
    reduce_scatter: int
    """The reduce-scatter's input: every rank's padded shard of the gradients, in ``reduce_dtype``."""
    reshard_after_forward: bool
    gathered: bool = False
    pending: int = 0
    """A prefetched gather's output buffer, until the unit's own pre-forward waits on it."""
    reduced: int = 0
    """Parameters whose gradient autograd has accumulated in this backward."""


class _Step:
    """One training step of one rank, traced on the meta device; ``peak`` is its peak, by category."""

    def __init__(
        self, model: nn.Module, config: FSDPConfig, shards: int, devices: Devices, autocast: torch.dtype | None = None
    ) -> None:
        """``autocast``: the step's forward and loss run under ``torch.autocast`` to this dtype."""
        self.config, self.shards, self.on_gpu = config, shards, devices.type == "cuda"
        self.autocast, self.device = autocast, devices.type
        self.param_dtype, self.reduce_dtype, buffer_dtype = config.dtypes()
        self.model = model
        units = wrap_units(model, config)
        ordered = forward_order(model, units)
        names = {id(m): n for n, m in model.named_modules()}
        owner: dict[int, nn.Module] = {}
        for unit in reversed(ordered):  # the deepest unit takes a parameter first
            for param in unit.parameters():
                owner.setdefault(id(param), unit)
        unique = list({id(p): p for p in model.parameters()}.values())
        self.units = [
            self._unit(u, names[id(u)], [p for p in unique if owner[id(p)] is u], u is model) for u in ordered
        ]
        self.params = sum(u.shard for u in self.units)
        self.optim = 0
        self.buffers = sum(
            b.numel() * _size(buffer_dtype if b.is_floating_point() and buffer_dtype is not None else b.dtype)
            for b in model.buffers()
        )
        for module in activation_modules(model, units, config):
            _checkpoint(module, autocast, devices.type)
        with torch.no_grad():  # the model computes in param_dtype: FSDP2 casts what it gathers (None: as stored)
            for param in unique:
                if param.is_floating_point() and self.param_dtype is not None:
                    param.data = param.data.to(self.param_dtype)
        # the ledger, in bytes: what FSDP2 holds besides the shards and the optimizer's state
        self.grads = 0
        self.accumulating = False
        self.gathered = 0
        self.in_flight = 0
        self.deferred = 0
        self.pending_reduce = 0
        self.phase, self.where = "forward", ""
        self.best: Peak | None = None
        self.limit: int | None = None
        """Where set: ``crossed`` is the step's first moment past this many bytes (``crossing``)."""
        self.crossed: Peak | None = None
        self.live = LiveBytes(self._check)
        self.live.hold([*unique, *model.buffers()])

    def _reduce_dtype(self, param: nn.Parameter) -> torch.dtype:
        """What ``param``'s gradient is reduced in: the policy's, else the dtype it is computed in."""
        return self.reduce_dtype or self.param_dtype or param.dtype

    def _unit(self, module: nn.Module, name: str, params: list[nn.Parameter], root: bool) -> _Unit:
        strategy = self.config.sharding_strategy
        return _Unit(
            module=module,
            name=name or "(root)",
            params=params,
            shard=sum(_padded(p, self.shards) * p.element_size() for p in params),
            unsharded=sum(p.numel() * _size(self.param_dtype or p.dtype) for p in params),
            unsharded_each=[p.numel() * _size(self.param_dtype or p.dtype) for p in params],
            all_gather=sum(_padded(p, self.shards) * _size(self.param_dtype or p.dtype) for p in params) * self.shards
            if self.shards > 1
            else 0,
            reduce_scatter=sum(
                _padded(p, self.shards) * _size(self._reduce_dtype(p)) for p in params if p.requires_grad
            )
            * self.shards
            if self.shards > 1
            else 0,
            # FSDP2 keeps the root gathered into backward, which needs it at once; SHARD_GRAD_OP keeps every unit
            reshard_after_forward=strategy != "SHARD_GRAD_OP" and not root,
        )

    # -- the peak
    def _check(self, where: str | None = None) -> None:
        split = self.live.split()
        comm = self.gathered + self.in_flight + self.deferred + self.pending_reduce + split["grads"]
        peak = Peak(
            params=self.params + self.buffers,
            grads=self.grads,
            optim=self.optim,
            activations=split["activations"],
            temporaries=split["temporaries"],
            comm_buffers=comm,
            at=where or f"{self.where}, {self.phase}",
        )
        if self.best is None or peak.total > self.best.total:
            self.best = peak
        if self.limit is not None and self.crossed is None and peak.total > self.limit:
            self.crossed = peak

    # -- FSDP2's gathers and reductions
    def _gather(self, unit: _Unit, prefetched: bool = False) -> None:
        """All-gather ``unit``: its output buffer and the unsharded parameters copied out of it, both at once
        until the copy is done (a prefetched unit's buffer waits for its own pre-hook). In forward FSDP2 keeps
        the output until the next unit's copy-out is over (to overlap that copy with the next all-gather; its
        ``wait_for_unshard`` holds the previous one in a local until it returns), or the root's post-forward."""
        if unit.gathered:
            return
        unit.gathered = True
        where = f"{unit.name}, all-gather in {self.phase}"
        self.in_flight += unit.all_gather
        if self.limit is None:
            self.gathered += unit.unsharded
        else:  # where the limit is passed: the output, then each parameter's storage as the copy-out makes it
            self._check(where)
            for size in unit.unsharded_each:
                self.gathered += size
                self._check(where)
        self._check(where)
        if not prefetched:
            self.in_flight -= unit.all_gather
            if self.phase == "forward":
                self.deferred = unit.all_gather  # the previous one is freed

    def _waited(self, unit: _Unit) -> None:
        """A prefetched unit's gather is waited on where it runs: its output buffer goes."""
        self.in_flight -= unit.pending
        unit.pending = 0

    def _reshard(self, unit: _Unit) -> None:
        if unit.gathered:
            unit.gathered = False
            self.gathered -= unit.unsharded

    def _reduce(self, unit: _Unit) -> None:
        """After a unit's backward: its gradients cast and copied into the reduce-scatter's input, the
        unsharded ones freed, the shard kept; the input stays until the next unit's reduction."""
        self.in_flight += unit.reduce_scatter
        self._check(f"{unit.name}, reduce-scatter in backward")
        for param in unit.params:
            param.grad = None
        if not self.accumulating:  # accumulating, the reduced shard adds into the one held
            self.grads += unit.shard
        self.in_flight -= unit.reduce_scatter
        # FSDP2 keeps the input (its reduce_scatter_state) until the next unit's reduction is issued, on the
        # CPU too; on a GPU that is also how long the collective may run on its own stream
        self.pending_reduce = unit.reduce_scatter
        self._reshard(unit)
        self._check(f"{unit.name}, after its reduce-scatter")

    def _next(self, unit: _Unit, order: list[_Unit]) -> _Unit | None:
        position = order.index(unit)
        return order[position + 1] if position + 1 < len(order) else None

    # -- hooks
    def _hooks(self) -> Iterator[Any]:
        # FSDP2 prefetches in backward by the reverse of the order the units' forwards *ended* in (a unit
        # holding others ends after them): recorded as the forward runs
        ended: list[_Unit] = []
        prefetch_forward = self.config.forward_prefetch
        prefetch_backward = self.config.effective_backward_prefetch != "NONE"
        for unit in self.units:
            module = unit.module

            def pre_forward(module, args, kwargs, unit=unit):
                self.where = unit.name
                if self.phase == "backward":  # a checkpointed unit recomputing (gathered for its backward)
                    self.live.kind = "activations"  # what it makes now is what its backward reads
                    return None
                self._waited(unit)
                self._gather(unit)
                following = self._next(unit, self.units)
                if prefetch_forward and following is not None and following is not self.units[0]:
                    self._gather(following, prefetched=True)
                    following.pending = following.all_gather
                if unit is self.units[0] and self.param_dtype is not None:  # FSDP2's root casts floating inputs
                    cast = lambda t: t.to(self.param_dtype) if torch.is_floating_point(t) else t  # noqa: E731
                    return tree_map(lambda v: cast(v) if isinstance(v, torch.Tensor) else v, (args, kwargs))
                return None

            def post_forward(module, args, kwargs, output, unit=unit):
                if self.phase == "backward":
                    self.live.kind = "temporaries"
                    return None
                ended.append(unit)
                if unit is self.units[0]:  # the root's post-forward frees the last unit's all-gather output
                    self.deferred = 0
                if unit.reshard_after_forward:
                    self._reshard(unit)
                tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, lambda grads, unit=unit: pre_backward(unit), mode="any"
                    )
                return None

            def pre_backward(unit: _Unit) -> None:
                self.phase, self.where = "backward", unit.name
                self._gather(unit)
                following = self._next(unit, ended[::-1]) if unit in ended else None
                if prefetch_backward and following is not None and following.params:
                    self._gather(following)

            def accumulated(param: torch.Tensor, unit=unit) -> None:
                assert param.grad is not None  # autograd has just accumulated it
                self.live.reclassify(param.grad, "grads")
                unit.reduced += 1
                if unit.reduced == len(unit.params):
                    unit.reduced = 0
                    self.where = unit.name
                    self.live.kind = "temporaries"  # a recompute that stopped early leaves it set
                    if self.pending_reduce:  # this unit's reduction is issued: the one before it is done
                        self.pending_reduce = 0
                    self._reduce(unit)

            yield module.register_forward_pre_hook(pre_forward, with_kwargs=True)
            yield module.register_forward_hook(post_forward, with_kwargs=True)
            for param in unit.params:
                if param.requires_grad:
                    yield param.register_post_accumulate_grad_hook(accumulated)
            unit.params = [p for p in unit.params if p.requires_grad]

    # -- the step
    def run(
        self,
        args: tuple,
        kwargs: dict,
        loss_of: Callable[[Any], torch.Tensor],
        micro_batches: int = 1,
        first_step: bool = False,
    ) -> Peak:
        """The second step's forward and backward (the optimizer's state exists; with ``first_step`` not yet),
        then the optimizer's step. With ``micro_batches``, its last micro-batch: the sharded gradients of the
        ones before it are held (each micro-batch reduces its gradients, FSDP2's default) and each unit's adds
        into its own."""
        self.optim = 0 if first_step else self._optimizer_state()
        self.accumulating = micro_batches > 1
        if self.accumulating:
            self.grads = sum(u.shard for u in self.units if u.params)
        handles = list(self._hooks())
        try:
            with self.live, device_attention(self.on_gpu, self.autocast):
                for tensor in tree_flatten((args, kwargs))[0]:
                    if isinstance(tensor, torch.Tensor):
                        self.live.count(tensor, "activations")
                self.phase = "forward"
                with meta_autocast(self.autocast, self.device):
                    output = self.model(*args, **kwargs)
                    loss = loss_of(output)
                del output
                self.live.kind = "temporaries"
                loss.backward()
                del loss
                self.pending_reduce = 0
                self._optimizer_step()
        finally:
            for handle in handles:
                handle.remove()
        assert self.best is not None  # the optimizer's step checked the peak
        return self.best

    def _optimizer_state(self) -> int:
        """AdamW's state on this rank: exp_avg and exp_avg_sq in fp32, the size of its unpadded shard, and
        a step counter per parameter (rank 0's share: the largest)."""
        params = [p for u in self.units for p in u.params if p.requires_grad]
        return sum(2 * 4 * _owned(p, self.shards, 0) + 4 for p in params)

    def _optimizer_step(self) -> None:
        """AdamW's step on shard-sized tensors (foreach on a GPU, as PyTorch picks there): its temporaries."""
        self.phase, self.where, self.live.kind = "optimizer step", "(all units)", "temporaries"
        with paused(self.live):  # the shards, their gradients and the state are the ledger's already
            shards = []
            for unit in self.units:
                for param in unit.params:
                    rows = param.shape[0] if param.dim() else 1
                    shape = (-(-rows // self.shards), *param.shape[1:]) if param.dim() else ()
                    shard = torch.empty(shape, device="meta", dtype=torch.float32, requires_grad=True)
                    shard.grad = torch.empty_like(shard)
                    shards.append(shard)
            optimizer = torch.optim.AdamW(shards, lr=1e-3, foreach=self.on_gpu)
            optimizer.step()  # the first step makes the state
        state = [t for per_param in optimizer.state.values() for t in per_param.values() if isinstance(t, torch.Tensor)]
        self.live.hold([*shards, *(s.grad for s in shards if s.grad is not None), *state])  # every grad is set
        optimizer.step()
        self._check()


def _checkpoint(module: nn.Module, autocast: torch.dtype | None, device: str) -> None:
    """Activation checkpointing as the ranks apply it; under autocast its recomputation casts as the forward
    did (``torch.utils.checkpoint`` restores autocast's state for it), in autograd's thread."""
    from nbfsdp.shared.torch_private import checkpoint

    if autocast is None:
        checkpoint(module)
    else:
        checkpoint(module, context_fn=lambda: (contextlib.nullcontext(), meta_autocast(autocast, device)))


def rank_peaks(
    model: nn.Module, config: FSDPConfig, world_size: int, devices: Devices, workload: Workload
) -> tuple[list[Peak], StepInputs]:
    """Each rank's peak in a training step of ``model`` on ``workload`` under ``config`` (validated),
    traced on the meta device; the rank's inputs it traced with (one micro-batch of them)."""
    _, shards = config.mesh_shape(world_size)
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
    loss = workload.loss
    meta = transfer.meta_copy(model)  # the trace changes the modules it runs (hooks, dtypes)
    step = _Step(meta, config, shards, devices, workload.autocast)
    traced = step.run(inputs.args, inputs.kwargs, loss_of_step(loss, inputs.target), workload.micro_batches)
    trained = [p for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad]
    peaks = []
    for rank in range(world_size):
        optim = sum(2 * 4 * _owned(p, shards, rank % shards) + 4 for p in trained)
        peaks.append(dataclasses.replace(traced, optim=optim))
    if config.cpu_offload and devices.type == "cuda":  # shards, grads and optimizer state live in host memory
        peaks = [dataclasses.replace(p, params=step.buffers, grads=0, optim=0) for p in peaks]
    return peaks, inputs


def crossing(
    model: nn.Module,
    config: FSDPConfig,
    world_size: int,
    devices: Devices,
    workload: Workload,
    limit: int,
    first_step: bool,
) -> Peak | None:
    """The first moment of a training step at which rank 0's bytes pass ``limit``, by category, and where in
    the step it falls (None: the step stays within it): what the planner says of a rank that ran out of
    memory there. ``first_step``: the optimizer's state does not exist yet."""
    _, shards = config.mesh_shape(world_size)
    parts = 1 if workload.per_rank_batches else world_size
    inputs = step_inputs(workload.batch, parts * workload.micro_batches, per_rank_batches=False)
    step = _Step(transfer.meta_copy(model), config, shards, devices, workload.autocast)
    step.limit = limit
    step.run(inputs.args, inputs.kwargs, loss_of_step(workload.loss, inputs.target), workload.micro_batches, first_step)
    return step.crossed
