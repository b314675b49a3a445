"""A model that lives on the ranks follows the world: a ``%%fsdp`` cell that needs another world size, device
or FSDP settings than the world holding it has the ranks move its trained weights, its optimizers' and
schedulers' state to the new layout first (issue 59). Runs in the kernel.

How: the old world saves what it holds as ``%fsdp save`` does (DCP, each rank writing its own shards) into a
directory in memory the host shares (``/dev/shm``; an attached cluster's shared directory across hosts), then
the cell's world loads it as ``%fsdp load`` does under the cell's settings (DCP's resharding: each new rank
reads its rows), and the directory is removed. So a move is exactly a save and a load at that point: the same
losses after, bit for bit, and the same rules for what carries over (RNG states and loaders' positions only at
the same world size). Nothing passes through the kernel.

Why not a redistribution over the old world's collectives: a world of another size here is other engine
processes (``FSDPCluster`` starts one engine set per world), so no process is in both worlds to send from;
and DCP's resharding already covers every change of layout (world size, mesh, units, dtype) with the one path
``%fsdp save`` and ``%fsdp load`` test. Measured in ``make bench`` (the weight_moves row).

A move that fails part-way loses nothing: before the new world starts, the old one still holds the model;
after, the complete checkpoint stays in shared memory, the model's record names it (``residence.leave_in``),
and the next cell over the model (or ``%fsdp load DIR``) reads it from there. Such a directory is freed once a
world holds the model again, at ``%fsdp stop`` and at the kernel's exit; a killed kernel's, when the next
cluster starts (``reaping.clean_stale``).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch.nn as nn
from IPython.core.error import UsageError

from nbfsdp.kernel.checkpoints import sharded
from nbfsdp.kernel.cluster import reaping
from nbfsdp.kernel.cluster.rank_calls import RankError
from nbfsdp.kernel.run import residence
from nbfsdp.kernel.run.residence import MustMove
from nbfsdp.kernel.run.session import Session
from nbfsdp.shared import checkpoints as fmt
from nbfsdp.shared.checkpoints import Manifest
from nbfsdp.shared.collectives import size_text
from nbfsdp.shared.config import FSDPConfig

#: A move's directory, under ``reaping.SHARED_MEMORY`` or the temporary directory, which ``clean_stale`` sweeps.
MOVE_PREFIX = f"{reaping.PRIVATE_DIR_PREFIX}move-"
#: What a move writes, at most, per byte of the models' weights: the weights and two fp32 moments (AdamW's).
WRITTEN_PER_WEIGHT_BYTE = 3


def move(session: Session, needed: MustMove, *, world_size: int, config: FSDPConfig, timeout: float) -> None:
    """Move what the running world holds to a world of ``world_size`` ranks under ``config``, the cell's (or read
    it from where a failed move left it); one line says what moved and what it cost. Where the models cannot
    move, raises ``needed``'s refusal with why, and nothing changed."""
    started = time.perf_counter()
    if needed.left_in is not None:
        checkpoint, wrote = Path(needed.left_in), f"read from {needed.left_in}, where a failed move left them, "
        manifest = fmt.read_manifest(checkpoint)
    else:
        checkpoint = _directory(session, needed) / "state"
        manifest = _write(session, needed, checkpoint)
        wrote = (
            f"{manifest.world_size} ranks wrote {size_text(sum(manifest.bytes_per_rank))} to "
            f"{checkpoint.parent.parent} in {time.perf_counter() - started:.2f} s, "
        )
    saved = manifest.world_size
    reading, old_world = time.perf_counter(), session.cluster.world
    try:
        with _quiet():
            next_cell = sharded.NextCell(config=config, timeout=timeout)
            sharded.load_with(session, checkpoint, world_size, _staying(manifest, needed), cell=next_cell)
    except UsageError as error:  # refused before any engine was touched (a skeleton that no longer fits)
        if needed.left_in is None and session.cluster.world is old_world:
            shutil.rmtree(checkpoint.parent, ignore_errors=True)
            raise UsageError(f"{needed}\nnbfsdp: they cannot move: {error}") from None
        _leave(session, checkpoint, needed.names, old_world)
        raise
    except BaseException:
        _leave(session, checkpoint, needed.names, old_world)
        raise
    if needed.left_in is not None:
        residence.free_left(str(checkpoint.parent))
    else:
        residence.free_in_background(checkpoint.parent)
    left = "" if saved == world_size else "; RNG states and data positions do not carry over to another world size"
    started_world = "a new world started and " if session.cluster.world is not old_world else ""
    print(
        f"nbfsdp: moved {', '.join(needed.names)} from {saved} ranks to {_layout(config, world_size)} in "
        f"{time.perf_counter() - started:.2f} s: {wrote}{started_world}read into the new layout in "
        f"{time.perf_counter() - reading:.2f} s{left}"
    )


