"""A small decoder-only GPT, shared by the examples and the benchmarks.

The defaults give 91.4M parameters (vocabulary 8192, width 768, 12 layers, 12 heads, context
128), with the output projection tied to the token embedding (97.7M if it were counted twice).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 8192
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    seq_len: int = 128


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=-1)
        # (batch, seq, width) -> (batch, heads, seq, head_dim), the layout SDPA expects
        q, k, v = (t.view(batch, seq, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class Embedding(nn.Embedding):
    """An embedding initialised with std 0.02, as GPT-2 does.

    PyTorch's N(0, 1) default, read back through the tied output layer, gives logits with a
    standard deviation near sqrt(d_model) and a starting loss in the hundreds. Overriding
    ``reset_parameters`` (rather than re-initialising after construction) keeps the init valid
    when a strategy partitions or materialises parameters as modules are built.
    """

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class Block(nn.Module):
    """One pre-norm transformer block. Sharding strategies gather it as one unit."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only language model; ``forward`` maps token ids to next-token logits."""

    def __init__(self, cfg: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.wte = Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # Tied on purpose: a parameter used by two modules is a case sharding must handle.
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all positions."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
