"""What of this rank's world a checkpoint holds: its sharded models, the optimizers, LR schedulers and split
DataLoaders in the cells' namespace, its RNG states, found by name and taken as DCP's state dict. Runs on the ranks,
for saves (``checkpointing``) and loads (``loading``).
"""

from __future__ import annotations

import copy
import dataclasses
import random
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from nbfsdp.engines.loader_positions import PositionedBatches
from nbfsdp.engines.loaders import SplitBatchSampler, shuffle_generators
from nbfsdp.engines.world import World
from nbfsdp.shared import optimizers
from nbfsdp.shared.checkpoints import CheckpointError
from nbfsdp.shared.protocol import LoaderState


def class_name(module: nn.Module) -> str:
    """The user's class, not FSDP2's per-class subclass of it."""
    cls = next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))
    return f"{cls.__module__}.{cls.__qualname__}"


def _owner(optimizer: Optimizer, models: dict[str, nn.Module]) -> str | None:
    """The model all of the optimizer's parameters belong to (DCP keys optimizer state by its FQNs)."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for name, model in models.items():
        if params and params <= {id(p) for p in model.parameters()}:
            return name
    return None


def recipe(optimizer: Optimizer, model: nn.Module) -> dict[str, Any]:
    """How a load builds ``optimizer`` again over ``model`` where the notebook has none: its class, and each
    param group's parameters (by FQN) and plain hyperparameters; its state, and the hyperparameters again,
    come from the checkpoint."""
    cls = type(optimizer)
    fqns = {id(p): fqn for fqn, p in model.named_parameters(remove_duplicate=False)}
    plain = (bool, int, float, str, type(None))
    groups = [
        {
            "params": [fqns[id(p)] for p in group["params"]],
            **{
                k: list(v) if isinstance(v, tuple) else v
                for k, v in group.items()
                if _plain(v, plain) and k != "params"
            },
        }
        for group in optimizer.param_groups
    ]
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "groups": groups}


def _plain(value: Any, kinds: tuple[type, ...]) -> bool:
    """A hyperparameter a manifest (JSON) keeps as it is: a number, a flag, a name, or a tuple of numbers."""
    return isinstance(value, kinds) or (isinstance(value, tuple) and all(isinstance(v, kinds) for v in value))


def objects_to_save(world: World) -> tuple[dict, dict, dict, dict, dict[str, str]]:
    """What the engines hold, by the cells' names: models, optimizers (-> model), schedulers (-> optimizer),
    split loaders; and the names left out, with why. The same on every rank: the same cells ran there."""
    models = {name: sharded.module for name, (_, sharded) in sorted(world.models.items())}
    found_optimizers: dict[str, tuple[Optimizer, str]] = {}
    schedulers: dict[str, tuple[Any, str]] = {}
    loaders: dict[str, DataLoader] = {}
    skipped: dict[str, str] = {}
    seen: dict[int, str] = {id(m): n for n, m in models.items()}
    items = sorted(world.namespace.items())
    for name, value in items:
        if isinstance(value, Optimizer) and id(value) not in seen:
            seen[id(value)] = name
            owner = _owner(value, models)
            if owner is None:
                skipped[name] = "its parameters are not all in one model the engines hold"
            elif not value.state:
                skipped[name] = "it has not stepped yet: no state to save"
            else:
                found_optimizers[name] = (value, owner)
    by_id = {id(opt): name for name, (opt, _) in found_optimizers.items()}
    for name, value in items:
        if isinstance(value, optimizers.STATEFUL) and not isinstance(value, Optimizer) and id(value) not in seen:
            seen[id(value)] = name
            optimizer = by_id.get(id(getattr(value, "optimizer", None)))
            if optimizer is None:
                skipped[name] = "its optimizer is not saved"
            else:
                schedulers[name] = (value, optimizer)
        elif (
            isinstance(value, DataLoader)
            and isinstance(value.batch_sampler, SplitBatchSampler)
            and id(value) not in seen
        ):
            seen[id(value)] = name
            loaders[name] = value
    return models, found_optimizers, schedulers, loaders, skipped


def rng_state(device: torch.device) -> dict[str, Any]:
    """This rank's random states: what dropout, shuffles and the user's own draws continue from."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "python" in state:
        random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def position(loader: DataLoader, begun: int | None) -> LoaderState:
    """Where the loader is; ``epochs`` counts every epoch begun since the notebook's first cell: this
    cell's after those before it, or ``begun`` (the kernel's count, between cells) where that is more."""
    batches = loader.batch_sampler
    assert isinstance(batches, SplitBatchSampler)  # objects_to_save keeps only the loaders split for this world
    own = batches.epochs.started + (batches.before if isinstance(batches, PositionedBatches) else 0)
    begun = own if begun is None else max(begun, own)  # the notebook's loader may be a new one, never sent
    if isinstance(batches, PositionedBatches) and batches.part_way():
        return LoaderState(epochs=begun, generators=batches.began, taken=batches.taken)
    return LoaderState(epochs=begun, generators=[g.get_state() for g in shuffle_generators(loader)])


@dataclasses.dataclass
class Snapshot:
    """What one save writes from this rank: DCP's state dict and, for rank 0's manifest, what it names."""

    state: dict[str, Any]
    models: dict[str, nn.Module]
    optimizers: dict[str, tuple[Optimizer, str]]
    schedulers: dict[str, tuple[Any, str]]
    loaders: list[str]
    skipped: dict[str, str]
    recipes: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """How a load builds each optimizer again (``recipe``), taken with the state: a background save completes
    after later cells, which may have sharded the model anew."""


def manifest_fields(config: Any) -> dict[str, Any]:
    """A model's settings as its checkpoint's manifest keeps them: how it is sharded, not the rank's memory."""
    fields = dataclasses.asdict(config)
    fields["wrap_cls"] = list(fields["wrap_cls"])
    fields.pop("memory_limit")
    return fields


def take_snapshot(world: World, epochs: dict[str, int] | None) -> Snapshot:
    """This rank's part of what a save writes, taken now; ``epochs``: the kernel's count of epochs each loader
    began, for a save between cells."""
    models, found, schedulers, loaders, skipped = objects_to_save(world)
    if not models:
        raise CheckpointError("the engines hold no model: run a %%fsdp cell that reads one first")
    rank = f"rank{world.rank}"
    state = {
        "models": {name: get_model_state_dict(model) for name, model in models.items()},
        "optimizers": {name: get_optimizer_state_dict(models[owner], opt) for name, (opt, owner) in found.items()},
        # deep copies: a scheduler's lists and a loader's position are written later by a background save
        "schedulers": {name: copy.deepcopy(scheduler.state_dict()) for name, (scheduler, _) in schedulers.items()},
        "rng": {rank: rng_state(world.device)},
        "loaders": {rank: {name: position(loader, (epochs or {}).get(name)) for name, loader in loaders.items()}}
        if loaders
        else {},
    }
    recipes = {name: recipe(opt, models[owner]) for name, (opt, owner) in found.items()}
    return Snapshot(state, models, found, schedulers, sorted(loaders), skipped, recipes)
