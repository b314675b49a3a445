"""Code that runs on the engines: the process group, the cell's namespace, sharding, gather.

The client calls ``setup`` once per world and ``run_cell`` once per cell, on
every rank at once, after ``receive_shards`` for each piece of any model the
cell needs anew. State lives in this module between cells: the namespace
the cells run in and the sharded models, so optimizer state and anything else
a cell leaves on the engines survive until the world is restarted.
"""

from __future__ import annotations

import builtins
import datetime
import linecache
import os
import traceback
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from ipyparallel.datapub import publish_data
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

import nbfsdp  # the package root, as the cell sees it (nbfsdp.log); it imports nothing on its own
from nbfsdp.engines import checkpointing, hosts, loaders, metrics, pasted, release, scaling, where, writes
from nbfsdp.engines import world as worlds
from nbfsdp.engines.control import CellCancelled, PeerEnded, RankControl, StepBoundaries
from nbfsdp.engines.memory_limit import RankMemory
from nbfsdp.engines.progress import route_bars
from nbfsdp.engines.sharding import ShardedModel, apply_live, cast_buffers, device_mesh, real_buffers, shard_model
from nbfsdp.engines.timeline import StepTimeline, clock_offset_ns
from nbfsdp.engines.world import World
from nbfsdp.shared import optimizers, torch_private, transfer
from nbfsdp.shared.config import FSDPConfig
from nbfsdp.shared.initializing import materialize
from nbfsdp.shared.network import interface_of, loopback_interface, source_address
from nbfsdp.shared.protocol import CellOutcome, CellSpec, EngineInfo, GatherModel, ShardAllocation, WorldSetup

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
    seconds = datetime.timedelta(seconds=joining.timeout)
    release.world_begins(generation)  # before the store: the connections made from here are the world's
    script_store = None
    if joining.rendezvous is None:
        _use_interface(loopback_interface())
        assert joining.store_path is not None  # nbfsdp's own cluster: a file in its private directory
        store: dist.Store = dist.FileStore(joining.store_path, world_size)
        listening = hosts.take_rendezvous() if rank == 0 else None
        if listening is not None:
            # the store MASTER_ADDR:MASTER_PORT name, on the loopback socket the kernel had rank 0 open: a script
            # that opens a store of its own at torchrun's address finds one there, as torchrun's agent store
            # would be; the world's group keeps its private FileStore
            script_store = torch_private.store_on(listening, world_size, seconds)
    else:
        address, port = joining.rendezvous
        _use_interface(interface_of(source_address(address)))
        listening = hosts.take_rendezvous() if rank == 0 else None
        if listening is not None:
            store = torch_private.store_on(listening, world_size, seconds)  # the store owns the socket now
        else:
            store = dist.TCPStore(address, port, world_size, rank == 0, timeout=seconds, wait_for_workers=False)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=seconds,
        device_id=device if backend == "nccl" else None,
    )
    worlds.current = World(
        rank=rank,
        world_size=world_size,
        device=device,
        generation=generation,
        script_store=script_store,
        # one machine's ranks share its clock; over several hosts a captured step's times go on rank 0's
        clock_offset_ns=clock_offset_ns(device) if joining.rendezvous is not None else 0,
    )
    where.watch(joining.where_dir, rank)
    pasted.install(rank, device)  # a pasted script's init/destroy_process_group, taken as this world's
    return describe()


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
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
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
    for name in spec.models:
        token = spec.model_tokens[name]
        if name in skeletons:
            skeleton = transfer.load_skeleton(skeletons[name])
            if name in spec.materialize:
                made = frozenset(real_buffers(skeleton))  # kept by shard_model: not initialized again
                sharded = shard_model(skeleton, world.device, config, world.meshes[shape])
                shard = (world.rank % shape[1], shape[1])
                if name in spec.sources:  # a pretrained model: its checkpoint, read here, is its "notebook" state
                    source = spec.sources[name]
                    checkpointing.load_pretrained(source, sharded.module, world.device, shard, spec.seed, made)
                else:
                    _materialize(world, sharded.module, config, shard, spec.seed, made)
            else:
                delivered_token, shards = world.incoming.pop(name, (None, {}))
                if delivered_token != token:
                    raise RuntimeError(f"engine did not receive its shards of {name!r}; run the cell again")
                sharded = shard_model(skeleton, world.device, config, world.meshes[shape], shards)
            cast_buffers(sharded.module, config.dtypes()[2])
            world.models[name] = (token, sharded)
            if name in spec.materialize and name not in spec.sources:
                world.in_notebook.pop(name, None)  # initialized here: the notebook has only its meta skeleton
            else:
                world.in_notebook[name] = writes.written(sharded.module)  # what the notebook sent, as it has it
        elif world.models.get(name, (None,))[0] != token:
            raise RuntimeError(f"engine lost its copy of {name!r}; run the cell again")


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


