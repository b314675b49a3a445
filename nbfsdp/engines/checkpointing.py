"""What each rank runs to save or load a checkpoint (the format: ``nbfsdp.shared.checkpoints``).

``save`` gathers this rank's part of its world (the sharded models, the optimizers and LR schedulers in
the cells' namespace, its RNG states, its split DataLoaders' positions) into DCP's state dict and writes
only its own shards; rank 0 completes the checkpoint once every rank has written. ``load_into`` runs
for a ``LoadCheckpoint`` request over the notebook's objects (``nbfsdp.kernel.checkpoints.sharded``): DCP reads into
the sharded models and optimizers in place, resharding from whatever world size wrote them.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import random
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import assert_never  # typing has it from Python 3.11; torch requires typing_extensions

from nbfsdp.engines import world as worlds
from nbfsdp.engines.control import SaveAgreement
from nbfsdp.engines.loaders import SplitBatchSampler, set_after_init, shuffle_generators
from nbfsdp.engines.world import World
from nbfsdp.shared import checkpoints, optimizers
from nbfsdp.shared.checkpoints import CheckpointError, Manifest
from nbfsdp.shared.initializing import materialize
from nbfsdp.shared.protocol import (
    GatherModel,
    InternalRequest,
    IntervalSaves,
    LoadCheckpoint,
    LoaderState,
    LoadWeightsFile,
)
from nbfsdp.shared.weights_files import Weights, WeightsDirectory, full_weights_reader

try:  # public since torch 2.8; the floor (2.6) reads Hugging Face checkpoints with nbfsdp's own reader
    from torch.distributed.checkpoint import HuggingFaceStorageReader
except ImportError:
    HuggingFaceStorageReader = None  # type: ignore[misc, assignment]


def _class_name(module: nn.Module) -> str:
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


def _find(world: World) -> tuple[dict, dict, dict, dict, dict[str, str]]:
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


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "python" in state:
        random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _position(loader: DataLoader, begun: int | None) -> LoaderState:
    """Where the loader is; ``epochs`` counts every epoch begun since the notebook's first cell: this
    cell's after those before it, or ``begun`` (the kernel's count, between cells) where that is more."""
    batches = loader.batch_sampler
    assert isinstance(batches, SplitBatchSampler)  # _find keeps only the loaders split for this world
    own = batches.epochs.started + (batches.before if isinstance(batches, PositionedBatches) else 0)
    begun = own if begun is None else max(begun, own)  # the notebook's loader may be a new one, never sent
    if isinstance(batches, PositionedBatches) and batches.part_way():
        return LoaderState(epochs=begun, generators=batches.began, taken=batches.taken)
    return LoaderState(epochs=begun, generators=[g.get_state() for g in shuffle_generators(loader)])


#: What a full disk during ``%fsdp save`` leaves: the engines are untouched by a failed write.
ENGINES_INTACT = "the engines still hold the trained state (free some space, or save somewhere else)"


@dataclasses.dataclass
class _Snapshot:
    """What one save writes from this rank: DCP's state dict and, for rank 0's manifest, what it names."""

    state: dict[str, Any]
    models: dict[str, nn.Module]
    optimizers: dict[str, tuple[Optimizer, str]]
    schedulers: dict[str, tuple[Any, str]]
    loaders: list[str]
    skipped: dict[str, str]


def _snapshot(world: World, epochs: dict[str, int] | None) -> _Snapshot:
    models, found, schedulers, loaders, skipped = _find(world)
    if not models:
        raise CheckpointError("the engines hold no model: run a %%fsdp cell that reads one first")
    rank = f"rank{world.rank}"
    state = {
        "models": {name: get_model_state_dict(model) for name, model in models.items()},
        "optimizers": {name: get_optimizer_state_dict(models[owner], opt) for name, (opt, owner) in found.items()},
        # deep copies: a scheduler's lists and a loader's position are written later by a background save
        "schedulers": {name: copy.deepcopy(scheduler.state_dict()) for name, (scheduler, _) in schedulers.items()},
        "rng": {rank: rng_state(world.device)},
        "loaders": {rank: {name: _position(loader, (epochs or {}).get(name)) for name, loader in loaders.items()}}
        if loaders
        else {},
    }
    return _Snapshot(state, models, found, schedulers, sorted(loaders), skipped)


def _write(
    snapshot: _Snapshot | Future, partial: str, rank: int, group: dist.ProcessGroup | None, disk_full_then: str
) -> None:
    """DCP's save of this rank's shards (or the end of a background one), every rank failing together.

    A write error on any rank reaches every rank through DCP's own collectives, so they fail together and
    the world stays usable. A full disk (``ENOSPC``) is a ``CheckpointError`` on every rank saying so and
    ``disk_full_then`` (what is still there), and the partial directory is removed.
    """
    try:
        if isinstance(snapshot, Future):
            snapshot.result()
        else:
            dcp.save(snapshot.state, storage_writer=FileSystemWriter(partial))
    except CheckpointException as error:  # DCP hands every rank the failures of all: they fail together
        # each rank looks at the file system it wrote to, before anything is removed; they decide together
        full = torch.tensor([int(checkpoints.is_disk_full(error, Path(partial).parent))])
        dist.all_reduce(full, op=dist.ReduceOp.MAX, group=group)
        if not full.item():
            raise
        # every rank is past its writes and its look: rank 0 frees what they wrote
        raise checkpoints.disk_full(partial, disk_full_then, remove=rank == 0) from None
    dist.barrier(group=group)  # every rank's files are written and synced: only now may the checkpoint complete


def _complete(
    world: World,
    snapshot: _Snapshot,
    partial: str,
    final: str,
    step: int | None,
    overwrite: bool,
    disk_full_then: str,
) -> tuple[str, dict]:
    """Rank 0, once every rank has written: the manifest, and the checkpoint complete under ``final``."""
    manifest = Manifest(
        step=step,
        world_size=world.world_size,
        created=checkpoints.now(),
        torch=torch.__version__,
        nbfsdp=checkpoints.nbfsdp_version(),
        models={
            name: {
                "class": _class_name(model),
                "parameters": sum(p.numel() for p in model.parameters()),
                "fsdp": _fields(world.models[name][1].config),
            }
            for name, model in snapshot.models.items()
        },
        optimizers={name: owner for name, (_, owner) in snapshot.optimizers.items()},
        schedulers={name: optimizer for name, (_, optimizer) in snapshot.schedulers.items()},
        loaders=snapshot.loaders,
        bytes_per_rank=checkpoints.bytes_per_rank(partial, world.world_size),
    )
    try:
        checkpoints.finish(partial, final, manifest, overwrite)
    except OSError as error:  # the manifest itself did not fit: the checkpoint never became complete
        if not checkpoints.is_disk_full(error, Path(partial).parent):
            raise
        raise checkpoints.disk_full(partial, disk_full_then, remove=True) from None
    return manifest.to_json(), snapshot.skipped


def save(
    generation: int,
    partial: str,
    final: str,
    step: int | None,
    overwrite: bool,
    disk_full_then: str = ENGINES_INTACT,
    epochs: dict[str, int] | None = None,
) -> tuple[str, dict] | None:
    """On every rank at once: write this rank's shards into ``partial``; rank 0 then completes the checkpoint
    as ``final``. Rank 0 returns the manifest (JSON) and the names left out, with why.

    Nothing complete is left by a failed write (``_write``). ``epochs``: the kernel's count of epochs each
    loader began, for a save between cells.
    """
    world = worlds.of_generation(generation)
    snapshot = _snapshot(world, epochs)
    _write(snapshot, partial, world.rank, None, disk_full_then)
    if world.rank != 0:
        return None
    return _complete(world, snapshot, partial, final, step, overwrite, disk_full_then)


class BackgroundSave:
    """``%fsdp save --async`` on one rank: DCP's ``async_save`` writes a snapshot in a thread while cells run.

    The snapshot is taken before ``start`` returns, a copy of every tensor, so a parameter training changes
    next cannot reach the file. On the CPU it is taken here (``_copied``: 1.0x the rank's shard) and not by
    DCP's stager, which took 2.3-2.5x the shard of FSDP2's state on torch 2.13 (measured) and, before
    torch 2.7, copied no CPU tensor at all (pytorch#144657); on a GPU DCP's stager copies into CPU memory.
    The write's collectives run on a gloo group of its own, as torchtitan's do, never on the world's, which
    the cells' collectives use meanwhile. The thread then completes the checkpoint as a blocking save does;
    ``result`` waits for it and raises its error.
    """

    def __init__(self, world: World, partial: str, final: str, step: int | None, overwrite: bool) -> None:
        self._world, self._partial, self._final = world, partial, final
        self._step, self._overwrite = step, overwrite
        self._outcome: tuple[str, dict] | BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self, snapshot: _Snapshot) -> None:
        group = _save_group(self._world)
        if self._world.device.type == "cuda":  # DCP's stager copies GPU tensors into CPU memory: what is wanted
            state, writer = snapshot.state, FileSystemWriter(self._partial)
        else:
            state, writer = _copied(snapshot.state), _SnapshotWriter(self._partial)
        future = dcp.async_save(state, storage_writer=writer, process_group=group)
        if not isinstance(future, Future):  # torch's newer response: staging done, the write still going
            future = future.upload_completion
        self._thread = threading.Thread(
            target=self._finish, args=(snapshot, future, group), name="nbfsdp-save", daemon=True
        )
        self._thread.start()

    def _finish(self, snapshot: _Snapshot, future: Future, group: dist.ProcessGroup) -> None:
        try:
            _write(future, self._partial, self._world.rank, group, ENGINES_INTACT)
            if self._world.rank == 0:
                args = (self._partial, self._final, self._step, self._overwrite, ENGINES_INTACT)
                self._outcome = _complete(self._world, snapshot, *args)
        except BaseException as error:  # raised by ``result``, at the kernel's next wait, stop or save
            self._outcome = error

    def result(self) -> tuple[str, dict] | None:
        """Wait for the write; rank 0's manifest (JSON) and names left out, or the write's error."""
        if self._thread is not None:
            self._thread.join()
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self._outcome


#: This rank's background save still to be waited for (one at a time: the kernel waits before the next).
_background: BackgroundSave | None = None
#: The gloo group background saves use, per world generation (made once, by every rank together).
_save_groups: dict[int, dist.ProcessGroup] = {}


def _save_group(world: World) -> dist.ProcessGroup:
    if world.generation not in _save_groups:
        _save_groups.clear()  # an older world's group went with its process group
        _save_groups[world.generation] = dist.new_group(backend="gloo")
    return _save_groups[world.generation]


class _SnapshotWriter(FileSystemWriter):
    """DCP's file writer for a state dict that is a snapshot already: staging it would copy it again."""

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        self.per_thread_copy_ahead = 0  # as FileSystemWriter.stage: the tensors are on the CPU already
        return state_dict


def _copied(state: Any) -> Any:
    """Every tensor in a state dict copied (a DTensor keeps its placement; its local shard is copied)."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {key: _copied(value) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(_copied(value) for value in state)
    return state


def save_in_background(
    generation: int,
    partial: str,
    final: str,
    step: int | None,
    overwrite: bool,
    epochs: dict[str, int] | None = None,
) -> dict | None:
    """On every rank at once: take this rank's snapshot and write it in the background; returns once the
    snapshot is taken (rank 0: the names left out, with why). ``wait_background_save`` ends it."""
    global _background
    world = worlds.of_generation(generation)
    if _background is not None:
        raise CheckpointError("a background save is still to be waited for: `%fsdp wait` first")
    snapshot = _snapshot(world, epochs)
    saving = BackgroundSave(world, partial, final, step, overwrite)
    saving.start(snapshot)
    _background = saving
    return snapshot.skipped if world.rank == 0 else None


def wait_background_save() -> tuple[str, dict] | None:
    """Wait for this rank's background save: rank 0 returns the manifest (JSON) and the names left out;
    the write's error, on any rank, is raised here."""
    global _background
    saving, _background = _background, None
    if saving is None:
        return None
    return saving.result()


class PositionedBatches(SplitBatchSampler):
    """A split loader's batches, counted, so that an interval save knows where in its epoch it is.

    At an epoch's last batch: a sampler may draw from its generator after its last batch
    (``RandomSampler`` draws one more permutation as it stops); the log call of that step comes before
    the draw, a cell's end after it. ``finish_epoch`` runs the sampler to its end at the save instead,
    as the loop would next, so the saved states are those the next epoch starts from.
    Part-way through an epoch: the save keeps the states the epoch drew its shuffle from and the batches
    taken (``LoaderState.taken``); the cell resumed from it gives ``resume`` here, and its first epoch
    shuffles from those states again and skips those batches (their indices only: no data is loaded).
    A ``resume`` with nothing taken and no generator states carries only the epochs begun before this
    cell (the kernel's count), so that a save here counts them too.
    """

    def __init__(self, split: SplitBatchSampler, generators: list[torch.Generator], resume: LoaderState | None) -> None:
        super().__init__(split.batches, split.rank, split.world_size, split.per_rank, split.epochs)
        self.taken = 0
        #: Epochs begun before this cell: a part-way epoch resumed is begun again here.
        self.before = max(resume.epochs - (1 if resume.taken else 0), 0) if resume is not None else 0
        self.began: list[torch.Tensor] = []
        self._generators, self._resume = generators, resume
        self._epoch: Any = None

    def __iter__(self) -> Any:
        resume, self._resume = self._resume, None
        if resume is not None:
            for generator, state in zip(self._generators, resume.generators, strict=False):
                generator.set_state(state)
        self.began = [g.get_state() for g in self._generators]  # before this epoch's shuffle is drawn
        self.taken = 0
        self._epoch = super().__iter__()
        for _ in range(resume.taken if resume is not None else 0):
            next(self._epoch, None)  # taken by the run that saved
            self.taken += 1
        for batch in self._epoch:
            self.taken += 1
            yield batch

    def part_way(self) -> bool:
        """An epoch begun and not all taken."""
        return self._epoch is not None and 0 < self.taken < len(self)

    def finish_epoch(self) -> None:
        """At a save: end an epoch whose batches were all taken (the sampler's draws as it stops)."""
        if self._epoch is not None and self.taken >= len(self):
            for _ in self._epoch:  # it has no batch left to give
                pass
            self._epoch = None


def track_positions(loader: DataLoader, resume: LoaderState | None) -> None:
    """With ``--save-interval`` or a part-way position to resume: count a split loader's batches."""
    if isinstance(loader.batch_sampler, SplitBatchSampler):
        batches = PositionedBatches(loader.batch_sampler, shuffle_generators(loader), resume)
        set_after_init(loader, "batch_sampler", batches)


class IntervalSaver:
    """``--save-interval`` on one rank: at each due ``nbfsdp.log`` the ranks agree through files
    (``SaveAgreement``: no collective, so a rank that skipped the log cannot hang the others), then save
    together with ``save``, as ``%fsdp save`` does, into ``<folder>/step-<s+1>``; rank 0 then prunes to the
    newest ``keep``.

    The log call is where every rank has finished step ``s``: optimizer and scheduler stepped, RNG and data
    consumed through it, so a run resumed from ``step-<s+1>`` at ``resume_step = s + 1`` continues exactly.
    """

    def __init__(self, saves: IntervalSaves, world: World) -> None:
        self._saves, self._world = saves, world
        self.agreement = SaveAgreement(saves.markers, world.rank, world.world_size)
        # the partial directory's name must be the same on every rank: derived from the cell's markers directory
        self._tag = hashlib.sha1(saves.markers.encode()).hexdigest()[:8]

    def at_log(self, step: int) -> None:
        due = (step + 1) % self._saves.interval == 0
        self.agreement.at_log(step, due)
        if not due:
            return
        loaders = {
            name: value
            for name, value in sorted(self._world.namespace.items())
            if isinstance(value, DataLoader) and isinstance(value.batch_sampler, PositionedBatches)
        }
        for loader in loaders.values():
            assert isinstance(loader.batch_sampler, PositionedBatches)  # as chosen just above
            loader.batch_sampler.finish_epoch()
        folder = Path(self._saves.folder)
        name = f"step-{step + 1}"
        partial = folder / f".{name}.partial-{self._tag}"
        # a later run into the same folder replaces its own step's checkpoint: never a half-written one
        earlier = "the earlier checkpoints in it stay complete; this cell stops here"
        result = save(self._world.generation, str(partial), str(folder / name), step + 1, True, earlier)
        if result is not None:
            removed = checkpoints.keep_latest(folder, self._saves.keep) if self._saves.keep > 0 else []
            gone = f"; removed {', '.join(Path(p).name for p in removed)}" if removed else ""
            print(f"nbfsdp: saved {folder / name}{gone}", flush=True)

    def end(self, failed: bool) -> None:
        self.agreement.end(failed)


def _fields(config: Any) -> dict[str, Any]:
    """A model's settings as its checkpoint's manifest keeps them: how it is sharded, not the rank's memory."""
    fields = dataclasses.asdict(config)
    fields["wrap_cls"] = list(fields["wrap_cls"])
    fields.pop("memory_limit")
    return fields


def run_request(request: InternalRequest, namespace: dict[str, Any]) -> None:
    """nbfsdp's own cell on this rank, with the notebook's objects it names from ``namespace``."""
    match request:
        case LoadCheckpoint():
            load_into(
                request.directory,
                {name: namespace[name] for name in request.models},
                {name: (namespace[name], owner) for name, owner in request.optimizers.items()},
                {name: namespace[name] for name in request.schedulers},
                request.ignore,
                request.restore_rng,
            )
        case LoadWeightsFile():
            if not request.read_when_sharded:  # else read as the model was sharded: nothing more
                load_weights_file(request.path, namespace[request.model])
        case GatherModel():  # gathered at the cell's end: nothing more
            pass
        case _:
            assert_never(request)


def load_into(
    path: str,
    models: dict[str, nn.Module],
    optimizers: dict[str, tuple[Optimizer, str]],
    schedulers: dict[str, Any],
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
        _set_rng_state(state["rng"][rank], world.device)  # last: nothing above may draw from what it restores


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
