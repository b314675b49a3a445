"""Every private or internal PyTorch API nbfsdp relies on, in one place.

Each function says what it relies on; ``tests/test_torch_private.py`` calls each one directly on
real FSDP2 units, so a PyTorch release that moves one fails there, by name, instead of deep inside
a cell. Runs wherever torch runs: the notebook's kernel and the engines.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed._composable import checkpoint
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Sampler
from torch.utils.data.dataloader import _InfiniteConstantSampler

__all__ = [
    "checkpoint",
    "is_iterable_loader",
    "infinite_sampler",
    "is_step_tracked",
    "local_tensor",
    "mark_optimizer_stepped",
    "mark_step_tracked",
    "pop_saved_tensors_hooks",
    "push_saved_tensors_hooks",
    "set_checkpointing",
    "set_mixed_precision",
    "top_saved_tensors_hooks",
]


def local_tensor(dtensor: DTensor) -> torch.Tensor:
    """This rank's shard: ``DTensor._local_tensor``, which ``to_local()`` returns through an autograd op
    (measurably slow when memory is counted at every optimizer step)."""
    return dtensor._local_tensor


def set_mixed_precision(unit: FSDPModule, policy: MixedPrecisionPolicy) -> None:
    """Switch a sharded unit to ``policy`` between steps; FSDP2 has no setter for it (torch 2.13).

    Relies on ``FSDPState._mp_policy``, ``FSDPParamGroup.mp_policy`` and ``_init_mp_dtypes()``, and on
    each ``FSDPParam``'s ``all_gather_outputs`` and ``_unsharded_param``: dropped, the next all-gather
    makes them in the new dtype. Every parameter must be sharded (between steps).
    """
    state = unit._get_fsdp_state()
    state._mp_policy = policy
    group = state._fsdp_param_group
    if group is None:  # a unit that owns no parameters
        return
    group.mp_policy = policy
    group._init_mp_dtypes()
    for param in group.fsdp_params:
        param.all_gather_outputs = []
        if hasattr(param, "_unsharded_param"):
            del param._unsharded_param


def set_checkpointing(module: nn.Module, enabled: bool) -> None:
    """Switch composable ``checkpoint(module)``'s recomputation on or off: its state's ``enable_hook``."""
    checkpoint.state(module).enable_hook = enabled


def push_saved_tensors_hooks(pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], torch.Tensor]) -> None:
    """Push autograd's saved-tensor hooks for the rest of the cell, not a ``with`` block: a cell's steps
    run between the meter's calls. ``torch._C._autograd._push_saved_tensors_default_hooks``."""
    torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


def pop_saved_tensors_hooks() -> None:
    torch._C._autograd._pop_saved_tensors_default_hooks()


#: ``torch._C._autograd._top_saved_tensors_default_hooks`` (torch 2.8 on): no public way to ask exists.
_top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def top_saved_tensors_hooks() -> tuple[Callable, Callable] | None | bool:
    """The (pack, unpack) hooks on top of this thread's stack, None if there are none, or False where torch
    cannot tell (before 2.8)."""
    return False if _top is None else _top(False)


def mark_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    """What ``LRScheduler``'s wrapper of ``optimizer.step`` sets: ``_opt_called``, read by its order check."""
    optimizer._opt_called = True


def mark_step_tracked(step: Callable) -> None:
    """``_wrapped_by_lr_sched``: LRScheduler's mark that ``step`` is its wrapper (it wraps only once)."""
    step._wrapped_by_lr_sched = True


def is_step_tracked(step: Callable) -> bool:
    return hasattr(step, "_wrapped_by_lr_sched")


def is_iterable_loader(loader: DataLoader) -> bool:
    """The loader reads an ``IterableDataset``: ``DataLoader._dataset_kind`` (0 map-style, 1 iterable)."""
    return bool(loader._dataset_kind)


def infinite_sampler() -> Sampler:
    """The sampler a DataLoader over an ``IterableDataset`` batches from: ``_InfiniteConstantSampler``
    (yields None forever; the dataset supplies the samples)."""
    return _InfiniteConstantSampler()
