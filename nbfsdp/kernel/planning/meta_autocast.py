"""``torch.autocast`` as it would run on the device, for the planner's trace on the meta device (which autocast
passes by). Runs in the notebook's kernel.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from nbfsdp.shared.torch_private import tree_map

#: What autocast runs in the low-precision dtype (its inputs cast down) and in fp32 (cast up) on each device,
#: by the name of the function or Tensor method a model calls (PyTorch's "Autocast Op Reference"); the rest
#: runs in the dtype its inputs have.
_AUTOCAST_DOWN = frozenset(
    {
        *("linear", "addmm", "addmv", "addr", "addbmm", "baddbmm", "bmm", "mm", "mv", "matmul", "__matmul__"),
        *("__rmatmul__", "einsum", "chain_matmul", "conv1d", "conv2d", "conv3d", "conv_transpose1d"),
        *("conv_transpose2d", "conv_transpose3d", "prelu"),
    }
)
_LOSSES_UP = frozenset(
    {
        *("cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div"),
        *("binary_cross_entropy_with_logits", "binary_cross_entropy", "poisson_nll_loss", "cosine_embedding_loss"),
        *("hinge_embedding_loss", "margin_ranking_loss", "soft_margin_loss", "triplet_margin_loss"),
        *("multi_margin_loss", "multilabel_margin_loss"),
    }
)
_AUTOCAST_UP = {
    "cuda": _LOSSES_UP
    | {
        *("pow", "__pow__", "__rpow__", "__rtruediv__", "__rdiv__", "acos", "asin", "cosh", "sinh", "tan", "exp"),
        *("expm1", "log", "log10", "log1p", "log2", "reciprocal", "rsqrt", "erfinv", "softplus", "layer_norm"),
        *("group_norm", "norm", "normalize", "softmax", "softmin", "log_softmax", "cumsum", "cumprod", "prod"),
        *("sum", "cosine_similarity", "cdist", "pdist", "dist", "renorm", "logsumexp"),
    },
    "cpu": _LOSSES_UP | {"prod", "cdist", "quantile", "nanquantile", "trace"},
}


class MetaAutocast(TorchFunctionMode):
    """``torch.autocast(device, dtype)`` for meta tensors, which autocast passes by (its dispatch keys are the
    devices'): floating inputs of the functions listed above cast down or up, the casts recorded by
    autograd (what backward keeps is the cast copy, as under autocast); a parameter's cast made once per
    autocast region and kept (autocast's cast cache)."""

    def __init__(self, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.dtype, self.up = dtype, _AUTOCAST_UP[device]
        self.cache: dict[int, torch.Tensor] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _AUTOCAST_DOWN:
            args, kwargs = tree_map(functools.partial(self._cast, self.dtype), (args, kwargs))
        elif name in self.up:
            args, kwargs = tree_map(functools.partial(self._cast, torch.float32), (args, kwargs))
        return func(*args, **kwargs)

    def _cast(self, dtype: torch.dtype, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dtype == dtype:
            return value
        if dtype != torch.float32 and value.dtype == torch.float64:
            return value  # autocast leaves fp64 alone
        if value.is_leaf and value.requires_grad:
            if id(value) not in self.cache:
                self.cache[id(value)] = value.to(dtype)
            return self.cache[id(value)]
        return value.to(dtype)


def meta_autocast(dtype: torch.dtype | None, device: str) -> contextlib.AbstractContextManager:
    """``MetaAutocast`` to ``dtype`` on ``device``'s rules; None: no autocast."""
    return contextlib.nullcontext() if dtype is None else MetaAutocast(dtype, device)
