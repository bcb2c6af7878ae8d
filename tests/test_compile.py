"""torch.compile under the strategy, through a real Trainer at 2 ranks on CPU/gloo.

Dynamo's own counters (``torch._dynamo.utils.counters``), read by a callback outside the engine
after every training step and validation pass, say how many frames it compiled, how many graphs it
made, how many graph breaks it met, and how many frames it gave up on and ran uncompiled. The run
trains 4 steps with a validation pass after steps 2 and 4, so the engine's state (the prefetch
trace, which units are gathered, the optimizer's updates) changes under the compiled code between
calls, and validation (no gradients) compiles its own graphs once.

Losses are compared with an uncompiled single-process run of plain Lightning. Inductor's fused
kernels sum in their own order, and the two ranks split each batch: measured, the losses differ by
at most 2e-7 relative over these steps; the bound is 1e-5.
"""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
from torch._dynamo.utils import counters

from lightning_zinf import ZeroInfinityStrategy
from tests import models
from tests.harness import run_distributed
from tests.test_trainer import GLOBAL_BATCH
from tests.test_trainer import LitGPT as TrainerGPT

STEPS = 4
HOOK_SKIPPED = "Skip calling `torch.compiler.disable()`d function"


class DynamoCounts(L.Callback):
    """Dynamo's running totals after every training step and validation pass: (phase, frames
    compiled, graphs made, graph breaks, frames run uncompiled)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, int, int, int]] = []

    def _record(self, phase: str) -> None:
        self.seen.append((phase, counters["frames"]["total"], counters["stats"]["unique_graphs"],
                          sum(counters["graph_break"].values()), sum(counters["unimplemented"].values())))

    def on_train_batch_end(self, *args) -> None:
        self._record("train")

    def on_validation_end(self, *args) -> None:
        self._record("val")


class LitGPT(TrainerGPT):
    """test_trainer's GPT module (its data, optimizer and schedule); ``compiled`` says what
    ``configure_model`` compiles: each block (``"blocks"``), the whole model (``"model"``) or
    nothing (``"none"``). Its steps only compute: a compiled LightningModule compiles them, and
    ``self.log`` would recompile there on its own."""

    def __init__(self, batch_size: int, compiled: str) -> None:
        super().__init__(batch_size)
        self.compiled = compiled
        self.val_losses: list[float] = []

    def configure_model(self) -> None:
        torch.manual_seed(0)
        self.model = models.GPT()
        if self.compiled == "blocks":
            for block in self.model.blocks:
                block.compile()
        elif self.compiled == "model":
            self.model.compile()

    def training_step(self, batch, batch_idx):
        return models.loss_fn(self.model, *batch)

    def validation_step(self, batch, batch_idx):
        return models.loss_fn(self.model, *batch)

    def on_train_batch_end(self, outputs, *args) -> None:
        self.train_losses.append(self.trainer.strategy.reduce(outputs["loss"].detach()).item())

    def on_validation_batch_end(self, outputs, *args) -> None:
        self.val_losses.append(self.trainer.strategy.reduce(outputs).item())


def _fit(rank: int, world: int, strategy, compiled: str) -> dict:
    """Fit on this rank; ``compiled="lightning_module"`` passes ``torch.compile(lit)`` to the Trainer."""
    counts = DynamoCounts()
    lit = LitGPT(GLOBAL_BATCH // world, "none" if compiled == "lightning_module" else compiled)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=STEPS, val_check_interval=2,
                        num_sanity_val_steps=0, callbacks=[counts], enable_checkpointing=False, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(torch.compile(lit) if compiled == "lightning_module" else lit)
    return {"losses": lit.train_losses + lit.val_losses, "seen": counts.seen,
            "reasons": sorted({*counters["graph_break"], *counters["unimplemented"]})}


def _zero(compiled: str) -> dict:
    strategy = ZeroInfinityStrategy(block_classes=["Block"], prefetch={"persistence_threshold": 0})
    return run_distributed(_fit, 2, strategy, compiled, init_pg=False)[0]


def _plain(compiled: str) -> dict:
    return run_distributed(_fit, 1, "auto", compiled, init_pg=False)[0]


@pytest.fixture(scope="module")
def eager() -> dict:
    return _plain("none")


def _assert_losses(run: dict, eager: dict) -> None:
    assert len(run["losses"]) == STEPS + 4  # 4 steps, 2 validation passes of 2 batches
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(eager["losses"]), rtol=1e-5, atol=0)


def _assert_compiles_once(seen: list[tuple]) -> None:
    """Nothing is compiled, broken or given up on after the first training step and the first
    validation pass: later steps and passes run the code compiled then."""
    first_val = next(i for i, s in enumerate(seen) if s[0] == "val")
    after_first = [s[1:] for s in seen[first_val:]]
    assert seen[1][1:] == seen[0][1:], f"the second training step compiled again: {seen}"
    assert all(s == after_first[0] for s in after_first), f"compiled again after the first validation: {seen}"


def test_compiled_blocks_compile_as_without_the_engine(eager: dict) -> None:
    """Blocks compiled in ``configure_model``: Dynamo compiles, breaks and gives up exactly as for
    the same model in one plain process (one graph for training, one for validation, no break);
    on the old code it traced into the hooks (6 breaks, 32 frames in the first step)."""
    zero, plain = _zero("blocks"), _plain("blocks")
    assert zero["seen"] == plain["seen"]
    assert plain["seen"][-1][1:] == (2, 2, 0, 0)
    _assert_losses(zero, eager)


@pytest.mark.parametrize("compiled", ["model", "lightning_module"])
def test_compiled_model_breaks_only_at_the_hooks(compiled: str, eager: dict) -> None:
    """The whole model compiled (``model.compile()`` in ``configure_model``, or the LightningModule
    given to the Trainer as ``torch.compile(lit)``, which Lightning refuses for strategies not its
    own): the engine's hooks are skipped whole (each unit's module boundary is a graph break, and
    the blocks compile as frames of their own), Dynamo never breaks inside them, and nothing
    compiles again after the first step and validation pass."""
    zero = _zero(compiled)
    _assert_compiles_once(zero["seen"])
    assert all(reason.startswith(HOOK_SKIPPED) and "Schedule._pre_forward" in reason for reason in zero["reasons"])
    _assert_losses(zero, eager)
