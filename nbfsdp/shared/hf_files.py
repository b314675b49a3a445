"""A Hugging Face model directory as ``save_pretrained`` writes it, for ``--hf`` saves and exports: which
names are written (a tie once), how they split into files, the index, and the directory's completion.

Used by the ranks (``nbfsdp.engines.hf_saving``: ``%fsdp save OUT --hf``) and by the kernel
(``nbfsdp.kernel.checkpoints.hf_export``: ``%fsdp export CKPT OUT --hf``), so both write the same layout::

    OUT/config.json  generation_config.json  model.safetensors                 (one file)
    OUT/config.json  generation_config.json  model-0000k-of-0000n.safetensors  model.safetensors.index.json

The split is huggingface_hub's (``split_state_dict_into_shards_factory``, what ``save_pretrained`` calls),
over the names in the model's ``state_dict`` order with their sizes only: no tensor is needed to plan it.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from nbfsdp.shared.checkpoints import CheckpointError

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
#: ``--max-shard-size`` when not given: huggingface_hub's default, and transformers 4's (transformers 5's is 50GB).
DEFAULT_MAX_SHARD_SIZE = "5GB"
#: ``--dtype`` choices for what is written (floating tensors only; others keep theirs).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: The units ``--max-shard-size`` takes, decimal as huggingface_hub's ``parse_size_to_int``.
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]B)?\s*$", re.IGNORECASE)
#: What a directory may hold to be replaced with ``--overwrite``: what ``save_pretrained`` writes, nothing else.
_REPLACEABLE = re.compile(
    r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|(generation_)?config\.json)$"
)


@dataclass(kw_only=True)
class HFSave:
    """``%fsdp save OUT --hf``: what every rank is asked to write (``nbfsdp.engines.hf_saving.save``)."""

    generation: int
    model: str
    """The cells' name of the model the ranks hold."""
    partial: str
    """Where the files are written until complete (a hidden sibling of ``final``)."""
    final: str
    overwrite: bool
    max_shard_bytes: int
    dtype: str | None = None
    """A ``DTYPES`` key, or None for what the ranks hold."""
    extra_files: dict[str, str] = field(default_factory=dict)
    """File name -> text: ``config.json`` (and ``generation_config.json``), made in the kernel from the notebook's
    model."""


def max_shard_bytes(size: str | int | None) -> int:
    """``--max-shard-size`` in bytes: a number of bytes, or digits and a unit (``200MB``, ``5GB``, decimal)."""
    if size is None:
        size = DEFAULT_MAX_SHARD_SIZE
    if isinstance(size, int):
        found = size
    elif match := _SIZE.match(size):
        found = int(float(match[1]) * (_UNITS[match[2].upper()] if match[2] else 1))
    else:
        found = 0
    if found <= 0:
        raise CheckpointError(
            f"--max-shard-size {size!r}: use a size such as 200MB, 5GB or 1.5GB (units {', '.join(_UNITS)}, "
            "decimal as save_pretrained's), or a number of bytes"
        )
    return found


def written_dtype(dtype: str | None) -> torch.dtype | None:
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[dtype] if dtype is not None else None


def kept_names(module: nn.Module) -> list[str]:
    """The state dict's names ``save_pretrained`` writes, in its order: a tied tensor once, under its first
    name (GPT-2's ``transformer.wte.weight``, not ``lm_head.weight``), and none of ``_keys_to_ignore_on_save``."""
    ignored = set(getattr(module, "_keys_to_ignore_on_save", None) or ())
    seen: set[int] = set()
    names = []
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in seen or name in ignored:
            continue
        seen.add(id(tensor))
        names.append(name)
    return names


def file_plan(sizes: dict[str, int], max_bytes: int) -> dict[str, str]:
    """Each name's file, as ``save_pretrained`` splits a state dict of these sizes (bytes, in its order)."""
    try:
        from huggingface_hub import split_state_dict_into_shards_factory
    except ImportError:  # transformers depends on it: a model with a .config came with it
        raise CheckpointError("--hf needs huggingface_hub (pip install huggingface_hub, or transformers)") from None
    split = split_state_dict_into_shards_factory(
        sizes,
        get_storage_size=lambda size: size,  # the "state dict" holds each tensor's size already
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=max_bytes,
    )
    return dict(split.tensor_to_filename)


def nbytes(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def index_json(plan: dict[str, str], sizes: dict[str, int], parameters: int) -> str:
    """``model.safetensors.index.json`` as ``save_pretrained`` writes it."""
    index = {
        "metadata": {"total_parameters": parameters, "total_size": sum(sizes.values())},
        "weight_map": plan,
    }
    return json.dumps(index, indent=2, sort_keys=True) + "\n"


def write_text(directory: str | os.PathLike, files: dict[str, str]) -> None:
    for name, text in files.items():
        Path(directory, name).write_text(text)


def check_target(final: str | os.PathLike, *, overwrite: bool) -> None:
    """Before a write: OUT may be new or empty; a model directory there is replaced with ``--overwrite``
    only, and a directory holding anything else never (the user's data)."""
    final = Path(final)
    if final.name.startswith("."):
        raise CheckpointError(f"{final}: the directory's name may not start with '.'")
    if final.exists() and not final.is_dir():
        raise CheckpointError(f"{final}: a file is there, not a directory")
    if not final.is_dir() or not any(final.iterdir()):
        return
    others = sorted(p.name for p in final.iterdir() if not (p.is_file() and _REPLACEABLE.match(p.name)))
    if others:
        raise CheckpointError(
            f"{final}: a directory with other files than a Hugging Face model's is there ({', '.join(others[:3])}); "
            "write somewhere else"
        )
    if not overwrite:
        raise CheckpointError(f"{final}: a model directory is there already; --overwrite (overwrite=True) replaces it")


def partial_path(final: str | os.PathLike) -> Path:
    final = Path(final)
    return final.parent / f".{final.name}.partial-{secrets.token_hex(4)}"


def finish(partial: str | os.PathLike, final: str | os.PathLike, *, overwrite: bool) -> None:
    """The written directory under its name in one rename (one process); an old one moved aside first."""
    partial, final = Path(partial), Path(final)
    aside = None
    if final.exists():
        check_target(final, overwrite=overwrite)  # again: something may have been written there since
        aside = final.parent / f".{final.name}.old-{secrets.token_hex(4)}"
        os.rename(final, aside)
    os.rename(partial, final)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
