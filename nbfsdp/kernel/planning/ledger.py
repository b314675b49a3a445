"""What FSDP2 allocates around its units during a recorded step (``recording``), replayed under one set of
settings: the planner's ledger. Runs in the notebook's kernel.

FSDP2's allocations, as it makes them:

- each rank's padded shards of the parameters (their own dtype) and AdamW's state (two fp32 tensors the
  size of its unpadded shard, after the first step);
- a unit's parameters unsharded in ``param_dtype`` from its pre-forward to its post-forward (FULL_SHARD;
  the root and, under SHARD_GRAD_OP, every unit stay gathered into backward), and again from its
  pre-backward to its post-backward, the next unit's with them where prefetch gathers it early; the
  all-gather's output buffer (``param_dtype``, padded, the whole group's) while a gather is waited on;
- after a unit's backward: its unsharded gradients (``param_dtype``, from autograd, the recording's), the
  reduce-scatter's input (``reduce_dtype``, padded) beside them while they are copied in, then the sharded
  gradient (its own dtype), kept to ``zero_grad``. On a GPU a unit's reduce-scatter input stays until the next
  unit's is issued (FSDP2's stream): one more unit's worth.

The peak is the largest sum of these and the recording's live bytes at any moment of the step.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from nbfsdp.kernel.planning.recording import Event, Ref, Split
from nbfsdp.shared.config import FSDPConfig
from nbfsdp.shared.units import forward_order

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


def padded(param: torch.Tensor, shards: int) -> int:
    """Elements of one rank's padded shard of ``param`` (FSDP2 pads every rank's shard to one size)."""
    rows = param.shape[0] if param.dim() else 1
    return -(-rows // shards) * (param.numel() // rows if rows else 0)


def owned(shape: tuple[int, ...], shards: int, shard: int) -> int:
    """Elements shard ``shard`` owns of a parameter of ``shape``, unpadded (AdamW's state is this size)."""
    rows = shape[0] if shape else 1
    per = -(-rows // shards)
    return max(0, min(per, rows - shard * per)) * (math.prod(shape) // rows if rows else 0)


def optimizer_state(params: list[nn.Parameter], shards: int) -> list[int]:
    """Bytes of AdamW's state (exp_avg and exp_avg_sq in fp32, a step counter each) for ``params`` on each shard.
    Parameters of one shape are counted together: a stack of 80 layers is a handful of shapes, and a plan of 256
    ranks asks for every shard."""
    shapes = Counter(tuple(p.shape) for p in params)
    return [
        sum(count * (2 * 4 * owned(shape, shards, shard) + 4) for shape, count in shapes.items())
        for shard in range(shards)
    ]


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(eq=False)
class Unit:
    """One FSDP unit as the ledger sees it: its own parameters and what FSDP2 allocates for them."""

    name: str
    trained: list[nn.Parameter]
    """Its parameters that have gradients."""
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
    post_forward: int = 0
    """``reshard_after_forward`` N: the bytes kept from the gather after forward (its output's 1/N, copied), until
    backward gathers from them."""
    gathered: bool = False
    holds_post_forward: bool = False
    pending: int = 0
    """A prefetched gather's output buffer, until the unit's own pre-forward waits on it."""


def ledger_units(
    model: nn.Module, config: FSDPConfig, shards: int, ref: Callable[[str], Ref], units: list[nn.Module]
) -> dict[Ref, Unit]:
    """``model``'s FSDP ``units`` (``wrap_units``) under ``config`` on ``shards`` shards, in forward order, by
    ``Ref``."""
    param_dtype, reduce_dtype, _ = config.dtypes()
    ordered = forward_order(model, units)
    names = {id(m): n for n, m in model.named_modules()}
    owner: dict[int, nn.Module] = {}
    for unit in reversed(ordered):  # the deepest unit takes a parameter first
        for param in unit.parameters():
            owner.setdefault(id(param), unit)
    unique = list({id(p): p for p in model.parameters()}.values())
    made: dict[Ref, Unit] = {}
    for module in ordered:
        params = [p for p in unique if owner[id(p)] is module]
        in_param = [element_size(param_dtype or p.dtype) for p in params]
        reduced = [element_size(reduce_dtype or param_dtype or p.dtype) for p in params]
        made[ref(names[id(module)])] = Unit(
            name=names[id(module)] or "(root)",
            trained=[p for p in params if p.requires_grad],
            shard=sum(padded(p, shards) * p.element_size() for p in params),
            unsharded=sum(p.numel() * size for p, size in zip(params, in_param, strict=True)),
            unsharded_each=[p.numel() * size for p, size in zip(params, in_param, strict=True)],
            all_gather=sum(padded(p, shards) * s for p, s in zip(params, in_param, strict=True)) * shards
            if shards > 1
            else 0,
            reduce_scatter=sum(padded(p, shards) * s for p, s in zip(params, reduced, strict=True) if p.requires_grad)
            * shards
            if shards > 1
            else 0,
            # FSDP2 keeps the root gathered into backward, which needs it at once; SHARD_GRAD_OP keeps every unit
            reshard_after_forward=config.sharding_strategy != "SHARD_GRAD_OP" and module is not model,
        )
        if config.reshard_after_forward and module is not model:
            made[ref(names[id(module)])].post_forward = (
                made[ref(names[id(module)])].all_gather // config.reshard_after_forward
            )
    return made


class Ledger:
    """One rank's step under one set of settings, replayed from a recording; ``best`` is its peak."""

    def __init__(
        self,
        units: dict[Ref, Unit],
        config: FSDPConfig,
        *,
        fixed: int,
        optim: int,
        accumulating: bool,
        limit: int | None = None,
    ) -> None:
        """``config``: validated, its ``device`` the one chosen; ``fixed``: the shards and buffers, always held;
        ``optim``: AdamW's state; ``accumulating``: a micro-batch after the first, whose sharded gradients add into
        those held; ``limit``: ``crossed`` is the first moment past it, found allocation by allocation."""
        self.units, self.order = units, list(units.values())
        self.fixed, self.optim, self.accumulating, self.limit = fixed, optim, accumulating, limit
        self.prefetch_forward = config.forward_prefetch
        self.prefetch_backward = config.effective_backward_prefetch != "NONE"
        # FSDP2 keeps a forward gather's output past its copy-out only when it gathered synchronously: CPU ranks
        # gather asynchronously, as nbfsdp has them (engines/sharding.py: ``torch_private.set_unshard_async_op``)
        self.defer_forward_output = config.device != "cpu"
        self.grads = sum(u.shard for u in self.order if u.trained) if accumulating else 0
        self.gathered = self.in_flight = self.deferred = self.pending_reduce = self.post_forward = 0
        self.split: Split = (0, 0, 0)
        self.phase, self.where = "forward", ""
        self.ended: list[Unit] = []
        self.best: Peak | None = None
        self.crossed: Peak | None = None

    def replay(self, events: list[Event]) -> Peak:
        for event in events:
            getattr(self, f"_{event[0]}")(*event[1:])
        assert self.best is not None  # the optimizer's step checked the peak
        return self.best

    # -- the peak
    def _check(self, where: str | None = None) -> None:
        activations, temporaries, grads = self.split
        peak = Peak(
            params=self.fixed,
            grads=self.grads,
            optim=self.optim,
            activations=activations,
            temporaries=temporaries,
            comm_buffers=self.gathered
            + self.in_flight
            + self.deferred
            + self.pending_reduce
            + self.post_forward
            + grads,
            at=where or f"{self.where}, {self.phase}",
        )
        if self.best is None or peak.total > self.best.total:
            self.best = peak
        if self.limit is not None and self.crossed is None and peak.total > self.limit:
            self.crossed = peak

    # -- the recording's events
    def _live(self, activations: int, temporaries: int, grads: int) -> None:
        self.split = activations, temporaries, grads
        self._check()

    def _where(self, ref: Ref) -> None:
        self.where = self.units[ref].name if ref in self.units else ref[1]

    def _phase(self, phase: str) -> None:
        self.phase = phase

    def _pre_forward(self, ref: Ref, split: Split) -> None:
        self.split, unit = split, self.units[ref]
        self.where = unit.name
        self.in_flight -= unit.pending  # a prefetched gather is waited on: its output buffer goes
        unit.pending = 0
        self._gather(unit)
        position = self.order.index(unit)
        following = self.order[position + 1] if position + 1 < len(self.order) else None
        if self.prefetch_forward and following is not None and following is not self.order[0]:
            self._gather(following, prefetched=True)
            following.pending = following.all_gather

    def _post_forward(self, ref: Ref) -> None:
        unit = self.units[ref]
        self.ended.append(unit)
        if unit is self.order[0]:  # the root's post-forward frees the last unit's all-gather output
            self.deferred = 0
        if unit.reshard_after_forward:
            if unit.post_forward and unit.gathered:  # its group's slice copied out of the gather, then freed
                unit.holds_post_forward = True
                self.post_forward += unit.post_forward
                self._check(f"{unit.name}, resharded to its group after forward")
            self._reshard(unit)

    def _pre_backward(self, ref: Ref, split: Split) -> None:
        # FSDP2 prefetches in backward by the reverse of the order the units' forwards *ended* in (a unit
        # holding others ends after them)
        self.split, unit = split, self.units[ref]
        self.phase, self.where = "backward", unit.name
        self._gather(unit)
        backward = self.ended[::-1]
        position = backward.index(unit) if unit in backward else -1
        following = backward[position + 1] if 0 <= position < len(backward) - 1 else None
        if self.prefetch_backward and following is not None and following.trained:
            self._gather(following)

    def _reduce(self, ref: Ref, before: Split, after: Split) -> None:
        """After a unit's backward: its gradients cast and copied into the reduce-scatter's input, the
        unsharded ones freed, the shard kept; the input stays until the next unit's reduction."""
        unit = self.units[ref]
        self.where = unit.name
        self.pending_reduce = 0  # this unit's reduction is issued: the one before it is done
        self.split = before
        self.in_flight += unit.reduce_scatter
        self._check(f"{unit.name}, reduce-scatter in backward")
        if not self.accumulating:  # accumulating, the reduced shard adds into the one held
            self.grads += unit.shard
        self.in_flight -= unit.reduce_scatter
        # FSDP2 keeps the input (its reduce_scatter_state) until the next unit's reduction is issued, on the
        # CPU too; on a GPU that is also how long the collective may run on its own stream
        self.pending_reduce = unit.reduce_scatter
        self._reshard(unit)
        self.split = after
        self._check(f"{unit.name}, after its reduce-scatter")

    def _backward_done(self) -> None:
        self.pending_reduce = 0

    # -- FSDP2's gathers
    def _gather(self, unit: Unit, *, prefetched: bool = False) -> None:
        """All-gather ``unit``: its output buffer and the unsharded parameters copied out of it, both at once
        until the copy is done (a prefetched unit's buffer waits for its own pre-hook). In forward FSDP2 keeps
        the output until the next unit's copy-out is over (to overlap that copy with the next all-gather; its
        ``wait_for_unshard`` holds the previous one in a local until it returns), or the root's post-forward, when it
        gathered synchronously (GPU ranks)."""
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
        if unit.holds_post_forward:  # gathered from the group's slice, which goes once copied out
            unit.holds_post_forward = False
            self.post_forward -= unit.post_forward
        if not prefetched:
            self.in_flight -= unit.all_gather
            if self.phase == "forward" and self.defer_forward_output:
                self.deferred = unit.all_gather  # the previous one is freed

    def _reshard(self, unit: Unit) -> None:
        if unit.gathered:
            unit.gathered = False
            self.gathered -= unit.unsharded
