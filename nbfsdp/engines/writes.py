"""Whether a rank's copy of a model is still what the notebook has, told without reading any weights.

Every in-place write to a tensor bumps its ``Tensor._version`` (autograd's counter): an optimizer's step, a
write through a DTensor or to its local shard, ``load_state_dict``. ``written`` takes those counts, and a
model whose counts are unchanged since the notebook last had it is not gathered back. Two kinds of write do
not count, so a cell's are counted here: DCP's storage readers copy into the tensors without bumping them
(``dcp.load``, torch 2.13), and a write through ``.data`` has a counter of its own (documented: write in
place under ``torch.no_grad()`` instead). Runs on the engines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict_loader as dcp_loader
import torch.nn as nn
from torch.distributed.tensor import DTensor

from nbfsdp.shared import torch_private


def written(model: nn.Module) -> list[tuple[int, int, int]]:
    """Each of ``model``'s parameters and buffers on this rank, and how often it was written (the DTensor's count
    for a write through it, its local shard's for a write to ``to_local()`` or an optimizer's step)."""
    found = []
    for tensor in [*model.parameters(), *model.buffers()]:
        local = torch_private.local_tensor(tensor) if isinstance(tensor, DTensor) else tensor
        found.append((id(tensor), torch_private.version(tensor), torch_private.version(local)))
    return found


def count_as_written(state: Any) -> None:
    """Count a write to every tensor of ``state`` (a state dict, nested or not): DCP loaded into them."""
    if isinstance(state, dict):
        for value in state.values():
            count_as_written(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            count_as_written(value)
    elif isinstance(state, torch.Tensor):
        torch.autograd.graph.increment_version(state)
        if isinstance(state, DTensor):
            torch.autograd.graph.increment_version(torch_private.local_tensor(state))


def _counting(load: Callable[..., Any]) -> Callable[..., Any]:
    def load_and_count(state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return load(state_dict, *args, **kwargs)
        finally:
            count_as_written(state_dict)

    load_and_count.__wrapped__ = load  # type: ignore[attr-defined]
    return load_and_count


@contextlib.contextmanager
def dcp_loads_counted() -> Iterator[None]:
    """While a cell runs, ``dcp.load`` (as ``torch.distributed.checkpoint.load`` and ``state_dict_loader.load``)
    counts a write to each tensor it loads into."""
    counted = _counting(dcp_loader.load)
    with torch_private.replaced(dcp, "load", counted), torch_private.replaced(dcp_loader, "load", counted):
        yield
