"""``--hf``: a model written as ``save_pretrained`` writes it, for ``from_pretrained`` and the Hub, without the
kernel ever holding the whole model::

    %fsdp save out/llama-hf --hf --max-shard-size 200MB       # from the live ranks
    %fsdp export ckpt/step-100 out/llama-hf --hf --model llama  # from an nbfsdp checkpoint, in the kernel

From the ranks (``save``): each rank writes its shards, joined into the files on disk
(``nbfsdp.engines.hf_saving``). From a checkpoint (``export``): the kernel reads one output file's tensors at a
time through DCP's reader and writes that file before the next. The layout, the names (a tie once) and the
split are ``nbfsdp.shared.hf_files``'s; the config comes from the notebook's model of that name (its
``.config``, and its ``generation_config`` where it generates), as ``save_pretrained`` writes them.
"""

from __future__ import annotations

import copy
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from IPython.core.error import UsageError
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from nbfsdp.engines import hf_saving
from nbfsdp.kernel.cluster.world import RunningWorld
from nbfsdp.kernel.run.session import Session
from nbfsdp.shared import hf_files
from nbfsdp.shared.checkpoints import CheckpointError
from nbfsdp.shared.collectives import size_text
from nbfsdp.shared.hf_files import HFSave
from nbfsdp.shared.torch_private import dcp_load_in_one_process
from nbfsdp.shared.weights_files import import_safetensors

#: ``sharded._on_every_rank``'s shape: (session, world, function, args, doing, partial) -> results by rank.
OnEveryRank = Callable[[Session, RunningWorld, Any, tuple, str, Path], list]


@dataclass(frozen=True, kw_only=True)
class HFOptions:
    """``%fsdp save --hf``'s own flags, together from ``sharded.save_with`` (which refuses them without ``--hf``)
    to ``save``: the model, the files' largest size, the dtype written."""

    model: str | None = None
    max_shard_size: str | int | None = None
    dtype: str | None = None


@dataclass(frozen=True, kw_only=True)
class SavedModel:
    """One model of an nbfsdp checkpoint as ``exporting`` opened it: what ``export`` reads from, with no second
    look at the manifest or DCP's metadata."""

    checkpoint: Path
    metadata: Metadata
    """DCP's metadata of the checkpoint: each key's shape and dtype."""
    keys: dict[str, str]
    """The model's names (its FQNs) -> their DCP keys."""
    name: str
    saved_class: str | None
    """The class the manifest says the model was, to compare with the notebook's; None where it says none."""


def _usage(error: CheckpointError) -> UsageError:
    return UsageError(str(error))


def config_files(module: nn.Module, name: str, dtype: torch.dtype) -> dict[str, str]:
    """What ``save_pretrained`` writes beside the weights: ``config.json`` (its ``architectures`` and
    ``dtype`` set as it sets them, on a copy), and ``generation_config.json`` for a model that generates."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise UsageError(
            f"{name} ({type(module).__name__}) has no Hugging Face .config: --hf writes config.json from it. "
            f"Give the model its config (a transformers PreTrainedModel has one: {name}.config = AutoConfig...), or "
            "save without --hf (an nbfsdp checkpoint) or export one .safetensors file"
        )
    config = copy.deepcopy(config)
    config.architectures = [type(module).__name__.removeprefix("FSDP")]
    if int(version("transformers").split(".")[0]) >= 5:
        config.dtype = str(dtype).removeprefix("torch.")
    else:  # transformers 4's key, which it writes as the dtype's name
        config.torch_dtype = dtype
    with tempfile.TemporaryDirectory(prefix="nbfsdp-config-") as directory:
        config.save_pretrained(directory)
        generation = getattr(module, "generation_config", None)
        can_generate = getattr(module, "can_generate", None)
        if generation is not None and callable(can_generate) and can_generate():
            generation.save_pretrained(directory)
        return {path.name: path.read_text() for path in Path(directory).iterdir() if path.is_file()}


def _model_dtype(module: nn.Module) -> torch.dtype:
    floating = [p.dtype for p in module.parameters() if p.is_floating_point()]
    return floating[0] if floating else torch.float32


def save(
    session: Session,
    path: str | os.PathLike,
    options: HFOptions,
    *,
    overwrite: bool,
    on_every_rank: OnEveryRank,
    writer: hf_saving.Writer | None = None,
) -> Path:
    """``%fsdp save OUT --hf``: the ranks' model ``options.model`` (default: the only one they hold) into ``path``
    as ``save_pretrained`` writes it; returns the directory. ``writer`` ("dcp", "rank0"): how the ranks write
    (``hf_saving.save``), by default DCP's HF writer where torch has it."""
    world = session.cluster.world
    assert world is not None  # save_with checked it runs and holds models
    name = _one_model(session.engine_models(), options.model, "the engines hold")
    module = session.shell.user_ns.get(name)
    if not isinstance(module, nn.Module):
        raise UsageError(f"the notebook has no model {name!r} any more: --hf reads its .config from it")
    try:
        shard_bytes = hf_files.max_shard_bytes(options.max_shard_size)
        written = hf_files.written_dtype(options.dtype)
    except CheckpointError as error:
        raise _usage(error) from None
    final = Path(path).expanduser().resolve()  # the engines may run in another directory
    try:
        hf_files.check_target(final, overwrite=overwrite)
    except CheckpointError as error:
        raise _usage(error) from None
    request = HFSave(
        generation=world.generation,
        model=name,
        partial=str(hf_files.partial_path(final)),
        final=str(final),
        overwrite=overwrite,
        max_shard_bytes=shard_bytes,
        dtype=options.dtype,
        extra_files=config_files(module, name, written or _model_dtype(module)),
    )
    final.parent.mkdir(parents=True, exist_ok=True)
    results = on_every_rank(session, world, hf_saving.save, (request, writer), "saving --hf", Path(request.partial))
    done = results[0]
    print(
        f"nbfsdp: saved {name} to {path} as save_pretrained does ({_files(len(done['files']))}, "
        f"{size_text(done['bytes'])}, written by "
        f"{'every rank, joined on disk' if done['writer'] == 'dcp' else 'rank 0 one file at a time'})"
    )
    return Path(path)


