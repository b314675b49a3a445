"""Scaled dot-product attention as the device would run it, for the planner's trace on the meta device: the
kernel decides what is kept for backward. Runs in the notebook's kernel.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from nbfsdp.kernel.planning import torch_private as kernels
from nbfsdp.shared import torch_private

#: The dtypes a GPU runs its flash kernel in (a mask, or heads wider than 256, send it to the efficient one).
_FLASH_ON_GPU = (torch.bfloat16, torch.float16)


def device_sdpa(  # noqa: PLR0913, PLR0917 (mirrors F.scaled_dot_product_attention, which models call positionally)
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,  # noqa: FBT002 (mirrors F.scaled_dot_product_attention, which models call positionally)
    scale=None,
    enable_gqa=False,  # noqa: FBT002 (mirrors F.scaled_dot_product_attention, which models call positionally)
    *,
    on_gpu: bool,
    autocast: torch.dtype | None,
):
    """Scaled dot-product attention as the device would run it: the kernel decides what is kept for backward
    (flash and memory-efficient attention keep the output and the log-sum-exp, the math path the scores).
    Under ``autocast`` its inputs are cast down first, as autocast casts them."""
    if autocast is not None:
        query, key, value = (t.to(autocast) if t.dtype == torch.float32 else t for t in (query, key, value))
    if key.shape[-3] != query.shape[-3]:  # grouped-query attention: each key-value head serves several
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, dim=-3), value.repeat_interleave(repeat, dim=-3)
    if on_gpu and query.dtype in _FLASH_ON_GPU and attn_mask is None and query.shape[-1] <= 256:
        return kernels.flash_attention(query, key, value, dropout_p, is_causal=is_causal, scale=scale)
    if on_gpu:
        return kernels.efficient_attention(query, key, value, attn_mask, dropout_p, is_causal=is_causal, scale=scale)
    if kernels.cpu_picks_flash(query, key, attn_mask, is_causal=is_causal):
        return kernels.cpu_flash_attention(query, key, value, attn_mask, dropout_p, is_causal=is_causal, scale=scale)
    return kernels.math_attention(query, key, value, attn_mask, dropout_p, is_causal=is_causal, scale=scale)


#: One trace at a time replaces attention: a second one (an explain while a cell's prediction traces in its
#: thread) would otherwise put back the first one's replacement for good.
_ATTENTION_REPLACED = threading.Lock()


@contextlib.contextmanager
def device_attention(*, on_gpu: bool, autocast: torch.dtype | None = None) -> Iterator[None]:
    """``F.scaled_dot_product_attention`` as the device would run it, for the trace. Replaced on the module
    for the trace's length rather than intercepted with a TorchFunctionMode: such a mode is the calling
    thread's, and autograd recomputes a checkpointed module on a thread of its own for the meta device."""
    replacement = functools.partial(device_sdpa, on_gpu=on_gpu, autocast=autocast)
    with _ATTENTION_REPLACED, torch_private.replaced(F, "scaled_dot_product_attention", replacement):
        yield
