"""The plain FSDP2 code a set of ``%%fsdp`` settings amounts to, as text: ``nbfsdp.explain(...).code``.

Runs in the notebook's kernel, on the model and the validated config ``plans.plan`` has; it
uses the same rules as the ranks (``units.wrap_units``, ``sharding.activation_modules``) and
renders what ``sharding.apply_fsdp`` does with them, so that the printed code, run on each rank
of a process group over the same model, gives the same units and the same losses as the cell
(``tests/test_fsdp_code.py`` runs it). Repeated units of one ``ModuleList`` become one loop.
"""

from __future__ import annotations

import torch.nn as nn

from nbfsdp.shared.config import FSDPConfig
from nbfsdp.shared.devices import Devices
from nbfsdp.shared.units import ROOT_RESHARD_LEFT_TO_FSDP, activation_modules, wrap_units

#: None: as the model stores each tensor (the policy's default).
_DTYPE_NAMES = {"float32": "torch.float32", "bfloat16": "torch.bfloat16", "float16": "torch.float16", "None": "None"}


def _expression(root: str, path: str) -> str:
    """``blocks.0.mlp`` -> ``model.blocks[0].mlp``."""
    parts = [
        f"[{p}]" if p.isdigit() else (f".{p}" if p.isidentifier() else f".get_submodule({p!r})")
        for p in path.split(".")
    ]
    return root + "".join(parts) if path else root


def _loop_name(container: str) -> str:
    last = container.rsplit(".", 1)[-1]
    return last[:-1] if last.endswith("s") and len(last) > 2 and last[:-1].isidentifier() else "layer"


def _split(path: str) -> tuple[str, int, str] | None:
    """(container, index, rest) at the first numeric part of ``path``, or None."""
    parts = path.split(".")
    position = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    if not position:  # no numeric part, or the model itself is the list
        return None
    return ".".join(parts[:position]), int(parts[position]), ".".join(parts[position + 1 :])


def _statements(model: nn.Module, paths: list[str], call: str) -> list[str]:
    """``call.format(module)`` for each module path, in order; the items of one ModuleList as a loop."""
    lines: list[str] = []
    i = 0
    while i < len(paths):
        split = _split(paths[i])
        if split is not None:
            container, _, _ = split
            run: list[tuple[str, int, str]] = []
            while i + len(run) < len(paths):
                s = _split(paths[i + len(run)])
                if s is None or s[0] != container:
                    break
                run.append(s)
            # numbered children: a ModuleList or Sequential (torch types a submodule as any Module)
            size = len(model.get_submodule(container)) if container else 0  # type: ignore[arg-type]
            per_item = [[rest for c, index, rest in run if index == k] for k in range(size)]
            in_order = [index for _, index, _ in run] == sorted(index for _, index, _ in run)
            if size > 1 and in_order and all(rests == per_item[0] for rests in per_item) and per_item[0]:
                var = _loop_name(container)
                lines.append(f"for {var} in {_expression('model', container)}:")
                lines += [f"    {call.format(_expression(var, rest))}" for rest in per_item[0]]
                i += len(run)
                continue
        lines.append(call.format(_expression("model", paths[i])))
        i += 1
    return lines


