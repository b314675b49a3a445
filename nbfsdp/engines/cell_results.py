"""A finished cell's results on this rank: what goes back to the notebook, and every unit sharded again. Runs on
the ranks, after ``engine`` ran the cell's code.

Back go the names the cell assigned (pickled by rank 0, a model's own parameters as references to the notebook's),
the trained state of the notebook's optimizers and schedulers, and of each model what changed: the tensors some
rank holds otherwise than the notebook has them (one small all-reduce agrees on which), whole, by rank 0; of a
model as its route says (``ModelRoute.returns``, decided by the kernel): what changed, all of it where
``nbfsdp.gather`` asked, or of a LoRA model living on the ranks its trained adapters.
"""

from __future__ import annotations

from typing import Any, assert_never, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from nbfsdp.engines import loaders, writes
from nbfsdp.engines.sharding import ShardedModel
from nbfsdp.engines.world import World
from nbfsdp.shared import optimizers, transfer
from nbfsdp.shared.protocol import CellOutcome, CellSpec, GatherModel, Returns


def outcome(
    world: World,
    spec: CellSpec,
    result: CellOutcome,
    *,
    read: dict[str, Any],
    split_loaders: dict[str, loaders.SplitLoader],
) -> CellOutcome:
    """``result``, the cell's outcome on this rank as its run left it (its records, captures, whether it was
    cancelled), completed with what goes back (rank 0's), every unit of its models resharded."""
    for name in spec.models:  # see _reshard_all
        _reshard_all(world.models[name][1])
    result.settings = {name: world.models[name][1].config for name in spec.models}
    _names_back(world, spec, read, result)
    states, written = _models_back(world, spec)
    if world.rank == 0:
        result.written = written
        result.loaders = {name: split.state() for name, split in split_loaders.items()}
        result.states = states
    return result


def _models_back(world: World, spec: CellSpec) -> tuple[dict[str, dict[str, torch.Tensor]], list[str]]:
    """What of each model goes back (rank 0's; the others' empty), and which models some rank wrote to. The models
    that may come back, and those living on the ranks (whose changes the kernel records), are watched; none under
    --no-gather otherwise, so such a cell ends with no collective of nbfsdp's own."""
    models = {name: sharded.module for name, (_, sharded) in world.models.items()}
    watched = [name for name, route in spec.models.items() if route.watched]
    changed = _changed_on_any_rank(world, watched, models)
    written = [name for name in watched if any(changed[name])]
    states: dict[str, dict[str, torch.Tensor]] = {}
    for name, route in spec.models.items():
        match route.returns:
            case Returns.ALL:  # nbfsdp.gather: the notebook has only the skeleton, so all goes, written or not
                assert isinstance(spec.request, GatherModel)
                states[name] = _full_state(models[name], spec.request)
            case Returns.CHANGED if name in written:
                whole = all(changed[name])
                states[name] = _full_state(models[name], None) if whole else _changed_state(models[name], changed[name])
            case Returns.ADAPTERS if name in written:  # a LoRA model living on the ranks: not its frozen base
                trained = [a and b for a, b in zip(changed[name], _trainable(models[name]), strict=True)]
                states[name] = _changed_state(models[name], trained)
            case Returns.CHANGED | Returns.ADAPTERS | Returns.NOTHING:
                continue
            case unknown:
                assert_never(unknown)
        world.in_notebook[name] = writes.written(models[name])  # a later cell sends it back only if changed again
    return states, written


