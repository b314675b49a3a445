"""Code that runs on the engines: the process group, the cell's namespace, sharding, gather.

The client calls ``setup`` once per world and ``run_cell`` once per cell, on
every rank at once, after ``receive_shards`` for each piece of any model the
cell needs anew. State lives in this module between cells: the namespace
the cells run in and the sharded models, so optimizer state and anything else
a cell leaves on the engines survive until the world is restarted.
"""

from __future__ import annotations

import bdb
import builtins
import datetime
import linecache
import os
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import CodeType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from ipyparallel.datapub import publish_data
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.optim import Optimizer

import nbfsdp  # the package root, as the cell sees it (nbfsdp.log); it imports nothing on its own
from nbfsdp.engines import (
    cell_results,
    debugging,
    hosts,
    loader_positions,
    loaders,
    loading,
    metrics,
    pasted,
    release,
    scaling,
    where,
    writes,
)
from nbfsdp.engines import world as worlds
from nbfsdp.engines.control import CellCancelled, PeerEnded, RankControl, StepBoundaries
from nbfsdp.engines.interval_saves import IntervalSaver
from nbfsdp.engines.memory_limit import RankMemory
from nbfsdp.engines.progress import route_bars
from nbfsdp.engines.sharding import ShardedModel, apply_live, cast_buffers, device_mesh, real_buffers, shard_model
from nbfsdp.engines.timeline import StepTimeline, clock_offset_ns
from nbfsdp.engines.world import World
from nbfsdp.shared import optimizers, torch_private, transfer
from nbfsdp.shared.config import FSDPConfig
from nbfsdp.shared.initializing import materialize
from nbfsdp.shared.limits import JOIN_TIMEOUT_SECONDS
from nbfsdp.shared.network import interface_of, loopback_interface, source_address
from nbfsdp.shared.protocol import Arrival, CellOutcome, CellSpec, EngineInfo, ShardAllocation, WorldSetup

_PACKAGE_DIR = str(Path(__file__).parents[1])  # nbfsdp/, whose frames a user traceback leaves out
#: Errors a rank raises only because a peer tore the world down first.
_PEER_FAILURE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted")


#: The socket interfaces the user set for the collectives before nbfsdp did: kept, whatever the world.
_USER_INTERFACES = {
    name: os.environ[name] for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if name in os.environ
}


def _use_interface(interface: str | None) -> None:
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if name in _USER_INTERFACES:
            os.environ[name] = _USER_INTERFACES[name]
        elif interface:
            os.environ[name] = interface


def setup(joining: WorldSetup) -> EngineInfo:
    """Join the new world ``joining`` describes: a fresh process group on a fresh store, a fresh namespace.

    On one machine collectives talk over the loopback interface only, and the store is a file in the
    client's private directory (``store_path``), so nothing listens on the network. Over several hosts
    (``rendezvous``) the store is a TCPStore on rank 0's socket, and each rank's collectives use the one
    interface that routes to rank 0, unless the user set ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``. On
    nbfsdp's own cluster rank 0 also serves the loopback store torchrun's variables (``environment``) name.
    """
    rank, world_size, backend, generation = joining.rank, joining.world_size, joining.backend, joining.generation
    if dist.is_initialized():
        dist.destroy_process_group()
    torch.set_num_threads(joining.threads)
    torch_private.patch_fsdp2_for_torch_2_6()  # FSDP2 on torch 2.6 runs on the CPU and gloo as on 2.7
    os.environ.update(joining.environment)
    if joining.gpu is not None:
        # nbfsdp's own engines see one GPU each (0); an attached host's engines see them all and take
        # LOCAL_RANK's, modulo the GPUs where ranks share them
        device = torch.device("cuda", joining.gpu)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    where.record_flights(backend)  # read when the process group is made
    debugging.release()  # a failed cell's frames go with the world they failed in
    release.world_begins(generation)  # before the store: the connections made from here are the world's
    script_store = _join(joining, device)
    worlds.current = World(
        rank=rank,
        world_size=world_size,
        device=device,
        generation=generation,
        timeout=joining.timeout,
        script_store=script_store,
        # one machine's ranks share its clock; over several hosts a captured step's times go on rank 0's
        clock_offset_ns=clock_offset_ns(device) if joining.rendezvous is not None else 0,
    )
    where.watch(joining.where_dir, rank)
    pasted.install(rank, device)  # a pasted script's init/destroy_process_group, taken as this world's
    return describe()


