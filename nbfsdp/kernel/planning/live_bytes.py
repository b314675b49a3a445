"""The planner's dispatch counter: the bytes of the storages operators make on the meta device while they live,
by when they were made (``LiveBytes``), for ``peak``'s traced step. Runs in the notebook's kernel.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from nbfsdp.shared.torch_private import TorchDispatchMode, paused_dispatch_mode, tree_flatten


@dataclass
class LiveBytes(TorchDispatchMode):
    """Bytes of the storages operators made and that are still alive, by when they were made.

    A storage counts once, from the operator that made it until it is freed (a finalizer on the storage);
    views share their base's. Made in forward: ``activations`` (what forward leaves alive is what backward
    needs); in backward or the optimizer's step: ``temporaries``; a gradient autograd accumulated into a
    parameter: ``grads`` (FSDP2's unsharded gradient). FSDPMemTracker files them the same way. The caller's
    ``on_change`` sees every operator (where a peak can be)."""

    on_change: Callable[[], None]
    live: dict[int, tuple[int, str]] = field(default_factory=dict)
    bytes_by_kind: dict[str, int] = field(default_factory=dict)
    kind: str = "activations"
    held: dict[int, torch.UntypedStorage] = field(default_factory=dict)
    """Storages the ledger counts (parameters, buffers, the optimizer's tensors): an operator's view of one,
    or an in-place update, makes nothing new."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self.count(tensor, self.kind)
        self.on_change()
        return out

    def hold(self, tensors: Iterable[torch.Tensor]) -> None:
        """These tensors' storages are the ledger's: never counted here."""
        for tensor in tensors:
            storage = tensor.untyped_storage()
            self.held[id(storage)] = storage

    def count(self, tensor: torch.Tensor, kind: str) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self.live or key in self.held:
            return
        size = storage.nbytes()
        self.live[key] = (size, kind)
        self.bytes_by_kind[kind] = self.bytes_by_kind.get(kind, 0) + size
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        size, kind = self.live.pop(key)
        self.bytes_by_kind[kind] -= size

    def reclassify(self, tensor: torch.Tensor, kind: str) -> None:
        """``tensor``'s storage is ``kind`` from now on (a gradient autograd accumulated)."""
        key = id(tensor.untyped_storage())
        if key in self.live:
            size, old = self.live[key]
            self.bytes_by_kind[old] -= size
            self.bytes_by_kind[kind] = self.bytes_by_kind.get(kind, 0) + size
            self.live[key] = (size, kind)
        else:
            self.count(tensor, kind)

    def split(self) -> dict[str, int]:
        """Live bytes now: activations, temporaries, unsharded gradients."""
        return {kind: self.bytes_by_kind.get(kind, 0) for kind in ("activations", "temporaries", "grads")}


@contextlib.contextmanager
def paused(mode: TorchDispatchMode) -> Iterator[None]:
    """Operators run uncounted (``mode`` is the innermost dispatch mode)."""
    with paused_dispatch_mode():
        yield
