"""Pretrain the main example's byte-level GPT with a plain PyTorch loop driving ``ZeroEngine``.

    torchrun --nproc-per-node 2 -m examples.engine_loop            # ZeRO-3 over 2 processes
    torchrun --nproc-per-node 2 -m examples.engine_loop --ddp      # the same loop under DDP

No Lightning: the engine is what the Trainer and Fabric strategies drive, and any loop can drive
it. The model is built under :func:`~lightning_zinf.meta_parameters` (nothing allocated), then
``ZeroEngine`` partitions it and initialises it unit by unit; ``engine.shard_optimizer`` points the
optimizer at this rank's fp32 master shards (an optimizer stepped without it would step empty
tensors, and the engine refuses it). Gradients are clipped by the global norm over every rank's
shards, and the run ends with a sharded checkpoint (the strategies' format: ``zinf-consolidate``
turns it into one file). ``--ddp`` runs the same loop with ``DistributedDataParallel`` over an
eagerly built model: the two print the same losses (the engine's initialisation reproduces eager
``reset_parameters()`` in construction order).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from examples.gpt import GPT, Block, GPTConfig, lm_loss
from examples.pretrain import StdlibBytes
from lightning_zinf import ZeroEngine, meta_parameters
from lightning_zinf.checkpoint import save_sharded


def main(argv: list[str] | None = None) -> list[float]:
    """Train; returns each step's training loss (mean over ranks), as rank 0 prints them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ddp", action="store_true", help="DistributedDataParallel instead of ZeroEngine")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank (default: %(default)s)")
    parser.add_argument("--d-model", type=int, default=128, help="default: %(default)s")
    parser.add_argument("--layers", type=int, default=2, help="default: %(default)s")
    parser.add_argument("--seq-len", type=int, default=64, help="default: %(default)s")
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--checkpoint", default="lightning_logs/engine_gpt/checkpoint",
                        help="where the sharded checkpoint goes (default: %(default)s)")
    args = parser.parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        parser.error("launch it with torchrun: torchrun --nproc-per-node 2 -m examples.engine_loop")

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    try:
        losses = _train(args, device, rank)
    finally:
        # gloo aborts a process that tears down while a peer still sends: meet first.
        dist.barrier()
        dist.destroy_process_group()
    return losses


def _train(args: argparse.Namespace, device: torch.device, rank: int) -> list[float]:
    data = StdlibBytes(seq_len=args.seq_len, batch_size=args.batch_size)
    data.setup("fit")
    sampler = DistributedSampler(data.train_set, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data.train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    cfg = GPTConfig(vocab_size=256, d_model=args.d_model, n_layers=args.layers, n_heads=4, seq_len=args.seq_len)
    torch.manual_seed(0)
    engine = None
    if args.ddp:
        model = DistributedDataParallel(GPT(cfg).to(device))
    else:
        with meta_parameters():  # nothing allocated: ZeroEngine initialises it unit by unit
            model = GPT(cfg)
        engine = ZeroEngine(model, block_classes=[Block], device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    if engine is not None:
        optimizer = engine.shard_optimizer(optimizer)  # before the first step, on every rank

    losses: list[float] = []
    epoch, batches = 0, iter(loader)
    while len(losses) < args.steps:
        try:
            inputs, targets = next(batches)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            batches = iter(loader)
            inputs, targets = next(batches)
        loss = lm_loss(model(inputs.to(device)), targets.to(device))
        loss.backward()
        if engine is not None:
            norm = engine.clip_grad_norm_(1.0)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
        if rank == 0 and (len(losses) % 10 == 0 or len(losses) in (1, args.steps)):
            print(f"step {len(losses):4d}  loss {losses[-1]:.6f}  grad norm {norm.item():.4f}", flush=True)
    if engine is not None:
        save_sharded(engine, [optimizer], args.checkpoint, meta={"step": len(losses)})
        if rank == 0:
            print(f"saved a sharded checkpoint to {args.checkpoint}", flush=True)
    return losses


if __name__ == "__main__":
    main()
