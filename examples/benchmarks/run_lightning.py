"""One rank of a Lightning contender (``zinf``, ``fsdp2`` or ``ddp``); launched by throughput.py.

    torchrun --nproc_per_node 2 run_lightning.py {zinf,fsdp2,ddp} --steps N --result-dir DIR

A step is timed from ``on_train_batch_start`` to ``on_train_batch_end``: forward, backward and the
optimizer step, plus Lightning's per-batch overhead, which every Lightning contender pays alike.
"""

import argparse
import os

import lightning as L
import torch
from torch.utils.data import DataLoader

from data import RandomTokens
from examples.gpt import GPT, Block, lm_loss
from measure import LR, MICRO_BATCH, SEED, StepClock, write_rank_result


class GPTModule(L.LightningModule):
    def __init__(self, mode: str, num_samples: int) -> None:
        super().__init__()
        self.mode = mode
        self.num_samples = num_samples
        self.model: GPT | None = None

    def configure_model(self) -> None:
        # Lightning may call this hook more than once; build only the first time.
        if self.model is not None:
            return
        torch.manual_seed(SEED)
        self.model = GPT()
        if self.mode == "fsdp2":
            shard_fsdp2(self.model, self.device_mesh["data_parallel"])

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return lm_loss(self.model(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR)

    def train_dataloader(self) -> DataLoader:
        # Lightning adds a DistributedSampler (no shuffle), so rank r reads samples r, r+W, ...
        return DataLoader(RandomTokens(self.num_samples, seed=SEED), batch_size=MICRO_BATCH)


def shard_fsdp2(model: GPT, mesh) -> None:
    """FSDP2 as ZeRO-3: one communication unit per block, the rest (embeddings, head) in the root."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


class StepTimer(L.Callback):
    def __init__(self, clock: StepClock) -> None:
        self.clock = clock

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.clock.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.clock.stop(outputs["loss"].item())


def make_strategy(mode: str):
    if mode == "zinf":
        import lightning_zinf  # noqa: F401  (registers the strategy names)
        from lightning_zinf import ZeroInfinityStrategy

        return ZeroInfinityStrategy(block_classes=[Block.__name__])
    if mode == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=int(os.environ["WORLD_SIZE"]), tensor_parallel_size=1)
    return "ddp"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["zinf", "fsdp2", "ddp"])
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--result-dir", required=True)
    args = parser.parse_args()

    world_size = int(os.environ["WORLD_SIZE"])
    clock = StepClock()
    trainer = L.Trainer(
        strategy=make_strategy(args.mode),
        accelerator="cpu",
        devices=world_size,
        max_steps=args.steps,
        callbacks=[StepTimer(clock)],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(GPTModule(args.mode, num_samples=args.steps * world_size * MICRO_BATCH))
    write_rank_result(args.result_dir, trainer.global_rank, clock)


if __name__ == "__main__":
    main()
