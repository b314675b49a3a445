"""What each rank runs to save a checkpoint (the format: ``nbfsdp.shared.checkpoints``).

``save`` takes this rank's part of its world (``rank_state``: the sharded models, the optimizers and LR schedulers
in the cells' namespace, its RNG states, its split DataLoaders' positions) as DCP's state dict and writes only its
own shards; rank 0 completes the checkpoint once every rank has written. ``save_in_background`` does the same in a
thread while cells run (``%fsdp save --async``). Loads are ``loading``'s.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from nbfsdp.engines import world as worlds
from nbfsdp.engines.rank_state import Snapshot, class_name, manifest_fields, take_snapshot
from nbfsdp.engines.world import World
from nbfsdp.shared import checkpoints
from nbfsdp.shared.checkpoints import CheckpointError, Manifest
from nbfsdp.shared.protocol import SaveTarget


def _write(snapshot: Snapshot | Future, target: SaveTarget, rank: int, group: dist.ProcessGroup | None) -> None:
    """DCP's save of this rank's shards (or the end of a background one), every rank failing together.

    A write error on any rank reaches every rank through DCP's own collectives, so they fail together and
    the world stays usable. A full disk (``ENOSPC``) is a ``CheckpointError`` on every rank saying so and
    ``target.disk_full_then`` (what is still there), and the partial directory is removed.
    """
    try:
        if isinstance(snapshot, Future):
            snapshot.result()
        else:
            dcp.save(snapshot.state, storage_writer=FileSystemWriter(target.partial))
    except CheckpointException as error:  # DCP hands every rank the failures of all: they fail together
        # each rank looks at the file system it wrote to, before anything is removed; they decide together
        full = torch.tensor([int(checkpoints.is_disk_full(error, Path(target.partial).parent))])
        dist.all_reduce(full, op=dist.ReduceOp.MAX, group=group)
        if not full.item():
            raise
        # every rank is past its writes and its look: rank 0 frees what they wrote
        raise checkpoints.disk_full(target.partial, target.disk_full_then, remove=rank == 0) from None
    dist.barrier(group=group)  # every rank's files are written and synced: only now may the checkpoint complete


def _complete(world: World, snapshot: Snapshot, target: SaveTarget) -> tuple[str, dict]:
    """Rank 0, once every rank has written: the manifest, and the checkpoint complete under ``target.final``."""
    manifest = Manifest(
        step=target.step,
        world_size=world.world_size,
        created=checkpoints.now(),
        torch=torch.__version__,
        nbfsdp=checkpoints.nbfsdp_version(),
        models={
            name: {
                "class": class_name(model),
                "parameters": sum(p.numel() for p in model.parameters()),
                "fsdp": manifest_fields(world.models[name][1].config),
            }
            for name, model in snapshot.models.items()
        },
        optimizers={name: owner for name, (_, owner) in snapshot.optimizers.items()},
        schedulers={name: optimizer for name, (_, optimizer) in snapshot.schedulers.items()},
        recipes=snapshot.recipes,
        loaders=snapshot.loaders,
        bytes_per_rank=checkpoints.bytes_per_rank(target.partial, world.world_size),
    )
    try:
        checkpoints.finish(target.partial, target.final, manifest, overwrite=target.overwrite)
    except OSError as error:  # the manifest itself did not fit: the checkpoint never became complete
        if not checkpoints.is_disk_full(error, Path(target.partial).parent):
            raise
        raise checkpoints.disk_full(target.partial, target.disk_full_then, remove=True) from None
    return manifest.to_json(), snapshot.skipped


def save(generation: int, target: SaveTarget, *, epochs: dict[str, int] | None = None) -> tuple[str, dict] | None:
    """On every rank at once: write this rank's shards into ``target.partial``; rank 0 then completes the
    checkpoint as ``target.final``. Rank 0 returns the manifest (JSON) and the names left out, with why.

    Nothing complete is left by a failed write (``_write``). ``epochs``: the kernel's count of epochs each
    loader began, for a save between cells.
    """
    world = worlds.of_generation(generation)
    snapshot = take_snapshot(world, epochs)
    _write(snapshot, target, world.rank, None)
    if world.rank != 0:
        return None
    return _complete(world, snapshot, target)


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

    def __init__(self, world: World, target: SaveTarget) -> None:
        self._world, self._target = world, target
        self._outcome: tuple[str, dict] | BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self, snapshot: Snapshot) -> None:
        group = _save_group(self._world)
        if self._world.device.type == "cuda":  # DCP's stager copies GPU tensors into CPU memory: what is wanted
            state, writer = snapshot.state, FileSystemWriter(self._target.partial)
        else:
            state, writer = _copied(snapshot.state), SnapshotWriter(self._target.partial)
        future = dcp.async_save(state, storage_writer=writer, process_group=group)
        if not isinstance(future, Future):  # torch's newer response: staging done, the write still going
            future = future.upload_completion
        self._thread = threading.Thread(
            target=self._finish, args=(snapshot, future, group), name="nbfsdp-save", daemon=True
        )
        self._thread.start()

    def _finish(self, snapshot: Snapshot, future: Future, group: dist.ProcessGroup) -> None:
        try:
            _write(future, self._target, self._world.rank, group)
            if self._world.rank == 0:
                self._outcome = _complete(self._world, snapshot, self._target)
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


class SnapshotWriter(FileSystemWriter):
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


def save_in_background(generation: int, target: SaveTarget, *, epochs: dict[str, int] | None = None) -> dict | None:
    """On every rank at once: take this rank's snapshot and write it in the background; returns once the
    snapshot is taken (rank 0: the names left out, with why). ``wait_background_save`` ends it."""
    global _background
    world = worlds.of_generation(generation)
    if _background is not None:
        raise CheckpointError("a background save is still to be waited for: `%fsdp wait` first")
    snapshot = take_snapshot(world, epochs)
    saving = BackgroundSave(world, target)
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
