"""Optimizers and LR schedulers between the notebook and the ranks, both ways.

An optimizer the cell reads from the notebook arrives on each rank pointing at
the sharded parameters already (its parameters travel as references to them,
``nbfsdp.shared.transfer``), but with its state as the notebook left it: whole
tensors beside sharded parameters, which the first ``step`` refuses ("mixed
torch.Tensor and DTensor"). ``shard_state`` (engines) gives each state tensor
its parameter's placement, as Composer's ``sync_optimizer_and_model_params``
and Accelerate's parameter switch re-point an optimizer built before sharding,
but keeping the state instead of clearing it. A scheduler travels in the same
pickle as its optimizer, so it stays bound to it.

After the cell, ``gather_state`` (engines, a collective) makes every sharded
state tensor whole on rank 0, as the model's weights are; the notebook then
loads it into its own optimizer in place (``load_state_dict``) or rebuilds an
optimizer the cell created around the notebook's own parameters
(``nbfsdp.shared.transfer.load_result``).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from nbfsdp.shared import torch_private
from nbfsdp.shared.torch_private import (
    is_step_tracked,
    local_tensor,
    mark_optimizer_stepped,
    mark_step_tracked,
    shard_whole_tensor,
)

#: What the notebook brings back in place: optimizers and LR schedulers (ReduceLROnPlateau is no LRScheduler).
STATEFUL = (Optimizer, LRScheduler, ReduceLROnPlateau)


def shard_state(optimizer: Optimizer) -> None:
    """On a rank: each whole state tensor of a sharded parameter becomes this rank's shard of it.

    Every rank received the whole tensor, so each takes its own part without
    communicating (``torch_private.shard_whole_tensor``), padded as FSDP2 pads its shards.
    """
    for param, state in optimizer.state.items():
        if not isinstance(param, DTensor):
            continue
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == param.shape:
                local = value.to(local_tensor(param).device)
                state[key] = shard_whole_tensor(local, param.device_mesh, param.placements)


def fingerprint(value: Any) -> tuple:
    """Changes whenever the notebook's optimizer or scheduler changes: its state tensors (replaced, or
    written in place: ``Tensor._version``), its other state, its hyperparameters and parameters. Taken
    when a cell has brought the ranks' state back into it: while it holds, the ranks' copy is the same
    and the next cell need not send it again (``nbfsdp.kernel.run.session``), as a model's fingerprint does.
    Reads no tensor data."""
    if isinstance(value, Optimizer):
        state = tuple(
            (key, (id(v), torch_private.version(v)) if isinstance(v, torch.Tensor) else repr(v))
            for entry in value.state.values()
            for key, v in entry.items()
        )
        groups = tuple(
            (tuple(sorted((k, repr(v)) for k, v in group.items() if k != "params")), tuple(map(id, group["params"])))
            for group in value.param_groups
        )
        return id(value), len(value.state), state, groups
    return id(value), repr(value.state_dict())


def track_steps(scheduler: Any) -> None:
    """Mark the scheduler's optimizer's ``step`` as LRScheduler's ``__init__`` does, after a pickle round trip.

    That mark is an instance attribute set by a closure inside ``LRScheduler.__init__``, which no pickle
    keeps (``Optimizer.__getstate__`` keeps defaults, state and groups only); without it the scheduler's
    first ``step()`` warns that ``optimizer.step()`` "has been overridden" although nothing was.
    """
    optimizer: Any = getattr(scheduler, "optimizer", None)
    if not isinstance(scheduler, LRScheduler) or is_step_tracked(optimizer.step):
        return
    step = type(optimizer).step

    @functools.wraps(step)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        mark_optimizer_stepped(optimizer)
        return step(optimizer, *args, **kwargs)

    mark_step_tracked(tracked)
    optimizer.step = tracked


def gather_state(optimizer: Optimizer) -> dict[int, torch.Tensor]:
    """On every rank at once: each sharded state tensor whole, on the CPU, by ``id`` of the shard.

    ``get_optimizer_state_dict`` would do this per model; an optimizer here may
    span several of the cell's models, so each DTensor is made whole on its own
    (``full_tensor``, one collective each, in the same order on every rank).
    """
    whole: dict[int, torch.Tensor] = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, DTensor):
                whole[id(value)] = value.full_tensor().cpu()
    return whole


def portable_state_dict(value: Any, whole: dict[int, torch.Tensor]) -> dict[str, Any]:
    """On rank 0: the optimizer's or scheduler's ``state_dict()`` with its sharded tensors whole."""
    state = value.state_dict()
    if isinstance(value, Optimizer):
        state["state"] = {
            index: {key: whole.get(id(v), v) for key, v in entry.items()} for index, entry in state["state"].items()
        }
    return state


def recipe_class(recipe: dict[str, Any]) -> type | None:
    """The optimizer class a checkpoint's recipe names (``engines.rank_state.recipe``), where it imports here."""
    module, _, name = recipe["class"].rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None
    return found if isinstance(found, type) else None
