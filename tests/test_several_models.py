"""Several models per Fabric strategy: each ``fabric.setup`` partitions its own model with its own
engine (units, optimizer, frozen storage), as a student and its frozen teacher need, or RLHF's
actor and reference models.

The reference is plain PyTorch in one process: the same two models, the same global batch, the
same distillation loss. Checkpoints of both kinds (sharded folders, one full file) resume exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric

import lightning_zinf  # noqa: F401  (registers "zero_infinity")
from lightning_zinf import ZeroInfinityFabricStrategy
from lightning_zinf.checkpoint import CheckpointError, load_sharded
from tests import models
from tests.harness import run_distributed

BATCH = 8  # global


def _models(fabric: Fabric | None = None, one_stream: bool = False):
    """Each model from a seed of its own (on the meta device each is initialised from the random
    state at its first parameter, and building the student there draws nothing), or both from one
    random stream, the teacher's draws after the student's (``one_stream``: what a single engine
    materialising both, in module order, draws)."""
    built = []
    for layers, seed in ((2, 0), (3, 1)):
        if not (one_stream and built):
            torch.manual_seed(seed)
        if fabric is None:
            built.append(models.GPT(layers=layers))
        else:
            with fabric.init_module():
                built.append(models.GPT(layers=layers))
    student, teacher = built
    teacher.requires_grad_(False)
    return student, teacher


def _loss(student, teacher, x, y) -> torch.Tensor:
    logits = student(x)
    with torch.no_grad():
        target = teacher(x).softmax(-1)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten()) + F.cross_entropy(logits.flatten(0, 1), target.flatten(0, 1))


def _steps(student, teacher, optimizer, steps, rank: int = 0, world: int = 1, fabric: Fabric | None = None) -> list[float]:
    losses = []
    for step in steps:
        x, y = models.make_batch("gpt", step, BATCH)
        share = BATCH // world
        loss = _loss(student, teacher, x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share])
        (fabric.backward(loss) if fabric else loss.backward())
        optimizer.step()
        optimizer.zero_grad()
        losses.append((fabric.all_reduce(loss.detach()) if fabric else loss.detach()).item())
    return losses


def _reference(one_stream: bool = False, batches=range(6)) -> list[float]:
    student, teacher = _models(one_stream=one_stream)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2)
    return _steps(student, teacher, optimizer, batches)


def _set_up(strategy):
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    student, teacher = _models(fabric)
    student, optimizer = fabric.setup(student, torch.optim.AdamW(student.parameters(), lr=1e-2))
    teacher = fabric.setup(teacher)
    return fabric, student, teacher, optimizer


def _run(rank: int, world: int, folder: str, kind: str) -> dict:
    strategy = ZeroInfinityFabricStrategy(state_dict_type=kind)
    fabric, student, teacher, optimizer = _set_up(strategy)
    engines = fabric.strategy.engines
    assert len(engines) == 2 and engines[0] is not engines[1] and engines[1].optimizers == []
    with pytest.raises(RuntimeError, match="engine_of"):
        fabric.strategy.engine
    losses = _steps(student, teacher, optimizer, range(3), rank, world, fabric)
    fabric.save(folder, {"student": student, "teacher": teacher, "optimizer": optimizer, "step": 3})
    # A fresh pair of models and optimizer, resumed from the checkpoint.
    fabric, student, teacher, optimizer = _set_up(ZeroInfinityFabricStrategy(state_dict_type=kind))
    state = {"student": student, "teacher": teacher, "optimizer": optimizer, "step": 0}
    fabric.load(folder, state)
    assert state["step"] == 3
    losses += _steps(student, teacher, optimizer, range(3, 6), rank, world, fabric)
    error = ""
    if kind == "sharded":
        with pytest.raises(CheckpointError, match="several models") as info:
            load_sharded(fabric.strategy.engine_of(student), [], folder)
        error = str(info.value)
    return {"losses": losses, "error": error}


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_student_and_frozen_teacher_each_partitioned_train_and_resume_exactly(tmp_path: Path, kind: str) -> None:
    """Two ``fabric.setup`` calls, two engines (the teacher's with no trainable parameter and no
    optimizer); the distillation losses equal plain PyTorch's at every step, across a save and a
    load of both models and the optimizer (a folder per model when sharded, one file when full)."""
    want = _reference()
    got = run_distributed(_run, 2, str(tmp_path / "ckpt"), kind, init_pg=False)[0]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want), rtol=1e-5, atol=0)
    if kind == "sharded":
        (data,) = (tmp_path / "ckpt").glob("save-*")
        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["meta.pt", data.name]
        assert sorted(p.name for p in data.iterdir()) == ["student", "teacher"]
        assert "student, teacher" in got["error"]
    else:
        saved = torch.load(tmp_path / "ckpt", weights_only=True)
        assert set(saved) == {"student", "teacher", "optimizer", "step"}


def _frozen_bits(rank: int, world: int) -> dict:
    fabric, student, teacher, optimizer = _set_up(ZeroInfinityFabricStrategy(zero_pp={"frozen_bits": 8}))
    teacher_engine = fabric.strategy.engine_of(teacher)
    stored = [g.codes is not None for g in teacher_engine.groups]
    student_stored = [g.codes is not None for g in fabric.strategy.engine_of(student).groups]
    losses = _steps(student, teacher, optimizer, range(3), rank, world, fabric)
    return {"stored": stored, "student_stored": student_stored, "losses": losses}


def test_a_frozen_model_alone_is_stored_quantized_with_frozen_bits() -> None:
    """A model with no trainable parameter set up on its own is stored as INT8 codes
    (``frozen_bits=8``), the trainable student beside it is not; training follows the fp32
    reference within the quantization's error."""
    want = _reference()[:3]
    got = run_distributed(_frozen_bits, 2, init_pg=False)[0]
    assert all(got["stored"]) and not any(got["student_stored"])
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want), rtol=2e-2, atol=0)


