"""What a rank measures inside a ``%%fsdp`` cell: the collectives it runs, the parameters it holds gathered.

``CommMeter`` is a ``TorchDispatchMode`` (PyTorch's hook on every operation) that keeps each c10d
collective with the size of the tensor it handles and the size of its group; from those two,
``planning.ring_bytes`` gives what the rank sends and receives under the ring algorithms.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from nbfsdp.planning import ring_bytes

#: c10d's ops as FSDP2 and DDP-style replication issue them, by the name the course uses.
COLLECTIVES = {
    "c10d::_allgather_base_": "all_gather",
    "c10d::_reduce_scatter_base_": "reduce_scatter",
    "c10d::allreduce_": "all_reduce",
}


class CommMeter(TorchDispatchMode):
    """The collectives this rank runs while active, as ``calls``: (kind, tensor bytes, group size).

    The tensor counted is the one a collective handles whole: the gathered output of an
    all-gather, the unreduced input of a reduce-scatter, the tensors of an all-reduce.
    Anything else from c10d is kept under its own op name, so nothing passes unseen.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func._schema.name
        if name.startswith("c10d::"):
            kind = COLLECTIVES.get(name, name)
            if kind == "all_gather":  # (output, input, group, ...)
                tensors, group = [args[0]], args[0].numel() // max(args[1].numel(), 1)
            elif kind == "reduce_scatter":  # (output, input, group, op, ...)
                tensors, group = [args[1]], args[1].numel() // max(args[0].numel(), 1)
            else:  # ([tensors], group, ...)
                tensors = [t for t in args[0] if isinstance(t, torch.Tensor)] if isinstance(args[0], list) else []
                group = dist.ProcessGroup.unbox(args[1]).size() if kind == "all_reduce" else 0
            self.calls.append((kind, sum(t.numel() * t.element_size() for t in tensors), group))
        return func(*args, **(kwargs or {}))

    def totals(self) -> dict[str, int]:
        """Bytes of the tensors each kind of collective handled (all-gather, reduce-scatter, all-reduce)."""
        totals = dict.fromkeys(COLLECTIVES.values(), 0)
        for kind, nbytes, _ in self.calls:
            totals[kind] = totals.get(kind, 0) + nbytes
        return totals

    def sent(self) -> dict[str, int]:
        """Bytes this rank sends per kind under the ring algorithms (it receives as many)."""
        sent = dict.fromkeys(COLLECTIVES.values(), 0)
        for kind, nbytes, group in self.calls:
            if kind in sent:
                sent[kind] += ring_bytes(kind, nbytes, group)
        return sent

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(COLLECTIVES.values(), 0)
        for kind, _, _ in self.calls:
            counts[kind] = counts.get(kind, 0) + 1
        return counts


def unsharded_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters that are gathered (full, plain tensors) right now.

    FSDP2 swaps a unit's sharded parameters (DTensors) for plain full tensors while it is gathered.
    """
    return sum(p.numel() * p.element_size() for p in model.parameters() if not isinstance(p, DTensor))
