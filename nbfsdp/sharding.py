"""Turn a meta-device skeleton into this rank's FSDP2 shards.

The default wrap, until configurable policies land, is torchtitan's: each
element of the model's outermost ``nn.ModuleList`` / ``nn.Sequential`` block
containers becomes its own FSDP unit, then the root.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, fully_shard


def block_units(model: nn.Module) -> list[nn.Module]:
    """Elements of the outermost block containers that hold parameters.

    Containers nested inside a block (an MLP's ``nn.Sequential``) are left to
    that block's unit: wrapping every ``Linear`` would all-gather per layer.
    """
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, (nn.ModuleList, nn.Sequential)):
                units.extend(c for c in child.children() if any(True for _ in c.parameters()))
            else:
                visit(child)

    if isinstance(model, (nn.ModuleList, nn.Sequential)):
        units.extend(c for c in model.children() if any(True for _ in c.parameters()))
    else:
        visit(model)
    return units


def shard_model(skeleton: nn.Module, shard: dict[str, torch.Tensor], device: torch.device) -> nn.Module:
    """Shard ``skeleton`` with FSDP2 and fill this rank's local tensors from ``shard``.

    ``fully_shard`` on the meta device allocates nothing; ``to_empty`` then
    allocates only the local shards, which are filled from what the notebook
    sent, so a rank never holds the full model.
    """
    for unit in block_units(skeleton):
        fully_shard(unit)
    fully_shard(skeleton)
    skeleton.to_empty(device=device)
    with torch.no_grad():
        for fqn, param in skeleton.named_parameters():
            local = param.to_local() if isinstance(param, torch.distributed.tensor.DTensor) else param
            data = shard[fqn]
            if local.shape != data.shape:
                raise RuntimeError(
                    f"shard of {fqn!r} has shape {tuple(data.shape)} but FSDP2 holds "
                    f"{tuple(local.shape)} on this rank; is a custom shard placement in use?"
                )
            local.copy_(data)
        for fqn, buffer in skeleton.named_buffers():
            buffer.copy_(shard[fqn])
    return skeleton


def fsdp_units(model: nn.Module) -> list[str]:
    """Qualified names of the modules that are FSDP units ('' is the root)."""
    return [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]
