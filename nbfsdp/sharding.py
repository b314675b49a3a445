"""Apply an ``FSDPConfig`` with FSDP2: choose the units, checkpoint, shard, prefetch.

Composer's rules, in its order. A module is its own FSDP unit when its
``_fsdp_wrap`` attribute says so; otherwise when the root's
``fsdp_wrap_fn(module)`` is true, its class is in ``wrap_cls`` (TorchAcc), or
it holds at least ``min_params`` parameters not already in a unit below it.
The root is always a unit. Activation checkpointing goes where a module's
``_activation_checkpointing`` attribute says, else where the root's
``activation_checkpointing_fn(module)`` says, else on every non-root unit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from nbfsdp.config import FSDPConfig


def _root_method(model: nn.Module, name: str) -> Callable[[nn.Module], object] | None:
    method = getattr(model, name, None)
    return method if callable(method) else None


def wrap_units(model: nn.Module, config: FSDPConfig) -> list[nn.Module]:
    """The non-root units in post-order (a unit's descendants come before it)."""
    wrap_fn = _root_method(model, "fsdp_wrap_fn")
    units: list[nn.Module] = []

    def unwrapped_params(module: nn.Module) -> int:
        count = sum(p.numel() for p in module.parameters(recurse=False))
        count += sum(unwrapped_params(child) for child in module.children())
        if module is model or count == 0:
            return count
        if hasattr(module, "_fsdp_wrap"):
            wrap = bool(module._fsdp_wrap)
        else:
            wrap = (
                bool(wrap_fn and wrap_fn(module))
                or type(module).__name__ in config.wrap_cls
                or count >= config.min_params
            )
        if wrap:
            units.append(module)
            return 0
        return count

    unwrapped_params(model)
    return units


def checkpointed_modules(model: nn.Module, units: list[nn.Module], config: FSDPConfig) -> list[nn.Module]:
    """Where activations are recomputed (outermost choices only: nesting would recompute twice)."""
    if not (config.activation_checkpointing or config.activation_cpu_offload):
        return []
    choose = _root_method(model, "activation_checkpointing_fn")
    unit_ids = {id(u) for u in units}
    chosen: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if module is model or id(module) in inside:
            continue
        if hasattr(module, "_activation_checkpointing"):
            selected = bool(module._activation_checkpointing)
        elif choose is not None:
            selected = bool(choose(module))
        else:
            selected = id(module) in unit_ids
        if selected:
            chosen.append(module)
            inside.update(id(m) for m in module.modules())
    return chosen


def _offload_saved_activations(module: nn.Module, pin_memory: bool) -> None:
    """Keep what ``module`` saves for backward on the CPU (autograd's ``save_on_cpu``)."""

    def enter(mod: nn.Module, args: object) -> None:
        context = torch.autograd.graph.save_on_cpu(pin_memory=pin_memory)
        context.__enter__()
        mod._nbfsdp_offload_contexts.append(context)

    def leave(mod: nn.Module, args: object, output: object) -> None:
        mod._nbfsdp_offload_contexts.pop().__exit__(None, None, None)

    module._nbfsdp_offload_contexts = []
    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)


def device_mesh(config: FSDPConfig, world_size: int, device: torch.device) -> DeviceMesh:
    replicate, shard = config.mesh_shape(world_size)
    if replicate == 1:
        return init_device_mesh(device.type, (world_size,))
    # NO_SHARD and HYBRID_SHARD: FSDP2 replicates across the first dim, shards across the second
    return init_device_mesh(device.type, (replicate, shard), mesh_dim_names=("replicate", "shard"))


def apply_fsdp(model: nn.Module, config: FSDPConfig, mesh: DeviceMesh, device: torch.device) -> list[nn.Module]:
    """Shard ``model`` in place as ``config`` says; return its units in forward order, root last."""
    units = wrap_units(model, config)
    recompute = checkpointed_modules(model, units, config)
    for module in recompute:
        if config.activation_cpu_offload:
            _offload_saved_activations(module, pin_memory=device.type == "cuda")
        if config.activation_checkpointing:
            checkpoint(module)
    param_dtype, reduce_dtype, _ = config.dtypes()
    options = {
        "mesh": mesh,
        "reshard_after_forward": config.sharding_strategy != "SHARD_GRAD_OP",
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
    }
    if config.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for unit in units:
        fully_shard(unit, **options)
    fully_shard(model, **options)
    ordered = [*units, model]
    if config.forward_prefetch:
        for current, following in zip(units, units[1:], strict=False):
            current.set_modules_to_forward_prefetch([following])
    if config.effective_backward_prefetch == "NONE":
        # FSDP2 treats an empty list as "prefetch implicitly"; a unit's own entry is an explicit
        # list whose only member is already gathered when it is consulted, so nothing is prefetched
        for unit in ordered:
            unit.set_modules_to_backward_prefetch([unit])
    return ordered


def shard_model(
    skeleton: nn.Module, shard: dict[str, torch.Tensor], device: torch.device, config: FSDPConfig, mesh: DeviceMesh
) -> nn.Module:
    """Shard ``skeleton`` with FSDP2 and fill this rank's local tensors from ``shard``.

    ``fully_shard`` on the meta device allocates nothing; ``to_empty`` then
    allocates only the local shards, which are filled from what the notebook
    sent, so a rank never holds the full model.
    """
    apply_fsdp(skeleton, config, mesh, device)
    skeleton.to_empty(device="cpu" if config.cpu_offload else device)
    _, _, buffer_dtype = config.dtypes()
    with torch.no_grad():
        for fqn, param in skeleton.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            data = shard[fqn]
            if local.shape != data.shape:
                raise RuntimeError(
                    f"shard of {fqn!r} has shape {tuple(data.shape)} but FSDP2 holds "
                    f"{tuple(local.shape)} on this rank; is a custom shard placement in use?"
                )
            local.copy_(data)
        for name, module in skeleton.named_modules():
            for key, buffer in list(module._buffers.items()):
                if buffer is not None:
                    full = shard[f"{name}.{key}" if name else key]
                    dtype = buffer_dtype if full.is_floating_point() else full.dtype
                    module._buffers[key] = full.to(device=device, dtype=dtype, copy=True)
    return skeleton
