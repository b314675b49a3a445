"""A checkpoint read in the kernel, with no engines and no process group: exported as one file of full
weights, or loaded straight into the notebook's own plain model, optimizer and scheduler.

A checkpoint (``nbfsdp.shared.checkpoints`` describes the format) is DCP's sharded files plus the manifest
``nbfsdp.json``. DCP reassembles whole tensors from every rank's shards when asked for them without a
process group (``torch_private.dcp_load_in_one_process``), so the kernel needs no world to read one. What to ask for
comes from DCP's own ``.metadata`` (every key, its shape and dtype, and the nested path it was flattened
from), so nothing of the model has to be built first::

    nbfsdp.export("ckpt/step-100", "model.safetensors", dtype="bf16")
    nbfsdp.load("ckpt/step-100", into=model, optimizer=opt, scheduler=sched)
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from IPython.core.error import UsageError
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.optim import Optimizer

from nbfsdp.kernel.cluster.threads import KernelThread
from nbfsdp.kernel.usage_errors import as_usage_errors
from nbfsdp.shared.collectives import size_text
from nbfsdp.shared.torch_private import dcp_load_in_one_process
from nbfsdp.shared.weights_files import check_suffix, import_safetensors

#: ``dtype=`` choices: what floating tensors are cast to (integer and bool tensors keep theirs).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: The manifest's file name: its presence marks a checkpoint complete.
MANIFEST = "nbfsdp.json"


@dataclass(frozen=True, slots=True)
class _Checkpoint:
    """A complete checkpoint opened: its manifest (a dict, as written), DCP's metadata, each key's path."""

    path: Path
    manifest: dict[str, Any]
    metadata: Metadata
    paths: dict[str, tuple[str | int, ...]]

    def names(self, section: str) -> list[str]:
        """The names under ``section`` ("models", "optimizers", ...): the manifest's, else the stored keys'."""
        listed = self.manifest.get(section)
        if isinstance(listed, dict) and listed:
            return list(listed)
        return list(dict.fromkeys(str(p[1]) for p in self.paths.values() if len(p) > 2 and p[0] == section))


def _open(checkpoint: str | os.PathLike[str]) -> _Checkpoint:
    """The checkpoint at ``checkpoint``, or a UsageError saying why it is none (missing, incomplete)."""
    path = Path(checkpoint).expanduser()
    if not path.is_dir():
        raise UsageError(f"no checkpoint at {str(path)!r}: it does not exist or is not a directory")
    if path.name.startswith(".") or not (path / MANIFEST).is_file() or not (path / ".metadata").is_file():
        raise UsageError(
            f"{str(path)!r} is not a complete checkpoint (no {MANIFEST}, no .metadata, or a hidden partial "
            "directory): a save that did not finish; use another checkpoint"
        )
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as error:
        raise UsageError(f"{str(path / MANIFEST)!r} cannot be read: {error}") from None
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    return _Checkpoint(path, manifest if isinstance(manifest, dict) else {}, metadata, _paths(metadata))


def _paths(metadata: Metadata) -> dict[str, tuple[str | int, ...]]:
    """Each stored key's path in the nested state dict that was saved.

    DCP's default save planner keeps the path of every flattened key in ``planner_data``; without it the
    path is read from the key as the format spells it (names never hold a dot; FQNs may).
    """
    if isinstance(metadata.planner_data, dict) and set(metadata.planner_data) >= set(metadata.state_dict_metadata):
        return {key: tuple(metadata.planner_data[key]) for key in metadata.state_dict_metadata}
    paths: dict[str, tuple[str | int, ...]] = {}
    for key in metadata.state_dict_metadata:
        section, name, rest = (key.split(".", 2) + ["", ""])[:3]
        if section == "optimizers" and rest.startswith("state."):
            fqn, _, entry = rest[len("state.") :].rpartition(".")
            paths[key] = (section, name, "state", fqn, entry)
        elif section == "optimizers" and rest.startswith("param_groups."):
            _, index, entry = rest.split(".", 2)
            paths[key] = (section, name, "param_groups", int(index), entry)
        elif section == "models":
            paths[key] = (section, name, rest)
        else:
            paths[key] = (section, name, *rest.split("."))
    return paths


def _read(checkpoint: _Checkpoint, prefix: tuple[str, ...]) -> Any:
    """Everything stored under ``prefix``, whole, rebuilt as the nested value that was saved."""
    keys = {key: path[len(prefix) :] for key, path in checkpoint.paths.items() if path[: len(prefix)] == prefix}
    flat: dict[str, Any] = {}
    for key in keys:
        stored = checkpoint.metadata.state_dict_metadata[key]
        # tensors are read into whole tensors of the saved shape; other values are unpickled in their place
        flat[key] = (
            torch.empty(stored.size, dtype=stored.properties.dtype)
            if isinstance(stored, TensorStorageMetadata)
            else None
        )
    dcp_load_in_one_process(flat, dcp.FileSystemReader(str(checkpoint.path)))
    nested: dict[Any, Any] = {}
    for key, path in keys.items():
        node = nested
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = flat[key]
    return _as_lists(nested)


def _as_lists(value: Any) -> Any:
    """Dicts keyed 0..n-1 (DCP flattens lists by index) back into lists."""
    if not isinstance(value, dict):
        return value
    value = {key: _as_lists(item) for key, item in value.items()}
    if value and all(isinstance(key, int) for key in value) and sorted(value) == list(range(len(value))):
        return [value[index] for index in range(len(value))]
    return value


def _model_name(checkpoint: _Checkpoint, model: str | None) -> str:
    names = checkpoint.names("models")
    if not names:
        raise UsageError(f"checkpoint {str(checkpoint.path)!r} holds no model")
    if model is None:
        if len(names) > 1:
            raise UsageError(f"checkpoint {str(checkpoint.path)!r} holds several models: pass model= one of {names}")
        return names[0]
    if model not in names:
        raise UsageError(f"checkpoint {str(checkpoint.path)!r} has no model {model!r}: its models are {names}")
    return model


def _owned(checkpoint: _Checkpoint, section: str, owner: str, what: str) -> str:
    """The one optimizer of model ``owner`` (or scheduler of optimizer ``owner``) the manifest names."""
    listed = checkpoint.manifest.get(section) or {}
    names = [name for name, of in listed.items() if of == owner] if isinstance(listed, dict) else []
    if len(names) != 1:
        found = f"several ({', '.join(names)})" if names else "none"
        raise UsageError(f"checkpoint {str(checkpoint.path)!r} has {found} {what} for {owner!r}: load_into needs one")
    return names[0]


def _listed(found: list[str]) -> str:
    return ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")


@as_usage_errors
def export(  # noqa: PLR0913 (public API: nbfsdp.export's keywords are %fsdp export's flags)
    checkpoint: str | Path,
    out: str | Path,
    *,
    model: str | None = None,
    dtype: str | None = None,
    hf: bool = False,
    max_shard_size: str | int | None = None,
    overwrite: bool = False,
) -> Path:
    """One model's full weights from ``checkpoint`` into one ``.pt`` or ``.safetensors`` file; returns its path.

    ``.pt`` is a plain state dict (``load_state_dict(torch.load(out), strict=True)`` on the plain model);
    ``.safetensors`` has the same names (the module FQNs, Hugging Face style). Tied weights are written
    under each of their names, each its own copy: safetensors refuses shared storage, and every name
    present keeps a strict ``load_state_dict`` working (``safetensors.torch.load_model`` then needs
    ``strict=False``: it expects Hugging Face's convention of one name per tie).
    ``dtype`` ("fp32", "bf16", "fp16") casts floating tensors only. The file appears complete or not at all.

    ``hf=True`` (``--hf``): ``out`` is a directory written as ``save_pretrained`` writes it (safetensors files
    of at most ``max_shard_size``, their index, the config of the notebook's model of that name), read one
    file's tensors at a time (``nbfsdp.kernel.checkpoints.hf_export``); ``overwrite`` replaces such a directory.
    """
    if hf:
        from nbfsdp.kernel.checkpoints import hf_export  # the --hf writer: imported only when used

        opened = _open(checkpoint)
        name = _model_name(opened, model)
        keys = {str(p[2]): key for key, p in opened.paths.items() if p[:2] == ("models", name) and len(p) == 3}
        listed = opened.manifest.get("models", {}).get(name, {})
        saved = hf_export.SavedModel(
            checkpoint=opened.path,
            metadata=opened.metadata,
            keys=keys,
            name=name,
            saved_class=listed.get("class") if isinstance(listed, dict) else None,
        )
        return hf_export.export(saved, out, max_shard_size=max_shard_size, dtype=dtype, overwrite=overwrite)
    if max_shard_size is not None or overwrite:
        raise UsageError("--max-shard-size and --overwrite go with --hf (a file of full weights is one file)")
    out = Path(out).expanduser()
    suffix = check_suffix(out)
    if dtype is not None and dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    safetensors = import_safetensors() if suffix == ".safetensors" else None  # before the reading, not after
    opened = _open(checkpoint)
    name = _model_name(opened, model)
    state = _read(opened, ("models", name))
    if dtype is not None:
        state = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in state.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial-{secrets.token_hex(4)}")
    try:
        if safetensors is not None:
            tensors = {key: value.contiguous() for key, value in state.items()}
            safetensors.save_file(tensors, str(partial), metadata={"format": "pt", "nbfsdp.model": name})
        else:
            torch.save(state, partial)
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return out


def wrote(out: Path) -> str:
    """What ``%fsdp export`` says it wrote: a file, or a directory's safetensors files (``--hf``)."""
    if out.is_dir():
        files = len(list(out.glob("*.safetensors")))
        size = size_text(sum(f.stat().st_size for f in out.iterdir() if f.is_file()))
        return f"nbfsdp: wrote {out} as save_pretrained does ({files} safetensors file{'s' * (files > 1)}, {size})"
    return f"nbfsdp: wrote {out} ({size_text(out.stat().st_size)})"


@as_usage_errors
def load_into(
    checkpoint: str | os.PathLike[str],
    module: nn.Module,
    optimizer: Optimizer | None = None,
    scheduler: Any = None,
    *,
    model: str | None = None,
) -> None:
    """A checkpoint into the notebook's own plain model (and optimizer, scheduler), in place, no engines.

    The weights are exactly the saved ones; keys or shapes that differ are a UsageError naming them, and
    everything is read and checked before anything is changed. The optimizer's state is saved keyed by
    FQN (``get_optimizer_state_dict``); it is mapped to the plain optimizer's indices through
    ``module.named_parameters()`` in the optimizer's own parameter order, so any plain optimizer over the
    module's parameters loads, in the groups it has.
    """
    opened = _open(checkpoint)
    name = _model_name(opened, model)
    optimizers: dict[str, tuple[Optimizer, str]] = {}
    schedulers: dict[str, Any] = {}
    if optimizer is not None or scheduler is not None:
        optimizer_name = _owned(opened, "optimizers", name, "optimizers")
        if optimizer is not None:
            optimizers[optimizer_name] = (optimizer, name)
        if scheduler is not None:
            schedulers[_owned(opened, "schedulers", optimizer_name, "schedulers")] = scheduler
    NotebookRead(opened.path, {name: module}, optimizers, schedulers).apply()


class NotebookRead:
    """A checkpoint's models, optimizers and schedulers read in the kernel for the notebook's own objects of
    those names, in a thread: ``%fsdp load`` reads it so while the ranks load their shards, instead of
    gathering every loaded tensor back from them. ``apply`` waits for the read, then loads each object in
    place; a read that failed raises there, before any object changes."""

    def __init__(
        self,
        checkpoint: str | Path,
        models: dict[str, nn.Module],
        optimizers: dict[str, tuple[Optimizer, str]],
        schedulers: dict[str, Any],
    ) -> None:
        self._checkpoint, self._models, self._optimizers, self._schedulers = checkpoint, models, optimizers, schedulers
        self._objects = {**models, **{name: opt for name, (opt, _) in optimizers.items()}, **schedulers}
        self._states: dict[str, Any] = {}
        self._error: BaseException | None = None
        self._thread = KernelThread(target=self._read, name="nbfsdp-read")
        self._thread.start()

    def _read(self) -> None:
        try:
            opened = _open(self._checkpoint)
            for name, module in self._models.items():
                self._states[name] = _read(opened, ("models", name))
                _check_fits(opened, name, self._states[name], module)
            for name, (optimizer, owner) in self._optimizers.items():
                saved = _read(opened, ("optimizers", name))
                self._states[name] = _plain_optimizer_state(saved, self._models[owner], optimizer, name)
            for name in self._schedulers:
                self._states[name] = _read(opened, ("schedulers", name))
        except BaseException as error:  # raised by ``apply``, in the notebook's thread
            self._error = error

    def apply(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error
        for name, value in self._objects.items():  # models first: an optimizer's state maps onto its parameters
            if isinstance(value, nn.Module):
                value.load_state_dict(self._states[name], strict=True)
            else:
                value.load_state_dict(self._states[name])


def _check_fits(checkpoint: _Checkpoint, name: str, state: dict[str, torch.Tensor], module: nn.Module) -> None:
    expected = module.state_dict()
    missing = [key for key in expected if key not in state]
    unexpected = [key for key in state if key not in expected]
    shapes = [
        f"{key} (checkpoint {list(state[key].shape)}, module {list(value.shape)})"
        for key, value in expected.items()
        if key in state and state[key].shape != value.shape
    ]
    found_by_kind = {"missing": missing, "unexpected": unexpected, "other shapes": shapes}
    problems = [f"{what}: {_listed(found)}" for what, found in found_by_kind.items() if found]
    if problems:
        raise UsageError(
            f"model {name!r} of {str(checkpoint.path)!r} does not fit this {type(module).__name__}: "
            + "; ".join(problems)
        )


def _plain_optimizer_state(saved: dict[str, Any], module: nn.Module, optimizer: Optimizer, name: str) -> dict:
    """The saved FQN-keyed optimizer state as ``optimizer.state_dict()`` keys it: by index, in its order.

    A tied parameter has several FQNs; the saved state is under one of them (the first, as
    ``named_parameters`` gives it), so each is tried. The plain groups' own keys that the saved groups lack
    (DCP may lose ``initial_lr``, pytorch#140900) are kept.
    """
    fqns: dict[int, list[str]] = {}
    for param_fqn, param in module.named_parameters(remove_duplicate=False):
        fqns.setdefault(id(param), []).append(param_fqn)
    saved_groups, saved_state = saved.get("param_groups") or [], saved.get("state") or {}
    if len(saved_groups) != len(optimizer.param_groups):
        raise UsageError(
            f"optimizer {name!r} was saved with {len(saved_groups)} parameter groups, this one has "
            f"{len(optimizer.param_groups)}"
        )
    state: dict[int, Any] = {}
    groups = []
    index = 0
    for group, saved_group in zip(optimizer.param_groups, saved_groups, strict=True):
        saved_params = list(saved_group.get("params", []))
        indices = []
        for param in group["params"]:
            if id(param) not in fqns:
                raise UsageError(f"the optimizer holds a parameter that is not the module's (optimizer {name!r})")
            fqn = next((f for f in fqns[id(param)] if f in saved_params), None)
            if fqn is None:
                raise UsageError(f"optimizer {name!r} was saved without parameter {fqns[id(param)][0]!r}")
            if fqn in saved_state:
                state[index] = saved_state[fqn]
            indices.append(index)
            index += 1
        if len(saved_params) != len(indices):
            raise UsageError(
                f"optimizer {name!r} was saved over {len(saved_params)} parameters in a group, this one {len(indices)}"
            )
        kept = {key: value for key, value in group.items() if key != "params"}
        groups.append({**kept, **{k: v for k, v in saved_group.items() if k != "params"}, "params": indices})
    return {"state": state, "param_groups": groups}
