"""Pretrain a byte-level GPT on the Python standard library's own source, with ``zero_infinity``.

Run through the ``zinf`` command (LightningCLI) with ``examples/configs/gpt_stdlib.yaml``:

    zinf fit --config examples/configs/gpt_stdlib.yaml

The corpus is every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` (third-party
``site-packages`` excluded), read in sorted path order; one package (``email`` by default) is held
out for validation. Real text that every Python install ships, so nothing is downloaded.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Optional

import lightning.pytorch as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info
import torch
from torch.utils.data import DataLoader, Dataset

from examples.gpt import GPT, GPTConfig, lm_loss

__all__ = ["StdlibBytes", "GPTPretrain", "stdlib_sources"]


def stdlib_sources(root: Optional[Path] = None, held_out: str = "email") -> tuple[bytes, bytes]:
    """The standard library's ``.py`` sources as bytes: ``(train, validation)``.

    Args:
        root: The stdlib folder (default: this interpreter's).
        held_out: Top-level package whose files form the validation split.

    Returns:
        Two byte strings: the concatenated sources (in sorted path order, each file followed by a
        blank line) outside and inside ``held_out``.

    Raises:
        ValueError: ``held_out`` matched no file.
    """
    root = Path(root or sysconfig.get_paths()["stdlib"])
    train, val = bytearray(), bytearray()
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if "site-packages" in parts or "dist-packages" in parts:
            continue
        (val if parts[0] == held_out else train).extend(path.read_bytes() + b"\n\n")
    if not val:
        raise ValueError(f"No stdlib file under package {held_out!r} in {root}; choose another held_out package.")
    return bytes(train), bytes(val)


class _Chunks(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes; item i is ``(inputs, targets)`` (int64,
    ``seq_len`` each), targets shifted by one byte."""

    def __init__(self, data: bytes, seq_len: int) -> None:
        usable = (len(data) - 1) // seq_len * seq_len + 1
        self.data = torch.frombuffer(bytearray(data[:usable]), dtype=torch.uint8)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.data[i * self.seq_len : (i + 1) * self.seq_len + 1].long()
        return window[:-1], window[1:]


class StdlibBytes(L.LightningDataModule):
    """Byte-level language modelling data from the stdlib sources (see :func:`stdlib_sources`).

    Args:
        seq_len: Context length in bytes.
        batch_size: Sequences per rank per step.
        held_out: Package held out for validation.
    """

    def __init__(self, seq_len: int = 128, batch_size: int = 16, held_out: str = "email") -> None:
        super().__init__()
        self.seq_len, self.batch_size, self.held_out = seq_len, batch_size, held_out

    def setup(self, stage: str) -> None:
        train, val = stdlib_sources(held_out=self.held_out)
        self.train_set, self.val_set = _Chunks(train, self.seq_len), _Chunks(val, self.seq_len)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


class GPTPretrain(L.LightningModule):
    """A byte-level GPT (vocabulary 256) trained with AdamW and a cosine schedule.

    The model is built in ``configure_model``, so under ``zero_infinity`` it is partitioned as it is
    built. At the end of ``fit`` it writes a short sample continuing ``prompt`` (rank 0 prints it).

    Args:
        d_model, n_layers, n_heads, seq_len: Model shape.
        lr: Peak learning rate.
        sample_bytes: Length of the generated sample in bytes.
        prompt: Text the sample continues.
    """

    def __init__(
        self,
        d_model: int = 256,
        n_layers: int = 4,
        n_heads: int = 4,
        seq_len: int = 128,
        lr: float = 2e-3,
        sample_bytes: int = 120,
        prompt: str = "def ",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.cfg = GPTConfig(vocab_size=256, d_model=d_model, n_layers=n_layers, n_heads=n_heads, seq_len=seq_len)
        self.model: Optional[GPT] = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPT(self.cfg)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = lm_loss(self.model(batch[0]), batch[1])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", lm_loss(self.model(batch[0]), batch[1]), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.dim() < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.lr,
            betas=(0.9, 0.95),
        )
        steps = max(self.trainer.estimated_stepping_batches, 1)
        if steps < 4:  # a smoke run (--trainer.max_steps 2): too short for a warm-up and a decay
            schedule = torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0)
        else:
            # Warm-up over 10% of the steps, and at least 2 (OneCycleLR divides by the warm-up length - 1).
            warmup = min(0.5, max(0.1, 2 / steps))
            schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.hparams.lr, total_steps=steps,
                                                           pct_start=warmup)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    @torch.no_grad()
    def generate(self, prompt: bytes, length: int, temperature: float = 0.8) -> bytes:
        """Sample ``length`` bytes after ``prompt``. Every rank must call it (the forward gathers
        parameters collectively); a fixed generator keeps the ranks' samples identical."""
        gen = torch.Generator().manual_seed(0)
        idx = torch.tensor([list(prompt)], device=self.device)
        for _ in range(length):
            logits = self.model(idx[:, -self.cfg.seq_len :])[0, -1].float().cpu() / temperature
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
            idx = torch.cat([idx, nxt.to(idx.device)[None]], dim=1)
        return bytes(idx[0].tolist())

    def on_fit_end(self) -> None:
        was_training = self.training
        self.eval()
        sample = self.generate(self.hparams.prompt.encode(), self.hparams.sample_bytes)
        self.train(was_training)
        # Through logging, not print: a progress bar that redirects stdout (Lightning's rich one)
        # can recurse on a print of arbitrary bytes in a notebook's worker processes.
        rank_zero_info("\n--- sample from the trained model ---\n" + sample.decode("utf-8", errors="replace"))
