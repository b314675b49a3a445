"""Apply an ``FSDPConfig`` with FSDP2, on the engines: checkpoint, shard, prefetch.

The units and where activations are recomputed are chosen by the rules in
``nbfsdp.shared.units``, which the notebook's kernel plans with too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from nbfsdp.shared.config import LIVE_SETTINGS, LIVE_STRATEGIES, FSDPConfig
from nbfsdp.shared.torch_private import (
    apply_to_tensors,
    checkpoint,
    set_checkpointing,
    set_mixed_precision,
    set_reshard_after_forward,
    set_unshard_async_op,
)
from nbfsdp.shared.units import ROOT_RESHARD_LEFT_TO_FSDP, activation_modules, forward_order, wrap_units


class HostOffload:
    """Keep what ``module`` saves for backward in host memory (autograd's ``save_on_cpu``), except the tensors that
    share a storage with its parameters: under FSDP those are the unit's gathered parameters, which FSDP gathers
    again for backward, so sending them too would move a unit's weights to the host and back each step and hold a
    second copy of them through backward (``save_on_cpu`` alone does; course 06 measures both).

    ``moved``: the bytes the module's last forward sent to the host."""

    def __init__(self, module: nn.Module, *, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self.moved = 0
        self._open: list[torch.autograd.graph.saved_tensors_hooks] = []  # one per forward of the module under way
        module.register_forward_pre_hook(self._enter)
        module.register_forward_hook(self._leave)

    def _enter(self, module: nn.Module, args: object) -> None:
        offload = torch.autograd.graph.save_on_cpu(pin_memory=self.pin_memory)
        parameters: set[int] = set()  # read at the first save, once FSDP has gathered the unit's parameters
        self.moved = 0

        def pack(tensor: torch.Tensor) -> tuple[bool, Any]:
            if not parameters:
                parameters.update(p.untyped_storage().data_ptr() for p in module.parameters())
            if tensor.untyped_storage().data_ptr() in parameters:
                return False, tensor
            self.moved += tensor.nbytes
            return True, offload.pack_hook(tensor)

        def unpack(packed: tuple[bool, Any]) -> torch.Tensor:
            sent, value = packed
            return offload.unpack_hook(value) if sent else value

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        hooks.__enter__()
        self._open.append(hooks)

    def _leave(self, module: nn.Module, args: object, output: object) -> None:
        self._open.pop().__exit__(None, None, None)


def device_mesh(config: FSDPConfig, world_size: int, device: torch.device) -> DeviceMesh:
    replicate, shard = config.mesh_shape(world_size)
    if replicate == 1:
        return init_device_mesh(device.type, (world_size,))
    # NO_SHARD and HYBRID_SHARD: FSDP2 replicates across the first dim, shards across the second
    return init_device_mesh(device.type, (replicate, shard), mesh_dim_names=("replicate", "shard"))


@dataclass(eq=False)
class ShardedModel:
    """A model sharded on this rank, with what run-time changes need: its units and checkpointable modules."""

    module: nn.Module
    units: list[FSDPModule]
    """FSDP units, the root first, then in registration order (``units.forward_order``)."""
    checkpointable: list[nn.Module]
    """Where activation checkpointing applies when it is on (Composer's rules)."""
    config: FSDPConfig
    """The settings in force now, live changes included."""


def apply_fsdp(model: nn.Module, config: FSDPConfig, mesh: DeviceMesh, device: torch.device) -> ShardedModel:
    """Shard ``model`` in place as ``config`` says.

    Checkpointing hooks go on every module where the rules would put them and
    are switched on or off, so a running cell can toggle them (``apply_live``).
    """
    units = wrap_units(model, config)
    checkpointable = activation_modules(model, units, dataclasses.replace(config, activation_checkpointing=True))
    for module in checkpointable:
        if config.activation_cpu_offload:
            HostOffload(module, pin_memory=device.type == "cuda")
        checkpoint(module)
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": config.unit_reshard_after_forward}
    options["mp_policy"] = _mp_policy(config)
    if config.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for unit in units:  # bottom-up: a unit takes the parameters no unit below it took
        fully_shard(unit, **options)
    if config.sharding_strategy != "SHARD_GRAD_OP" and ROOT_RESHARD_LEFT_TO_FSDP:
        # FSDP2 keeps the root gathered from forward into backward, which needs it at once, only
        # when the root's reshard_after_forward is left to it; True would gather it twice a step
        options["reshard_after_forward"] = None
    fully_shard(model, **options)
    ordered = cast(list[FSDPModule], forward_order(model, units))  # fully_shard made each an FSDPModule
    if device.type == "cpu":  # gloo: a prefetched gather overlaps only if issued async (set_unshard_async_op)
        set_unshard_async_op(model, async_op=True)
    sharded = ShardedModel(model, ordered, checkpointable, config)
    _set_prefetch(sharded, config)
    _set_checkpointing(sharded, config)
    return sharded


def _mp_policy(config: FSDPConfig) -> MixedPrecisionPolicy:
    param_dtype, reduce_dtype, _ = config.dtypes()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def _set_prefetch(sharded: ShardedModel, config: FSDPConfig) -> None:
    ordered = sharded.units
    for position, current in enumerate(ordered[1:], start=2):
        following = ordered[position : position + 1] if config.forward_prefetch else []
        current.set_modules_to_forward_prefetch(following)
    for unit in ordered:
        # FSDP2 treats an empty list as "prefetch implicitly"; a unit's own entry is an explicit
        # list whose only member is already gathered when it is consulted, so nothing is prefetched
        unit.set_modules_to_backward_prefetch([unit] if config.effective_backward_prefetch == "NONE" else [])


def _set_checkpointing(sharded: ShardedModel, config: FSDPConfig) -> None:
    for module in sharded.checkpointable:
        set_checkpointing(module, enabled=config.activation_checkpointing)


def _set_mixed_precision(sharded: ShardedModel, config: FSDPConfig) -> None:
    """Switch the units to ``config``'s dtypes between steps.

    FSDP2 has no run-time setter for its ``MixedPrecisionPolicy`` (pytorch 2.13): see
    ``torch_private.set_mixed_precision``.
    """
    policy = _mp_policy(config)
    for unit in sharded.units:
        set_mixed_precision(unit, policy)
    cast_buffers(sharded.module, config.dtypes()[2])


def apply_live(sharded: ShardedModel, settings: dict[str, Any]) -> list[str]:
    """Apply settings changed while a cell runs, between two steps; return ``key=value`` for each change.

    Sharding strategy moves between FULL_SHARD and SHARD_GRAD_OP only (same mesh), with FSDP2's
    ``set_reshard_after_forward`` (via torch_private); the root keeps FSDP2's own choice, as ``fully_shard`` sets it.
    Not with ``reshard_after_forward`` N: FSDP2 sets a bool at run time, and its group of N is made once.
    """
    old = sharded.config
    new = dataclasses.replace(old, **{k: v for k, v in settings.items() if k in LIVE_SETTINGS})
    changed = [key for key in LIVE_SETTINGS if getattr(new, key) != getattr(old, key)]
    if not changed:
        return []
    if "sharding_strategy" in changed and {old.sharding_strategy, new.sharding_strategy} - set(LIVE_STRATEGIES):
        raise ValueError(
            f"sharding_strategy cannot change from {old.sharding_strategy} to {new.sharding_strategy} "
            "while a cell runs (another mesh); it applies from the next cell"
        )
    if "sharding_strategy" in changed and old.reshard_after_forward is not None:
        raise ValueError(
            f"sharding_strategy cannot change while a cell runs with reshard_after_forward "
            f"{old.reshard_after_forward} (FSDP2 makes its groups once); it applies from the next cell"
        )
    if "sharding_strategy" in changed:
        for unit in sharded.units[1:]:
            set_reshard_after_forward(unit, reshard=new.sharding_strategy != "SHARD_GRAD_OP")
    _set_prefetch(sharded, new)
    _set_checkpointing(sharded, new)
    if new.dtypes() != old.dtypes():
        _set_mixed_precision(sharded, new)
    new.why = {key: why for key, why in old.why.items() if key not in changed}  # now as asked
    sharded.config = new
    return [f"{key}={getattr(new, key)}" for key in changed]


def shard_model(
    skeleton: nn.Module,
    device: torch.device,
    config: FSDPConfig,
    mesh: DeviceMesh,
    shards: dict[str, torch.Tensor] | None = None,
) -> ShardedModel:
    """Shard a meta-device ``skeleton`` with FSDP2 on this rank's ``shards`` (by fqn), or on empty ones.

    ``fully_shard`` on the meta device allocates nothing; the local shards are
    then the tensors the notebook delivered (``adopt_shards``), or ``to_empty``'s
    fresh ones for a model initialized on the ranks. A rank never holds the full model.
    """
    made = real_buffers(skeleton)  # a meta-built model's buffers its constructor made: kept as they are
    sharded = apply_fsdp(skeleton, config, mesh, device)
    storage = "cpu" if config.cpu_offload else device
    if shards is None:
        skeleton.to_empty(device=storage)
        for name, buffer in made.items():
            owner, _, key = name.rpartition(".")
            setattr(skeleton.get_submodule(owner), key, buffer.to(device))  # an existing buffer's name: replaced
    elif torch.device(storage).type != mesh.device_type:
        # CPU offload on GPUs: DTensor.from_local would move the shard to the GPU, so copy instead
        skeleton.to_empty(device=storage)
        _copy_shards(skeleton, shards, device)
    else:
        adopt_shards(skeleton, shards)
    return sharded


def real_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers of a model built on the meta device that are not on it (its constructor made them), by name."""
    if not any(p.is_meta for p in model.parameters()):
        return {}
    return {name: buffer for name, buffer in model.named_buffers() if not buffer.is_meta}


def _check_shape(fqn: str, data: torch.Tensor, local: torch.Tensor) -> None:
    if local.shape != data.shape:
        raise RuntimeError(
            f"shard of {fqn!r} has shape {tuple(data.shape)} but FSDP2 holds "
            f"{tuple(local.shape)} on this rank; is a custom shard placement in use?"
        )


def adopt_shards(model: nn.Module, shards: dict[str, torch.Tensor]) -> None:
    """Make the delivered tensors this rank's shards and buffers without copying them.

    Where ``to_empty`` would hand each meta tensor a fresh ``empty_like``,
    ``apply_to_tensors`` hands it the delivered tensor, and FSDP2 then
    takes it as the sharded storage. FSDP2 copies only a shard it must pad
    (dim 0 not divisible by the shard count).
    """
    names = {id(t): fqn for fqn, t in [*model.named_parameters(), *model.named_buffers()]}

    def delivered(tensor: torch.Tensor) -> torch.Tensor:
        fqn = names[id(tensor)]
        data = shards[fqn]
        if not isinstance(tensor, DTensor):
            _check_shape(fqn, data, tensor)
            return data
        _check_shape(fqn, data, tensor.to_local())
        return DTensor.from_local(
            data, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
        )

    with torch.no_grad():
        apply_to_tensors(model, delivered)


def _copy_shards(model: nn.Module, shards: dict[str, torch.Tensor], device: torch.device) -> None:
    with torch.no_grad():
        for fqn, param in model.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            _check_shape(fqn, shards[fqn], local)
            local.copy_(shards[fqn])
        for name, module in model.named_modules():
            for key, _ in list(module.named_buffers(recurse=False, remove_duplicate=False)):
                setattr(module, key, shards[f"{name}.{key}" if name else key].to(device))


def cast_buffers(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Floating-point buffers in ``dtype`` (FSDP2's policy has no buffer dtype; PURE wants one); None: as stored."""
    if dtype is None:
        return
    for module in model.modules():
        for key, buffer in list(module.named_buffers(recurse=False, remove_duplicate=False)):
            if buffer.is_floating_point():
                setattr(module, key, buffer.to(dtype))
