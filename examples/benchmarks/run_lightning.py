"""One rank of a Lightning contender; launched by throughput.py and offload_vs_deepspeed.py.

    torchrun --nproc_per_node 2 run_lightning.py {zinf,fsdp2,ddp} --steps N --result-dir DIR
    torchrun --nproc_per_node 2 run_lightning.py zinf_nvme --nvme DIR [--overlap-step off] [--host-bytes B] --steps N --result-dir DIR
    torchrun --nproc_per_node 2 run_lightning.py {zinf,ddp} --compile {blocks,model} --steps N --result-dir DIR
    torchrun --nproc_per_node 2 run_lightning.py {zinf,fsdp2} --sharding grad_op --steps N --result-dir DIR
    (any mode) [--precision {32-true,bf16-mixed}]

``zinf_nvme`` is ``zinf`` with parameters and optimizer state (fp32 masters, gradients, AdamW
state) on NVMe: ``OffloadConfig(param="nvme", optimizer="nvme", nvme_path=DIR)``, everything else
at the strategy's defaults, and torch's fused CPU AdamW (the offloaded step runs on the CPU; DeepSpeed
steps with its own vectorised CPU Adam). It also snapshots the swapper's byte counters every step,
and rank 0 prints the swap files' sizes by kind at the end of training (``swap files:``, one JSON line).

``--precision`` is the ``Trainer``'s (default ``32-true``). Under ``bf16-mixed`` the forward runs under
bf16 autocast; zinf then gathers its fp32 shards in bf16 and, with ``zinf_nvme``, keeps a bf16
compute copy of each shard on NVMe, which the gathers read instead of the fp32 shard (masters,
fp32 gradient shards and AdamW state stay fp32 on NVMe).

``--compile blocks`` compiles each transformer block (``block.compile()``) in ``configure_model``,
``--compile model`` the whole GPT (``model.compile()``); compile.py runs them.

A step is timed from ``on_train_batch_start`` to ``on_train_batch_end``: forward, backward and the
optimizer step, plus Lightning's per-batch overhead, which every Lightning contender pays alike.
Its phases are recorded too: ``forward`` (to ``on_before_backward``), ``backward`` (to
``on_after_backward``) and ``rest`` (the optimizer step and the per-batch overhead: the step time
not hidden behind forward and backward).
"""

import argparse
import json
import os

import lightning as L
import torch
from torch.utils.data import DataLoader

from data import RandomTokens
from examples.gpt import GPT, Block, lm_loss
from measure import LR, MICRO_BATCH, SEED, StepClock, swap_files, write_rank_result


