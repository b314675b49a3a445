"""What nbfsdp reads of peft's models, in one place (any process): nbfsdp never imports peft, so what it relies on
is peft's attributes as they are, named here. A LoRA adapter's matrices and initialization (``lora_A``/``lora_B``
under an adapted layer, the root's ``peft_config``, the layer's ``r`` and ``reset_lora_parameters``), and a peft
model's base (``get_base_model()``, each adapted layer's ``base_layer``). ``tests/test_lora.py`` and
``tests/test_pretrained.py`` run real peft models through each.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch.nn as nn

#: The ``init_lora_weights`` a rank can apply to one adapter matrix on its own (peft's ``reset_lora_parameters``);
#: the others (PiSSA, OLoRA, LoftQ, EVA...) read the base layer's weights, or make both matrices at once.
LORA_INITS_WITHOUT_BASE = (True, False, "gaussian")


def lora_adapter(root: nn.Module, name: str) -> tuple[str, str | bool, int] | None:
    """For a peft LoRA adapter (``...q_proj.lora_A.default``): whether it is ``lora_A`` or ``lora_B``, its
    ``init_lora_weights`` (from the root's ``peft_config``) and its rank ``r``; None for any other module. nbfsdp
    never imports peft: its attributes are read as they are."""
    parts = name.split(".")
    if len(parts) < 3 or parts[-2] not in ("lora_A", "lora_B"):
        return None
    layer = root.get_submodule(".".join(parts[:-2]))
    config = getattr(root, "peft_config", {}).get(parts[-1])
    if not callable(getattr(layer, "reset_lora_parameters", None)) or config is None:
        return None
    ranks: Any = layer.r  # peft's dict of each adapter's rank (torch types a module's attributes as tensors)
    return parts[-2], config.init_lora_weights, int(ranks[parts[-1]])


def lora_init(which: str, *, how: str | bool, rank: int) -> Callable[[nn.Module], object] | None:
    """peft's ``reset_lora_parameters`` for one adapter matrix, on the copy ``materialize`` makes of it: peft's
    own method needs the whole LoRA layer (both matrices and the base), which a rank holds only sharded.
    None where the initialization reads the base's weights."""
    if how not in LORA_INITS_WITHOUT_BASE:
        return None

    def init(copy: nn.Module) -> None:
        if how is False:  # peft leaves nn.Linear's own initialization
            copy.reset_parameters()  # type: ignore[operator]
        elif which == "lora_B":  # zero: the adapted model starts as the base
            for param in copy.parameters(recurse=False):
                nn.init.zeros_(param)
        elif how is True:
            nn.init.kaiming_uniform_(copy.weight, a=math.sqrt(5))  # type: ignore[arg-type]
        else:
            nn.init.normal_(copy.weight, std=1 / rank)  # type: ignore[arg-type]

    return init


def wrapped_model(module: nn.Module) -> tuple[str, nn.Module]:
    """A peft model's base (``get_base_model()``) and its path inside it with a trailing dot; ``("", module)`` for
    any other model. nbfsdp never imports peft: the method is read as it is."""
    get_base = getattr(module, "get_base_model", None)
    base = get_base() if callable(get_base) else None
    if not isinstance(base, nn.Module) or base is module:
        return "", module
    path = next(name for name, inner in module.named_modules() if inner is base)
    return f"{path}.", base


def name_in_base(key: str, inside: str) -> str:
    """A peft model's tensor name as its base names it: peft's wrapper path (``inside``, from ``wrapped_model``)
    and each adapted layer's ``base_layer`` taken away; ``key`` itself for a model peft does not wrap."""
    return key.removeprefix(inside).replace(".base_layer.", ".") if inside else key