class _Distill(__import__("lightning.pytorch", fromlist=["LightningModule"]).LightningModule):
    """The student and its frozen teacher in one LightningModule: the Trainer's one model holds both."""

    def __init__(self) -> None:
        super().__init__()
        self.student = self.teacher = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.student is None:
            self.student, self.teacher = _models(one_stream=True)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = _loss(self.student, self.teacher, x, y)
        self.losses.append(self.trainer.strategy.reduce(loss.detach()).item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.student.parameters(), lr=1e-2)

    def train_dataloader(self):
        from torch.utils.data import DataLoader, TensorDataset
        # One epoch of three steps: a resumed run starts the next epoch (Lightning replays an
        # epoch it resumes in the middle of, without a stateful loader).
        batches = [models.make_batch("gpt", step, BATCH) for step in range(3)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        rank, world = self.trainer.global_rank, self.trainer.world_size
        share = BATCH // world
        index = [i for step in range(3) for i in range(step * BATCH + rank * share, step * BATCH + (rank + 1) * share)]
        return DataLoader(TensorDataset(x[index], y[index]), batch_size=share)


def _trainer_run(rank: int, world: int, folder: str) -> dict:
    import lightning.pytorch as L

    from lightning_zinf import ZeroInfinityStrategy

    def trainer(epochs: int) -> L.Trainer:
        return L.Trainer(strategy=ZeroInfinityStrategy(zero_pp={"frozen_bits": 8}), accelerator="cpu", devices=2,
                         max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False)

    first, lit = trainer(1), _Distill()
    first.fit(lit)
    first.save_checkpoint(folder)
    engine = first.strategy.engine
    frozen = [g.codes is not None for g in engine.groups if not g.trainable]
    keys = list(lit.state_dict())
    resumed = _Distill()
    trainer(2).fit(resumed, ckpt_path=folder)
    return {"losses": lit.losses + resumed.losses, "frozen": frozen, "keys": keys}


def test_trainer_student_and_frozen_teacher_in_one_module(tmp_path: Path) -> None:
    """With the Trainer, the models live in the one LightningModule: its engine stores the frozen
    teacher as INT8 codes (``frozen_bits=8``), ``state_dict()`` covers both models, and a resumed
    run continues the losses (within the quantized teacher's error of the fp32 reference)."""
    want = _reference(one_stream=True, batches=[0, 1, 2, 0, 1, 2])
    got = run_distributed(_trainer_run, 2, str(tmp_path / "ckpt"), init_pg=False)[0]
    assert got["frozen"] and all(got["frozen"])
    assert {k.split(".")[0] for k in got["keys"]} == {"student", "teacher"}
    assert len(got["losses"]) == 6
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want), rtol=2e-2, atol=0)
