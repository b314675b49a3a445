"""A small Transformer with a dataclass config, in the shape of pytorch/examples' FSDP2 ``model.py``: every
module can ``reset_parameters()``, so a model built on the meta device initializes after sharding."""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelArgs:
    n_layers: int = 2
    vocab_size: int = 64
    max_seq_len: int = 16
    dim: int = 32
    n_heads: int = 4
    dropout_p: float = 0.0


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.dropout_p = args.dropout_p
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x):
        batch, seq, dim = x.shape
        q, k, v = (w(x).view(batch, seq, self.n_heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout_p if self.training else 0.0)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, dim))

    def reset_parameters(self):
        for linear in (self.wq, self.wk, self.wv, self.wo):
            linear.reset_parameters()


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim)
        self.w2 = nn.Linear(hidden_dim, dim)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))

    def reset_parameters(self):
        self.w1.reset_parameters()
        self.w2.reset_parameters()


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.feed_forward = FeedForward(args.dim, 4 * args.dim)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))

    def reset_parameters(self):
        for module in (self.attention_norm, self.attention, self.ffn_norm, self.feed_forward):
            module.reset_parameters()


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.max_seq_len = args.max_seq_len
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens):
        seq = tokens.shape[1]
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(seq, device=tokens.device))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).float()

    def reset_parameters(self):
        for module in (self.tok_embeddings, self.pos_embeddings, *self.layers, self.norm, self.output):
            module.reset_parameters()
