"""``nbfsdp.from_pretrained``: a Hugging Face checkpoint directory to a model that trains on the ranks, the kernel
holding only its skeleton (``nbfsdp.kernel.run.residence``). Runs in the kernel.

    model = nbfsdp.from_pretrained("llama-1b", dtype=torch.bfloat16)   # a meta model: nothing read yet

    %%fsdp --world-size 2                                              # each rank reads its rows of each tensor
    ...

The model is built as ``from_pretrained`` builds it, on the meta device; the checkpoint's headers are checked
against it at once (names matched as ``from_pretrained`` matches them); what the checkpoint lacks (non-persistent
buffers such as rotary ``inv_freq``, a new head) must be made as the model makes it (``units.init_function``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from IPython.core.error import UsageError

from nbfsdp.kernel.checkpoints.transformers_private import config_builder, kept_in_fp32
from nbfsdp.kernel.run import residence
from nbfsdp.shared import torch_private
from nbfsdp.shared.collectives import size_text
from nbfsdp.shared.config import ConfigError
from nbfsdp.shared.weights_files import full_weights_reader, hugging_face_checkpoint


def from_pretrained(path: str | os.PathLike, dtype: torch.dtype | None = None, *, model_class: Any = None) -> nn.Module:
    """The model of the Hugging Face checkpoint directory ``path``, on the meta device, in ``dtype`` (the
    checkpoint's values are cast to it), its weights to be read by the ranks at the first ``%%fsdp`` cell
    that uses it; they then live there (``nbfsdp.gather`` brings them into the notebook). ``model_class``: a
    ``transformers`` model class (``AutoModelForSequenceClassification`` ...), by default the one the
    checkpoint's config names (``architectures``)."""
    directory = hugging_face_checkpoint(os.fspath(path))
    if directory is None:
        raise UsageError(
            f"{path} is not a Hugging Face checkpoint directory: it has no model.safetensors and no "
            "model.safetensors.index.json (save_pretrained writes them)"
        )
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise UsageError(
            f"dtype must be a floating-point torch dtype (torch.bfloat16, torch.float32 ...), got {dtype!r}"
        )
    model = _build(directory, dtype, model_class)
    try:
        with full_weights_reader(directory) as reader:
            shapes = reader.shapes()
    except ConfigError as error:
        raise UsageError(str(error)) from None
    residence.check_reads(model, shapes, directory)
    residence.mark(model, source=str(directory))
    count = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    size = size_text(residence.weights_bytes(model))
    print(
        f"nbfsdp: {type(model).__name__} of {_count_text(count)} parameters ({size}, {_dtype_of(model)}) on the "
        f"meta device; the ranks read {path} at the first %%fsdp cell that uses it",
        file=sys.stderr,
    )
    return model


def _count_text(count: int) -> str:
    return f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.0f}M" if count >= 1e6 else f"{count:,}"


def _dtype_of(model: nn.Module) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def _build(directory: Path, dtype: torch.dtype | None, model_class: Any) -> nn.Module:
    try:
        import transformers
    except ImportError:
        raise UsageError("nbfsdp.from_pretrained needs transformers: pip install 'nbfsdp[examples]'") from None
    try:
        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as error:
        raise UsageError(f"{directory}: no config.json transformers can read ({error})") from None
    if model_class is None:
        named = (getattr(config, "architectures", None) or [None])[0]
        model_class = getattr(transformers, named, None) if named else transformers.AutoModelForCausalLM
        if model_class is None:
            raise UsageError(f"{directory}/config.json names {named}, which transformers has not: pass model_class=")
    build = config_builder(model_class)
    if build is None:
        raise UsageError(f"{model_class!r} builds no model from a config (no from_config or _from_config)")
    with parameters_on_meta():
        model = build(config)
    if dtype is not None:  # the parameters only, on the meta device (free): buffers keep the dtype they were made in
        in_fp32 = kept_in_fp32(model, dtype)  # as from_pretrained keeps them (a router, a gate)
        cast: dict[int, nn.Parameter] = {}  # a tie stays one parameter
        for prefix, module in model.named_modules():
            for key, param in torch_private.own_parameters(module).items():
                if param is not None and param.is_floating_point():
                    wanted = torch.float32 if in_fp32(f"{prefix}.{key}".lstrip(".")) else dtype
                    made = cast.setdefault(id(param), nn.Parameter(param.to(wanted), requires_grad=param.requires_grad))
                    torch_private.put_parameter(module, key, made)
    return model


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build a model with its parameters on the meta device and its buffers as its constructor makes them (the
    rotary ``inv_freq``): what Accelerate's ``init_empty_weights(include_buffers=False)`` does, which
    ``from_pretrained`` used before transformers 5. Hand-written: Accelerate is not a dependency, and
    transformers 5 builds buffers on the meta device too (its ``_init_weights`` makes them after, which
    transformers 4 does not). Each parameter is allocated empty, then moved: nothing is initialized."""
    register: Callable[[nn.Module, str, nn.Parameter | None], None] = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            kind = type(param)
            torch_private.put_parameter(module, name, kind(param.to("meta"), requires_grad=param.requires_grad))

    with torch_private.replaced(nn.Module, "register_parameter", on_meta):
        yield


def make_buffers(model: nn.Module) -> None:
    """The buffers of a Hugging Face model built on the meta device, made as its constructor makes them: the
    same class built again from its config with its parameters on the meta device (``parameters_on_meta``), its
    buffers taken. Nothing for another model (``units.init_function`` makes its buffers on the ranks)."""
    missing = [name for name, buffer in model.named_buffers() if buffer.is_meta]
    config = getattr(model, "config", None)
    build = config_builder(type(model)) if hasattr(type(model), "_from_config") else None  # a Hugging Face model's
    if not missing or config is None or build is None:
        return
    with parameters_on_meta(), torch.device("cpu"):
        twin = build(config)
    made = dict(twin.named_buffers())
    for name in missing:
        if name in made and not made[name].is_meta:
            owner, _, key = name.rpartition(".")
            torch_private.put_buffer(model.get_submodule(owner), key, made[name])
