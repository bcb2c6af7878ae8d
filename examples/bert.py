"""A BERT encoder (Devlin et al., 2019) whose parameter names match Hugging Face's ``BertModel``, so
a pretrained ``model.safetensors`` (e.g. all-MiniLM-L6-v2) loads into it by name, plus LoRA
adapters (Hu et al., 2021) for fine-tuning with the base weights frozen.

Every module that owns parameters has ``reset_parameters()``, so the model can be built on the
meta device and materialised unit by unit by a sharding strategy.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BertConfig", "BertModel", "LoRALinear", "add_lora", "mean_pool"]


@dataclass(frozen=True)
class BertConfig:
    """The fields of a Hugging Face BERT ``config.json`` this encoder uses (defaults: MiniLM-L6-H384)."""

    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1

    @classmethod
    def from_json(cls, path: str | Path) -> "BertConfig":
        """Read the fields above from a ``config.json`` (other keys are ignored).

        Raises:
            ValueError: the file describes an activation other than GELU.
        """
        raw = json.loads(Path(path).read_text())
        if raw.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported (only 'gelu').")
        return cls(**{f.name: raw[f.name] for f in fields(cls) if f.name in raw})


class LoRALinear(nn.Linear):
    """``nn.Linear`` plus a low-rank update: ``y = x W^T + b + (alpha / rank) * x A^T B^T``.

    ``weight``/``bias`` keep ``nn.Linear``'s names, so pretrained weights load unchanged. ``lora_a``
    (``[rank, in_features]``) starts Kaiming-uniform and ``lora_b`` (``[out_features, rank]``) at
    zero, so the layer starts equal to the pretrained one (Hu et al., LoRA, 2021, §4.1).

    Raises:
        ValueError: ``rank`` is not positive.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, rank: int = 8, alpha: float = 16.0) -> None:
        if rank <= 0:
            raise ValueError(f"LoRA rank must be positive, got {rank}.")
        self.rank, self.scaling = rank, alpha / rank
        super().__init__(in_features, out_features, bias)
        factory = {"device": self.weight.device, "dtype": self.weight.dtype}
        self.lora_a = nn.Parameter(torch.empty(rank, in_features, **factory))
        self.lora_b = nn.Parameter(torch.empty(out_features, rank, **factory))
        self.reset_lora()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "lora_a"):  # nn.Linear.__init__ calls this before the adapters exist
            self.reset_lora()

    def reset_lora(self) -> None:
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scaling


class _Embeddings(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=0)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        # Single-segment input: every token has type 0. Calling the module (not indexing its weight)
        # lets a sharding strategy see the use and gather the parameter.
        types = torch.zeros_like(input_ids)
        x = self.word_embeddings(input_ids) + self.position_embeddings(pos) + self.token_type_embeddings(types)
        return self.dropout(self.LayerNorm(x))


class _SelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.heads = cfg.num_attention_heads
        self.dropout = cfg.attention_probs_dropout_prob
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = (lin(x).view(batch, seq, self.heads, -1).transpose(1, 2) for lin in (self.query, self.key, self.value))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=self.dropout if self.training else 0.0)
        return y.transpose(1, 2).reshape(batch, seq, width)


class _DenseNorm(nn.Module):
    """``LayerNorm(residual + dropout(dense(x)))``: BERT's post-norm sub-layer output."""

    def __init__(self, cfg: BertConfig, in_features: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(residual + self.dropout(self.dense(x)))


class _Attention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.self = _SelfAttention(cfg)
        self.output = _DenseNorm(cfg, cfg.hidden_size)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, keep), x)


class _Intermediate(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))


class BertLayer(nn.Module):
    """One encoder layer (attention, then the feed-forward); sharding strategies gather it as one unit."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attention = _Attention(cfg)
        self.intermediate = _Intermediate(cfg)
        self.output = _DenseNorm(cfg, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, keep)
        return self.output(self.intermediate(x), x)


class _Encoder(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))


class BertModel(nn.Module):
    """The BERT encoder without pooler or heads (parameter names as Hugging Face's ``BertModel``).

    ``forward(input_ids, attention_mask)``: int64 ``[batch, seq]`` token ids and a ``[batch, seq]``
    mask (1/True for real tokens, 0 for padding) → float ``[batch, seq, hidden_size]`` hidden states.
    """

    def __init__(self, cfg: BertConfig = BertConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = _Embeddings(cfg)
        self.encoder = _Encoder(cfg)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # [batch, 1, 1, seq]: every query position may attend to every real key position.
        keep = attention_mask.bool()[:, None, None, :]
        x = self.embeddings(input_ids)
        for layer in self.encoder.layer:
            x = layer(x, keep)
        return x


def add_lora(model: nn.Module, targets: Iterable[str], rank: int, alpha: float) -> list[str]:
    """Replace every ``nn.Linear`` whose attribute name is in ``targets`` (e.g. ``"query"``) by a
    :class:`LoRALinear` with the same weights, then freeze everything except the adapters.

    Works on the meta device too (the new layer is created where the old one's weight lives).

    Returns:
        The qualified names of the replaced layers.

    Raises:
        ValueError: no layer matched ``targets``.
    """
    targets = set(targets)
    replaced = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if name in targets and type(child) is nn.Linear:
                lora = LoRALinear(child.in_features, child.out_features, child.bias is not None, rank=rank, alpha=alpha)
                lora.to(child.weight.device)
                with torch.no_grad():
                    if child.weight.device.type != "meta":
                        lora.weight.copy_(child.weight)
                        if child.bias is not None:
                            lora.bias.copy_(child.bias)
                setattr(parent, name, lora)
                replaced.append(f"{parent_name}.{name}".lstrip("."))
    if not replaced:
        raise ValueError(f"No nn.Linear named any of {sorted(targets)}; LoRA targets are attribute names such as 'query'.")
    for pname, p in model.named_parameters():
        p.requires_grad_(pname.rsplit(".", 1)[-1] in ("lora_a", "lora_b"))
    return replaced


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the hidden states over real tokens, L2-normalised (sentence-transformers' pooling
    for all-MiniLM-L6-v2): ``[batch, seq, hidden]`` + ``[batch, seq]`` → ``[batch, hidden]``."""
    mask = attention_mask.to(hidden.dtype).unsqueeze(-1)
    summed = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)
    return F.normalize(summed, dim=-1)
