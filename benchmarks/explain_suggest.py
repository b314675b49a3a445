"""explain_suggest: ``%fsdp explain --suggest`` on Llama-3-70B's shapes, the plan a user waits for.

Llama-3-70B built from its config on the meta device (80 layers, hidden 8192), 64 x H100, one step of 128 x 4,096
tokens (2 sequences a rank), PURE, ``LlamaDecoderLayer`` units: the plain plan with its traced peak (A), then the
same plan with ``suggest=True`` (B), which traces every change that could make it fit, alone and in pairs. B's
time is the figure (target: at most 30 s, issue 55; it took 74 s at ``9274565`` and 179 s at ``cce4aea``, where
each candidate was traced whole, every layer, optimizer step included). The note gives the changes tried, the
suggestions found and how many recordings the search traced (a deep stack is traced cut to 3, 4 and 5 layers
and stretched; settings the trace does not see replay a recording).

``--quick``: Llama-3-8B's shapes (32 layers) on 8 x H100 at 32 x 4,096 tokens (notebook 09's step that does not
fit), the same search.

Run alone: ``python -m benchmarks --only explain_suggest``.
"""

from __future__ import annotations

import time

import torch

from benchmarks.context import Context
from benchmarks.measurement import Measurement

NAME = "explain_suggest"
TARGET_SECONDS = 30.0
SHAPES = {
    "70B": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, intermediate_size=28672),
    "8B": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=14336),
}


def _llama(size: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **SHAPES[size],
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def run(ctx: Context) -> dict:
    import nbfsdp

    size, world_size, sequences = ("8B", 8, 32) if ctx.quick else ("70B", 64, 128)
    model = _llama(size)
    ids = torch.empty(sequences, 4096, dtype=torch.long, device="meta")
    asked = {
        "world_size": world_size,
        "device": "cuda",
        "batch": {"input_ids": ids, "labels": ids},
        "gpu": "H100",
        "mixed_precision": "PURE",
        "wrap_cls": "LlamaDecoderLayer",
    }
    started = time.perf_counter()
    plain = nbfsdp.explain(model, **asked)
    plain_seconds = time.perf_counter() - started
    started = time.perf_counter()
    searched = nbfsdp.explain(model, **asked, suggest=True)
    seconds = time.perf_counter() - started
    changes = ", ".join(s.change for s in searched.suggestions) or "none"
    row = Measurement(
        what=f"`%fsdp explain --suggest`, Llama-3-{size} shapes on {world_size} x H100, "
        f"{sequences} x 4096 tokens, PURE",
        value=seconds,
        unit="s",
        target=TARGET_SECONDS,
        op="<=",
        a_label="the plan alone",
        a=plain_seconds,
        b_label="with --suggest",
        b=seconds,
        ab_unit="s",
        note=(
            f"asked for: peak {plain.peak[0]['total'] / 1e9:.1f} GB, fits {plain.fits}; suggestions: {changes}; "
            f"{searched.traced} recordings traced for the search's plans"
        ),
    )
    return {"measurements": [row], "size": size, "suggestions": len(searched.suggestions), "traced": searched.traced}