def _join(joining: WorldSetup, device: torch.device) -> dist.Store | None:
    """The world's process group, joined within ``JOIN_TIMEOUT_SECONDS`` at least (seen: a rank of a world
    started beside a loaded suite came after --timeout's 30 s, and its peer's gloo set-up failed with "Wait
    timeout"), its collectives then given --timeout; where torch cannot change a group's timeout (2.6),
    --timeout throughout. The store torchrun's variables name, on nbfsdp's own cluster."""
    seconds = datetime.timedelta(seconds=joining.timeout)
    late = datetime.timedelta(seconds=max(joining.timeout, JOIN_TIMEOUT_SECONDS))
    joined_within = late if torch_private.collective_timeout_settable() else seconds
    store, script_store = _stores(joining, joined_within)
    dist.init_process_group(
        joining.backend,
        store=store,
        rank=joining.rank,
        world_size=joining.world_size,
        timeout=joined_within,
        device_id=device if joining.backend == "nccl" else None,
    )
    if joined_within != seconds:
        torch_private.set_collective_timeout(seconds)
        store.set_timeout(seconds)
    return script_store


def _stores(joining: WorldSetup, seconds: datetime.timedelta) -> tuple[dist.Store, dist.Store | None]:
    """The world's store, and on nbfsdp's own cluster the one torchrun's variables name for a pasted script."""
    rank, world_size = joining.rank, joining.world_size
    if joining.rendezvous is not None:
        address, port = joining.rendezvous
        _use_interface(interface_of(source_address(address)))
        listening = hosts.take_rendezvous() if rank == 0 else None
        if listening is not None:
            return torch_private.store_on(listening, world_size, seconds), None  # the store owns the socket now
        return dist.TCPStore(address, port, world_size, rank == 0, timeout=seconds, wait_for_workers=False), None
    _use_interface(loopback_interface())
    assert joining.store_path is not None  # nbfsdp's own cluster: a file in its private directory
    store = dist.FileStore(joining.store_path, world_size)
    listening = hosts.take_rendezvous() if rank == 0 else None
    # the store MASTER_ADDR:MASTER_PORT name, on the loopback socket the kernel had rank 0 open: a script that
    # opens a store of its own at torchrun's address finds one there, as torchrun's agent store would be; the
    # world's group keeps its private FileStore
    script_store = torch_private.store_on(listening, world_size, seconds) if listening is not None else None
    return store, script_store


def describe() -> EngineInfo:
    """This engine as ``%fsdp status`` shows it."""
    world = worlds.current
    gpu = torch.cuda.get_device_name(0) if world and world.device.type == "cuda" else ""
    return EngineInfo(
        rank=world.rank if world else None,
        pid=os.getpid(),
        host=hosts.identity().hostname,
        device=f"{world.device}{f' ({gpu})' if gpu else ''}" if world else "",
        backend=dist.get_backend() if dist.is_initialized() else "",
        threads=torch.get_num_threads(),
    )


_CELL_SOURCES_KEPT = 20


def _remember_source(filename: str, code: str) -> None:
    """Let tracebacks show the cell's lines; keep only recent cells (linecache never forgets)."""
    linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)
    cells = [name for name in linecache.cache if name.startswith("<fsdp-cell-")]
    for name in cells[:-_CELL_SOURCES_KEPT]:
        del linecache.cache[name]


def _user_traceback(error: BaseException) -> str:
    """The traceback without nbfsdp's own frames: the user's code and what it called."""
    summary = traceback.TracebackException.from_exception(error)
    summary.stack = traceback.StackSummary.from_list(
        [frame for frame in summary.stack if not frame.filename.startswith(_PACKAGE_DIR)]
    )
    return "".join(summary.format())


