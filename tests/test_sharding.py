"""Sharding modes (issue 41): ``grad_op`` (ZeRO-2, Lightning's ``SHARD_GRAD_OP``) against today's
``full`` ZeRO-3.

``grad_op`` keeps a unit gathered from its forward to its backward instead of gathering it again:
the arithmetic is the same, so the losses and weights must equal ``full``'s bit for bit (fp32,
gloo) at 1, 2 and 4 ranks, with gradient accumulation and clipping. What it costs is memory: the
test reads the model's own parameters when backward starts (a released parameter is an empty
tensor) and the ledger's peak of gathered bytes against the parameters' sizes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_zinf import PrefetchConfig, ZeroEngine
from lightning_zinf.options import ZeroOptions
from tests import models
from tests.harness import run_distributed

GPT = dict(d=64, layers=6, vocab=64, heads=2)
STEPS, BATCH, ACCUMULATE = 3, 8, 2


def _train(rank: int, world: int, sharding: str) -> dict:
    torch.manual_seed(0)
    model = models.GPT(**GPT)
    # No persistent units and one unit gathered ahead: every block is released after its forward
    # under full sharding, so what grad_op keeps shows.
    engine = ZeroEngine(model, block_classes=["Block"], prefetch=PrefetchConfig(bucket_size=0, persistence_threshold=0),
                        sharding=sharding)
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    seen_at_backward_start = []  # blocks.0's weight as the head's backward runs: gathered or released
    model.head.register_full_backward_pre_hook(
        lambda *_: seen_at_backward_start.append(model.blocks[0].qkv.weight.numel()))
    losses, peaks = [], []
    for step in range(STEPS):
        engine.reset_memory_peaks()
        losses += models.accumulate_step(model, rank, world, step, BATCH, ACCUMULATE)
        engine.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
        peaks.append(engine.memory()["gathered"])
    with engine.gathered():
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    # The full parameters in the compute dtype (fp32 here), each tied tensor once.
    full_bytes = sum(p.numel() * p.element_size() for p in weights.values())
    return {"losses": losses, "weights": weights, "peaks": peaks, "full_bytes": full_bytes,
            "seen": seen_at_backward_start}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_grad_op_trains_as_full_sharding_keeping_the_units_for_backward(world: int) -> None:
    """``grad_op`` gives ``full``'s losses and weights bit for bit, with two micro-batches per step
    and clipping. When backward starts, the first block's weights are still gathered under
    ``grad_op`` and released under ``full``; the gathered bytes peak at every parameter's (the
    whole model held through backward) under ``grad_op``, and at well under half of that under
    ``full``, and nothing stays gathered after a step in either."""
    full = run_distributed(_train, world, "full")
    grad_op = run_distributed(_train, world, "SHARD_GRAD_OP")  # Lightning's name
    for f, g in zip(full, grad_op):
        assert g["losses"] == f["losses"]
        for name, value in f["weights"].items():
            assert torch.equal(g["weights"][name], value), name
        shard = models.GPT(**GPT).blocks[0].qkv.weight.numel()
        assert g["seen"] == [shard] * (STEPS * ACCUMULATE) and f["seen"] == [0] * (STEPS * ACCUMULATE)
        for (g_now, g_peak), (f_now, f_peak) in zip(g["peaks"], f["peaks"]):
            assert g_now == f_now == 0
            assert g_peak >= g["full_bytes"] and f_peak <= 0.5 * f["full_bytes"], (g_peak, f_peak, g["full_bytes"])


def _trainer_losses(rank: int, world: int, strategy: object) -> tuple[list[float], str]:
    from lightning_zinf import ZeroInfinityStrategy
    from tests.test_trainer import GLOBAL_BATCH, LitGPT, _trainer

    if isinstance(strategy, dict):
        strategy = ZeroInfinityStrategy(**strategy)
    lit = LitGPT(GLOBAL_BATCH // world)
    trainer = _trainer(strategy, world)
    trainer.fit(lit)
    return lit.train_losses, trainer.strategy.options.sharding


def test_the_trainer_takes_lightnings_name_and_a_preset_for_grad_op() -> None:
    """``ZeroInfinityStrategy(sharding="SHARD_GRAD_OP")`` and the ``"zero_infinity_grad_op"``
    preset under a real Trainer (validation and clipping included) train with the default's
    losses."""
    full = run_distributed(_trainer_losses, 2, "zero_infinity", init_pg=False)
    named = run_distributed(_trainer_losses, 2, {"sharding": "SHARD_GRAD_OP"}, init_pg=False)
    preset = run_distributed(_trainer_losses, 2, "zero_infinity_grad_op", init_pg=False)
    assert full[0][1] == "full" and named[0][1] == preset[0][1] == "grad_op"
    assert named[0][0] == preset[0][0] == full[0][0] and len(full[0][0]) > 0


def _across_modes(rank: int, world: int, folder: str, first: str, second: str) -> dict:
    from lightning_zinf import ZeroInfinityFabricStrategy
    from tests.test_fabric import _build, _fabric, _train as fabric_train

    fabric = _fabric(ZeroInfinityFabricStrategy(block_classes=["Block"], sharding=first))
    model, optimizer = _build(fabric)
    fabric_train(fabric, model, optimizer, range(2))
    fabric.save(folder, {"model": model, "optimizer": optimizer})
    straight = fabric_train(fabric, model, optimizer, range(2, 4))
    fabric = _fabric(ZeroInfinityFabricStrategy(block_classes=["Block"], sharding=second))
    model, optimizer = _build(fabric)
    fabric.load(folder, {"model": model, "optimizer": optimizer})
    return {"straight": straight, "resumed": fabric_train(fabric, model, optimizer, range(2, 4))}


@pytest.mark.parametrize("first, second", [("grad_op", "full"), ("full", "grad_op")])
def test_a_checkpoint_moves_between_sharding_modes(tmp_path: Path, first: str, second: str) -> None:
    """Under Fabric, a checkpoint saved in one mode resumes in the other with the losses and
    gradient norms of the run that never stopped."""
    for r in run_distributed(_across_modes, 2, str(tmp_path / "ckpt"), first, second, init_pg=False):
        assert r["resumed"] == r["straight"]


def test_sharding_names_and_what_is_refused() -> None:
    """Lightning's and torch FSDP's names are accepted (by the options and by the engine), and an
    unknown mode lists the known ones (hybrid sharding's names and refusals: test_hybrid.py)."""
    from torch.distributed.fsdp import ShardingStrategy

    assert ZeroOptions(sharding="FULL_SHARD").sharding == "full"
    assert ZeroOptions(sharding="shard_grad_op").sharding == "grad_op"
    assert ZeroOptions(sharding=ShardingStrategy.SHARD_GRAD_OP).sharding == "grad_op"
    with pytest.raises(ValueError, match="sharding='zero2': Use 'full'"):
        ZeroOptions(sharding="zero2")
    with pytest.raises(ValueError, match="sharding='zero2': Use 'full'"):
        ZeroEngine(nn.Linear(4, 4), sharding="zero2")  # the engine checks as the options do


def _composed(rank: int, world: int, sharding: str, variant: str, nvme_path: str) -> dict:
    from lightning_zinf import MixedPrecisionConfig, OffloadConfig, ZeroPPConfig

    torch.manual_seed(0)
    model = models.GPT(**GPT, lora_rank=4 if variant == "lora" else 0)
    kwargs = {
        "nvme": dict(offload=OffloadConfig(param="nvme", optimizer="nvme", nvme_path=nvme_path, staging_bytes=8 << 20)),
        "cpu-bf16": dict(offload=OffloadConfig(param="cpu", optimizer="cpu"),
                         mixed_precision=MixedPrecisionConfig(param_dtype="bf16")),
        "checkpointing": dict(activation_checkpointing=["Block"]),
        "lora": {},
        "qgz": dict(zero_pp=ZeroPPConfig(qgz=True)),
        "qwz": dict(zero_pp=ZeroPPConfig(qwz=True)),
        "hpz": dict(zero_pp=ZeroPPConfig(hpz=True, ranks_per_node=2)),
    }[variant]
    engine = ZeroEngine(model, block_classes=["Block"], prefetch=PrefetchConfig(bucket_size=0, persistence_threshold=0),
                        sharding=sharding, **kwargs)
    opt = engine.shard_optimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    losses = []
    for step in range(STEPS):
        x, y = models.make_batch("gpt", step, BATCH)
        per_rank = BATCH // world
        loss = models.loss_fn(model, x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    engine.release_all()
    return {"losses": losses, "gathered": engine.memory()["gathered"][0]}


@pytest.mark.parametrize("variant", ["nvme", "cpu-bf16", "checkpointing", "lora", "qgz", "qwz", "hpz"])
def test_grad_op_composes_with_offload_precision_checkpointing_lora_and_zero_pp(variant: str, tmp_path: Path) -> None:
    """``grad_op`` with parameters and optimizer state on NVMe, on the ``cpu`` tier in bf16, with
    activation checkpointing (the recompute finds its units held), with LoRA (frozen base units
    released at the end of backward), and with ZeRO++'s qgZ, qwZ (backward reads the forward's
    dequantized weights, the values a quantized re-gather gives) and hpZ (which then has no
    backward gather to serve): the same losses as ``full`` in the same configuration, bit for bit,
    and nothing left gathered."""
    full = run_distributed(_composed, 2, "full", variant, str(tmp_path))
    grad_op = run_distributed(_composed, 2, "grad_op", variant, str(tmp_path))
    for f, g in zip(full, grad_op):
        assert g["losses"] == f["losses"]
        assert g["gathered"] == f["gathered"] == 0


def test_a_memory_budget_counts_the_units_grad_op_holds() -> None:
    """``memory_budget`` plans ``grad_op`` with the whole model's units gathered through backward
    and one gather a step: at the budget ZeRO-3 fits on the device, ``grad_op``'s plan must move
    optimizer state off it; a budget below the held units alone is refused; and the collectives
    count one gather a step (as full sharding does when the model fits the prefetch bucket)."""
    from lightning_zinf.planning import BudgetError, Inventory, Placement, plan_memory
    from lightning_zinf.planning.timing import collective_bytes

    inventory = Inventory.of(models.GPT(d=128, layers=6, vocab=64, heads=2), world=2, block_classes=["Block"],
                             persistence_threshold=0)
    shallow = PrefetchConfig(bucket_size=0)  # one unit ahead: full sharding holds two or three units
    full = plan_memory(inventory, 1 << 40, accelerator=True, prefetch=shallow)
    held = plan_memory(inventory, 1 << 40, accelerator=True, prefetch=shallow, sharding="grad_op")
    whole = sum(g.shard_numel * inventory.world * g.compute_bytes for g in inventory.groups)
    assert held.prediction.categories["gathered"] >= whole > 2 * full.prediction.categories["gathered"]
    tight = plan_memory(inventory, full.prediction.device, accelerator=True, prefetch=shallow, sharding="grad_op")
    assert full.placement == Placement() and tight.placement.optimizer != "none"  # the held units push it off
    assert tight.prediction.device <= full.prediction.device
    with pytest.raises(BudgetError, match="Raise memory_budget to at least"):
        plan_memory(inventory, held.prediction.categories["gathered"], accelerator=True, sharding="grad_op")
    assert collective_bytes(inventory, "grad_op", bucket_size=0) < collective_bytes(inventory, bucket_size=0)
    # A model within one prefetch bucket stays gathered from its forward to its backward anyway.
    assert collective_bytes(inventory, "grad_op") == collective_bytes(inventory)
    assert ZeroOptions(sharding="grad_op", memory_budget="1GiB").sharding == "grad_op"


def _without_backward(rank: int, world: int, sharding: str) -> dict:
    from lightning_zinf import MixedPrecisionConfig

    prefetch = PrefetchConfig(bucket_size=0, persistence_threshold=0)
    torch.manual_seed(1)
    teacher = models.GPT(**GPT).requires_grad_(False)
    teachers = ZeroEngine(teacher, block_classes=["Block"], prefetch=prefetch, sharding=sharding)
    torch.manual_seed(0)
    model = models.GPT(**GPT)
    # The Lightning strategy's engine: its steps begin the passes (auto_pass=False).
    engine = ZeroEngine(model, block_classes=["Block"], prefetch=prefetch, sharding=sharding, auto_pass=False,
                        mixed_precision=MixedPrecisionConfig(param_dtype="bf16"))
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    per_rank = BATCH // world
    x, y = (t[rank * per_rank:(rank + 1) * per_rank] for t in models.make_batch("gpt", 0, BATCH))
    out: dict = {"losses": []}
    for step in range(2):
        engine.begin_pass("train")
        # A frozen teacher's forward without torch.no_grad(): its outputs need no gradient, so no
        # graph goes through it and no backward comes for it.
        soft = teacher(x).softmax(-1)
        out.setdefault("teacher", []).append(teachers.gathered_bytes)
        # A forward whose graph is dropped (a metric computed with gradients on), then the
        # weights read, then the step's own forward and backward.
        models.loss_fn(model, x, y)
        out.setdefault("dropped", []).append(engine.gathered_bytes)
        with engine.gathered():
            out.setdefault("norm", []).append(sum(p.double().square().sum() for p in model.parameters()).item())
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)) \
            + F.kl_div(logits.float().log_softmax(-1), soft, reduction="batchmean")
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
    # A step skipped after its forward (training_step returning None), then the engine released (a
    # checkpoint's save, the end of a run).
    engine.begin_pass("train")
    models.loss_fn(model, x, y)
    engine.release_all()
    out["released"] = engine.gathered_bytes
    return out


def test_grad_op_holds_only_for_a_backward_that_can_come() -> None:
    """Forwards with gradients on that no backward follows: a frozen teacher's (no graph through
    it) is released after its forward under ``grad_op`` as under ``full``; a forward whose graph is
    dropped keeps its units only until the weights are read (``gathered()``, under bf16 compute
    weights: the next forward computes in bf16 again) or the engine is released
    (``release_all``, a checkpoint's save or a run's end), which leaves nothing gathered; and the
    step's losses equal ``full``'s. (Before: the teacher stayed gathered whole, the forward after
    ``gathered()`` met fp32 weights and raised, ``release_all`` kept the held units.)"""
    full = run_distributed(_without_backward, 2, "full")
    grad_op = run_distributed(_without_backward, 2, "grad_op")
    for f, g in zip(full, grad_op):
        assert f["teacher"] == g["teacher"] == [0, 0]
        # Held for a backward (full has at most the unit prefetched for the next use).
        assert all(held > gathered for held, gathered in zip(g["dropped"], f["dropped"]))
        assert g["norm"] == f["norm"] and g["losses"] == f["losses"]
        assert g["released"] == f["released"] == 0
