"""Small models for the tests, each exercising one thing the engine must get right."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class MLP(nn.Module):
    """Three Linear layers; ``frozen=True`` freezes the first, ``buffer=True`` adds a running mean."""

    def __init__(self, d: int = 16, hidden: int = 48, out: int = 8, frozen: bool = False, buffer: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, out)
        if frozen:
            self.fc1.requires_grad_(False)
        self.use_buffer = buffer
        if buffer:
            self.register_buffer("shift", torch.linspace(-1.0, 1.0, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_buffer:
            x = x - self.shift
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class TwiceMLP(MLP):
    """Calls ``fc2`` twice in one forward (a module reused within a pass)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(self.fc2(h))
        h = torch.tanh(self.fc2(h))
        return self.fc3(h)


class BranchMLP(MLP):
    """Takes a different branch on odd steps: the gather order changes between steps."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.alt = nn.Linear(48, 48)
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        h = torch.tanh((self.alt if self.step % 2 else self.fc2)(h))
        return self.fc3(h)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP; with ``lora_rank`` > 0,
    low-rank adapters (LoRA, Hu et al. 2021) add ``b(a(x))`` to ``qkv`` and ``down``."""

    def __init__(self, d: int, heads: int, lora_rank: int = 0):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.lora = lora_rank > 0
        if self.lora:
            self.qkv_a, self.qkv_b = nn.Linear(d, lora_rank, bias=False), nn.Linear(lora_rank, 3 * d, bias=False)
            self.down_a, self.down_b = nn.Linear(4 * d, lora_rank, bias=False), nn.Linear(lora_rank, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        qkv = self.qkv(h) + self.qkv_b(self.qkv_a(h)) if self.lora else self.qkv(h)
        q, k, v = qkv.split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        u = F.gelu(self.up(self.ln2(x)))
        return x + (self.down(u) + self.down_b(self.down_a(u)) if self.lora else self.down(u))


class GPT(nn.Module):
    """A tiny causal GPT with tied input/output embeddings (``head.weight is wte.weight``).

    ``checkpointing=True`` wraps every block in ``torch.utils.checkpoint`` (non-reentrant),
    ``checkpointing="reentrant"`` in its reentrant form (Hugging Face's default).
    ``lora_rank`` > 0 adds adapters to every block and freezes everything else (a LoRA fine-tuning).
    """

    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 2, heads: int = 2, seq: int = 16,
                 checkpointing: bool | str = False, lora_rank: int = 0):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, lora_rank) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        self.checkpointing = checkpointing
        if lora_rank:
            for name, p in self.named_parameters():
                p.requires_grad_(name.split(".")[-2].endswith(("_a", "_b")))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.checkpointing == "reentrant") if self.checkpointing else block(x)
        return self.head(self.ln_f(x))


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy for the GPT (token targets) or mean squared error for the MLPs."""
    out = model(x)
    if out.dim() == 3:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))
    return F.mse_loss(out.float(), y)


def make_batch(kind: str, step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic global batch for ``step`` (the same on every rank and in the reference)."""
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "gpt":
        tokens = torch.randint(0, 64, (batch, 17), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    return torch.randn(batch, 16, generator=g), torch.randn(batch, 8, generator=g)


def saved_by_autograd(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, int]:
    """In plain PyTorch, the bytes of the activations autograd saves for one forward and loss of
    ``batch`` (non-empty tensors on the model's device that are not parameters or views of them),
    and how many saved tensors are parameters or views of them: an observer independent of the
    engine, on whatever device the model is (CUDA kernels save other tensors than CPU ones)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    device = next(model.parameters()).device
    activation_bytes, weights = 0, 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal activation_bytes, weights
        if t.untyped_storage().data_ptr() in params:
            weights += 1
        elif t.device == device and t.numel():
            activation_bytes += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(model, *(t.to(device) for t in batch))
    return activation_bytes, weights


def accumulate_step(model: nn.Module, rank: int, world: int, step: int, batch: int, micro_batches: int) -> list[float]:
    """The forwards and backwards of one optimizer step of the GPT: ``micro_batches`` global
    batches of ``batch`` rows (``make_batch``), this rank's ``batch // world`` rows of each, each
    loss divided by ``micro_batches`` before its backward; the micro-batches' losses."""
    losses = []
    for micro in range(micro_batches):
        x, y = make_batch("gpt", step * micro_batches + micro, batch)
        per_rank = batch // world
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = loss_fn(model, x[rows], y[rows])
        (loss / micro_batches).backward()
        losses.append(loss.item())
    return losses
