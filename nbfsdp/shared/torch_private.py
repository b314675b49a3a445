"""Every private or internal PyTorch API nbfsdp relies on, in one place (the planner's attention kernels, used
only in the kernel, are in ``nbfsdp.kernel.planning.torch_private``).

Each function says what it relies on; ``tests/test_torch_private.py`` calls each one directly on
real FSDP2 units, so a PyTorch release that moves one fails there, by name, instead of deep inside
a cell. Nothing is patched on import: the engines call ``patch_fsdp2_for_torch_2_6`` when a world is set
up. Runs wherever torch runs: the notebook's kernel and the engines.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import inspect
import socket
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Placement, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode_temporarily
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.data import DataLoader, Sampler
from torch.utils.data.dataloader import _InfiniteConstantSampler

__all__ = [
    "TorchDispatchMode",
    "abort_nccl_communicators",
    "apply_to_tensors",
    "checkpoint",
    "childless_copy",
    "cpu_attention_flop_formulas",
    "dcp_load_in_one_process",
    "fsdp_unit_states",
    "gathered_from",
    "infinite_sampler",
    "is_iterable_loader",
    "is_persistent_buffer",
    "is_step_tracked",
    "local_tensor",
    "mark_optimizer_stepped",
    "mark_step_tracked",
    "operator_name",
    "own_buffers",
    "own_parameters",
    "patch_fsdp2_for_torch_2_6",
    "paused_dispatch_mode",
    "pop_saved_tensors_hooks",
    "profiled_allocation_peak",
    "profiler_events",
    "push_saved_tensors_hooks",
    "put_buffer",
    "put_parameter",
    "replaced",
    "set_checkpointing",
    "collective_timeout_settable",
    "set_collective_timeout",
    "set_mixed_precision",
    "set_reshard_after_forward",
    "set_unshard_async_op",
    "shard_whole_tensor",
    "store_on",
    "top_saved_tensors_hooks",
    "tree_flatten",
    "tree_map",
    "tree_unflatten",
    "unscale_and_check_",
    "update_scale_",
    "version",
    "view_base",
]


def _cpu_streams_for_fsdp2() -> None:
    """FSDP2 records and waits on events of its streams; on CPU those are ``torch.cpu.Stream``, which gained
    its no-op ``record_event`` / ``wait_event`` in torch 2.7 (pytorch#145935). On torch 2.6 FSDP2 on CPU
    fails at its first all-gather without them, so they are added, the same no-ops, where missing."""
    stream = torch.cpu.Stream
    if not hasattr(stream, "record_event"):
        # an Event, not 2.7's None: FSDP2 2.6 asserts it has one after an all-reduce (NO_SHARD, HSDP)
        stream.record_event = lambda self: torch.cpu.Event()  # type: ignore[method-assign,assignment]
    if not hasattr(stream, "wait_event"):
        stream.wait_event = lambda self, event: None  # type: ignore[method-assign]


def _cpu_copy_out_for_fsdp2() -> None:
    """FSDP2 writes each all-gather into the unsharded parameters with ``torch.ops.fsdp.split_with_sizes_copy``.
    On CPU that write bumps their autograd version counter (CUDA's fast path does not, pytorch#132014), so a
    parameter gathered again for backward fails autograd's check on the tensors it saved in forward. From
    torch 2.7 FSDP2 restores the counters around the copy itself; on 2.6 the op is wrapped to do the same."""
    if torch.__version__ >= "2.7":
        return
    importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_collectives")  # defines torch.ops.fsdp
    copy = torch.ops.fsdp.split_with_sizes_copy

    def split_with_sizes_copy(
        all_gather_output: torch.Tensor, split_sizes: list[int], dim: int = 0, *, out: list[torch.Tensor]
    ) -> None:
        versions = [(t, t._version) for t in out if not t.is_inference()]
        copy(all_gather_output, split_sizes, dim=dim, out=out)
        for tensor, version in versions:
            # torch 2.6's signature (one tensor, its version); the stubs are this torch's (sequences)
            torch._C._autograd._unsafe_set_version_counter(tensor, version)  # type: ignore[arg-type]

    # torch 2.6's op, which the stubs (this torch's) do not know: the overload FSDPMemTracker instruments, and
    # the op itself, looked up at each all-gather
    split_with_sizes_copy.default = copy.default  # type: ignore[attr-defined]
    torch.ops.fsdp.split_with_sizes_copy = split_with_sizes_copy  # type: ignore[attr-defined]


def _gloo_gradient_mean_for_fsdp2() -> None:
    """FSDP2 averages fp32/bf16 gradients with ``ReduceOp.AVG``. Gloo on torch 2.6 has no AVG: its
    ``reduce_scatter_tensor`` silently sums (gradients N times too large) and its ``all_reduce`` (HSDP)
    raises. From torch 2.7 gloo averages; on 2.6 FSDP2 is given, on gloo groups, the divide-then-sum
    factors it already uses for fp16 (``_fsdp_collectives._get_gradient_divide_factors``), which it pairs
    with ``ReduceOp.SUM``."""
    if torch.__version__ >= "2.7":
        return
    collectives = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_collectives")
    factors = collectives._get_gradient_divide_factors

    def gradient_divide_factors(
        reduce_scatter_group: dist.ProcessGroup, all_reduce_group: dist.ProcessGroup | None, reduce_dtype: torch.dtype
    ) -> tuple[float, float] | tuple[None, None]:
        if dist.get_backend(reduce_scatter_group) == "gloo":
            reduce_dtype = torch.float16  # the dtype FSDP2 divides for itself
        return factors(reduce_scatter_group, all_reduce_group, reduce_dtype)

    # a global foreach_reduce looks up (torch 2.6's; the stubs are this torch's, without it)
    collectives._get_gradient_divide_factors = gradient_divide_factors  # type: ignore[attr-defined]


#: Whether ``patch_fsdp2_for_torch_2_6`` has run in this process.
_patched = False


def patch_fsdp2_for_torch_2_6() -> None:
    """What FSDP2 on torch 2.6 lacks for the ranks' CPU and gloo worlds (each a no-op from 2.7): called by
    ``engine.setup`` before a world's first collective, never on import."""
    global _patched
    if _patched:  # each world's set-up calls it: the wrappers go on once
        return
    _cpu_streams_for_fsdp2()
    _cpu_copy_out_for_fsdp2()
    _gloo_gradient_mean_for_fsdp2()
    _patched = True


# -- dispatch modes and pytrees: ``torch.utils._python_dispatch`` and ``torch.utils._pytree`` (no public
# equivalent in torch 2.6; ``torch.utils.pytree`` is not there either)


@contextlib.contextmanager
def paused_dispatch_mode() -> Iterator[None]:
    """Operators run past the innermost dispatch mode while inside: ``_pop_mode_temporarily``."""
    with _pop_mode_temporarily():
        yield


def operator_name(func: Any) -> str:
    """An ``OpOverload``'s operator without its overload (``"c10d::allreduce_"``, ``"aten::add"``), as a
    dispatch mode's ``__torch_dispatch__`` receives it: ``func._schema.name``."""
    return func._schema.name


def apply_to_tensors(model: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Hand every parameter and buffer of ``model`` (and its submodules) ``fn``'s tensor in its place, as
    ``to_empty`` hands each an ``empty_like``: ``nn.Module._apply``, which FSDP2 overrides to take the new
    tensors as its sharded storage."""
    model._apply(fn)


def local_tensor(dtensor: DTensor) -> torch.Tensor:
    """This rank's shard: ``DTensor._local_tensor``, which ``to_local()`` returns through an autograd op
    (measurably slow when memory is counted at every optimizer step)."""
    return dtensor._local_tensor


def set_mixed_precision(unit: FSDPModule, policy: MixedPrecisionPolicy) -> None:
    """Switch a sharded unit to ``policy`` between steps; FSDP2 has no setter for it (torch 2.13).

    Relies on ``FSDPState._mp_policy``, ``FSDPParamGroup.mp_policy`` and ``_init_mp_dtypes()``, and on
    each ``FSDPParam``'s ``all_gather_outputs`` and ``_unsharded_param``: dropped, the next all-gather
    makes them in the new dtype. Every parameter must be sharded (between steps).
    """
    state = unit._get_fsdp_state()
    state._mp_policy = policy
    group = state._fsdp_param_group
    if group is None:  # a unit that owns no parameters
        return
    group.mp_policy = policy
    group._init_mp_dtypes()
    for param in group.fsdp_params:
        param.all_gather_outputs = []
        if hasattr(param, "_unsharded_param"):
            del param._unsharded_param


def set_reshard_after_forward(unit: FSDPModule, *, reshard: bool) -> None:
    """Have ``unit`` alone free its gathered parameters after forward or keep them for backward, between steps.

    ``FSDPModule.set_reshard_after_forward(reshard, recurse=False)`` from torch 2.7; on 2.6, what it sets: the
    ``FSDPParamGroup.post_forward_mesh_info`` (the unit's own mesh to reshard to, None to stay gathered).
    """
    if hasattr(unit, "set_reshard_after_forward"):
        unit.set_reshard_after_forward(reshard, recurse=False)
        return
    group = unit._get_fsdp_state()._fsdp_param_group
    if group is not None:  # a unit that owns no parameters
        # as FSDPParamGroup.__init__ sets it (torch annotates the two as different mesh infos)
        group.post_forward_mesh_info = group.mesh_info if reshard else None  # type: ignore[assignment]


def fsdp_unit_states(model: nn.Module) -> list[dict[str, Any]]:
    """What each FSDP unit of ``model`` that owns parameters holds on this rank now, in module order: its
    parameters sharded or gathered, its training state, an all-gather issued and not yet waited on, a
    reduce-scatter not yet waited on, and its parameter bytes here and whole.

    Relies on ``FSDPModule._get_fsdp_state()._fsdp_param_group`` and on the group's ``_sharded_state``,
    ``_training_state``, ``_all_gather_result``, ``_post_reduce_event`` and ``fsdp_params`` (each one's
    ``sharded_param``), the same in torch 2.6 and 2.13.
    """
    rows = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule) or (group := module._get_fsdp_state()._fsdp_param_group) is None:
            continue
        shards = [param.sharded_param for param in group.fsdp_params]
        rows.append(
            {
                "unit": name or "(root)",
                "state": group._sharded_state.name,
                "training": group._training_state.name,
                "all_gather_pending": group._all_gather_result is not None,
                "reduce_scatter_pending": group._post_reduce_event is not None,
                "params": len(shards),
                "local_bytes": sum(local_tensor(cast(DTensor, shard)).nbytes for shard in shards),
                "full_bytes": sum(shard.numel() * shard.element_size() for shard in shards),
            }
        )
    return rows


def gathered_from(model: nn.Module, tensor: torch.Tensor) -> tuple[str, DTensor] | None:
    """Where ``tensor`` is a parameter FSDP2 gathered for a unit of ``model`` (registered on the module in place of
    the sharded one while the unit computes): the unit's name and the sharded parameter; else None.

    Relies on each ``FSDPParam``'s ``_unsharded_param`` (set while gathered) and ``sharded_param``.
    """
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule) or (group := module._get_fsdp_state()._fsdp_param_group) is None:
            continue
        for param in group.fsdp_params:
            if getattr(param, "_unsharded_param", None) is tensor:
                return name or "(root)", cast(DTensor, param.sharded_param)
    return None


def collective_timeout_settable() -> bool:
    """Whether ``set_collective_timeout`` takes on this torch (not on 2.6, whose gloo keeps a group's first)."""
    return torch.__version__ >= "2.7"


def set_collective_timeout(timeout: datetime.timedelta) -> bool:
    """Give every process group of this world ``timeout`` for the collectives issued from now on; whether it took.

    ``distributed_c10d._set_pg_timeout`` on each group of ``_world.pg_map`` (the world and a mesh's subgroups).
    A collective already issued keeps its timeout. On torch 2.6 gloo ignores it (measured: its next all_reduce
    still timed out at the group's first timeout): False there.
    """
    from torch.distributed import distributed_c10d

    if not collective_timeout_settable() or not dist.is_initialized():
        return False
    for group in list(distributed_c10d._world.pg_map):
        distributed_c10d._set_pg_timeout(timeout, group)
    return True


def set_unshard_async_op(model: nn.Module, *, async_op: bool) -> None:
    """Have every FSDP unit of ``model`` (an FSDP root) issue its all-gathers, its own and those it prefetches,
    with ``async_op``.

    On a GPU FSDP2 gathers on a stream of its own, so a prefetched gather overlaps the compute before it. On the
    CPU (gloo) it has no stream to run one on, and issues each gather synchronously: a prefetch only moves the
    wait earlier (0% of the communication hidden, measured). With ``async_op=True`` gloo runs the gather in its
    own thread and FSDP2 waits on it in the unit's pre-forward or pre-backward: 44-65% hidden.
    ``FSDPModule._set_unshard_async_op``, private from torch 2.6 to 2.13; it sets every unit below too."""
    cast(FSDPModule, model)._set_unshard_async_op(async_op)


def profiler_running() -> bool:
    """Whether a ``torch.profiler`` session is on in this process (``torch._C._autograd._profiler_enabled``): a
    cell's own, or nbfsdp's capture of a step unless a cell's profiler ended it (one session at a time: the inner
    one's end ends both)."""
    return bool(torch._C._autograd._profiler_enabled())


def profiler_events(profiler: Any) -> tuple[list[tuple[str, int, int, int, bool, int, int]], int]:
    """A stopped ``torch.profiler.profile``'s events as ``(name, start_ns, end_ns, thread, on_device, correlation,
    linked correlation)``, and the trace's start (nanoseconds since the epoch), read from the Kineto results it
    keeps (``profile.profiler.kineto_results``, undocumented): ``profile.events()`` would make a ``FunctionEvent``
    of each, with its children and memory, 10 to 50 times slower, on the step after the captured one."""
    results = profiler.profiler.kineto_results
    device = torch.autograd.DeviceType.CPU
    events = [
        (
            e.name(),
            e.start_ns(),
            e.end_ns(),
            e.start_thread_id(),
            e.device_type() != device,
            e.correlation_id(),
            e.linked_correlation_id(),
        )
        for e in results.events()
        if e.name() != "[memory]"
    ]
    return events, results.trace_start_ns()


def profiled_allocation_peak(profiler: Any, threads: set[int]) -> int:
    """The most bytes of CPU tensors a ``torch.profiler.profile(profile_memory=True)`` saw allocated at once of
    those allocated while it ran (its ``[memory]`` events, each allocation's bytes and each free's negative) on
    ``threads``: what a step allocated above what it found. Tensors allocated before are not counted, nor their
    frees (the profiler's CPU reporter knows no size for them). Only the step's own threads: gloo's workers
    stage transfers in buffers of their own, which a GPU's allocator statistics do not count for NCCL either,
    and which come and go with the scheduling (a rank's peak 8% higher when they met it under load). The price:
    a step thread's tensor that gloo's thread frees (a finished asynchronous gather's buffer) is not seen freed,
    and the profiler's events name no address to pair it by, so under load the figure can be off by such
    buffers (12% against FSDPMemTracker once, in course 02; 0.45 MB above a --memory-limit the ranks kept)."""
    cpu = torch.autograd.DeviceType.CPU
    live = peak = 0
    for event in sorted(
        (
            e
            for e in profiler.profiler.kineto_results.events()
            if e.name() == "[memory]" and e.device_type() == cpu and e.start_thread_id() in threads
        ),
        key=lambda e: e.start_ns(),
    ):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def release_profiler_results(profiler: Any) -> None:
    """Frees a stopped ``torch.profiler.profile``'s results now. The profile object is in a reference cycle (its
    ``action_map`` holds its own bound methods), so its Kineto results, megabytes of native memory for a captured
    step, would wait for Python's cyclic collector: 50 cells each capturing a step grew an engine by 80 MiB."""
    profiler.profiler = None


def shard_whole_tensor(tensor: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """This rank's part of a tensor that every rank holds whole, split as FSDP2 splits a parameter.

    ``distribute_tensor(..., src_data_rank=None)`` (torch 2.7 on) takes it without communicating; torch 2.6 has
    no ``src_data_rank`` and scatters rank 0's copy instead: the same values, through a collective every rank
    makes in the same order.
    """
    if "src_data_rank" in inspect.signature(distribute_tensor).parameters:
        return distribute_tensor(tensor, mesh, placements, src_data_rank=None)
    return distribute_tensor(tensor, mesh, placements)


def set_checkpointing(module: nn.Module, *, enabled: bool) -> None:
    """Switch composable ``checkpoint(module)``'s recomputation on or off: its state's ``enable_hook``."""
    checkpoint.state(module).enable_hook = enabled


def push_saved_tensors_hooks(pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], torch.Tensor]) -> None:
    """Push autograd's saved-tensor hooks for the rest of the cell, not a ``with`` block: a cell's steps
    run between the meter's calls. ``torch._C._autograd._push_saved_tensors_default_hooks``."""
    torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


def pop_saved_tensors_hooks() -> None:
    torch._C._autograd._pop_saved_tensors_default_hooks()


#: ``torch._C._autograd._top_saved_tensors_default_hooks`` (torch 2.8 on): no public way to ask exists.
_top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def top_saved_tensors_hooks() -> tuple[Callable, Callable] | None | bool:
    """The (pack, unpack) hooks on top of this thread's stack, None if there are none, or False where torch
    cannot tell (before 2.8)."""
    return False if _top is None else _top(False)  # noqa: FBT003 (torch's binding takes its flag positionally only)


def mark_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    """What ``LRScheduler``'s wrapper of ``optimizer.step`` sets: ``_opt_called``, read by its order check."""
    optimizer._opt_called = True  # type: ignore[attr-defined]  # LRScheduler's own mark on the instance


def mark_step_tracked(step: Callable) -> None:
    """``_wrapped_by_lr_sched``: LRScheduler's mark that ``step`` is its wrapper (it wraps only once)."""
    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # LRScheduler's own mark on the function


def is_step_tracked(step: Callable) -> bool:
    return hasattr(step, "_wrapped_by_lr_sched")


def unscale_and_check_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Multiply ``grads`` (plain tensors of one device) by ``inv_scale`` in place, and set ``found_inf`` to 1 where
    any holds inf or NaN: GradScaler's own fused kernel (``torch._amp_foreach_non_finite_check_and_unscale_``),
    which, unlike ``GradScaler.unscale_``, takes fp16 gradients and needs no optimizer."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> None:
    """GradScaler's update of its dynamic scale in place (``torch._amp_update_scale_``): times ``backoff_factor``
    where ``found_inf``, times ``growth_factor`` after ``growth_interval`` steps without."""
    torch._amp_update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval)


def is_iterable_loader(loader: DataLoader) -> bool:
    """The loader reads an ``IterableDataset``: ``DataLoader._dataset_kind`` (0 map-style, 1 iterable)."""
    return bool(loader._dataset_kind)


def infinite_sampler() -> Sampler:
    """The sampler a DataLoader over an ``IterableDataset`` batches from: ``_InfiniteConstantSampler``
    (yields None forever; the dataset supplies the samples)."""
    return _InfiniteConstantSampler()


def dcp_load_in_one_process(state: dict[str, Any], reader: Any) -> None:
    """``dcp.load`` in a process with no process group (the kernel), whole tensors from every rank's shards.

    torch 2.7 added ``no_dist=True`` to say so; torch 2.6 has no such argument and loads in one process
    whenever ``torch.distributed`` is not initialized, which the kernel never initializes. Either way the
    warning that it assumes one process is the point here, not news."""
    import torch.distributed.checkpoint as dcp  # the kernel's reads only: engines never need it here

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is (disabled|unavailable)", UserWarning)
        if "no_dist" in inspect.signature(dcp.load).parameters:
            dcp.load(state, storage_reader=reader, no_dist=True)
        else:
            dcp.load(state, storage_reader=reader)


def store_on(listening: socket.socket, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The server of a ``TCPStore`` on a socket bound and listening already (an address of nbfsdp's choosing:
    TCPStore's own server listens on every interface, pytorch#173909); the store owns the socket then.

    torch 2.6's default libuv server refuses a listen fd ("does not support initialization with an listen
    fd") before it takes the socket; the legacy server, its ``use_libuv=False``, takes it then."""
    address, port = listening.getsockname()[:2]
    settings: dict[str, Any] = dict(
        is_master=True, timeout=timeout, wait_for_workers=False, master_listen_fd=listening.detach()
    )
    try:
        return dist.TCPStore(address, port, world_size, **settings)
    except NotImplementedError:
        return dist.TCPStore(address, port, world_size, **settings, use_libuv=False)


def cpu_attention_flop_formulas() -> dict[Any, Callable[..., int]]:
    """``FlopCounterMode``'s formulas for ``scaled_dot_product_attention`` on CPU, for its ``custom_mapping``.

    On CPU the attention runs as ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its ``_backward``),
    private ops ``torch.utils.flop_counter`` has no formula for (torch 2.13): it counts them 0, while it counts
    the GPU's flash, efficient and cuDNN attention. They take the same leading arguments as the GPU's flash op
    (query, key, value; the backward's gradient first), so they are counted here with the GPU flash op's own
    registered formulas (``sdpa_flop``, ``sdpa_backward_flop``): a CPU rank and a GPU rank count the same FLOPs.
    The registered formulas already read shapes from tensors (``shape_wrapper``), so they are marked raw for
    ``FlopCounterMode``, which would wrap them a second time."""
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    pairs = {
        aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: aten._scaled_dot_product_flash_attention_backward,
    }
    formulas: dict[Any, Callable[..., int]] = {}
    for cpu_op, gpu_op in pairs.items():
        formula = flop_registry[gpu_op]

        def counted(*args: Any, _formula: Callable[..., int] = formula, **kwargs: Any) -> int:
            return _formula(*args, **kwargs)

        counted._get_raw = True  # type: ignore[attr-defined]
        formulas[cpu_op] = counted
    return formulas


#: FSDPMemTracker's categories (``_FSDPRefType`` values) as ``%fsdp explain``'s planner files the same bytes
#: (``nbfsdp.kernel.planning.peak``): the gathered parameters and autograd's unsharded gradients are
#: communication buffers there, as FSDP2 allocates them around its all-gathers and reduce-scatters.
MEMORY_TRACKER_CATEGORIES = {
    "Sharded Param": "params",
    "Buffer": "params",
    "Sharded Grad": "grads",
    "OptState": "optim",
    "Activation": "activations",
    "Inputs": "activations",
    "Temp": "temporaries",
    "Unsharded Param": "comm_buffers",
    "Unsharded Grad": "comm_buffers",
    "All Gather": "comm_buffers",
    "Reduce Scatter": "comm_buffers",
}


def limited_memory_tracker(root: nn.Module, over_limit: Callable[[int, int], None]) -> Any:
    """``FSDPMemTracker`` over the FSDP model ``root`` that calls ``over_limit(asked, total)`` each time a
    storage it tracks is made or grows (``asked`` bytes) and its tracked total is then ``total``.

    Relies on ``torch.distributed._tools.fsdp2_mem_tracker`` (private) and overrides three of its private
    methods: ``_update_snap`` (every change of its running totals), ``_fsdp_state_pre_forward`` (a root
    called again is the next iteration, which FSDPMemTracker refuses unless its per-module statistics are
    reset; they are not used here) and ``_register_module_and_optimizer_hooks`` (its optimizer hooks are
    global here: a cell makes its optimizer after the tracker starts). ``doing`` says what the rank was
    doing: the unit FSDP2 was gathering or reducing, else the operator."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
    from torch.distributed._tools.mem_tracker import _UpdateType
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    grows = (_UpdateType.ADD, _UpdateType.SIZE)

    class LimitedTracker(FSDPMemTracker):
        unit = "(before the first unit)"
        collective = ""  # FSDP2's all-gather or reduce-scatter of ``unit`` under way, else ""
        operator = ""

        def _update_snap(self, u_type: Any, winfo: Any, old_mem_consumed: Any = None, old_reftype: Any = None) -> None:
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
            if u_type in grows:
                asked = (
                    winfo.mem_consumed - (old_mem_consumed or 0) if u_type == _UpdateType.SIZE else winfo.mem_consumed
                )
                if asked > 0:  # a resize may shrink (FSDP2 frees an unsharded parameter's storage so)
                    over_limit(asked, self._curr_mem_snap.get(winfo.device, {}).get("Total", 0))

        def _noting(self, fsdp_mod: Any, collective: str, inner: Callable) -> Callable:
            def noted(*args: Any, **kwargs: Any) -> Any:
                name = self._mod_tracker.get_known_fqn(fsdp_mod) or ""
                forward = collective == "all-gather" and not self._mod_tracker.is_bw
                if forward and fsdp_mod in self.memory_tracking and self._mod_tracker.parents - {name} == {"Global"}:
                    self.reset_mod_stats()  # the root again: the next iteration
                self.unit, self.collective = _unit_name(name), collective
                try:
                    return inner(*args, **kwargs)
                finally:
                    self.collective = ""

            return noted

        def _fsdp_state_pre_forward(self, fsdp_mod: Any, orig: Callable) -> Callable:
            return self._noting(fsdp_mod, "all-gather", super()._fsdp_state_pre_forward(fsdp_mod, orig))

        def _fsdp_param_group_pre_backward(self, fsdp_mod: Any, orig: Callable) -> Callable:
            return self._noting(fsdp_mod, "all-gather", super()._fsdp_param_group_pre_backward(fsdp_mod, orig))

        def _fsdp_param_group_post_backward(self, fsdp_mod: Any, orig: Callable) -> Callable:
            return self._noting(fsdp_mod, "reduce-scatter", super()._fsdp_param_group_post_backward(fsdp_mod, orig))

        def _register_module_and_optimizer_hooks(self) -> None:
            super()._register_module_and_optimizer_hooks()  # no optimizer given: these hooks are every one's

            def before(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
                self._in_opt = True

            def after(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
                self._track_optimizer_states(_FSDPRefType.OPT, optimizer)
                self._in_opt = False

            self._optimizer_hook_handles = (
                register_optimizer_step_pre_hook(before),
                register_optimizer_step_post_hook(after),
            )  # FSDPMemTracker's exit removes them

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.operator = func
            return super().__torch_dispatch__(func, types, args, kwargs)

        def total(self, device: torch.device) -> int:
            """The bytes tracked on ``device`` now."""
            return self._curr_mem_snap.get(device, {}).get("Total", 0)

        @property
        def doing(self) -> str:
            """What the rank was doing at the last change: FSDP2's collective for a unit, else the operator."""
            phase = "optimizer step" if self._in_opt else "backward" if self._mod_tracker.is_bw else "forward"
            if self.collective:
                return f"{self.collective} of unit {self.unit} ({phase})"
            operator = getattr(self.operator, "overloadpacket", self.operator)
            name = getattr(operator, "__name__", "") or "allocation"
            return f"{name} in {phase}" + ("" if self._in_opt else f", in unit {self.unit}")

        def by_category(self) -> dict[str, int]:
            """The bytes tracked now, by the planner's categories."""
            totals = dict.fromkeys(dict.fromkeys(MEMORY_TRACKER_CATEGORIES.values()), 0)
            for per_device in self._curr_mem_snap.values():
                for kind, size in per_device.items():
                    if kind in MEMORY_TRACKER_CATEGORIES:
                        totals[MEMORY_TRACKER_CATEGORIES[kind]] += size
            return totals

    return LimitedTracker(root)


def _unit_name(fqn: str) -> str:
    """ModTracker's name of a module (``GPT2LMHeadModel.transformer.h.0``) as the planner names the unit."""
    return fqn.partition(".")[2] or "(root)"


def abort_nccl_communicators() -> bool:
    """Abort every NCCL communicator of this process's groups, from any thread: a collective blocked in one
    ends with "NCCL communicator was aborted", and the main thread destroys the groups as usual after.

    ``_abort_process_group`` would do it but also clears ``_world``'s maps, which the main thread's
    ``destroy_process_group`` reads at the same moment; so only the backends are aborted here, all within
    one ``ncclGroupStart``/``ncclGroupEnd`` as it does (one communicator's abort must not wait on
    another's kernels, pytorch#119797). Relies on ``_world.pg_names``, ``ProcessGroup._get_backend`` and
    ``ProcessGroupNCCL._group_start``/``_group_end``/``abort`` (all in torch 2.6 too). Returns whether there
    was any NCCL communicator (False without NCCL: gloo has no abort for a running collective)."""
    from torch.distributed.distributed_c10d import _world

    nccl = getattr(dist, "ProcessGroupNCCL", None)  # absent from a build without NCCL
    backends = []
    for group, _ in sorted(_world.pg_names.items(), key=lambda item: item[1], reverse=True):
        try:
            backend = group._get_backend(torch.device("cuda"))
        except RuntimeError:  # a group with no CUDA backend
            continue
        if nccl is not None and isinstance(backend, nccl):
            backends.append(backend)
    if not backends:
        return False
    backends[0]._group_start()
    try:
        for backend in backends:
            backend.abort()
    finally:
        backends[0]._group_end()
    return True


# -- nn.Module's and Tensor's own state, where their public API has no way to it


def flight_recorder_entries() -> list[dict[str, Any]]:
    """The flight recorder's collectives of this process, oldest first, without stacks (empty where it does not
    record): ``torch._C._distributed_c10d._dump_fr_trace`` (torch 2.13; ``_dump_nccl_trace`` before, NCCL only),
    the pickle torch's own ``fr_trace`` tool reads, whose entries carry ``process_group``, ``collective_seq_id``,
    ``profiling_name``, ``input_sizes`` and ``state``."""
    import pickle

    from torch._C import _distributed_c10d as c10d

    dump = getattr(c10d, "_dump_fr_trace", None)
    if dump is None and dist.is_initialized() and dist.get_backend() == "nccl":
        dump = getattr(c10d, "_dump_nccl_trace", None)  # before torch 2.8 (torch 2.6 hangs in it on gloo)
    if dump is None:
        return []
    traces = dump(includeCollectives=True, includeStackTraces=False, onlyActive=False)
    return list(pickle.loads(traces).get("entries", []))


def own_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """``module``'s own parameter slots by name, None ones included (``Module._parameters``, the dict itself):
    ``named_parameters(recurse=False)`` leaves out a slot set to None, which ``reset_parameters`` reads (a
    Linear without bias)."""
    return cast(dict[str, nn.Parameter | None], module._parameters)


def own_buffers(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """``module``'s own buffer slots by name, None ones included (``Module._buffers``, the dict itself)."""
    return cast(dict[str, torch.Tensor | None], module._buffers)


def put_parameter(module: nn.Module, key: str, parameter: nn.Parameter | None) -> None:
    """Set an existing parameter slot as ``Module.__setattr__`` would, without ``register_parameter``'s checks
    and hooks (``parameters_on_meta`` is such a hook: it calls this from inside one)."""
    module._parameters[key] = parameter


def put_buffer(module: nn.Module, key: str, buffer: torch.Tensor | None) -> None:
    """Set an existing buffer slot keeping its persistence, which ``register_buffer`` would reset."""
    module._buffers[key] = buffer


def is_persistent_buffer(module: nn.Module, key: str) -> bool:
    """Whether ``module``'s buffer ``key`` is in its state dict (``Module._non_persistent_buffers_set``)."""
    return key not in module._non_persistent_buffers_set


def childless_copy(
    module: nn.Module, parameters: dict[str, nn.Parameter | None], buffers: dict[str, torch.Tensor | None]
) -> nn.Module:
    """A module of ``module``'s class and attributes with no children and these own tensors, its constructor not
    run (``Module._modules``, ``_parameters``, ``_buffers`` set directly): what its initializer needs of it."""
    copy = object.__new__(type(module))
    copy.__dict__ = dict(module.__dict__)
    copy._modules = {}
    copy._parameters = parameters
    copy._buffers = buffers
    return copy


def version(tensor: torch.Tensor) -> int:
    """How many in-place writes ``tensor`` has had (``Tensor._version``, autograd's counter)."""
    return tensor._version


def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``tensor`` is a view of, or None (``Tensor._base``)."""
    return tensor._base


@contextlib.contextmanager
def replaced(owner: Any, name: str, replacement: Any) -> Iterator[Any]:
    """``owner.name`` (a torch class's method: ``Tensor.backward``, ``GradScaler.scale``,
    ``Module.register_parameter``) replaced by ``replacement`` while inside, restored however it ends; yields the
    original, which the replacement calls."""
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield original
    finally:
        setattr(owner, name, original)