def _names_back(world: World, spec: CellSpec, read: dict[str, Any], outcome: CellOutcome) -> None:
    """What rank 0 sends back besides the models, into ``outcome``: the names the cell assigned, pickled,
    and the trained state of the notebook's own optimizers and schedulers (to load in place), with why any
    name stays.

    What the notebook has its own copy of travels as a reference to it (``transfer.model_references``):
    a parameter of a cell's model comes back as the notebook model's own. Another sharded tensor comes
    back whole; an optimizer's sharded state too, gathered like the weights. Both are collectives:
    every rank walks the same names in the same order.
    """
    gather = spec.gathers
    cell_models = {name: world.models[name][1].module for name in spec.models}
    references = transfer.model_references(cell_models) if gather else {}
    sharded = {id(model.module) for _, model in world.models.values()}
    assigned = {name: world.namespace[name] for name in spec.assigned if name in world.namespace}
    # optimizers first: the notebook loads them before a scheduler that refers to one
    assigned = {
        name: value
        for name, value in sorted(assigned.items(), key=lambda item: not isinstance(item[1], Optimizer))
        if id(value) not in sharded
    }
    stateful = {n: v for n, v in read.items() if gather and isinstance(v, optimizers.STATEFUL) and n not in assigned}
    made = {name: v for name, v in assigned.items() if isinstance(v, optimizers.STATEFUL)} if gather else {}
    whole: dict[int, torch.Tensor] = {}
    for value in [*stateful.values(), *made.values()]:
        if isinstance(value, Optimizer):
            whole.update(optimizers.gather_state(value))
    for name, value in assigned.items():
        if isinstance(value, DTensor) and id(value) not in references:
            assigned[name] = value.full_tensor()
    if world.rank != 0:
        return
    references.update((key, ("whole", tensor)) for key, tensor in whole.items())
    references.update((id(value), ("object", name)) for name, value in stateful.items())
    made_ids = {id(value): ("object", name) for name, value in made.items()}  # a scheduler finds its optimizer
    for name, value in assigned.items():
        others = {key: ref for key, ref in made_ids.items() if key != id(value)}
        try:
            outcome.names[name] = transfer.pickle_result(value, {**references, **others})
        except transfer.HoldsDTensor:
            outcome.skipped[name] = "holds sharded tensors (DTensor)"
        except Exception as error:
            outcome.skipped[name] = f"{type(error).__name__}: {str(error)[:80]}"
    outcome.in_place = {name: optimizers.portable_state_dict(value, whole) for name, value in stateful.items()}


def _reshard_all(sharded: ShardedModel) -> None:
    """Every unit sharded again at the cell's end. FSDP2 leaves the root (and any unit under SHARD_GRAD_OP)
    unsharded after a forward until the next backward: after a cell that only ran a forward (an evaluation
    under ``no_grad``), the next cell's ``model.parameters()`` would give those units' whole plain tensors,
    which an optimizer built there would step without the model ever seeing it."""
    for unit in sharded.units:
        unit.reshard()


def _full_state(model: nn.Module, request: GatherModel | None) -> dict[str, torch.Tensor]:
    """The model's full state dict on the CPU (rank 0's; the others' are empty), in the dtype ``nbfsdp.gather``
    asked for."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))  # full: plain tensors
    if request is None or request.dtype is None:
        return state
    dtype = getattr(torch, request.dtype)
    return {key: value.to(dtype) if value.is_floating_point() else value for key, value in state.items()}


def _changed_on_any_rank(world: World, names: list[str], models: dict[str, nn.Module]) -> dict[str, list[bool]]:
    """Of each model named, which tensors (``writes.written``'s order) some rank holds otherwise than the notebook
    has them (``World.in_notebook``): only those are gathered back (a LoRA cell's adapters, not its frozen base),
    and every rank must agree, the gather being a collective; of a model that lives on the ranks, what a world that
    ends would lose. One small all-reduce; none when the cell reads no model."""
    flags: dict[str, list[bool]] = {}
    for name in names:
        now, before = writes.written(models[name]), world.in_notebook.get(name)
        same = before is not None and len(before) == len(now)
        flags[name] = [not same or old != new for old, new in zip(before or now, now, strict=True)]
    if not names:
        return flags
    together = torch.tensor([flag for name in names for flag in flags[name]], dtype=torch.int32, device=world.device)
    dist.all_reduce(together, op=dist.ReduceOp.MAX)
    agreed, start = together.tolist(), 0
    for name in names:
        flags[name], start = [bool(flag) for flag in agreed[start : start + len(flags[name])]], start + len(flags[name])
    return flags


def _trainable(model: nn.Module) -> list[bool]:
    """Which of ``model``'s tensors (``writes.written``'s order) are trainable parameters: a LoRA model's
    adapters."""
    return [isinstance(t, nn.Parameter) and t.requires_grad for t in [*model.parameters(), *model.buffers()]]


def _changed_state(model: nn.Module, changed: list[bool]) -> dict[str, torch.Tensor]:
    """The tensors of ``model`` flagged ``changed`` (``writes.written``'s order), whole, on the CPU, by every name
    they have (rank 0's; each sharded one made whole by a collective, in the same order on every rank)."""
    tensors = [*model.parameters(), *model.buffers()]
    wanted = {id(tensor) for tensor, flag in zip(tensors, changed, strict=True) if flag}
    whole: dict[int, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) not in wanted:
            continue
        if id(value) not in whole:
            full = value.full_tensor() if isinstance(value, DTensor) else value
            whole[id(value)] = full.detach().cpu()
        state[key] = whole[id(value)]
    return state if dist.get_rank() == 0 else {}
