"""A cell's inputs, read from the notebook and pickled before any engine is touched.

Everything that can be refused (a model FSDP cannot shard, a name that cannot be pickled) is refused
here, so a bad cell fails at once and the notebook's state stays as it was.
"""

from __future__ import annotations

import sys
from typing import Any

import torch.nn as nn
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from torch.utils.data import DataLoader

from nbfsdp.kernel.run import residence
from nbfsdp.shared import optimizers, transfer
from nbfsdp.shared.units import check_initializable

#: A cell's pickled inputs above this size get a warning naming the big ones.
HUGE_INPUT_BYTES = 64 * 2**20


def on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def refuse_quantized(name: str, model: nn.Module) -> None:
    """QLoRA's 4-bit storage (bitsandbytes' ``Params4bit``, read by its class name: nbfsdp never imports it) is
    refused: FSDP2 shards the packed bytes as a plain tensor and drops the quantization state beside them, and
    training then goes silently wrong (Accelerate#3983: a loss of 0.0, NaN gradient norms)."""
    for path, param in model.named_parameters():
        if type(param).__name__ == "Params4bit":
            raise UsageError(
                f"{name}.{path} is a bitsandbytes 4-bit parameter (QLoRA): FSDP2's sharding drops its quantization "
                "state, and training then goes silently wrong (Accelerate#3983: a loss of 0.0). Load the base in "
                "bf16 instead (nbfsdp.from_pretrained(DIR, dtype=torch.bfloat16)) and train LoRA adapters on it"
            )


def check_no_shared_modules(name: str, model: nn.Module) -> None:
    """Composer's duplicate-module check: FSDP shards each module once, by one path."""
    seen: dict[int, str] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        if id(module) in seen and any(True for _ in module.parameters()):
            raise UsageError(
                f"{name}.{seen[id(module)]} and {name}.{path} are the same module; FSDP can shard a module "
                "only once: give each place its own module (tie single parameters instead)"
            )
        seen.setdefault(id(module), path)


def read_inputs(shell: InteractiveShell, reads: list[str]) -> tuple[dict[str, nn.Module], dict[str, Any]]:
    """The notebook's models the cell reads, and every other name it reads."""
    namespace, hidden = shell.user_ns, shell.user_ns_hidden
    inputs = {name: namespace[name] for name in reads if name in namespace and name not in hidden}
    models: dict[str, nn.Module] = {}
    for name, value in inputs.items():  # a second name for the same model travels as a reference
        if transfer.is_model(value) and all(value is not m for m in models.values()):
            models[name] = value
    for name, model in models.items():
        if (wrapped := residence.wrapped_record(model)) is not None:
            residence.take_over_checkpoint(name, model, *wrapped)
        refuse_quantized(name, model)
        if on_meta(model) and residence.of(model) is None and (why := check_initializable(model)):
            raise UsageError(f"{name!r} is built on the meta device, but {why}")
        check_no_shared_modules(name, model)
    return models, {n: v for n, v in inputs.items() if n not in models}


def pack_inputs(
    others: dict[str, Any], models: dict[str, nn.Module], kept: set[str], world_size: int | None
) -> tuple[bytes, dict[str, Any]]:
    """The cell's other names pickled, less those ``kept`` (the ranks hold them already); and the
    loaders, optimizers and schedulers among them all, which take the ranks' state after the cell."""
    sending = {n: v for n, v in others.items() if n not in kept}
    try:
        values = transfer.pack_values(sending, models)
    except transfer.UnpicklableName as error:
        raise UsageError(str(error)) from None
    if len(values) > HUGE_INPUT_BYTES:
        _warn_huge(sending, models, world_size)
    return values, {n: v for n, v in others.items() if isinstance(v, (DataLoader, *optimizers.STATEFUL))}


def _warn_huge(values: dict[str, Any], models: dict[str, nn.Module], world_size: int | None) -> None:
    """Name the inputs that make a cell's payload big: each rank gets a copy of each."""
    sizes = {name: transfer.pickled_size(v, models) for name, v in values.items()}
    big = ", ".join(f"{n} ({s / 2**20:.0f} MiB)" for n, s in sizes.items() if s > HUGE_INPUT_BYTES // 4)
    ranks = f"each of {world_size} ranks" if world_size else "each rank"
    print(f"nbfsdp: sending {big} to {ranks}; data this big is better loaded on the ranks", file=sys.stderr)