class GPTModule(L.LightningModule):
    def __init__(self, mode: str, num_samples: int, compiled: str = "none", sharding: str = "full") -> None:
        super().__init__()
        self.mode = mode
        self.num_samples = num_samples
        self.compiled = compiled
        self.sharding = sharding
        self.model: GPT | None = None

    def configure_model(self) -> None:
        # Lightning may call this hook more than once; build only the first time.
        if self.model is not None:
            return
        torch.manual_seed(SEED)
        self.model = GPT()
        if self.mode == "fsdp2":
            shard_fsdp2(self.model, self.device_mesh["data_parallel"], reshard_after_forward=self.sharding == "full")
        for module in {"blocks": self.model.blocks, "model": [self.model]}.get(self.compiled, []):
            module.compile()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return lm_loss(self.model(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # The offloaded step runs on the CPU: with torch's fused CPU AdamW, as DeepSpeed's NVMe
        # contender steps with its own vectorised CPU Adam. (The in-memory contenders keep the default.)
        return torch.optim.AdamW(self.parameters(), lr=LR, fused=self.mode == "zinf_nvme")

    def train_dataloader(self) -> DataLoader:
        # Lightning adds a DistributedSampler (no shuffle), so rank r reads samples r, r+W, ...
        return DataLoader(RandomTokens(self.num_samples, seed=SEED), batch_size=MICRO_BATCH)


def shard_fsdp2(model: GPT, mesh, reshard_after_forward: bool = True) -> None:
    """FSDP2 as ZeRO-3: one communication unit per block, the rest (embeddings, head) in the root
    (``reshard_after_forward=False``: as ZeRO-2, the gathered weights kept from forward to backward)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)


class StepTimer(L.Callback):
    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.clock.start()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.clock.mark("forward")

    def on_after_backward(self, trainer, pl_module) -> None:
        self.clock.mark("backward")  # "rest": the optimizer step and Lightning's per-batch work

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.clock.stop(outputs["loss"].item())


class SwapFiles(L.Callback):
    """Rank 0 prints the bytes of the files under the swap folder by kind (summed over paths that
    differ only in their digits, ``#``) when training ends, before the strategy removes them."""

    def __init__(self, root: str) -> None:
        self.root = root

    def on_train_end(self, trainer, pl_module) -> None:
        trainer.strategy.barrier()
        if trainer.global_rank == 0:
            print("swap files:", json.dumps(swap_files(self.root)), flush=True)


def make_strategy(mode: str, nvme_path: str | None = None, overlap_step: bool = True, host_bytes: int = 0,
                  sharding: str = "full", units: str = "blocks"):
    if mode in ("zinf", "zinf_nvme"):
        import lightning_zinf  # noqa: F401  (registers the strategy names)
        from lightning_zinf import OffloadConfig, ZeroInfinityStrategy

        offload = (OffloadConfig(param="nvme", optimizer="nvme", nvme_path=nvme_path, overlap_step=overlap_step,
                                 host_bytes=host_bytes)
                   if mode == "zinf_nvme" else None)
        # units "auto": no block_classes, the engine groups the modules itself (a user who names none).
        return ZeroInfinityStrategy(block_classes=[Block.__name__] if units == "blocks" else (), offload=offload,
                                    sharding=sharding)
    if mode == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=int(os.environ["WORLD_SIZE"]), tensor_parallel_size=1)
    return "ddp"


def swapper_counters(swapper) -> dict[str, int]:
    """The swapper's own count of the bytes it read and wrote (a cross-check of /proc/self/io)."""
    return {"swapper_read_bytes": swapper.bytes_read, "swapper_written_bytes": swapper.bytes_written}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["zinf", "zinf_nvme", "fsdp2", "ddp"])
    parser.add_argument("--nvme", help="folder for the swap files (zinf_nvme)")
    parser.add_argument("--compile", choices=["none", "blocks", "model"], default="none",
                        help="what configure_model compiles: each block, the whole GPT, or nothing")
    parser.add_argument("--precision", choices=["32-true", "bf16-mixed"], default="32-true",
                        help="the Trainer's precision (default: %(default)s)")
    parser.add_argument("--overlap-step", choices=["on", "off"], default="on",
                        help="zinf_nvme: OffloadConfig.overlap_step (the step in the background; default: %(default)s)")
    parser.add_argument("--host-bytes", type=int, default=0,
                        help="zinf_nvme: OffloadConfig.host_bytes (NVMe-tier state kept in host memory; default: %(default)s)")
    parser.add_argument("--sharding", choices=["full", "grad_op"], default="full",
                        help="zinf's sharding, and fsdp2's reshard_after_forward (False for grad_op; default: %(default)s)")
    parser.add_argument("--units", choices=["blocks", "auto"], default="blocks",
                        help="zinf's units: a GPT block each (block_classes) or grouped by the engine (none named)")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--result-dir", required=True)
    args = parser.parse_args()

    if (args.mode == "zinf_nvme") != bool(args.nvme):
        parser.error("--nvme is required with zinf_nvme and only with it")

    world_size = int(os.environ["WORLD_SIZE"])
    clock = StepClock()
    trainer = L.Trainer(
        strategy=make_strategy(args.mode, args.nvme, args.overlap_step == "on", args.host_bytes, args.sharding,
                               args.units),
        accelerator="cpu",
        devices=world_size,
        max_steps=args.steps,
        precision=args.precision,
        callbacks=[StepTimer(clock), *([SwapFiles(args.nvme)] if args.nvme else [])],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if args.mode == "zinf_nvme":
        clock.extra_counters = lambda: swapper_counters(trainer.strategy.engine.swapper)
    trainer.fit(GPTModule(args.mode, num_samples=args.steps * world_size * MICRO_BATCH, compiled=args.compile,
                          sharding=args.sharding))
    write_rank_result(args.result_dir, trainer.global_rank, clock)


if __name__ == "__main__":
    main()
