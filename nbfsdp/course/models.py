"""The models the course trains, built in the notebook and run on the ranks.

``TinyGPT`` is the quick start's GPT with its sizes as arguments; ``MLP`` is a stack of residual
MLP blocks for the notebooks whose point is arithmetic, where a GPT's attention would only blur it.
Both are plain ``nn.Module``s with ``reset_parameters`` everywhere, so they can be built on the meta
device, and both flatten their output so that ``nn.Linear``'s output is never a 3-D view at the root
(FSDP2 warns about in-place ops on such a view).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP, each with a residual."""

    def __init__(self, width: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, width // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, width))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """Token and position embeddings, ``depth`` blocks, a final norm, a head: logits (batch * seq, vocab)."""

    def __init__(self, vocab: int = 16, width: int = 64, heads: int = 4, depth: int = 2, seq: int = 12):
        super().__init__()
        self.vocab, self.seq = vocab, seq
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).flatten(0, 1))


def batch_for(
    rank: int, step: int, size: int = 32, vocab: int = 16, seq: int = 12, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s part of step ``step``'s global batch: counting sequences (each token the last plus one).

    Seeded by (step, rank) alone, so one process can rebuild the global batch of any step
    (``torch.cat([batch_for(r, step)[0] for r in range(N)])``) and check parity with N ranks. Drawn on the
    CPU, then moved to ``device`` (a rank passes its own): the same numbers on every device.
    """
    g = torch.Generator().manual_seed(10_000 * step + rank)
    start = torch.randint(0, vocab, (size, 1), generator=g)
    tokens = ((start + torch.arange(seq + 1)) % vocab).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in fp32 whatever the logits' dtype: bf16 logits (a DEFAULT or PURE forward) would round the
    log-softmax to 8 bits of mantissa, so large-model trainers upcast them first."""
    return F.cross_entropy(logits.float(), targets.reshape(-1))


class MLPBlock(nn.Module):
    """x + down(gelu(up(x))): two Linears, 8 * width**2 weights."""

    def __init__(self, width: int = 128):
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class MLP(nn.Module):
    """``embed`` (features -> width), ``depth`` MLPBlocks, ``head`` (width -> features)."""

    def __init__(self, width: int = 128, depth: int = 4, features: int = 32):
        super().__init__()
        self.features = features
        self.embed = nn.Linear(features, width)
        self.blocks = nn.ModuleList([MLPBlock(width) for _ in range(depth)])
        self.head = nn.Linear(width, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def rotation_batch(
    rank: int, step: int, size: int = 64, features: int = 32, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s part of step ``step``'s batch for the MLP: random features, the target them rotated by one
    (drawn on the CPU, then moved to ``device``)."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(size, features, generator=g).to(device)
    return x, x.roll(1, dims=1)