def render(model: nn.Module, config: FSDPConfig, world_size: int, devices: Devices) -> str:
    """FSDP2 code equivalent to ``config`` (validated for the device) for ``model`` at ``world_size`` on
    ``devices``."""
    device_type = devices.type
    names = {id(m): n for n, m in model.named_modules()}
    units = wrap_units(model, config)
    replicas, shards = config.mesh_shape(world_size)
    param_dtype, reduce_dtype, buffer_dtype = (str(d).removeprefix("torch.") for d in config.dtypes())
    imports = ["FSDPModule", "MixedPrecisionPolicy", "fully_shard"]
    if config.cpu_offload:
        imports.insert(0, "CPUOffloadPolicy")
    lines = [
        f"# FSDP2 code for {config.sharding_strategy}, mixed precision {config.mixed_precision}, "
        f"world size {world_size} ({devices}): what %%fsdp runs on each rank.",
        "# Run it on every rank after torch.distributed.init_process_group, with `model` the same full",
        "# model on every rank (same seed or same weights): each rank keeps its own shards.",
        *(
            [
                "# Ranks share GPUs: before init_process_group each rank set NCCL_HOSTID so that NCCL takes the",
                "# ranks of one GPU for different hosts (it refuses two ranks of a communicator on one device),",
                "# and torch.cuda.set_device(rank % torch.cuda.device_count()).",
            ]
            if devices.shared
            else []
        ),
        "import torch",
        "from torch.distributed.device_mesh import init_device_mesh",
        f"from torch.distributed.fsdp import {', '.join(imports)}",
    ]
    checkpointed = activation_modules(model, units, config) if config.activation_checkpointing else []
    if checkpointed:
        lines.append("from torch.distributed._composable import checkpoint")
    lines.append("")
    if replicas == 1:
        lines.append(f'mesh = init_device_mesh("{device_type}", ({world_size},))  # one dim: every rank holds a shard')
    else:
        why = "replicate only: DDP's math" if shards == 1 else f"{replicas} replica groups of {shards} shards"
        lines.append(
            f'mesh = init_device_mesh("{device_type}", ({replicas}, {shards}), mesh_dim_names=("replicate", "shard"))'
            f"  # {why}"
        )
    lines.append(
        f"mp_policy = MixedPrecisionPolicy(param_dtype={_DTYPE_NAMES[param_dtype]}, "
        f"reduce_dtype={_DTYPE_NAMES[reduce_dtype]})"
        + ("  # None: each parameter computes in the dtype the model stores it in" if param_dtype == "None" else "")
    )
    options = f"mesh=mesh, reshard_after_forward={config.unit_reshard_after_forward}, mp_policy=mp_policy"
    root_options = "mesh=mesh, mp_policy=mp_policy"
    if config.cpu_offload:
        pin = device_type == "cuda"
        lines.append(f"offload_policy = CPUOffloadPolicy(pin_memory={pin})  # shards, grads, optimizer state on CPU")
        options += ", offload_policy=offload_policy"
        root_options += ", offload_policy=offload_policy"
    if config.activation_cpu_offload:
        lines.append(
            "# activation_cpu_offload: nbfsdp also runs each checkpointable module's forward under "
            "torch.autograd.graph.save_on_cpu()'s hooks, its gathered parameters left where they are"
        )
    if checkpointed:
        lines += ["", "# activation checkpointing first: recompute these modules' activations in backward"]
        lines += _statements(model, [names[id(m)] for m in checkpointed], "checkpoint({})")
    lines += ["", "# the units, bottom-up: each takes the parameters no unit inside the model below it took"]
    lines += _statements(model, [names[id(u)] for u in units], f"fully_shard({{}}, {options})")
    if config.sharding_strategy == "SHARD_GRAD_OP":
        lines.append(f"fully_shard(model, {root_options}, reshard_after_forward=False)  # the root")
    elif ROOT_RESHARD_LEFT_TO_FSDP:
        lines.append(f"fully_shard(model, {root_options})  # the root: FSDP2 keeps it gathered into backward")
    else:
        lines.append(f"fully_shard(model, {root_options}, reshard_after_forward=True)  # the root")
    if buffer_dtype not in ("float32", "None"):
        lines += [
            "",
            f"# {config.mixed_precision}: floating-point buffers in {buffer_dtype} too (no buffer dtype in the policy)",
            "for module in model.modules():",
            "    for key, buffer in module._buffers.items():",
            "        if buffer is not None and buffer.is_floating_point():",
            f"            module._buffers[key] = buffer.to({_DTYPE_NAMES[buffer_dtype]})",
        ]
    if device_type == "cpu":
        lines += [
            "",
            "# gloo has no stream to gather on: gathered asynchronously (in gloo's thread), a prefetched unit's",
            "# all-gather overlaps the compute before it; FSDP2's private setter (torch 2.6 to 2.13)",
            "model._set_unshard_async_op(True)",
        ]
    lines += [
        "",
        "# the units in registration order (model.modules()), the order nbfsdp prefetches them in: forward's",
        "# order only where forward runs the units as the model registers them (a ModuleList in a loop does)",
        "units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]",
    ]
    if config.forward_prefetch:
        lines += [
            "for this, following in zip(units, units[1:]):  # forward prefetch: gather the next unit early",
            "    this.set_modules_to_forward_prefetch([following])",
        ]
    else:
        lines.append(
            "# forward: FSDP2's own order, each unit gathered as forward reaches it (on a GPU, on its own stream)"
        )
    if config.effective_backward_prefetch == "NONE":
        lines += [
            "for unit in [model, *units]:  # backward prefetch off: a list whose only unit is already gathered",
            "    unit.set_modules_to_backward_prefetch([unit])",
        ]
    else:
        lines.append("# backward: FSDP2's default prefetch, the next unit in backward gathered while this one computes")
    if param_dtype == "float16":
        lines += [
            "",
            "# fp16: %%fsdp scales the losses itself (nbfsdp.engines.scaling); a script scales them with a GradScaler,",
            "# which agrees across ranks on an overflow through DTensor's gradients:",
            f'# scaler = torch.amp.GradScaler("{device_type}")',
            "# scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()",
        ]
    return "\n".join(lines) + "\n"