def _layout(config: FSDPConfig, world_size: int) -> str:
    """The cell's layout in words: its ranks, strategy and, where given, mixed precision."""
    precision = config.mixed_precision if isinstance(config.mixed_precision, str) else None
    ranks = f"{world_size} rank{'s' if world_size != 1 else ''}"
    return ", ".join([ranks, config.sharding_strategy, *([precision] if precision else [])])


def _staying(manifest: Manifest, needed: MustMove) -> list[str]:
    """What the old world held that does not move (``--load-ignore-keys`` globs): every model but those that
    must (models that do not live on the ranks are in the notebook as they were, and the cell sends them as any
    cell does; a model the notebook no longer has, or whose name it bound to another model, stays behind as its
    world would have left it), and their optimizers."""
    staying = [name for name in manifest.models if name not in needed.names]
    optimizers = [name for name, owner in manifest.optimizers.items() if owner in staying]
    return [*(f"models.{name}.*" for name in staying), *(f"optimizers.{name}" for name in optimizers)]


def _write(session: Session, needed: MustMove, checkpoint: Path) -> Manifest:
    """The running world's state, saved into ``checkpoint`` (``%fsdp save``'s); a failure frees it and says that
    the models stay where they were."""
    try:
        with _quiet():
            manifest = sharded.save_with(session, checkpoint, overwrite=False)
    except (UsageError, RankError) as error:
        shutil.rmtree(checkpoint.parent, ignore_errors=True)
        world = session.cluster.world
        kept = "they stay on the running world" if world is not None and not world.broken else "their world broke"
        raise UsageError(f"{needed}\nnbfsdp: moving them failed while the ranks wrote them ({error}): {kept}") from None
    except BaseException:  # an interrupt: what was written goes, the model stays where it was
        shutil.rmtree(checkpoint.parent, ignore_errors=True)
        raise
    assert isinstance(manifest, Manifest)  # a foreground save of nbfsdp's own format
    return manifest


def _leave(session: Session, checkpoint: Path, names: list[str], old_world: object) -> None:
    """The load failed after the old world wrote the models: they stay in ``checkpoint`` for the next cell, and
    the world that may hold part of the load is not used again."""
    world = session.cluster.world
    if world is not None and world is old_world:
        world.broken = True  # part-loaded: the next cell starts a fresh world and reads the checkpoint
    namespace = session.shell.user_ns
    for name in names:
        if isinstance(namespace.get(name), nn.Module):
            residence.leave_in(namespace[name], str(checkpoint), str(checkpoint.parent))
    print(
        f"nbfsdp: the move of {', '.join(names)} failed after the old world wrote them: they are whole in "
        f"{checkpoint}, which the next cell over them reads (or %fsdp load {checkpoint}); freed at %fsdp stop",
        file=sys.stderr,
    )


def _directory(session: Session, needed: MustMove) -> Path:
    """A new directory for the move: in shared memory where it has room, else the temporary directory; an
    attached cluster's in its directory every host sees."""
    if session.attached_cluster is not None:
        if why := session.cluster.unsteerable():
            raise UsageError(f"{needed}\nnbfsdp: they cannot move: every rank must see where they are written: {why}")
        parent = Path(session.cluster.private_dir)
    else:
        namespace = session.shell.user_ns
        models = [namespace[n] for n in needed.names if isinstance(namespace.get(n), nn.Module)]
        needs = WRITTEN_PER_WEIGHT_BYTE * sum(residence.weights_bytes(model) for model in models)
        shared = reaping.SHARED_MEMORY
        parent = shared if shared.is_dir() and shutil.disk_usage(shared).free > needs else Path(tempfile.gettempdir())
        if parent != shared:
            print(f"nbfsdp: {shared} has no room for {size_text(needs)}: moving through {parent}", file=sys.stderr)
    directory = Path(tempfile.mkdtemp(prefix=MOVE_PREFIX, dir=parent))  # mode 0700
    reaping.note_kernel(str(directory), os.getpid())
    return directory


@contextlib.contextmanager
def _quiet():
    """The save's and the load's own lines left out: the move says what happened in one."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield
