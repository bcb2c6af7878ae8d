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


def _models(fabric: Fabric | None = None):
    """Each model from a seed of its own (on the meta device each is initialised from the random
    state at its first parameter, and building the student there draws nothing)."""
    built = []
    for layers, seed in ((2, 0), (3, 1)):
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


def _reference() -> list[float]:
    student, teacher = _models()
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2)
    return _steps(student, teacher, optimizer, range(6))


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
        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["meta.pt", "student", "teacher"]
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
