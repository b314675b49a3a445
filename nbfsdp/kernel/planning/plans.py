"""What FSDP2 will do with a model, before it does it: ``%fsdp explain`` and ``nbfsdp.explain``.

Nothing runs on the engines. The plan uses the same rules as a real run
(``units.wrap_units`` and friends), and the memory it predicts counts what
FSDP2 allocates: each rank stores ``ceil(rows / shards)`` rows of every
parameter (shards are padded to equal size), gradients alike; AdamW keeps two
fp32 tensors the size of each rank's *unpadded* slice plus a 4-byte step.
Tests hold these predictions to 5% of ``FSDPMemTracker``'s measurement.

Communication is given twice: the size of the tensors each collective handles (what a
``TorchDispatchMode`` sees), and the bytes a rank sends and receives on the wire under the ring
algorithms NCCL uses for large messages (``ring_bytes``). Given each rank's host, the plan also says
which collectives' groups cross between hosts, and how many bytes a step sends over those links: the
slow ones, which ``HYBRID_SHARD`` keeps to the gradients' all-reduce. The plan's ``code`` is the plain
FSDP2 code the settings amount to (``fsdp_code``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from nbfsdp.kernel.cluster.world import planned_devices
from nbfsdp.kernel.planning import fitting, placement, predicted
from nbfsdp.kernel.planning.fitting import DeviceMemory
from nbfsdp.kernel.planning.fsdp_code import render
from nbfsdp.kernel.planning.peak import RecordingsSpent, TraceCache, rank_peaks
from nbfsdp.kernel.planning.placement import replicate_groups, shard_groups
from nbfsdp.kernel.planning.progress import ProgressLine
from nbfsdp.kernel.planning.workload import Workload, autocast_dtype
from nbfsdp.kernel.usage_errors import as_usage_errors
from nbfsdp.shared.collectives import ring_bytes, size_text
from nbfsdp.shared.config import ConfigError, FSDPConfig, resolve, validate
from nbfsdp.shared.devices import Devices
from nbfsdp.shared.units import activation_modules, dtype_splits, forward_order, ties_kept, wrap_rule, wrap_units


@dataclass(kw_only=True, slots=True)
class UnitPlan:
    """One FSDP unit: the parameters it gathers and frees together."""

    name: str
    """Qualified name; '' is the root."""
    cls: str
    params: int
    """Parameters this unit owns (not those of units inside it)."""
    full_bytes: int
    """Those parameters unsharded, in their own dtype."""
    sharded_bytes: int
    """Those parameters as one rank stores them (padded shard)."""
    frozen: int = 0
    """Of ``params``, those that do not train (``requires_grad`` False): no gradient, no optimizer state."""
    gathered_bytes: int = 0
    """Those parameters unsharded in the dtype they compute in (``param_dtype``, or each one's own as stored)."""
    recomputed: int = 0
    """Of ``params``, those inside a checkpointed module: backward computes their forward again."""


@dataclass(kw_only=True, slots=True)
class Plan:
    """The plan of one model at one world size, as data a notebook can plot."""

    world_size: int
    config: dict[str, Any]
    units: list[UnitPlan]
    devices: str = ""
    """Where the ranks run, in words: "4 ranks on 1 GPU (shared)", "2 ranks on the CPU (gloo)"."""
    """The root first, then in registration order, which forward prefetch follows (``units.forward_order``)."""
    wrap_rule: dict[str, Any]
    """What chose the units: the ``wrap_cls`` in force, their ``source`` (``_no_split_modules``...), in words;
    ``ties_kept``: the units a default rule left out to keep a tie whole (``units.ties_kept``); ``split_by_dtype``:
    the units split because their trainable parameters are stored in several dtypes (``units.dtype_splits``)."""
    checkpointed: list[str]
    dtypes: dict[str, str]
    """param_dtype, reduce_dtype, buffer_dtype."""
    forward_prefetch: list[tuple[str, str]]
    """(unit, unit it prefetches) pairs in forward."""
    backward_order: list[str]
    memory: list[dict[str, int]] = field(default_factory=list)
    """Per rank: predicted bytes of params, grads and optim (AdamW), and a lower bound of FSDP2's comm_buffers at
    their peak (``_comm_buffers_lower_bound``; with a batch, ``peak`` traces them)."""
    communication: dict[str, int] = field(default_factory=dict)
    """Tensor bytes per step per rank: all_gather (unsharded output), reduce_scatter (input), all_reduce."""
    wire: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per collective: ``tensor`` bytes (as ``communication``), ``group`` size, the bytes a rank
    ``sent`` and ``received`` per step under the ring algorithms, and the bytes all its groups send
    between hosts per step (``cross_host``, 0 on one host)."""
    code: str = ""
    """The plain FSDP2 code these settings amount to, to run on each rank."""
    mesh: tuple[int, int] = (1, 1)
    """(replicate, shard) degrees of the device mesh."""
    hosts: list[str] = field(default_factory=list)
    """Each rank's host; empty when every rank is on one host."""
    cross_host: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per collective: the bytes each host sends to other hosts per step under the ring algorithms (its
    groups' total is ``wire[kind]["cross_host"]``); empty on one host."""
    peak: list[dict[str, int]] = field(default_factory=list)
    """With a batch: per rank, its bytes at its peak in a training step, traced on the meta device
    (``nbfsdp.kernel.planning.peak``): ``params``, ``grads``, ``optim``, ``activations``, ``temporaries``,
    ``comm_buffers`` and their ``total``. Empty without a batch."""
    peak_at: str = ""
    """Where the peak falls: the unit, and forward, backward or the optimizer step."""
    batch: str = ""
    """The batch each rank traced with, in words."""
    tokens: int = 0
    """Tokens (rows, for a model of features) a rank computes per step: what recompute costs scale with."""
    device_memory: dict[str, Any] = field(default_factory=dict)
    """With a device: its ``name``, ``total`` bytes and the ``usable`` part (less the allocator's margin)."""
    fits: bool | None = None
    """Every rank's peak within the device's usable memory; None without a device or a batch."""
    suggestions: list[Plan] = field(default_factory=list)
    """With ``suggest``: plans of other settings that fit, cheapest first (``nbfsdp.kernel.planning.fitting``)."""
    change: str = ""
    """A suggestion's change against the settings asked for."""
    change_settings: dict[str, Any] = field(default_factory=dict)
    """The same change as fsdp_config keys (and ``world_size``, ``micro_batches``)."""
    cost_seconds: float = 0.0
    """A suggestion's added seconds per step (negative: saved), by ``nbfsdp.kernel.planning.fitting``'s cost model."""
    gpu_factor: float = 1.0
    """A suggestion's ranks against those asked for."""
    searched: bool = False
    """Suggestions were asked for (an empty list then means none fits)."""
    untried: int = 0
    """Changes the search left untried when its budget of recordings ran out (``StepTrace.cache``)."""
    traced: int = 0
    """With a batch: the step's recordings this plan and its search made (each a forward and backward on the
    meta device, of the whole model or of its stack cut short; settings the trace does not see replay one)."""

    def __str__(self) -> str:
        name = lambda n: n or "(root)"  # noqa: E731
        c = self.config
        lines = [
            f"FSDP plan at world size {self.world_size}, {self.devices}: {c['sharding_strategy']}, "
            f"mixed precision {c['mixed_precision']} (params {self.dtypes['param_dtype']}, "
            f"reduce {self.dtypes['reduce_dtype']}, buffers {self.dtypes['buffer_dtype']})",
            *(f"{key.replace('_', ' ')} {c[key]}: {why}" for key, why in c["why"].items()),
            f"{'unit':<24} {'class':<16} {'params':>12} {'sharded/rank':>14}",
        ]
        lines += [
            f"{name(u.name):<24} {u.cls:<16} {u.params:>12,} {size_text(u.sharded_bytes):>14}" for u in self.units
        ]
        counts = Counter(u.cls for u in self.units[1:])
        chosen = ", ".join(f"{cls} x {n}" for cls, n in counts.items()) or "the root alone"
        lines.append(f"units: {chosen}, {self.wrap_rule['rule']}")
        lines += [f"  {kept}" for kept in self.wrap_rule.get("ties_kept", [])]
        lines += [f"  {split}" for split in self.wrap_rule.get("split_by_dtype", [])]
        frozen = sum(u.frozen for u in self.units)
        if frozen:
            trained = sum(u.params for u in self.units) - frozen
            lines.append(
                f"frozen: {frozen:,} parameters (requires_grad False) have no gradient and no optimizer state; "
                f"{trained:,} train"
            )
        lines.append(f"activation checkpointing: {', '.join(map(name, self.checkpointed)) or 'none'}")
        lines.append(f"forward order (as registered): {' -> '.join(name(u.name) for u in self.units)}")
        prefetch = ", ".join(f"{name(a)} prefetches {name(b)}" for a, b in self.forward_prefetch) or "off"
        lines.append(f"forward prefetch: {prefetch}")
        lines.append(
            f"backward order: {' -> '.join(map(name, self.backward_order))}; backward prefetch {c['backward_prefetch']}"
        )
        for rank, m in enumerate(self.memory):
            lines.append(
                f"rank {rank} predicted: params {size_text(m['params'])}, grads {size_text(m['grads'])}, "
                f"optimizer (AdamW) {size_text(m['optim'])}, "
                f"comm buffers at peak at least {size_text(m['comm_buffers'])}"
            )
        comm = self.communication
        lines.append(
            f"per step per rank, tensors the collectives handle: all-gather {size_text(comm['all_gather'])}, "
            f"reduce-scatter {size_text(comm['reduce_scatter'])}, all-reduce {size_text(comm['all_reduce'])}"
        )
        wire = self.wire
        lines.append(
            "per step per rank, bytes sent (and as many received) under the ring algorithms, (g-1)/g of the "
            "tensor per all-gather or reduce-scatter and 2(g-1)/g per all-reduce in a group of g: "
            + ", ".join(f"{kind.replace('_', '-')} {size_text(w['sent'])}" for kind, w in wire.items())
            + f"; {size_text(sum(w['sent'] for w in wire.values()))} in all"
        )
        return "\n".join(lines + self.hosts_lines() + self.peak_lines())

    def peak_lines(self) -> list[str]:
        """Each rank's traced peak, the verdict for the device, and the suggestions; none without a batch."""
        if not self.peak:
            return []
        lines = [f"peak in a training step, traced on the meta device with {self.batch}:"]
        shown = self.peak if len({tuple(p.items()) for p in self.peak}) > 1 else self.peak[:1]
        for rank, p in enumerate(shown):
            who = f"rank {rank}" if len(shown) > 1 else "every rank"
            parts = ", ".join(f"{key.replace('_', ' ')} {size_text(p[key])}" for key in p if key != "total")
            lines.append(f"  {who}: {size_text(p['total'])} ({parts}), at {self.peak_at}")
        if self.device_memory:
            top = max(p["total"] for p in self.peak)
            usable = self.device_memory["usable"]
            verdict = "fits" if self.fits else "does not fit"
            total = self.device_memory["total"]
            nccl = self.device_memory.get("nccl", 0)
            rest = (
                ""
                if usable == total
                else f"; the rest is the CUDA context, {size_text(nccl)} of NCCL's buffers and the allocator's margin"
                if nccl
                else "; the rest is the CUDA context and the allocator's margin"
            )
            lines.append(
                f"on {self.device_memory['name']}: {verdict} ({size_text(top)} of {size_text(usable)} usable of "
                f"{size_text(total)}{rest})"
            )
        if self.suggestions:
            lines.append(
                "settings that fit, cheapest first (seconds a step adds, by the cost model of "
                "nbfsdp.kernel.planning.fitting):"
            )
            for s in self.suggestions:
                top = max(p["total"] for p in s.peak)
                cost = f"{s.cost_seconds * 1e3:+.1f} ms a step" + (
                    f", {s.gpu_factor:g}x the GPUs" if s.gpu_factor != 1 else ""
                )
                lines.append(f"  {s.change}: peak {size_text(top)}; {cost}")
        elif self.fits is False:
            lines.append(
                "no setting nbfsdp tries fits" if self.searched else "--suggest searches the settings that fit"
            )
        return lines

    def hosts_lines(self) -> list[str]:
        """The mesh over hosts and what each collective sends between them; none on one host."""
        if not self.hosts:
            return []
        ranks: dict[str, list[int]] = {}
        for rank, host in enumerate(self.hosts):
            ranks.setdefault(host, []).append(rank)
        replicas, shards = self.mesh
        dims = []
        for dim, degree, groups in (
            ("shard", shards, shard_groups(replicas, shards)),
            ("replicate", replicas, replicate_groups(replicas, shards)),
        ):
            if degree > 1:
                spans = frozenset(len({self.hosts[r] for r in group}) > 1 for group in groups)
                where = {frozenset([True]): "across hosts", frozenset([False]): "inside each host"}.get(
                    spans, "some across hosts"
                )
                listed = "; ".join(self._group_text(group) for group in groups)
                dims.append(f"{dim} groups {where} ({listed})")
        lines = [
            f"hosts: {', '.join(f'{host} (ranks {_ranges(rs)})' for host, rs in ranks.items())}",
            f"mesh (replicate {replicas}, shard {shards}): {', '.join(dims) or 'one rank'}",
            "between hosts per step, under the ring algorithms (each link of a ring that crosses hosts carries "
            "what one rank sends):",
        ]
        for kind, w in self.wire.items():
            if not w["tensor"] or w["group"] <= 1:
                where = "not run"
            elif not w["cross_host"]:
                where = "inside each host"
            else:
                out = ", ".join(f"{host} sends {size_text(n)}" for host, n in self.cross_host[kind].items() if n)
                where = f"crosses hosts: {w['cross_host']:,} bytes/step ({size_text(w['cross_host'])}; {out})"
            lines.append(f"  {kind.replace('_', '-')}: {where}")
        return lines

    def _group_text(self, group: list[int]) -> str:
        on = {self.hosts[rank] for rank in group}
        return f"{on.pop()}: ranks {_ranges(group)}" if len(on) == 1 else f"ranks {_ranges(group)}"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # noqa: FBT001 (IPython's pretty-printer protocol)
        printer.text(str(self))


def _shard_numel(shape: tuple[int, ...], shards: int, shard: int) -> tuple[int, int]:
    """(elements stored, elements owned) of a parameter of ``shape`` on shard ``shard``: stored shards are padded."""
    rows = shape[0] if shape else 1
    row_numel = math.prod(shape) // rows if rows else 0
    per_shard = -(-rows // shards)
    return per_shard * row_numel, max(0, min(per_shard, rows - shard * per_shard)) * row_numel


def _ranges(ranks: list[int]) -> str:
    """``0-1`` for consecutive ranks, ``0,2`` otherwise."""
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


@dataclass(frozen=True, kw_only=True)
class StepTrace:
    """The training step a plan traces each rank's peak in, and what that peak is held to: a device's memory,
    and with ``suggest`` the search for settings that fit. They travel together from ``plan`` into the plan of
    each suggestion (``_replan``: its micro-batches changed, no search of its own)."""

    workload: Workload
    memory: DeviceMemory | None = None
    """With it, ``Plan.fits``."""
    suggest: bool = False
    """With ``memory``, ``Plan.suggestions``: the settings that fit."""
    cache: TraceCache | None = None
    """Recordings to reuse, and a budget of them (a change that needs one more is left untried); None: a new one."""
    progress: ProgressLine | None = None
    """Says how far the search is."""


def plan(
    model: nn.Module,
    config: FSDPConfig,
    world_size: int,
    hosts: list[str] | None = None,
    devices: Devices | None = None,
    *,
    trace: StepTrace | None = None,
) -> Plan:
    """The plan of ``config`` (validated for ``devices``); ``hosts`` names each rank's host, to say which
    collectives cross between hosts. ``devices`` not given: those of ``config.device`` on this machine, or
    planned for GPUs it does not have. With a ``trace``, each rank's peak in its training step, traced
    (``peak``), and what ``StepTrace`` asks of it. A cell that trains ``model`` on no loader of its own predicts
    its peak with the trace's workload."""
    if trace is not None:
        predicted.remember(model, trace.workload)
    return _traced(model, config, world_size, hosts, devices, trace)


def _traced(
    model: nn.Module,
    config: FSDPConfig,
    world_size: int,
    hosts: list[str] | None,
    devices: Devices | None,
    trace: StepTrace | None,
) -> Plan:
    planned = _plan(model, config, world_size, hosts, devices)
    if trace is None:
        return planned
    cache = trace.cache or TraceCache()  # the suggestions' plans reuse its recordings
    peaks, inputs = rank_peaks(model, config, _devices_of(planned, devices, config), trace.workload, cache)
    planned.peak = [p.as_dict() for p in peaks]
    planned.peak_at = peaks[0].at
    planned.batch = inputs.described
    planned.tokens = inputs.tokens * trace.workload.micro_batches
    memory = trace.memory
    if memory is not None:
        if config.device == "cuda":
            memory = dataclasses.replace(
                memory, nccl_groups=fitting.nccl_groups(planned), network_groups=fitting.network_groups(planned)
            )
        planned.device_memory = {
            "name": memory.name,
            "total": memory.total,
            "usable": memory.usable,
            "nccl": memory.nccl_bytes,
        }
        planned.fits = fitting.fits(planned, memory)
    if trace.suggest and memory is not None:
        planned.searched = True
        progress = trace.progress
        asked = dataclasses.replace(trace, memory=memory, cache=cache)
        planned.suggestions, planned.untried = fitting.suggest(
            planned,
            functools.partial(_replan, model, config, world_size, hosts, asked),
            on_progress=progress.searched if progress is not None else None,
        )
        if progress is not None:
            progress.done()
    planned.traced = cache.traced
    return planned


def _devices_of(planned: Plan, devices: Devices | None, config: FSDPConfig) -> Devices:
    return devices if devices is not None else planned_devices(planned.world_size, config.device)


def _replan(
    model: nn.Module,
    config: FSDPConfig,
    world_size: int,
    hosts: list[str] | None,
    trace: StepTrace,
    change: fitting.Change,
) -> Plan | None:
    """The plan of ``change`` applied to ``config`` (None where the settings cannot be), traced as ``trace``
    asks but for a search of its own."""
    settings = dict(change.settings)
    size = settings.pop("world_size", world_size)
    micro = settings.pop("micro_batches", 1)
    changed = dataclasses.replace(config, **settings)
    devices = planned_devices(size, config.device)
    try:
        changed = validate(dataclasses.replace(changed, why={}), size, devices, quiet=True)
        work = dataclasses.replace(trace.workload, micro_batches=trace.workload.micro_batches * micro)
        traced = dataclasses.replace(trace, workload=work, suggest=False, progress=None)
        return _traced(model, changed, size, hosts if size == world_size else None, devices, traced)
    except ConfigError:
        return None
    except RecordingsSpent as spent:
        raise fitting.Untried(str(spent)) from spent


@dataclass(frozen=True, slots=True)
class _Units:
    """The model's FSDP units as the plan counts them: forward order, who owns each parameter."""

    ordered: list[nn.Module]
    names: dict[int, str]
    """Each module's name, by ``id``."""
    owned_by: dict[int, list[nn.Parameter]]
    """Each unit's own parameters, by the unit's ``id`` (the deepest unit takes a shared one)."""
    unique: list[nn.Parameter]
    trained: list[nn.Parameter]
    checkpointed: list[nn.Module]
    plans: list[UnitPlan]


def _units(model: nn.Module, config: FSDPConfig, shards: int) -> _Units:
    """The units ``config`` wraps, each with what it holds sharded and gathered."""
    units = wrap_units(model, config)
    ordered = forward_order(model, units)
    names = {id(m): n for n, m in model.named_modules()}
    owner: dict[int, nn.Module] = {}
    for unit in reversed(ordered):  # deepest units first claim their parameters
        for param in unit.parameters():
            owner.setdefault(id(param), unit)
    param_dtype = config.dtypes()[0]
    unique = list({id(p): p for p in model.parameters()}.values())
    checkpointed = activation_modules(model, units, config) if config.activation_checkpointing else []
    recomputed = {id(p) for module in checkpointed for p in module.parameters()}
    owned_by = {id(unit): [p for p in unique if owner[id(p)] is unit] for unit in ordered}
    plans = []
    for unit in ordered:
        own = owned_by[id(unit)]
        plans.append(
            UnitPlan(
                name=names[id(unit)],
                cls=type(unit).__name__,
                params=sum(p.numel() for p in own),
                full_bytes=sum(p.numel() * p.element_size() for p in own),
                sharded_bytes=sum(_shard_numel(tuple(p.shape), shards, 0)[0] * p.element_size() for p in own),
                frozen=sum(p.numel() for p in own if not p.requires_grad),
                gathered_bytes=sum(p.numel() * _size(param_dtype or p.dtype) for p in own),  # as it computes
                recomputed=sum(p.numel() for p in own if id(p) in recomputed),
            )
        )
    trained = [p for p in unique if p.requires_grad]
    return _Units(ordered, names, owned_by, unique, trained, checkpointed, plans)


def _memory(units: _Units, world_size: int, shards: int, strategy: str) -> list[dict[str, int]]:
    """Per rank: its shards' bytes, its sharded gradients', AdamW's state's, and a lower bound of FSDP2's
    communication buffers at their peak."""
    comm_buffers = _comm_buffers_lower_bound(units.plans, strategy, shards)
    # parameters of one shape counted together: a stack of layers is a handful of shapes, and ranks ask per shard
    shapes = Counter((tuple(p.shape), p.element_size(), p.requires_grad) for p in units.unique)
    by_shard = []
    for shard in range(min(shards, world_size)):
        stored = grads = owned = 0
        for (shape, size, trained), count in shapes.items():
            kept, own = _shard_numel(shape, shards, shard)
            stored += count * kept * size
            if trained:  # a frozen parameter has no gradient and no optimizer state
                grads, owned = grads + count * kept * size, owned + count * own
        by_shard.append(
            {
                "params": stored,
                "grads": grads,
                "optim": 2 * 4 * owned + 4 * len(units.trained),  # AdamW: exp_avg, exp_avg_sq in fp32, an fp32 step
                "comm_buffers": comm_buffers,
            }
        )
    return [dict(by_shard[rank % shards]) for rank in range(world_size)]


def _communication(model: nn.Module, units: _Units, config: FSDPConfig, mesh: tuple[int, int]) -> dict[str, int]:
    """Bytes of the tensors each kind of collective handles in a step: every unit gathered for forward and
    again for backward (the root and SHARD_GRAD_OP's once), each trained gradient reduced."""
    replicas, shards = mesh
    param_dtype, reduce_dtype, _ = config.dtypes()
    reduced = lambda p: _size(reduce_dtype or param_dtype or p.dtype)  # noqa: E731
    once = config.sharding_strategy == "SHARD_GRAD_OP"
    gathered = sum(
        plan.gathered_bytes * (1 if unit is model or once else 2)
        for plan, unit in zip(units.plans, units.ordered, strict=True)
    )
    reduced_bytes = sum(
        p.numel() * reduced(p) for unit in units.ordered for p in units.owned_by[id(unit)] if p.requires_grad
    )
    return {
        "all_gather": 0 if shards == 1 else gathered,
        "reduce_scatter": 0 if shards == 1 else reduced_bytes,
        "all_reduce": 0
        if replicas == 1
        else sum(_shard_numel(tuple(p.shape), shards, 0)[0] * reduced(p) for p in units.trained),
    }


def _wire(
    communication: dict[str, int],
    mesh: tuple[int, int],
    hosts: list[str] | None,
    post_forward: tuple[int, int] | None = None,
) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """What each collective puts on the wire under the ring algorithms, and (over several hosts) what crosses
    between them, by kind. ``post_forward``: ``reshard_after_forward`` N and the bytes backward gathers, inside
    groups of N ranks."""
    replicas, shards = mesh
    groups = {"all_gather": shards, "reduce_scatter": shards, "all_reduce": replicas}
    wire = {
        kind: {
            "tensor": nbytes,
            "group": groups[kind],
            "sent": ring_bytes(kind, nbytes, groups[kind]),
            "received": ring_bytes(kind, nbytes, groups[kind]),
            "cross_host": 0,
        }
        for kind, nbytes in communication.items()
    }
    if post_forward is not None and communication["all_gather"]:
        group, backward = post_forward
        inside = ring_bytes("all_gather", backward, group)
        sent = ring_bytes("all_gather", communication["all_gather"] - backward, shards) + inside
        wire["all_gather"].update(sent=sent, received=sent, post_forward_group=group, post_forward_sent=inside)
    several = hosts is not None and len(set(hosts)) > 1
    cross_host = placement.cross_host(wire, mesh, hosts) if hosts is not None and several else {}
    for kind, out in cross_host.items():
        wire[kind]["cross_host"] = sum(out.values())
    return wire, cross_host


def _plan(
    model: nn.Module,
    config: FSDPConfig,
    world_size: int,
    hosts: list[str] | None = None,
    devices: Devices | None = None,
) -> Plan:
    """The plan without a step: units, dtypes, the state's memory, communication, the code."""
    if devices is None:
        devices = planned_devices(world_size, config.device)
    if hosts is not None and len(hosts) != world_size:
        raise ConfigError(f"hosts: {len(hosts)} given for world size {world_size}; one per rank")
    mesh = config.mesh_shape(world_size)
    param_dtype, reduce_dtype, buffer_dtype = config.dtypes()
    units = _units(model, config, mesh[1])
    names, ordered = units.names, units.ordered
    communication = _communication(model, units, config, mesh)
    wire, cross_host = _wire(communication, mesh, hosts, _post_forward(model, units, config))
    forward_prefetch = (
        [(names[id(a)], names[id(b)]) for a, b in zip(ordered[1:], ordered[2:], strict=False)]
        if config.forward_prefetch
        else []
    )
    return Plan(
        world_size=world_size,
        config=config.as_dict(),
        units=units.plans,
        wrap_rule={
            **wrap_rule(model, config).as_dict(),
            **({"ties_kept": kept} if (kept := ties_kept(model, config)) else {}),
            **({"split_by_dtype": split} if (split := dtype_splits(model, config)) else {}),
        },
        checkpointed=[names[id(m)] for m in units.checkpointed],
        dtypes={
            "param_dtype": _dtype_name(param_dtype, units.unique),
            "reduce_dtype": _dtype_name(reduce_dtype or param_dtype, units.trained),
            "buffer_dtype": _dtype_name(buffer_dtype, list(model.buffers())),
        },
        forward_prefetch=forward_prefetch,
        backward_order=[names[id(u)] for u in reversed(ordered)],
        memory=_memory(units, world_size, mesh[1], config.sharding_strategy),
        communication=communication,
        wire=wire,
        code=render(model, config, world_size, devices),
        devices=str(devices),
        mesh=mesh,
        hosts=list(hosts) if hosts is not None and len(set(hosts)) > 1 else [],
        cross_host=cross_host,
    )


def _post_forward(model: nn.Module, units: _Units, config: FSDPConfig) -> tuple[int, int] | None:
    """``reshard_after_forward`` N: N, and the bytes backward gathers again inside each group of N (every unit's
    but the root's); None otherwise."""
    if not config.reshard_after_forward:
        return None
    backward = sum(
        plan.gathered_bytes for plan, unit in zip(units.plans, units.ordered, strict=True) if unit is not model
    )
    return config.reshard_after_forward, backward


def _comm_buffers_lower_bound(units: list[UnitPlan], strategy: str, shards: int) -> int:
    """FSDP2's buffers without a step to trace: what must be alive together at the end of some unit's backward,
    a lower bound of their peak (a traced step, ``Plan.peak``, says what is). FULL_SHARD and HSDP: the root
    (gathered from forward into backward), the unit and its unsharded gradients, in the dtype it computes in;
    SHARD_GRAD_OP: every unit, still gathered after forward, and the gradients of the unit backward starts with
    (the last); NO_SHARD: nothing to gather, its gradients all-reduced where they are."""
    if shards == 1:
        return 0
    root, rest = units[0], units[1:] or units[:1]
    grads = lambda u: u.gathered_bytes * (u.params - u.frozen) // max(1, u.params)  # noqa: E731
    if strategy == "SHARD_GRAD_OP":
        return sum(u.gathered_bytes for u in units) + grads(units[-1])
    return max((root.gathered_bytes if u is not root else 0) + u.gathered_bytes + grads(u) for u in rest)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _dtype_name(dtype: torch.dtype | None, tensors: Sequence[torch.Tensor]) -> str:
    """``dtype``'s name; for None (as stored), the dtype the model stores ``tensors`` in, or each of its dtypes."""
    if dtype is not None:
        return str(dtype).removeprefix("torch.")
    stored = sorted({str(t.dtype).removeprefix("torch.") for t in tensors if t.is_floating_point()})
    if len(stored) == 1:
        return stored[0]
    return f"as stored ({' and '.join(stored)})" if stored else "as stored"


@as_usage_errors
def explain(  # noqa: PLR0913 (public API: nbfsdp.explain's keywords are %fsdp explain's flags)
    model: nn.Module,
    world_size: int = 2,
    hosts: list[str] | None = None,
    *,
    batch: Any = None,
    loss: Callable[..., torch.Tensor] | None = None,
    per_rank_batches: bool = False,
    autocast: str | torch.dtype | None = None,
    gpu: str | None = None,
    device_memory: str | int | None = None,
    suggest: bool = False,
    **settings: Any,
) -> Plan:
    """The plan FSDP2 would follow for ``model``; ``settings`` are ``fsdp_config`` keys (``device="cuda"``
    plans for GPUs, from a kernel without one too), ``hosts`` each rank's host (to see which collectives
    cross between hosts).

    With ``batch`` (one step's global batch, as one process would feed it: a tensor, a tuple, a dict of
    tensors, a DataLoader, or meta tensors for shapes alone; each rank plans with its 1/N share, or the
    whole of it with ``per_rank_batches``), ``Plan.peak`` holds each rank's peak in a training step,
    traced on the meta device. The loss is the output's ``loss`` (Hugging Face's), else ``loss(output,
    *target)``, else the output's sum; ``autocast`` (``"bf16"``) runs forward and loss under
    ``torch.autocast``, as a loop that uses it on top of FSDP2's mixed precision does. With ``gpu`` (a
    name, loosely: ``"H100"``) or ``device_memory`` (``"80GiB"``), ``Plan.fits`` says whether that fits;
    with ``suggest``, ``Plan.suggestions`` the settings that do, cheapest first.

    >>> nbfsdp.explain(model, world_size=4, sharding_strategy="SHARD_GRAD_OP", wrap_cls="Block")
    >>> nbfsdp.explain(model, world_size=4, device="cuda")  # bf16 compute, fp32 reduction: Composer's DEFAULT
    >>> nbfsdp.explain(model, world_size=4, hosts=["a", "a", "b", "b"], sharding_strategy="HYBRID_SHARD", replicas=2)
    >>> ids = torch.empty(16, 4096, dtype=torch.long, device="meta")
    >>> nbfsdp.explain(llama, world_size=8, device="cuda", batch={"input_ids": ids, "labels": ids}, gpu="H100")
    """
    config = resolve(settings, {})
    devices = planned_devices(world_size, config.device)
    if batch is None and (loss is not None or per_rank_batches or autocast is not None):
        raise ConfigError("loss, per_rank_batches and autocast go with batch: the step they describe")
    workload = None if batch is None else Workload(batch, loss, per_rank_batches, autocast=autocast_dtype(autocast))
    memory = fitting.device_memory(gpu, device_memory)
    if memory is not None and memory.capability is not None and devices.type == "cuda" and devices.planned:
        devices = dataclasses.replace(devices, capability=memory.capability)  # a T4's plan computes in fp16
    validated = validate(config, world_size, devices, quiet=True)
    if workload is None:
        return plan(model, validated, world_size, hosts, devices)
    progress = ProgressLine("nbfsdp: --suggest") if suggest and memory is not None else None
    trace = StepTrace(workload=workload, memory=memory, suggest=suggest, progress=progress)
    return plan(model, validated, world_size, hosts, devices, trace=trace)
