"""What a training step runs, for the planner's trace: one step's batch as one rank's share of it on the meta
device (``StepInputs``), its loss, how it is split (``Workload``). Runs in the notebook's kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nbfsdp.shared.config import ConfigError
from nbfsdp.shared.torch_private import tree_flatten, tree_map, tree_unflatten


@dataclass(frozen=True, slots=True)
class StepInputs:
    """One rank's share of a step's batch, on the meta device, as the model is called with it."""

    args: tuple
    kwargs: dict
    target: tuple
    """What ``loss_fn(output, *target)`` takes besides the output (a tuple batch's second part onwards)."""
    described: str
    """The share's shapes, in words."""

    @property
    def tokens(self) -> int:
        """Tokens in the share: a tensor of token ids' elements, else the rows of the first input (its
        elements less the last dimension, the features)."""
        first = next(t for t in tree_flatten((self.args, self.kwargs))[0] if isinstance(t, torch.Tensor))
        if first.is_floating_point() and first.dim() > 1:
            return first.numel() // first.shape[-1]
        return first.numel()


def first_batch(batch: Any) -> Any:
    """A DataLoader's first batch, leaving its shuffling where it was (iterating draws from its generator,
    or from torch's own when it has none); anything else as it is."""
    if not isinstance(batch, torch.utils.data.DataLoader):
        return batch
    generator = getattr(batch, "generator", None)
    saved = generator.get_state() if generator is not None else torch.random.get_rng_state()
    try:
        return next(iter(batch))
    finally:
        if generator is not None:
            generator.set_state(saved)
        else:
            torch.random.set_rng_state(saved)


def on_meta(batch: Any) -> Any:
    """``batch`` with its tensors as meta tensors of their shapes and dtypes."""

    def shape_of(leaf: Any) -> Any:
        return torch.empty(leaf.shape, dtype=leaf.dtype, device="meta") if isinstance(leaf, torch.Tensor) else leaf

    return tree_map(shape_of, batch)


def _share(tensor: torch.Tensor, parts: int) -> torch.Tensor:
    """A meta tensor of one rank's rows of ``tensor``: the first dimension split ``parts`` ways (rank 0's,
    the largest share where it does not divide)."""
    if tensor.dim() == 0 or parts == 1:
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    return torch.empty((-(-tensor.shape[0] // parts), *tensor.shape[1:]), dtype=tensor.dtype, device="meta")


def step_inputs(batch: Any, world_size: int, *, per_rank_batches: bool = False) -> StepInputs:
    """``batch`` (one step's global batch as one process would feed it: a tensor, a tuple or list, a dict of
    tensors, a DataLoader, or meta tensors for shapes alone) as one rank's share: each rank takes 1/N of
    every tensor's first dimension, as ``%%fsdp`` splits a notebook's DataLoader; with
    ``per_rank_batches`` the batch is each rank's already."""
    batch = first_batch(batch)
    parts = 1 if per_rank_batches else world_size
    leaves, spec = tree_flatten(batch)
    if not any(isinstance(leaf, torch.Tensor) for leaf in leaves):
        raise ConfigError(
            f"batch must hold tensors (a tensor, a tuple, a dict of tensors, a DataLoader); got {type(batch).__name__}"
        )
    shared = tree_unflatten([_share(leaf, parts) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec)

    def shape(leaf: torch.Tensor) -> str:
        return f"{'x'.join(map(str, leaf.shape))} {str(leaf.dtype).removeprefix('torch.')}"

    if isinstance(shared, dict):
        shapes = ", ".join(f"{key} {shape(v)}" for key, v in shared.items() if isinstance(v, torch.Tensor))
    else:
        shapes = ", ".join(shape(leaf) for leaf in tree_flatten(shared)[0] if isinstance(leaf, torch.Tensor))
    described = f"{shapes} a rank" + ("" if per_rank_batches else f" (the global batch / {world_size})")
    if isinstance(shared, dict):
        return StepInputs((), dict(shared), (), described)
    if isinstance(shared, (tuple, list)):
        return StepInputs((shared[0],), {}, tuple(shared[1:]), described)
    return StepInputs((shared,), {}, (), described)


def loss_of_step(loss_fn: Callable[..., torch.Tensor] | None, target: tuple) -> Callable[[Any], torch.Tensor]:
    """The loss a step backpropagates: the output's ``loss`` (Hugging Face's), else ``loss_fn(output,
    *target)``, else the sum of the output's floating tensors."""

    def loss_of(output: Any) -> torch.Tensor:
        own = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if isinstance(own, torch.Tensor):
            return own
        if loss_fn is not None:
            return loss_fn(output, *target)
        floating = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
        # a tensor (typeshed's sum starts at 0: with no floating tensors it is 0, which backward rejects)
        return sum(t.float().sum() for t in floating)  # type: ignore[return-value]

    return loss_of


@dataclass(frozen=True, slots=True)
class Workload:
    """What a training step runs, for its peak: one step's global batch, its loss, how it is split."""

    batch: Any
    """A tensor, a tuple or list, a dict of tensors, a DataLoader, or meta tensors (shapes alone)."""
    loss: Callable[..., torch.Tensor] | None = None
    """``loss(output, *target)`` where the output has no ``loss`` of its own."""
    per_rank_batches: bool = False
    """The batch is each rank's (as ``%%fsdp --per-rank-batches`` reads a loader), not the global one."""
    micro_batches: int = 1
    """Gradient accumulation: each rank's share runs in this many micro-batches, one at a time."""
    autocast: torch.dtype | None = None
    """The forward and the loss run under ``torch.autocast`` to this dtype (the loop's own, on top of FSDP2's
    mixed precision)."""


_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def autocast_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """``explain(..., autocast=...)``: ``"bf16"``, ``"fp16"`` or their torch dtypes; None for none."""
    if value is None or value in (torch.bfloat16, torch.float16):
        return value
    if isinstance(value, str) and value.lower() in _AUTOCAST_DTYPES:
        return _AUTOCAST_DTYPES[value.lower()]
    raise ConfigError(f"autocast must be one of bf16, fp16 (or torch.bfloat16, torch.float16); got {value!r}")
