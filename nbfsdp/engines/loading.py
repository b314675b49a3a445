"""What each rank runs to load: a checkpoint into the sharded models, optimizers and schedulers (``load_into``,
DCP resharding from whatever world size wrote it), a full-weights file or a Hugging Face checkpoint directory
(each rank reading only its rows), and nbfsdp's own requests that ask for them. Runs on the ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import assert_never  # typing has it from Python 3.11; torch requires typing_extensions

from nbfsdp.engines import world as worlds
from nbfsdp.engines.rank_state import rng_state, set_rng_state
from nbfsdp.shared import checkpoints
from nbfsdp.shared.config import FSDPConfig
from nbfsdp.shared.initializing import materialize
from nbfsdp.shared.optimizers import recipe_class
from nbfsdp.shared.protocol import GatherModel, InternalRequest, LoadCheckpoint, LoadWeightsFile
from nbfsdp.shared.weights_files import Weights, WeightsDirectory, full_weights_reader

try:  # public since torch 2.8; the floor (2.6) reads Hugging Face checkpoints with nbfsdp's own reader
    from torch.distributed.checkpoint import HuggingFaceStorageReader
except ImportError:
    HuggingFaceStorageReader = None  # type: ignore[misc, assignment]


def run_request(request: InternalRequest, namespace: dict[str, Any]) -> None:
    """nbfsdp's own cell on this rank, with the notebook's objects it names from ``namespace``."""
    match request:
        case LoadCheckpoint():
            for name, made in request.rebuilt.items():  # the cells' names on the ranks, as a cell made them
                namespace[name] = rebuild(made["recipe"], namespace[made["owner"]])
            load_into(
                request.directory,
                {name: namespace[name] for name in request.models},
                {name: (namespace[name], owner) for name, owner in request.optimizers.items()},
                {name: namespace[name] for name in request.schedulers},
                ignore=request.ignore,
                restore_rng=request.restore_rng,
            )
        case LoadWeightsFile():
            if not request.read_when_sharded:  # else read as the model was sharded: nothing more
                load_weights_file(request.path, namespace[request.model])
        case GatherModel():  # gathered at the cell's end: nothing more
            pass
        case _:
            assert_never(request)


def read_next(request: InternalRequest | None, name: str, config: FSDPConfig) -> frozenset[str]:
    """The tensors of model ``name``, built on the meta device, that ``request`` (a ``LoadCheckpoint``: ``%fsdp load``,
    a move) reads into it right after it is sharded: initializing them first would be thrown away (a 1B model's
    random initialization takes each of 4 CPU ranks seconds). Under ``sync_module_states`` rank 0 initializes the
    whole model and broadcasts it, so nothing is left out there."""
    if not isinstance(request, LoadCheckpoint) or name not in request.models or config.sync_module_states:
        return frozenset()
    prefix = f"models.{name}."
    saved = FileSystemReader(request.directory).read_metadata().state_dict_metadata
    return frozenset(
        key.removeprefix(prefix)
        for key in saved
        if key.startswith(prefix) and not checkpoints.ignored(key, request.ignore)
    )


def rebuild(recipe: dict[str, Any], model: nn.Module) -> Optimizer:
    """An optimizer a cell made, built again over ``model``'s sharded parameters as the checkpoint's manifest
    says (``rank_state.recipe``); ``load_into`` then gives it its state and hyperparameters."""
    cls = recipe_class(recipe)
    assert cls is not None  # the kernel asked for it only where it imports (the same environment)
    params = dict(model.named_parameters(remove_duplicate=False))
    groups = [{**group, "params": [params[fqn] for fqn in group["params"]]} for group in recipe["groups"]]
    return cls(groups)


def load_into(
    path: str,
    models: dict[str, nn.Module],
    optimizers: dict[str, tuple[Optimizer, str]],
    schedulers: dict[str, Any],
    *,
    ignore: list[str],
    restore_rng: bool,
) -> None:
    """For a ``LoadCheckpoint`` request, on every rank: read the checkpoint into these sharded models, optimizers and
    schedulers in place (DCP reshards to this world), and, at the world size that saved it, this rank's
    RNG states. The cell's end then brings the weights and state back into the notebook's own objects."""
    world = worlds.current
    assert world is not None  # a request runs in the world, as a cell does
    saved = set(FileSystemReader(path).read_metadata().state_dict_metadata)
    options = StateDictOptions(strict=False)
    state: dict[str, Any] = {"models": {}, "optimizers": {}, "schedulers": {}, "rng": {}}
    for name, model in models.items():
        full = get_model_state_dict(model)
        state["models"][name] = {
            fqn: value for fqn, value in full.items() if not checkpoints.ignored(f"models.{name}.{fqn}", ignore)
        }
    for name, (optimizer, owner) in optimizers.items():
        state["optimizers"][name] = get_optimizer_state_dict(models[owner], optimizer)
    for name, scheduler in schedulers.items():
        state["schedulers"][name] = scheduler.state_dict()
    rank = f"rank{world.rank}"
    if restore_rng and not checkpoints.ignored(f"rng.{rank}", ignore):
        mine = {key: value for key, value in rng_state(world.device).items() if f"rng.{rank}.{key}" in saved}
        state["rng"][rank] = mine
    dcp.load(state, storage_reader=FileSystemReader(path))
    for name, model in models.items():
        set_model_state_dict(model, state["models"][name], options=options)
    for name, (optimizer, owner) in optimizers.items():
        set_optimizer_state_dict(models[owner], optimizer, state["optimizers"][name])
    for name, scheduler in schedulers.items():
        scheduler.load_state_dict(state["schedulers"][name])
    if state["rng"]:
        set_rng_state(state["rng"][rank], world.device)  # last: nothing above may draw from what it restores


#: Bytes of tensor data this rank read in its last ``load_weights_file`` (the kernel reports them).
_bytes_read = 0


def load_weights_file(path: str, model: nn.Module) -> None:
    """For a ``LoadWeightsFile`` request, on every rank: this rank's part of every tensor of a full-weights
    file into the sharded ``model``, in place; only those rows are read (``full_weights_reader``). The cell's end then
    brings the weights back into the notebook's model, as after a checkpoint's load."""
    global _bytes_read
    with full_weights_reader(path) as reader:
        _bytes_read = _read_into(reader, model, strict=True)


def load_pretrained(
    path: str, model: nn.Module, device: torch.device, shard: tuple[int, int], seed: int, made: frozenset[str]
) -> None:
    """A sharded model built on the meta device, filled from the full weights at ``path`` (a Hugging Face
    checkpoint directory, as ``from_pretrained`` reads it): each rank reads only its rows of each tensor. What
    the weights lack is what the model's constructor ``made`` (non-persistent buffers such as rotary
    ``inv_freq``, kept) or is made as the model makes it (``units.init_function``: a new head), the same on
    every rank. The kernel checked both beforehand."""
    global _bytes_read
    with full_weights_reader(path) as reader:
        covered = reader.matched(model, strict=False).covered
        materialize(model, device, shard, seed, full=False, loaded=frozenset(covered) | made)
        _bytes_read = _read_into(reader, model, strict=False)


def _read_into(reader: Weights, model: nn.Module, *, strict: bool) -> int:
    """This rank's rows of each of ``model``'s tensors, read from ``reader``'s weights in place; the bytes read.

    A Hugging Face checkpoint directory is read by DCP's own ``HuggingFaceStorageReader`` where torch has it
    (2.8 on), as torchtitan reads one: DCP plans each rank's reads (the same ``safe_open`` slices) and casts to
    the model's dtype. Elsewhere (torch 2.6, a single file) ``reader`` reads them itself."""
    if HuggingFaceStorageReader is None or not isinstance(reader, WeightsDirectory):
        reader.load_into(model, strict=strict)
        return reader.bytes_read
    match = reader.matched(model, strict=strict)
    state = model.state_dict()  # detached views of the parameters: DCP writes into their local shards
    wanted = {stored: state[key] for key, stored in match.stored.items()}
    dcp.load(wanted, storage_reader=HuggingFaceStorageReader(str(reader.path)))
    local = [value.to_local() if isinstance(value, DTensor) else value for value in wanted.values()]
    return sum(t.numel() * t.element_size() for t in local)  # in the model's dtype


def bytes_read() -> int:
    """What this rank read in its last ``load_weights_file``."""
    return _bytes_read