def _names_back(world: World, spec: CellSpec, read: dict[str, Any], outcome: CellOutcome) -> None:
    """What rank 0 sends back besides the models, into ``outcome``: the names the cell assigned, pickled,
    and the trained state of the notebook's own optimizers and schedulers (to load in place), with why any
    name stays.

    What the notebook has its own copy of travels as a reference to it (``transfer.model_references``):
    a parameter of a cell's model comes back as the notebook model's own. Another sharded tensor comes
    back whole; an optimizer's sharded state too, gathered like the weights. Both are collectives:
    every rank walks the same names in the same order.
    """
    gather = spec.gather != []
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


#: A model living on the ranks brings its trained parameters back after a cell where they are at most this share
#: of its parameters' bytes: adapters (LoRA's are well under 1%) on a frozen base, which stays on the ranks.
ADAPTER_SHARE = 0.1


def _adapters(model: nn.Module) -> list[bool] | None:
    """Which of ``model``'s tensors (``writes.written``'s order) are trainable parameters, where those are a small
    part of it (``ADAPTER_SHARE``); None for a model that trains more (it lives wholly on the ranks)."""
    tensors = [*model.parameters(), *model.buffers()]
    trainable = [isinstance(t, nn.Parameter) and t.requires_grad for t in tensors]
    nbytes = {id(t): t.numel() * t.element_size() for t in model.parameters()}
    trained = sum(nbytes[id(t)] for t, flag in zip(tensors, trainable, strict=True) if flag)
    return trainable if 0 < trained <= ADAPTER_SHARE * sum(nbytes.values()) else None


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


