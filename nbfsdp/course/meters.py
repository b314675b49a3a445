"""What a rank measures inside a ``%%fsdp`` cell: the collectives it runs, the parameters it holds gathered.

``CommMeter`` is a ``TorchDispatchMode`` (PyTorch's hook on every operation) that keeps each c10d
collective with the size of the tensor it handles and the size of its group; from those two,
``collectives.ring_bytes`` gives what the rank sends and receives under the ring algorithms.
``tcp_counters``, ``peer_connections`` and ``traffic`` read what a rank really sent and received
on its own TCP connections to the other ranks (gloo's), from the kernel's per-socket counters.
``flop_counter`` counts FLOPs as PyTorch's ``FlopCounterMode`` does, the attention included on CPU too.
"""

from __future__ import annotations

import functools
import inspect
import os
import socket
import struct
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.flop_counter import FlopCounterMode

from nbfsdp.shared import collective_calls
from nbfsdp.shared.collectives import ring_bytes
from nbfsdp.shared.torch_private import TorchDispatchMode, cpu_attention_flop_formulas, operator_name

#: c10d's ops as FSDP2 and DDP-style replication issue them, by the name the course uses.
COLLECTIVES = {
    "c10d::_allgather_base_": "all_gather",
    "c10d::_reduce_scatter_base_": "reduce_scatter",
    "c10d::allreduce_": "all_reduce",
}


class _Collectives:
    """What both meters report from their ``calls``."""

    calls: list[tuple[str, int, int]]

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


class CommMeter(TorchDispatchMode, _Collectives):
    """The collectives this rank runs while active, as ``calls``: (kind, tensor bytes, group size).

    The tensor counted is the one a collective handles whole: the gathered output of an
    all-gather, the unreduced input of a reduce-scatter, the tensors of an all-reduce.
    Anything else from c10d is kept under its own op name. PyTorch's ``CommDebugMode`` counts
    collectives but not their bytes, hence this meter. Like any dispatch mode it sees the
    collectives FSDP2 issues on plain tensors, not those a DTensor op issues inside its own
    dispatch (``clip_grad_norm_``'s all-reduce of the norm, ``full_tensor()``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = operator_name(func)
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


class CollectiveMeter(_Collectives):
    """``CommMeter``'s record, ``calls`` of (kind, tensor bytes, group size), taken where the collectives are
    called: the meter watches ``torch.distributed``'s functions while it is active, through the one wrapper of
    them the ranks' ledger of collectives watches too (``shared.collective_calls``).

    For code under ``torch.compile``: Dynamo runs a frame eagerly while a Python dispatch mode such as
    ``CommMeter`` is active, so measuring with one would measure the eager model. FSDP2 issues its
    all-gathers and reduce-scatters through these functions from hooks that run outside the compiled
    graph, so they are all seen here; collectives compiled into a graph (functional ones) are not.
    """

    #: The functions wrapped: kind, and the position of the tensor handled whole (the gathered output, the
    #: unreduced input), as ``CommMeter`` counts them.
    FUNCTIONS = {
        "all_gather_single": ("all_gather", 0),
        "all_gather_into_tensor": ("all_gather", 0),
        "reduce_scatter_single": ("reduce_scatter", 1),
        "reduce_scatter_tensor": ("reduce_scatter", 1),
        "all_reduce": ("all_reduce", 0),
    }

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def __enter__(self) -> CollectiveMeter:
        collective_calls.watch(self)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        collective_calls.unwatch(self)

    def entered(self, name: str, function: Any, args: tuple, kwargs: dict) -> None:
        """A collective call begins (``collective_calls``' watcher): one of ``FUNCTIONS`` is recorded."""
        if name not in self.FUNCTIONS:
            return
        kind, index = self.FUNCTIONS[name]
        arguments = _signature(function).bind(*args, **kwargs).arguments  # FSDP2 passes them by name
        tensor = list(arguments.values())[index]
        group_size = dist.get_world_size(arguments.get("group"))
        self.calls.append((kind, tensor.numel() * tensor.element_size(), group_size))

    def left(self, token: None) -> None:
        pass


@functools.cache
def _signature(function: Any) -> inspect.Signature:
    return inspect.signature(function)


def flop_counter() -> FlopCounterMode:
    """PyTorch's ``FlopCounterMode`` (``display=False``) that counts ``scaled_dot_product_attention`` on CPU too.

    Left to itself it counts the GPU's attention kernels and not the CPU's (no formula for the CPU's flash
    op in torch 2.13: 0 FLOPs), so a count on CPU ranks would be short of a GPU rank's by the attention.
    Here the CPU op gets the GPU flash op's formula: the same FLOPs on either device for the same shapes.
    """
    return FlopCounterMode(display=False, custom_mapping=cpu_attention_flop_formulas())


def unsharded_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters that are gathered (full, plain tensors) right now.

    FSDP2 swaps a unit's sharded parameters (DTensors) for plain full tensors while it is gathered.
    """
    return sum(p.numel() * p.element_size() for p in model.parameters() if not isinstance(p, DTensor))


#: Offsets in Linux's ``struct tcp_info`` (include/uapi/linux/tcp.h): tcpi_bytes_received, tcpi_bytes_sent,
#: tcpi_bytes_retrans (4.19+).
_TCP_INFO_SIZE, _BYTES_RECEIVED, _BYTES_SENT, _BYTES_RETRANS = 232, 128, 200, 208

Connection = tuple[tuple[str, int], tuple[str, int]]


def tcp_counters() -> dict[Connection, tuple[int, int]]:
    """(bytes sent, bytes received) of each connected TCP socket of this process, by (this end, other end).

    Bytes sent count each byte once: the kernel's ``bytes_sent`` counts a retransmitted segment again (a
    64 KiB segment on a busy loopback now and then), so its ``bytes_retrans`` is taken off.
    The kernel's own counters (what ``ss -ti`` prints), read through a duplicate of each socket's
    descriptor; psutil has per-interface counters only, not per socket.
    """
    counters = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(fd)))  # closed below; the owner's descriptor stays open
        except OSError:
            continue
        with sock:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                ends = (sock.getsockname()[:2], sock.getpeername()[:2])
            except OSError:  # listening, not connected
                continue
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_SIZE)
            counters[ends] = (
                struct.unpack_from("Q", info, _BYTES_SENT)[0] - struct.unpack_from("Q", info, _BYTES_RETRANS)[0],
                struct.unpack_from("Q", info, _BYTES_RECEIVED)[0],
            )
    return counters


def peer_connections(rank: int, world_size: int) -> set[Connection]:
    """This rank's connections whose other end is another rank's socket (gloo's, not ipyparallel's).

    A collective: every rank must call it.
    """
    mine = {local for local, _ in tcp_counters()}
    everyone: list[set | None] = [None] * world_size
    dist.all_gather_object(everyone, mine)
    others = set().union(*(ends for r, ends in enumerate(everyone) if r != rank and ends is not None))  # all filled in
    return {ends for ends in tcp_counters() if ends[1] in others}


def traffic(
    before: dict[Connection, tuple[int, int]], after: dict[Connection, tuple[int, int]], connections: set[Connection]
) -> tuple[int, int]:
    """(bytes sent, bytes received) over ``connections`` between two ``tcp_counters`` readings."""
    sent = sum(after[c][0] - before.get(c, (0, 0))[0] for c in connections if c in after)
    received = sum(after[c][1] - before.get(c, (0, 0))[1] for c in connections if c in after)
    return sent, received
