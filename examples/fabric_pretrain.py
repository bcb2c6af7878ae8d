"""Pretrain the byte-level GPT of the main example with a Lightning Fabric loop and ``zero_infinity``.

    python -m examples.fabric_pretrain                       # 2 processes, ZeRO-3
    python -m examples.fabric_pretrain --strategy zero_infinity_nvme --steps 100
    python -m examples.fabric_pretrain --resume lightning_logs/fabric_gpt/checkpoint

The loop is a plain Fabric loop: the model is built inside ``fabric.init_module()`` (on the meta
device; partitioned and initialised unit by unit at ``fabric.setup``), gradients are accumulated
over ``--accumulate`` micro-batches under ``fabric.no_backward_sync``, clipped by the global norm,
and the run ends with a sharded checkpoint (``fabric.save``) that ``--resume`` continues from, and
that a ``Trainer(strategy="zero_infinity")`` run of ``examples.pretrain.GPTPretrain`` with the same
shape can load as well (both strategies write the same format).
"""

from __future__ import annotations

import argparse
import time

import torch
from lightning.fabric import Fabric

import lightning_zinf  # noqa: F401  (registers "zero_infinity" for Fabric)
from examples.gpt import GPT, GPTConfig, lm_loss
from examples.pretrain import StdlibBytes


def main(argv: list[str] | None = None) -> list[float]:
    """Train; returns the training loss of each step (mean over ranks), as rank 0 prints them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", default="zero_infinity", help="zero_infinity, a preset, or ddp to compare")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per micro-batch")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--checkpoint", default="lightning_logs/fabric_gpt/checkpoint")
    parser.add_argument("--resume", default=None, help="a checkpoint written by this script (or by the Trainer)")
    args = parser.parse_args(argv)

    fabric = Fabric(accelerator="auto", devices=args.devices, strategy=args.strategy, precision=args.precision)
    fabric.launch()
    fabric.seed_everything(0)

    data = StdlibBytes(seq_len=args.seq_len, batch_size=args.batch_size)
    data.setup("fit")
    loader = fabric.setup_dataloaders(data.train_dataloader())

    cfg = GPTConfig(vocab_size=256, d_model=args.d_model, n_layers=args.layers, n_heads=4, seq_len=args.seq_len)
    with fabric.init_module():  # zero_infinity: on the meta device, nothing allocated until setup
        model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if args.resume:
        fabric.load(args.resume, state)
        fabric.print(f"resumed from {args.resume} at step {state['step']}")

    losses: list[float] = []
    batches = iter(loader)
    start = time.perf_counter()
    while state["step"] < args.steps:
        total = 0.0
        for micro in range(args.accumulate):
            try:
                inputs, targets = next(batches)
            except StopIteration:
                batches = iter(loader)
                inputs, targets = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < args.accumulate - 1):
                loss = lm_loss(model(inputs), targets) / args.accumulate
                fabric.backward(loss)
            total += loss.detach()
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
        losses.append(fabric.all_reduce(total).item())
        if state["step"] % 10 == 0 or state["step"] == args.steps:
            fabric.print(f"step {state['step']:4d}  loss {losses[-1]:.4f}  grad norm {norm.item():.3f}  "
                         f"{(time.perf_counter() - start) / len(losses):.2f} s/step")
    fabric.save(args.checkpoint, state)
    fabric.print(f"saved a sharded checkpoint to {args.checkpoint}")
    return losses


if __name__ == "__main__":
    main()
