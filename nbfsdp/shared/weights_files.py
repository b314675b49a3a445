"""Full weights (a ``.pt`` or ``.safetensors`` file, or a Hugging Face checkpoint directory of several
safetensors files) read into a sharded model, each rank its own rows.

A rank that loads a full-weights file must not hold the whole model to take its shard of it (the point of
sharding). ``full_weights_reader(path)`` opens the file lazily: safetensors through ``safe_open`` and
``get_slice``, which reads only the requested rows from disk; ``.pt`` through ``torch.load(mmap=True)``,
whose tensors are views of the mapped file, so only the pages of the rows copied out are read. Each rank
then asks for the part of each tensor its DTensor holds (FSDP2: ``Shard(0)``, chunked as ``torch.chunk``
chunks; HSDP adds ``Replicate``). Run on a rank, in a cell::

    from nbfsdp.shared.weights_files import full_weights_reader
    with full_weights_reader("model.safetensors") as reader:
        reader.load_into(model)        # every parameter and buffer: this rank's rows only

A Hugging Face checkpoint directory (what ``save_pretrained`` and the Hub cache hold: ``model.safetensors``,
or ``model.safetensors.index.json`` naming the file of each tensor) reads the same way, each file opened
when a tensor of it is first asked for; names are matched as ``from_pretrained`` matches them
(``match_names``: the model's ``base_model_prefix`` added or taken away, a tie kept once in the file).

The kernel's side (exporting a checkpoint into such a file) is ``nbfsdp.kernel.checkpoints.exporting``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from nbfsdp.shared import peft_private
from nbfsdp.shared.config import ConfigError

#: The file formats of full weights, by suffix.
SUFFIXES = (".pt", ".safetensors")
#: What a Hugging Face checkpoint directory holds: one file, or an index of several (``save_pretrained``).
HF_SINGLE, HF_INDEX = "model.safetensors", "model.safetensors.index.json"


def hugging_face_checkpoint(path: str | Path) -> Path | None:
    """The directory of a Hugging Face checkpoint that ``path`` names (the directory, or its index file),
    None where ``path`` is no such thing."""
    path = Path(path).expanduser()
    if path.name == HF_INDEX and path.is_file():
        return path.parent
    if path.is_dir() and ((path / HF_INDEX).is_file() or (path / HF_SINGLE).is_file()):
        return path
    return None


def check_suffix(path: str | Path) -> str:
    """The suffix of ``path`` if it is a full-weights format, else a ConfigError naming the valid ones."""
    suffix = Path(path).suffix
    if suffix not in SUFFIXES:
        raise ConfigError(f"{str(path)!r}: unknown weights file suffix {suffix!r}; use one of {', '.join(SUFFIXES)}")
    return suffix


def import_safetensors() -> Any:
    """``safetensors.torch``, imported on first use: it is an optional extra (``examples``)."""
    try:
        import safetensors.torch
    except ImportError:
        raise ConfigError(
            "writing or reading .safetensors needs the safetensors package: pip install 'nbfsdp[examples]' "
            "(or pip install safetensors), or use a .pt file"
        ) from None
    return safetensors.torch


def local_slices(tensor: torch.Tensor) -> tuple[slice, ...]:
    """The region of the full tensor that this rank's part of ``tensor`` covers, one slice per dimension.

    A plain tensor covers all of it. A DTensor's ``Shard(d)`` placements narrow dimension ``d`` in mesh
    order, each as ``torch.chunk`` splits (``ceil(n / k)`` rows per rank, the last ones short or empty),
    which is how DTensor and FSDP2 split an uneven first dimension.
    """
    ranges = [(0, n) for n in tensor.shape]
    if isinstance(tensor, DTensor):
        mesh = tensor.device_mesh
        coordinate = mesh.get_coordinate()
        assert coordinate is not None  # the tensor is this rank's: the rank is in its mesh
        for mesh_dim, placement in enumerate(tensor.placements):
            if placement.is_replicate():
                continue
            if type(placement) is not Shard:  # Partial or a strided shard: not a split of the full tensor by rows
                raise ConfigError(f"cannot read a full-weights file into a tensor placed as {placement}")
            start, stop = ranges[placement.dim]
            rows = math.ceil((stop - start) / mesh.size(mesh_dim))
            first = min(start + coordinate[mesh_dim] * rows, stop)
            ranges[placement.dim] = (first, min(first + rows, stop))
    return tuple(slice(start, stop) for start, stop in ranges)


@dataclass
class NameMatch:
    """Which name of the weights each tensor of a model reads (``match_names``), and what does not fit."""

    stored: dict[str, str] = field(default_factory=dict)
    """A model tensor's first name -> the name the weights hold it under (one name per tie)."""
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    differ: list[str] = field(default_factory=list)
    """``name [file shape] vs [model shape]``."""
    ignored: list[str] = field(default_factory=list)
    """Names outside the model's base (a head the model has not): ``from_pretrained`` leaves them too."""
    covered: set[str] = field(default_factory=set)
    """Every name of the model's tensors the weights fill, each name of a tie included."""

    def problems(self, limit: int = 5) -> str:
        """What keeps the weights from loading ("" when nothing does)."""
        found = (
            ("not in the weights", self.missing),
            ("only in the weights", self.unexpected),
            ("shapes differ (weights vs model)", self.differ),
        )
        return "; ".join(
            f"{label}: {', '.join(keys[:limit])}{' ...' if len(keys) > limit else ''}" for label, keys in found if keys
        )


