"""Tiling (``tiling=TilingConfig(...)``) through every documented way of handing the strategies a
model and its optimizer: Fabric's ``setup(model, optimizer)`` and ``setup_module`` followed by
``setup_optimizers``, and the Trainer's ``configure_optimizers``, with the optimizer built before
the strategy tiles the model (over the untiled layers' ``weight`` and ``bias``) or after (over the
tiles). Each run, on two gloo ranks, must train as the untiled model does in plain single-process
PyTorch, with the optimizer's param groups (their own learning rate and weight decay) intact.
"""

from __future__ import annotations

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, Subset, TensorDataset

import lightning_zinf  # noqa: F401  (registers "zero_infinity")
from lightning_zinf import ZeroInfinityFabricStrategy, ZeroInfinityStrategy
from tests.harness import run_distributed
from tests.test_tiling import BATCH, STEPS, TILING, Net, _batch, _train


def _optimizer(model: Net) -> torch.optim.AdamW:
    """AdamW with two param groups of their own hyper-parameters: the first layer (which the
    strategy tiles) and the rest. Built over the tiles, ``model.inp.parameters()`` are the tiles."""
    first = {id(p) for p in model.inp.parameters()}
    return torch.optim.AdamW([{"params": list(model.inp.parameters()), "lr": 2e-2, "weight_decay": 0.1},
                              {"params": [p for p in model.parameters() if id(p) not in first]}], lr=1e-2)


def _reference() -> dict:
    """The untiled model and the same optimizer in one process, on the whole batch of each step."""
    torch.manual_seed(0)
    model = Net()
    losses = _train(model, _optimizer(model), 0, 1)
    return {"losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def _check(got: dict, want: dict) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-5, atol=0)
    assert list(got["state"]) == list(want["state"])  # the untiled layers' names
    for name, value in want["state"].items():
        torch.testing.assert_close(got["state"][name], value, rtol=1e-4, atol=1e-6, msg=name)


# --- Fabric ------------------------------------------------------------------------------------------
FABRIC_PATHS = ["setup-meta", "setup-real", "setup_module-then-optimizer", "optimizer-then-setup_module-real"]


def _fabric_paths(rank: int, world: int) -> dict[str, dict]:
    out = {}
    for path in FABRIC_PATHS:
        fabric = Fabric(accelerator="cpu", devices=world, strategy=ZeroInfinityFabricStrategy(tiling=TILING))
        fabric.launch()
        torch.manual_seed(0)
        if path == "setup-meta":
            with fabric.init_module():
                model = Net()
        else:
            model = Net()
        if path.startswith("setup-"):
            model, optimizer = fabric.setup(model, _optimizer(model))  # the optimizer holds the untiled layers
        elif path == "setup_module-then-optimizer":
            model = fabric.setup_module(model)
            optimizer = fabric.setup_optimizers(_optimizer(model))  # over the tiles
        else:
            optimizer = _optimizer(model)  # over the untiled layers
            model = fabric.setup_module(model)
            optimizer = fabric.setup_optimizers(optimizer)
        tiled = fabric.strategy.engine_of(model).tiled_layers
        losses = []
        for step in range(STEPS):
            x, y = (t[rank::world] for t in _batch(step))
            loss = F.mse_loss(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(fabric.all_reduce(loss.detach()).item())
        state = {k: v.clone() for k, v in model.module.state_dict().items()}  # gathered one tile at a time
        out[path] = {"losses": losses, "state": state, "tiled": tiled}
    return out


def test_fabric_trains_a_tiled_model_as_the_untiled_one_through_every_setup_path() -> None:
    """``fabric.setup(model, optimizer)`` with the optimizer over the untiled layers (built inside
    ``fabric.init_module()`` or over real parameters), and ``setup_module`` with the optimizer built
    after it or before it: the tiled model trains as plain PyTorch trains the untiled one, each
    param group keeping its learning rate and weight decay. (``fabric.setup`` raised
    ``KeyError: 'inp.weight'`` before, and an optimizer built before ``setup_module`` was refused.)
    An optimizer over meta-device parameters given to ``setup_optimizers`` is Fabric's own
    refusal, which names the path to use."""
    want = _reference()
    got = run_distributed(_fabric_paths, 2, init_pg=False)[0]
    for path in FABRIC_PATHS:
        assert got[path]["tiled"] == ["inp", "mid", "out"], path
        _check(got[path], want)


# --- Trainer -----------------------------------------------------------------------------------------
class _TiledLit(L.LightningModule):
    """``Net`` with the optimizer built ``when``: ``"init"`` (model and optimizer in ``__init__``, real
    parameters, before the strategy tiles), ``"configure_model"`` (both there, on the meta device,
    before) or ``"configure_optimizers"`` (the model in ``configure_model``, the optimizer over
    ``self.parameters()`` after tiling)."""

    def __init__(self, when: str) -> None:
        super().__init__()
        self.when = when
        self.net = self._optimizer = None
        self.losses: list[float] = []
        if when == "init":
            self._build()

    def _build(self) -> None:
        torch.manual_seed(0)
        self.net = Net()
        if self.when != "configure_optimizers":
            self._optimizer = _optimizer(self.net)

    def configure_model(self) -> None:
        if self.net is None:
            self._build()

    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self.net(batch[0]), batch[1])
        self.losses.append(self.trainer.strategy.reduce(loss.detach()).item())
        return loss

    def configure_optimizers(self):
        return self._optimizer if self._optimizer is not None else _optimizer(self.net)

    def train_dataloader(self):
        # Rank r reads samples r, r+W, ... of each step's batch: together the reference's whole batch.
        x, y = (torch.cat(t) for t in zip(*(_batch(step) for step in range(STEPS))))
        rank, world = self.trainer.global_rank, self.trainer.world_size
        return DataLoader(Subset(TensorDataset(x, y), range(rank, len(x), world)), batch_size=BATCH // world)


TRAINER_PATHS = ["init", "configure_model", "configure_optimizers"]


def _trainer_paths(rank: int, world: int) -> dict[str, dict]:
    out = {}
    for when in TRAINER_PATHS:
        lit = _TiledLit(when)
        trainer = L.Trainer(strategy=ZeroInfinityStrategy(tiling=TILING), accelerator="cpu", devices=world,
                            max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, use_distributed_sampler=False)
        trainer.fit(lit)
        state = {k.removeprefix("net."): v.clone() for k, v in lit.state_dict().items()}
        out[when] = {"losses": lit.losses, "state": state, "tiled": trainer.strategy.engine.tiled_layers}
    return out


def test_trainer_trains_a_tiled_model_as_the_untiled_one_whenever_the_optimizer_is_built() -> None:
    """``configure_optimizers`` returning an optimizer built over the untiled layers before the
    strategy tiled them (in ``__init__`` over real parameters, in ``configure_model`` over meta
    ones), or one built over ``self.parameters()`` after: the tiled model trains as plain PyTorch
    trains the untiled one. (The optimizer built before was refused: "holds a tensor ... that is not
    a trainable parameter".)"""
    want = _reference()
    got = run_distributed(_trainer_paths, 2, init_pg=False)[0]
    for when in TRAINER_PATHS:
        assert got[when]["tiled"] == ["net.inp", "net.mid", "net.out"], when
        _check(got[when], want)