def _split_loaders(world: World, spec: CellSpec, read: dict[str, Any]) -> dict[str, loaders.SplitLoader]:
    """The notebook's DataLoaders the cell reads, each giving this rank its part (``nbfsdp.engines.loaders``)."""
    splits = {
        name: loaders.split(read[name], world.rank, world.world_size, how.per_rank, how.seed_state)
        for name, how in spec.loaders.items()
    }
    for name, split in splits.items():  # interval saves, and a resume part-way, need where in its epoch it is
        if spec.saves is not None or name in spec.loader_resume:
            checkpointing.track_positions(split.loader, spec.loader_resume.get(name))
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
    world = worlds.current
    if world is None or world.generation != spec.generation:
        return CellOutcome.failed("world not set up")
    recorder = rank_memory = timeline = None
    try:
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
        code = compile(spec.code, spec.filename, "exec")
        params = [p for sharded in cell_models for p in sharded.module.parameters()]
        control = RankControl(spec.control, lambda settings: _apply_live(cell_models, settings))
        cancelled = False
        route_bars(world.rank)  # rank 0's progress bars show in the notebook, the others' nowhere
        saver = checkpointing.IntervalSaver(spec.saves, world) if spec.saves else None
        timeline = StepTimeline(
            every_seconds=spec.timeline,
            rank=world.rank,
            device=world.device,
            models=cell_models,
            publish=publish_data,
            clock_offset_ns=world.clock_offset_ns,
        )
        with metrics.MemoryMeter(world.device, params) as meter:
            recorder = metrics.active_recorder = metrics.Recorder(
                world.rank, meter, publish_data, None if cell_models else control, saver.at_log if saver else None
            )
            recorder.on_step = timeline.logged
            timeline.on_allocated = lambda step, allocated: recorder.captured_peak(step, meter.held() + allocated)
            boundaries = StepBoundaries(
                [s.module for s in cell_models],
                control,
                recorder.changed,
                saver.agreement if saver else None,
                on_step=timeline.at_forward,
            )
            failed = True
            rank_memory = RankMemory(
                world.rank,
                world.device,
                [s.module for s in cell_models],
                spec.fsdp.memory_limit,
                meter,
                spec.ranks_per_gpu,
                on_first_call=(lambda call: publish_data({"first_call": call})) if world.rank == 0 else None,
            )
            try:
                with (
                    pasted.cell_calls(spec.filename),
                    writes.dcp_loads_counted(),
                    scaling.scaled_losses(world, cell_models, recorder),  # fp16: GradScaler's work, done here
                    rank_memory,  # --memory-limit; what a rank that runs out reports
                ):
                    if spec.request is not None:
                        checkpointing.run_request(spec.request, namespace)
                    else:
                        exec(code, namespace)
                failed = False
            except CellCancelled:
                cancelled, failed = True, False  # every rank stops at the same step; the cell ends as a finished one
            finally:
                metrics.active_recorder = None
                boundaries.remove()
                timeline.end()
                if saver is not None:
                    saver.end(failed)
        for sharded in cell_models:  # see _reshard_all
            _reshard_all(sharded)
        outcome = CellOutcome(
            ok=True,
            cancelled=cancelled,
            metrics=recorder.records,
            settings={name: world.models[name][1].config for name in spec.models},
            timeline=timeline.captures,
        )
        _names_back(world, spec, read, outcome)
        # the models that may come back, and those living on the ranks (whose changes the kernel records); none
        # under --no-gather otherwise, so such a cell ends with no collective of nbfsdp's own
        watched = [name for name in spec.models if name in spec.gather or name in spec.on_ranks]
        changed = _changed_on_any_rank(world, watched, models)
        written = [name for name in watched if any(changed[name])]
        request = spec.request if isinstance(spec.request, GatherModel) else None
        # nbfsdp.gather: the notebook has only the skeleton, so the weights go whatever was written
        gathered = [name for name in spec.gather if name in written or request is not None]
        states = {
            name: _full_state(models[name], request)
            if request is not None or all(changed[name])
            else _changed_state(models[name], changed[name])
            for name in gathered
        }
        for name in spec.trained_back:  # a LoRA model living on the ranks: its adapters come back, not its base
            adapters = _adapters(models[name])
            if name in written and adapters is not None:
                trained = [a and b for a, b in zip(changed[name], adapters, strict=True)]
                states[name] = _changed_state(models[name], trained)
                world.in_notebook[name] = writes.written(models[name])  # a later cell sends them back only if changed
        world.in_notebook.update((name, writes.written(models[name])) for name in gathered)
        if world.rank == 0:
            outcome.written = written
            outcome.loaders = {name: split.state() for name, split in split_loaders.items()}
            outcome.states = states
        return outcome
    except BaseException as error:  # KeyboardInterrupt included: the world is broken either way
        message = f"{type(error).__name__}: {error}"
        if dist.is_initialized():
            dist.destroy_process_group()
        worlds.current = None
        return CellOutcome.failed(
            message,
            traceback=_user_traceback(error),
            # KeyboardInterrupt: the client interrupted this rank because of another failure or the user
            secondary=isinstance(error, (KeyboardInterrupt, PeerEnded))
            or any(m in message for m in _PEER_FAILURE_MARKERS),
            metrics=recorder.records if recorder else [],
            memory=rank_memory.report() if rank_memory else None,
            timeline=timeline.captures if timeline else None,
        )
