"""The private transformers API nbfsdp relies on, in one place (kernel side): building a model class from its
config, and the parameters ``from_pretrained`` keeps in fp32 whatever dtype it is asked for.
``tests/test_pretrained.py`` builds real models through it, so a transformers release that moves it fails there,
by name.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch


def config_builder(model_class: Any) -> Callable[[Any], Any] | None:
    """What builds ``model_class`` from a config: an auto class's ``from_config``, else a model class's
    ``_from_config`` (``PreTrainedModel``'s, private: what ``from_config`` calls, and what ``from_pretrained``
    builds with before loading); None for a class that is neither."""
    if hasattr(model_class, "from_config"):
        return model_class.from_config
    return getattr(model_class, "_from_config", None)


def kept_in_fp32(model: Any, dtype: torch.dtype) -> Callable[[str], bool]:
    """Whether ``from_pretrained(..., dtype=dtype)`` keeps the parameter of this name in fp32: those its class
    names in ``_keep_in_fp32_modules`` (under fp16) or ``_keep_in_fp32_modules_strict`` (under fp16 and bf16),
    gathered from its submodels. transformers 5 plans it (``_get_dtype_plan``) and matches each name as a regular
    expression anywhere in the parameter's name, ``*`` any text; transformers 4 kept ``_keep_in_fp32_modules``
    under fp16, matching a whole dotted part of the name."""
    plan = getattr(model, "_get_dtype_plan", None)
    if plan is not None:
        patterns = [name for name, kept in plan(dtype).items() if kept == torch.float32]
        expression = re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in patterns)) if patterns else None
        return lambda name: expression is not None and expression.search(name) is not None
    kept = set(getattr(model, "_keep_in_fp32_modules", None) or []) if dtype == torch.float16 else set()
    return lambda name: any(part in kept for part in name.split("."))