def receive_shards(
    generation: int, allocate: dict[str, ShardAllocation], keys: list[transfer.PieceKey], *data: np.ndarray
) -> int:
    """One piece of this rank's shards (``nbfsdp.kernel.run.delivery``); the bytes received.

    ``allocate`` (with the first piece) names each model's token and tensors:
    their storage is allocated here, once, and later becomes FSDP2's own.
    """
    world = worlds.current
    if world is None or world.generation != generation:
        raise RuntimeError("world not set up")
    for name, how in allocate.items():
        world.incoming.pop(name, None)  # a re-sent model: free the old storage first
        device = torch.device("cpu") if how.on_cpu else world.device
        world.incoming[name] = (how.token, transfer.allocate(how.tensors, device))
    for (name, fqn, start), piece in zip(keys, data, strict=True):
        transfer.write_piece(world.incoming[name][1][fqn], start, piece)
    return sum(piece.nbytes for piece in data)


def _load_models(world: World, spec: CellSpec, skeletons: dict[str, bytes]) -> None:
    """Shard the models the notebook sent, on their delivered shards; check the engine still holds the others."""
    config = spec.fsdp
    shape = config.mesh_shape(world.world_size)
    if skeletons and shape not in world.meshes:
        world.meshes[shape] = device_mesh(config, world.world_size, world.device)
    for name, route in spec.models.items():
        if route.arrives is Arrival.HELD:
            if world.models.get(name, (None,))[0] != route.token:
                raise RuntimeError(f"engine lost its copy of {name!r}; run the cell again")
            continue
        skeleton = transfer.load_skeleton(skeletons[name])
        if route.arrives is Arrival.DELIVERED:
            delivered_token, shards = world.incoming.pop(name, (None, {}))
            if delivered_token != route.token:
                raise RuntimeError(f"engine did not receive its shards of {name!r}; run the cell again")
            sharded = shard_model(skeleton, world.device, config, world.meshes[shape], shards)
        else:
            made = frozenset(real_buffers(skeleton))  # kept by shard_model: not initialized again
            sharded = shard_model(skeleton, world.device, config, world.meshes[shape])
            shard = (world.rank % shape[1], shape[1])
            if route.source is not None:  # a pretrained model: its checkpoint, read here, is its "notebook" state
                loading.load_pretrained(route.source, sharded.module, world.device, shard, spec.seed, made)
            else:
                made |= loading.read_next(spec.request, name, config)  # not initialized, to be overwritten at once
                _materialize(world, sharded.module, config, shard, spec.seed, made)
        cast_buffers(sharded.module, config.dtypes()[2])
        world.models[name] = (route.token, sharded)
        if route.arrives is Arrival.INITIALIZED:
            world.in_notebook.pop(name, None)  # initialized here: the notebook has only its meta skeleton
        else:
            world.in_notebook[name] = writes.written(sharded.module)  # what the notebook sent, as it has it


def _materialize(
    world: World, model: nn.Module, config: FSDPConfig, shard: tuple[int, int], seed: int, made: frozenset[str]
) -> None:
    """A model built on the meta device: every rank initializes its shards under the same seeds (the buffers
    ``made`` by its constructor are kept); with sync_module_states rank 0 initializes the whole model and
    broadcasts each rank its shards."""
    if not config.sync_module_states:
        materialize(model, world.device, shard, seed, full=False, loaded=made)
        return
    state = materialize(model, world.device, shard, seed, full=True, loaded=made) if world.rank == 0 else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, state, options=options)


def _split_loaders(world: World, spec: CellSpec, read: dict[str, Any]) -> dict[str, loaders.SplitLoader]:
    """The notebook's DataLoaders the cell reads, each giving this rank its part (``nbfsdp.engines.loaders``)."""
    splits = {
        name: loaders.split(read[name], world.rank, world.world_size, per_rank=how.per_rank, seed_state=how.seed_state)
        for name, how in spec.loaders.items()
    }
    for name, split in splits.items():  # interval saves, and a resume part-way, need where in its epoch it is
        if spec.saves is not None or name in spec.loader_resume:
            loader_positions.track_positions(split.loader, spec.loader_resume.get(name))
    return splits


