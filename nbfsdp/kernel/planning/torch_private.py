"""The private PyTorch APIs the planner's trace relies on: scaled dot-product attention's kernels by name, and
the CPU's choice among them (``aten._scaled_dot_product_*``, ``torch._fused_sdp_choice``).

``tests/test_torch_private.py`` calls each one directly on meta tensors, so a PyTorch release that renames an
op or changes its arguments fails there, by name. The rest of torch's private APIs are behind
``nbfsdp.shared.torch_private``. Runs in the notebook's kernel.
"""

from __future__ import annotations

import torch


def flash_attention(query, key, value, dropout_p: float, *, is_causal: bool, scale: float | None) -> torch.Tensor:
    """The GPU's flash kernel (``aten._scaled_dot_product_flash_attention``): it keeps the output and the
    log-sum-exp for backward."""
    return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[0]


def efficient_attention(  # noqa: PLR0913 (mirrors aten._scaled_dot_product_efficient_attention)
    query, key, value, attn_mask, dropout_p: float, *, is_causal: bool, scale: float | None
) -> torch.Tensor:
    """The GPU's memory-efficient kernel (``aten._scaled_dot_product_efficient_attention``), its
    log-sum-exp computed for backward."""
    aten = torch.ops.aten
    return aten._scaled_dot_product_efficient_attention(
        query,
        key,
        value,
        attn_mask,
        True,  # noqa: FBT003 (aten's schema: compute_log_sumexp, passed positionally as torch's own callers do)
        dropout_p,
        is_causal,
        scale=scale,
    )[0]


def cpu_flash_attention(  # noqa: PLR0913 (mirrors aten._scaled_dot_product_flash_attention_for_cpu)
    query, key, value, attn_mask, dropout_p: float, *, is_causal: bool, scale: float | None
) -> torch.Tensor:
    """The CPU's flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )[0]


def math_attention(  # noqa: PLR0913 (mirrors aten._scaled_dot_product_attention_math)
    query, key, value, attn_mask, dropout_p: float, *, is_causal: bool, scale: float | None
) -> torch.Tensor:
    """The math path (``aten._scaled_dot_product_attention_math``): it keeps the ``s x s`` scores."""
    aten = torch.ops.aten
    return aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal, scale=scale)[0]


def cpu_picks_flash(query: torch.Tensor, key: torch.Tensor, attn_mask: torch.Tensor | None, *, is_causal: bool) -> bool:
    """Whether PyTorch runs its CPU flash kernel for attention of these dtypes and head sizes
    (``torch._fused_sdp_choice``): asked on one-token tensors of the same layout."""
    q, k, v = (torch.zeros(1, 1, 1, t.shape[-1], dtype=t.dtype) for t in (query, key, key))
    mask = None if attn_mask is None else torch.zeros(1, 1, 1, 1, dtype=attn_mask.dtype)
    choice = torch._fused_sdp_choice(q, k, v, mask, 0.0, is_causal)
    return choice == torch.nn.attention.SDPBackend.FLASH_ATTENTION.value