def match_names(module: nn.Module, shapes: dict[str, tuple[int, ...]]) -> NameMatch:
    """Each of ``module``'s tensors (parameters and persistent buffers; a tie is one tensor under several
    names) matched to a name of weights holding ``shapes``, as ``from_pretrained`` matches them: the same
    name; or, for a Hugging Face model (its ``base_model_prefix``, e.g. ``model``), the name with that prefix
    added (weights of the bare base model into a model with a head) or taken away (weights of a model with a
    head into its bare base, the head's names then ignored). A peft model's tensors match by their names in its
    base (peft's wrapper path and the ``base_layer`` of each adapted layer taken away): its adapters by none."""
    inside, base = peft_private.wrapped_model(module)
    prefix = getattr(base, "base_model_prefix", "") or ""
    groups: dict[int, list[str]] = {}
    model_shapes: dict[str, tuple[int, ...]] = {}
    as_base: dict[str, str] = {}  # a tensor's name in the base (without peft's wrapper path and ``base_layer``)
    for key, tensor in module.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(key)
        model_shapes[key] = tuple(tensor.shape)
        as_base[key] = peft_private.name_in_base(key, inside)
    strip = bool(prefix) and not any(key.startswith(f"{prefix}.") for key in as_base.values())
    strip = strip and any(key.startswith(f"{prefix}.") for key in shapes)

    def candidates(name: str) -> list[str]:
        key = as_base[name]
        found = [key]
        if prefix and strip:
            found.append(f"{prefix}.{key}")
        elif prefix and key.startswith(f"{prefix}."):
            found.append(key.removeprefix(f"{prefix}."))
        return found

    match = NameMatch()
    used: set[str] = set()
    for group in groups.values():
        stored = next((c for key in group for c in candidates(key) if c in shapes), None)
        if stored is None:
            match.missing.append(group[0])
            continue
        used.add(stored)
        match.stored[group[0]] = stored
        match.covered.update(group)
        if shapes[stored] != model_shapes[group[0]]:
            match.differ.append(f"{stored} {list(shapes[stored])} vs {list(model_shapes[group[0]])}")
    for key in shapes:
        if key in used:
            continue
        (match.ignored if strip and not key.startswith(f"{prefix}.") else match.unexpected).append(key)
    return match