def _apply_live(models: list[ShardedModel], settings: dict[str, Any]) -> list[str]:
    """One settings change on every model of the cell; the changes as ``key=value``, once each."""
    changed = [change for sharded in models for change in apply_live(sharded, settings)]
    return list(dict.fromkeys(changed))


def run_cell(spec: CellSpec, values: bytes, skeletons: dict[str, bytes]) -> CellOutcome:
    """Run one cell on this rank, in the notebook's working directory; return its outcome, never raise.

    On any error the process group is torn down at once: peers blocked in a
    collective then fail within a second instead of waiting for the timeout.
    """
    with pasted.notebook_directory(spec.cwd):
        return _run_cell(spec, values, skeletons)


def _run_cell(spec: CellSpec, values: bytes, skeletons: dict[str, bytes]) -> CellOutcome:
    """The cell's named steps on this rank: enter (its models, namespace, loaders, code), execute (its code
    inside nbfsdp's instruments), its results back (``cell_results``)."""
    world = worlds.current
    if world is None or world.generation != spec.generation:
        return CellOutcome.failed("world not set up")
    cell: _Cell | None = None
    debugging.release()  # the last cell's failed frames: %debug is over once the next cell runs
    try:
        cell = _enter(world, spec, values, skeletons)
        cancelled = _execute(world, spec, cell)
        assert cell.recorder is not None  # _execute made it
        ran = CellOutcome(ok=True, cancelled=cancelled, metrics=cell.recorder.records, timeline=cell.timeline.captures)
        return cell_results.outcome(world, spec, ran, read=cell.read, split_loaders=cell.split_loaders)
    except BaseException as error:  # KeyboardInterrupt included: the world is broken either way
        return _failed(error, cell)


@dataclass
class _Cell:
    """One cell on this rank: what ``_enter`` prepared, and the instruments ``_execute`` ran it under."""

    models: list[ShardedModel]
    read: dict[str, Any]
    """The notebook's values it reads, and those an earlier cell of this world kept here."""
    split_loaders: dict[str, loaders.SplitLoader]
    code: CodeType
    control: RankControl
    saver: IntervalSaver | None
    timeline: StepTimeline
    recorder: metrics.Recorder | None = None
    rank_memory: RankMemory | None = None


def _enter(world: World, spec: CellSpec, values: bytes, skeletons: dict[str, bytes]) -> _Cell:
    """The cell's models sharded, its namespace filled, its loaders split, its code compiled."""
    _load_models(world, spec, skeletons)
    cell_models = [world.models[name][1] for name in spec.models]
    models = {name: sharded.module for name, (_, sharded) in world.models.items()}
    namespace = world.namespace
    namespace.update(__name__="__main__", __builtins__=builtins)
    read = transfer.unpack_values(values, models)
    missing = [name for name in spec.kept if name not in namespace]
    if missing:  # the kernel keeps only what an earlier cell of this world left here
        raise RuntimeError(f"nbfsdp: {', '.join(missing)} expected on the ranks from an earlier cell, not found")
    read.update((name, namespace[name]) for name in spec.kept)
    split_loaders = _split_loaders(world, spec, read)
    for value in read.values():
        if isinstance(value, Optimizer):
            optimizers.shard_state(value)
        optimizers.track_steps(value)
    namespace.update(read)
    namespace.update((name, models[name]) for name in spec.models)
    namespace.update(rank=world.rank, world_size=world.world_size, device=world.device, nbfsdp=nbfsdp)
    namespace["resume_step"] = spec.resume_step
    _remember_source(spec.filename, spec.code)
    route_bars(world.rank)  # rank 0's progress bars show in the notebook, the others' nowhere
    return _Cell(
        models=cell_models,
        read=read,
        split_loaders=split_loaders,
        code=compile(spec.code, spec.filename, "exec"),
        control=RankControl(spec.control, lambda settings: _apply_live(cell_models, settings)),
        saver=IntervalSaver(spec.saves, world) if spec.saves else None,
        timeline=StepTimeline(world, cell_models, every_seconds=spec.timeline, publish=publish_data),
    )


