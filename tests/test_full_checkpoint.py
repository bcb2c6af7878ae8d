"""Full (single-file) checkpoints both ways, through the real Trainer: a DDP run moved onto
``zero_infinity`` and back continues its losses as if it had never moved.

The reference is the same run under Lightning's own DDP strategy, uninterrupted. The moved run
trains one epoch under DDP and saves DDP's ``.ckpt``; resumes it under ``zero_infinity``
(``state_dict_type="full"``), trains a second epoch and saves a full checkpoint; resumes that under
DDP for a third epoch. DDP and ``LightningModule.load_from_checkpoint`` read the file as their own.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

import lightning_zinf  # noqa: F401  (registers "zero_infinity")
from lightning_zinf import ZeroInfinityStrategy
from lightning_zinf.checkpoint import CheckpointError
from tests import models
from tests.harness import run_distributed

GLOBAL_BATCH = 8
STEPS_PER_EPOCH = 3


class Lit(L.LightningModule):
    def __init__(self, batch_size: int = GLOBAL_BATCH, optimizers: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: torch.nn.Module | None = None
        self.losses: list[float] = []
        self.automatic_optimization = optimizers == 1

    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(0)
            self.model = models.GPT()

    def training_step(self, batch, batch_idx):
        loss = models.loss_fn(self.model, *batch)
        self.losses.append(self.trainer.strategy.reduce(loss.detach()).item())
        if not self.automatic_optimization:
            self.manual_backward(loss)
            for optimizer in self.optimizers():
                optimizer.step()
                optimizer.zero_grad()
        return loss

    def configure_optimizers(self):
        if self.hparams.optimizers == 2:
            return [torch.optim.SGD(self.model.blocks.parameters(), lr=0.1),
                    torch.optim.SGD([*self.model.wte.parameters(), *self.model.wpe.parameters(),
                                     *self.model.ln_f.parameters()], lr=0.1)]
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}

    def train_dataloader(self):
        tokens = torch.randint(0, 64, (GLOBAL_BATCH * STEPS_PER_EPOCH, 17), generator=torch.Generator().manual_seed(1))
        data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
        rank, world = self.trainer.global_rank, self.trainer.world_size
        return DataLoader(Subset(data, range(rank, len(data), world)), batch_size=self.hparams.batch_size)


def _trainer(strategy, epochs: int) -> L.Trainer:
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=epochs, enable_checkpointing=False,
                     logger=False, enable_progress_bar=False, enable_model_summary=False,
                     use_distributed_sampler=False)


def _moved(rank: int, world: int, folder: str) -> dict:
    ddp_ckpt, zinf_ckpt = Path(folder) / "ddp.ckpt", Path(folder) / "zinf.ckpt"
    losses = []
    for epochs, strategy, resume, save in ((1, "ddp", None, ddp_ckpt),
                                           (2, ZeroInfinityStrategy(state_dict_type="full"), ddp_ckpt, zinf_ckpt),
                                           (3, "ddp", zinf_ckpt, None)):
        lit = Lit(GLOBAL_BATCH // world)
        trainer = _trainer(strategy, epochs)
        trainer.fit(lit, ckpt_path=resume)
        losses += lit.losses
        if save is not None:
            trainer.save_checkpoint(save)
    return {"losses": losses}


def _uninterrupted(rank: int, world: int) -> list[float]:
    lit = Lit(GLOBAL_BATCH // world)
    _trainer("ddp", 3).fit(lit)
    return lit.losses


def test_ddp_to_zero_infinity_to_ddp_continues_exactly(tmp_path: Path) -> None:
    """Weights, AdamW's moments and step, the LR scheduler and the loops cross both ways: every
    step's loss equals the uninterrupted DDP run's to float tolerance; the full checkpoint is one
    file that ``load_from_checkpoint`` reads on one device, with the weights the run had."""
    want = run_distributed(_uninterrupted, 2, init_pg=False)[0]
    got = run_distributed(_moved, 2, str(tmp_path), init_pg=False)[0]["losses"]
    assert len(got) == len(want) == 3 * STEPS_PER_EPOCH
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    checkpoint = torch.load(tmp_path / "zinf.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 2 * STEPS_PER_EPOCH
    plain = Lit()
    plain.configure_model()
    params = list(plain.parameters())
    state = checkpoint["optimizer_states"][0]["state"]
    assert sorted(state) == list(range(len(params)))  # plain AdamW's numbering, every parameter stepped
    assert all(state[i]["exp_avg"].shape == p.shape for i, p in enumerate(params))
    # One device reads it as its own: the model built, then the weights (strict: every key, full size).
    restored = Lit.load_from_checkpoint(tmp_path / "zinf.ckpt")
    restored.configure_model()
    restored.load_state_dict(checkpoint["state_dict"])
    assert all(torch.equal(restored.state_dict()[k], v) for k, v in checkpoint["state_dict"].items())


def _two_into_one(rank: int, world: int, folder: str) -> str:
    path = Path(folder) / "two.ckpt"
    trainer = _trainer(ZeroInfinityStrategy(state_dict_type="full"), 1)
    trainer.fit(Lit(GLOBAL_BATCH // world, optimizers=2))
    trainer.save_checkpoint(path)
    with pytest.raises(CheckpointError, match="holds the state of 2 optimizer.* returns 1"):
        _trainer("zero_infinity", 2).fit(Lit(GLOBAL_BATCH // world), ckpt_path=path)
    return "ok"


def test_a_checkpoint_with_another_number_of_optimizers_is_refused(tmp_path: Path) -> None:
    """A checkpoint of two optimizers resumed by a run with one is an error naming both counts
    (its second optimizer's state was once dropped without a word)."""
    assert run_distributed(_two_into_one, 2, str(tmp_path), init_pg=False) == ["ok", "ok"]


def _consolidated(rank: int, world: int, folder: str) -> list[float]:
    from lightning_zinf.consolidate import consolidate

    sharded, resumable = Path(folder) / "sharded.ckpt", Path(folder) / "consolidated.ckpt"
    lit = Lit(GLOBAL_BATCH // world)
    trainer = _trainer("zero_infinity", 2)
    trainer.fit(lit)
    trainer.save_checkpoint(sharded)
    if rank == 0:
        consolidate(sharded, resumable, fmt="lightning")
        consolidate(sharded, Path(folder) / "model.pth", strip_prefix="model.")  # LitGPT's name: a torch state dict
    trainer.strategy.barrier()
    resumed = Lit(GLOBAL_BATCH // world)
    _trainer("ddp", 3).fit(resumed, ckpt_path=resumable)
    return lit.losses + resumed.losses


def test_a_consolidated_sharded_checkpoint_resumes_under_ddp(tmp_path: Path) -> None:
    """``zinf-consolidate --format lightning`` turns a sharded checkpoint into one DDP resumes
    (weights, AdamW's state, scheduler, loops): the losses continue the uninterrupted DDP run's;
    any output name takes a state dict (``model.pth`` holds the plain model's)."""
    want = run_distributed(_uninterrupted, 2, init_pg=False)[0]
    got = run_distributed(_consolidated, 2, str(tmp_path), init_pg=False)[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    plain = models.GPT()
    plain.load_state_dict(torch.load(tmp_path / "model.pth", weights_only=True))


def test_plain_optimizer_state_loads_as_torch_places_it() -> None:
    """A plain AdamW state dict whose moments are bf16 (a bf16 model's, under DDP) loads into the
    sharded optimizer as torch's own ``load_state_dict`` loads it into the fp32 model: moments cast
    to the parameters' fp32, ``step`` an fp32 CPU tensor; the next step then runs and matches
    torch's. (The moments once kept bf16 next to fp32 masters: the step failed on mixed dtypes.)"""
    import copy

    from lightning_zinf import PrefetchConfig, ZeroEngine
    from lightning_zinf.checkpoint.full import full_optimizer_state_dict, load_full_optimizer_state_dict

    torch.manual_seed(0)
    plain = models.MLP()
    model = copy.deepcopy(plain)
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    x, y = models.make_batch("mlp", 0, 4)
    models.loss_fn(plain, x, y).backward()
    reference.step()
    saved = reference.state_dict()
    for entry in saved["state"].values():
        entry["exp_avg"], entry["exp_avg_sq"] = entry["exp_avg"].bfloat16(), entry["exp_avg_sq"].bfloat16()
    reference.load_state_dict(copy.deepcopy(saved))
    engine = ZeroEngine(model, prefetch=PrefetchConfig(persistence_threshold=0))
    optimizer = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    model.load_state_dict(plain.state_dict())  # the stepped weights
    load_full_optimizer_state_dict(engine, optimizer, saved)
    for net, opt in ((model, optimizer), (plain, reference)):
        opt.zero_grad()
        models.loss_fn(net, *models.make_batch("mlp", 1, 4)).backward()
        opt.step()
    mine, theirs = full_optimizer_state_dict(engine, optimizer)["state"], reference.state_dict()["state"]
    for index, entry in theirs.items():
        assert mine[index]["exp_avg"].dtype == torch.float32 and mine[index]["step"].device.type == "cpu"
        torch.testing.assert_close(mine[index]["exp_avg"], entry["exp_avg"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(mine[index]["step"], entry["step"])