def _files(count: int) -> str:
    return f"{count} safetensors file{'s' if count > 1 else ''}"


def _one_model(names: list[str], model: str | None, where: str) -> str:
    if model is None:
        if len(names) != 1:
            raise UsageError(f"{where} several models: pass --model one of {', '.join(names)}")
        return names[0]
    if model not in names:
        raise UsageError(f"{where} no model {model!r}: --model one of {', '.join(names) or '(none)'}")
    return model


def export(
    saved: SavedModel,
    out: str | os.PathLike,
    *,
    max_shard_size: str | int | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
    namespace: dict[str, Any] | None = None,
) -> Path:
    """``%fsdp export CKPT OUT --hf``: the checkpoint's model ``saved`` into the directory ``out``, one file's
    tensors in memory at a time; the config and the names to write (a tie once) from the notebook's model of
    its name. Returns the directory."""
    name, keys = saved.name, saved.keys
    safetensors = import_safetensors()
    try:
        shard_bytes = hf_files.max_shard_bytes(max_shard_size)
        cast = hf_files.written_dtype(dtype)
        final = Path(out).expanduser().resolve()
        hf_files.check_target(final, overwrite=overwrite)
    except CheckpointError as error:
        raise _usage(error) from None
    module = _notebook_model(name, saved.saved_class, namespace)
    stored = {n: saved.metadata.state_dict_metadata[key] for n, key in keys.items()}
    names = hf_files.kept_names(module)
    missing = [n for n in names if not isinstance(stored.get(n), TensorStorageMetadata)]
    if missing:
        raise UsageError(
            f"the checkpoint's {name!r} lacks tensors the notebook's {name} has: {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}; export the model the checkpoint was saved from"
        )
    dtypes = {n: _dtype(stored[n], cast) for n in names}
    sizes = {n: hf_files.nbytes(_meta(stored[n]).size, dtypes[n]) for n in names}
    try:
        plan = hf_files.file_plan(sizes, shard_bytes)
    except CheckpointError as error:
        raise _usage(error) from None
    floating = [d for n, d in dtypes.items() if _meta(stored[n]).properties.dtype.is_floating_point]
    files = config_files(module, name, floating[0] if floating else torch.float32)
    by_file: dict[str, list[str]] = {}
    for tensor_name, file in plan.items():
        by_file.setdefault(file, []).append(tensor_name)
    if len(by_file) > 1:
        parameters = sum(p.numel() for p in module.parameters())  # a tie once, as num_parameters() counts
        files[hf_files.INDEX_NAME] = hf_files.index_json(plan, sizes, parameters)
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = hf_files.partial_path(final)
    partial.mkdir()
    try:
        reader = dcp.FileSystemReader(str(saved.checkpoint))
        for file, file_names in sorted(by_file.items()):
            flat = {
                keys[n]: torch.empty(_meta(stored[n]).size, dtype=_meta(stored[n]).properties.dtype) for n in file_names
            }
            dcp_load_in_one_process(flat, reader)
            tensors = {n: flat.pop(keys[n]).to(dtypes[n]).contiguous() for n in file_names}
            safetensors.save_file(tensors, str(partial / file), metadata={"format": "pt"})
            del tensors, flat
        hf_files.write_text(partial, files)
        hf_files.finish(partial, final, overwrite=overwrite)
    except CheckpointError as error:
        raise _usage(error) from None
    finally:
        if partial.exists():
            shutil.rmtree(partial, ignore_errors=True)
    return final


def _meta(stored: Any) -> TensorStorageMetadata:
    assert isinstance(stored, TensorStorageMetadata)  # export checked every name written is a tensor
    return stored


def _dtype(stored: Any, cast: torch.dtype | None) -> torch.dtype:
    saved = _meta(stored).properties.dtype
    return cast if cast is not None and saved.is_floating_point else saved


def _notebook_model(name: str, saved_class: str | None, namespace: dict[str, Any] | None) -> nn.Module:
    """The notebook's model ``name``: the one the checkpoint's model came from, for its config and ties."""
    if namespace is None:
        from IPython import get_ipython

        shell = get_ipython()
        namespace = shell.user_ns if shell is not None else {}
    module = namespace.get(name)
    saved = f" ({saved_class})" if saved_class else ""
    if not isinstance(module, nn.Module):
        raise UsageError(
            f"--hf takes the config of the checkpoint's model {name!r}{saved} from the notebook's model of that "
            f"name, and the notebook has none: build it first (e.g. {name} = AutoModelForCausalLM.from_config(config); "
            "on the meta device is enough), then export again"
        )
    own = f"{type(module).__module__}.{type(module).__qualname__}"
    if saved_class and own != saved_class:
        print(f"nbfsdp: the checkpoint's {name} was a {saved_class}; the notebook's is a {own}", file=sys.stderr)
    return module
