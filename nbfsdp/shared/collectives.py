"""What a collective costs on the wire, and byte counts as a person reads them.

Used by the kernel's plans (``%fsdp explain``) and by the course's meters, which run on the ranks.
"""

from __future__ import annotations


def size_text(nbytes: float) -> str:
    """``nbytes`` in B, KiB, MiB or GiB, as a person reads it."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:,.0f} {unit}" if unit == "B" else f"{nbytes:,.1f} {unit}"
        nbytes /= 1024
    raise AssertionError


def ring_bytes(kind: str, tensor_bytes: int, group_size: int) -> int:
    """Bytes a rank sends (and receives) in a ring ``kind`` collective over ``tensor_bytes``, group of ``group_size``.

    All-gather and reduce-scatter: N-1 steps of 1/N of the (gathered, or unreduced) tensor; an
    all-reduce is a reduce-scatter then an all-gather, twice that (Patarasuk & Yuan; NCCL's ring).
    gloo differs in one place: it runs a reduce-scatter as an all-reduce of the whole input, so
    on CPU a rank sends twice this per reduce-scatter (measured in notebook 03).
    """
    if group_size <= 1:
        return 0
    factor = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}[kind]
    return factor * tensor_bytes * (group_size - 1) // group_size