class Weights:
    """Full weights opened for reading: names, shapes, and any tensor's part read on its own."""

    path: Path
    bytes_read: int

    def keys(self) -> list[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def read(self, name: str, like: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's name and shape (the headers only: nothing is read)."""
        return {key: self.shape(key) for key in self.keys()}

    def matched(self, module: nn.Module, *, strict: bool = True) -> NameMatch:
        """Which name of the weights each of ``module``'s tensors reads (``match_names``); with ``strict``, a
        ``ConfigError`` for a tensor the weights lack or a name only they have."""
        match = match_names(module, self.shapes())
        if strict and (match.missing or match.unexpected):
            raise ConfigError(
                f"{str(self.path)!r} does not fit the model: "
                + "; ".join(
                    f"{what} {', '.join(found[:5])}{' ...' if len(found) > 5 else ''}"
                    for what, found in (("missing", match.missing), ("unexpected", match.unexpected))
                    if found
                )
            )
        return match

    def load_into(self, module: nn.Module, *, strict: bool = True) -> None:
        """Every parameter and persistent buffer of ``module``: this rank's part, read from the weights.

        Tied parameters are one object under several names: each is read once, under the first of its names
        the weights have (weights that follow Hugging Face and keep one name of a tie load too). Names are
        matched as ``match_names`` matches them; the values take the model's dtype.
        """
        match = self.matched(module, strict=strict)
        state = module.state_dict(keep_vars=True)
        with torch.no_grad():
            for key, stored in match.stored.items():
                tensor = state[key]
                part = self.read(stored, tensor)
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                if part.shape != local.shape:  # copy_ would broadcast a wrong split silently
                    raise ConfigError(f"{stored}: this rank holds {list(local.shape)}, read {list(part.shape)}")
                local.copy_(part)

    def close(self) -> None:
        pass

    def __enter__(self) -> Weights:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


class WeightsFile(Weights):
    """An open full-weights file: names, shapes, and any tensor's part read on its own."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.suffix = check_suffix(self.path)
        if not self.path.is_file():
            raise ConfigError(f"no weights file at {str(self.path)!r}")
        #: Bytes of tensor data read so far (what this rank took from the file).
        self.bytes_read = 0
        if self.suffix == ".safetensors":
            import_safetensors()
            from safetensors import safe_open

            self._file: safe_open | None = safe_open(str(self.path), framework="pt", device="cpu")
            self._tensors: dict[str, torch.Tensor] | None = None
            names = self._file.keys()  # a safe_open is not iterable itself
            self._shapes = {name: tuple(self._file.get_slice(name).get_shape()) for name in names}
        else:
            # mmap: tensors are views of the file, so nothing is read until rows are copied out
            state = torch.load(self.path, map_location="cpu", mmap=True, weights_only=True)
            if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise ConfigError(f"{str(self.path)!r} is not a plain state dict (names to tensors)")
            self._file = None
            self._tensors = state
            self._shapes = {name: tuple(t.shape) for name, t in state.items()}

    def keys(self) -> list[str]:
        return list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def read(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The part of ``name`` that ``like`` (a DTensor or a plain tensor of the full shape) holds here."""
        if name not in self._shapes:
            raise ConfigError(f"{str(self.path)!r} has no tensor {name!r}")
        if self._shapes[name] != tuple(like.shape):
            raise ConfigError(
                f"{name}: {str(self.path)!r} holds shape {list(self._shapes[name])}, the model {list(like.shape)}"
            )
        where = local_slices(like)
        local_shape = tuple(s.stop - s.start for s in where)
        if 0 in local_shape:  # this rank holds no rows of it (an uneven first dimension)
            return torch.empty(local_shape, dtype=like.dtype)
        # .pt: the copy reads only these rows' pages of the mapped file; safetensors: only these rows
        if self._tensors is not None:
            part = self._tensors[name][where].clone()
        else:
            assert self._file is not None, "the file is closed"
            part = self._file.get_slice(name)[where]
        self.bytes_read += part.numel() * part.element_size()
        return part

    def close(self) -> None:
        self._file = self._tensors = None


class WeightsDirectory(Weights):
    """A Hugging Face checkpoint directory: ``model.safetensors``, or the files ``model.safetensors.index.json``
    names. Each file is opened (its header read) when the directory is; a tensor's rows are read from its file
    alone."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.bytes_read = 0
        index = self.path / HF_INDEX
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            weight_map = dict.fromkeys(WeightsFile(self.path / HF_SINGLE).keys(), HF_SINGLE)
        absent = sorted({name for name in weight_map.values() if not (self.path / name).is_file()})
        if absent:
            raise ConfigError(f"{str(self.path)!r}: {HF_INDEX} names files that are not there: {', '.join(absent)}")
        self._files = {name: WeightsFile(self.path / name) for name in sorted(set(weight_map.values()))}
        self._where = weight_map
        held = {name: set(file.keys()) for name, file in self._files.items()}
        for key, name in weight_map.items():
            if key not in held[name]:
                raise ConfigError(f"{str(self.path)!r}: {HF_INDEX} puts {key} in {name}, which does not hold it")

    def keys(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._files[self._where[name]].shape(name)

    def read(self, name: str, like: torch.Tensor) -> torch.Tensor:
        if name not in self._where:
            raise ConfigError(f"{str(self.path)!r} has no tensor {name!r}")
        file = self._files[self._where[name]]
        before = file.bytes_read
        part = file.read(name, like)
        self.bytes_read += file.bytes_read - before
        return part

    def close(self) -> None:
        for file in self._files.values():
            file.close()


def full_weights_reader(path: str | Path) -> Weights:
    """``path`` (``.pt`` or ``.safetensors`` of full weights, or a Hugging Face checkpoint directory or its
    index) opened for reading one rank's part at a time."""
    directory = hugging_face_checkpoint(path)
    return WeightsDirectory(directory) if directory is not None else WeightsFile(path)