def _execute(world: World, spec: CellSpec, cell: _Cell) -> bool:
    """Run the cell's code (or nbfsdp's request) under the memory meter, the step boundaries, the memory limit
    and fp16's loss scaling; whether it was cancelled (every rank stops at the same step, a finished cell)."""
    params = [p for sharded in cell.models for p in sharded.module.parameters()]
    with metrics.MemoryMeter(world.device, params) as meter:
        boundaries = _instrument(world, spec, cell, meter)
        assert cell.recorder is not None and cell.rank_memory is not None  # _instrument made them
        failed, cancelled = True, False
        debugging.cell_begins(world.rank, spec, publish_data)  # breakpoint() prompts in the notebook
        try:
            with (
                pasted.cell_calls(spec.filename),
                writes.dcp_loads_counted(),
                scaling.scaled_losses(world, cell.models, cell.recorder),  # fp16: GradScaler's work, done here
                cell.rank_memory,  # --memory-limit; what a rank that runs out reports
            ):
                if spec.request is not None:
                    loading.run_request(spec.request, world.namespace)
                else:
                    exec(cell.code, world.namespace)
            failed = False
        except CellCancelled:
            cancelled, failed = True, False
        finally:
            debugging.cell_ends(world.timeout)
            metrics.active_recorder = None
            boundaries.remove()
            cell.timeline.end()
            if cell.saver is not None:
                cell.saver.end(failed=failed)
    return cancelled


def _instrument(world: World, spec: CellSpec, cell: _Cell, meter: metrics.MemoryMeter) -> StepBoundaries:
    """The cell's recorder (``nbfsdp.log``), its step boundaries (live changes, captures, interval saves) and
    its memory limit, set on ``cell``; the boundaries, removed when it ends."""
    saver, timeline, modules = cell.saver, cell.timeline, [s.module for s in cell.models]
    recorder = cell.recorder = metrics.active_recorder = metrics.Recorder(
        world.rank, meter, publish_data, None if cell.models else cell.control, saver.at_log if saver else None
    )
    recorder.on_step = timeline.logged
    timeline.on_allocated = lambda step, allocated: recorder.captured_peak(step, meter.held() + allocated)
    cell.rank_memory = RankMemory(
        world,
        modules,
        meter,
        limit=spec.fsdp.memory_limit,
        ranks_per_gpu=spec.ranks_per_gpu,
        on_first_call=(lambda call: publish_data({"first_call": call})) if world.rank == 0 else None,
    )
    return StepBoundaries(
        modules, cell.control, recorder.changed, saver.agreement if saver else None, on_step=timeline.at_forward
    )


def _failed(error: BaseException, cell: _Cell | None) -> CellOutcome:
    """A failed cell's outcome; the process group torn down at once, so peers blocked in a collective fail
    within a second instead of waiting for the timeout."""
    message = f"{type(error).__name__}: {error}"
    if dist.is_initialized():
        dist.destroy_process_group()
    worlds.current = None
    quit_debugger = isinstance(error, bdb.BdbQuit)
    # KeyboardInterrupt: the client interrupted this rank because of another failure or the user
    interrupted = (KeyboardInterrupt, PeerEnded, debugging.PromptInterrupted)
    secondary = isinstance(error, interrupted) or any(m in message for m in _PEER_FAILURE_MARKERS)
    if not (secondary or quit_debugger):  # this rank's own error: its frames stay for %debug
        debugging.keep_failure(error)
    return CellOutcome(
        ok=False,
        error=message,
        traceback=_user_traceback(error),
        secondary=secondary,
        quit_debugger=quit_debugger,
        kept_frames=debugging.kept() is not None,
        metrics=cell.recorder.records if cell is not None and cell.recorder else [],
        memory=cell.rank_memory.report() if cell is not None and cell.rank_memory else None,
        timeline=cell.timeline.captures if cell is not None else [],
    )
