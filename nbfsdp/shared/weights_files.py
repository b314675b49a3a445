"""One file of full weights (``.pt`` or ``.safetensors``) read into a sharded model, each rank its own rows.

A rank that loads a full-weights file must not hold the whole model to take its shard of it (the point of
sharding). ``full_weights_reader(path)`` opens the file lazily: safetensors through ``safe_open`` and
``get_slice``, which reads only the requested rows from disk; ``.pt`` through ``torch.load(mmap=True)``,
whose tensors are views of the mapped file, so only the pages of the rows copied out are read. Each rank
then asks for the part of each tensor its DTensor holds (FSDP2: ``Shard(0)``, chunked as ``torch.chunk``
chunks; HSDP adds ``Replicate``). Run on a rank, in a cell::

    from nbfsdp.shared.weights_files import full_weights_reader
    with full_weights_reader("model.safetensors") as reader:
        reader.load_into(model)        # every parameter and buffer: this rank's rows only

The kernel's side (exporting a checkpoint into such a file) is ``nbfsdp.kernel.checkpoints.exporting``.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from nbfsdp.shared.config import ConfigError

#: The file formats of full weights, by suffix.
SUFFIXES = (".pt", ".safetensors")


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


class WeightsFile:
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

    def load_into(self, module: nn.Module, *, strict: bool = True) -> None:
        """Every parameter and persistent buffer of ``module``: this rank's part, read from the file.

        Tied parameters are one object under several names: each is read once, under the first of its names
        the file has (a file that follows Hugging Face and keeps one name of a tie loads too).
        """
        names: dict[int, list[str]] = {}
        tensors: dict[int, torch.Tensor] = {}
        for name, tensor in module.state_dict(keep_vars=True).items():
            names.setdefault(id(tensor), []).append(name)
            tensors[id(tensor)] = tensor
        wanted = {name for group in names.values() for name in group}
        missing = [group[0] for group in names.values() if not any(n in self._shapes for n in group)]
        unexpected = [name for name in self._shapes if name not in wanted]
        if strict and (missing or unexpected):
            raise ConfigError(
                f"{str(self.path)!r} does not fit the model: "
                + "; ".join(
                    f"{what} {', '.join(found[:5])}{' ...' if len(found) > 5 else ''}"
                    for what, found in (("missing", missing), ("unexpected", unexpected))
                    if found
                )
            )
        with torch.no_grad():
            for key, group in names.items():
                stored = next((n for n in group if n in self._shapes), None)
                if stored is None:
                    continue
                tensor = tensors[key]
                part = self.read(stored, tensor)
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                if part.shape != local.shape:  # copy_ would broadcast a wrong split silently
                    raise ConfigError(f"{stored}: this rank holds {list(local.shape)}, read {list(part.shape)}")
                local.copy_(part)

    def close(self) -> None:
        self._file = self._tensors = None

    def __enter__(self) -> WeightsFile:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def full_weights_reader(path: str | Path) -> WeightsFile:
    """``path`` (``.pt`` or ``.safetensors`` of full weights) opened for reading one rank's part at a time."""
    return WeightsFile(path)
