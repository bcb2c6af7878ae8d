"""One memory budget instead of tiers (``memory_budget``, :mod:`lightning_zinf.planning`).

The planner predicts, for a placement, the peak of each category of the engine's memory ledger;
these tests hold the prediction against the ledger of real 2-rank runs (every category at or below
its prediction, the device total within 30% of it), then sweep budgets and check that the run
stays inside each (the ledger, the staging pool, and the process's RSS as an observer outside the
engine), and that a budget too small is refused on every rank with a size that then fits.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

import lightning.pytorch as pl
import pytest
import torch

from lightning_zinf import MixedPrecisionConfig, OffloadConfig, PrefetchConfig, ZeroEngine, meta_parameters
from lightning_zinf.engine.grouping import unit_size_for
from lightning_zinf.engine_setup import build_engine, memory_plan
from lightning_zinf.offload import SwapError
from lightning_zinf.options import ZeroOptions
from lightning_zinf.planning.bandwidth import Bandwidths
from lightning_zinf.planning import BudgetError, Inventory, Placement, parse_bytes, plan_memory, predict
from tests import models
from tests.harness import run_distributed

BF16 = MixedPrecisionConfig(param_dtype="bf16")


def _rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process, bytes: what the kernel says it holds, and its peak."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def _steps(model: torch.nn.Module, engine: ZeroEngine, opt: torch.optim.Optimizer, vocab: int, steps: int = 3) -> None:
    for step in range(steps):
        engine.reset_memory_peaks()
        x = models.make_batch("gpt", step, 4)[0] % vocab
        models.loss_fn(model, x, x).backward()
        opt.step()
        opt.zero_grad()


def _ledger_against_prediction(rank: int, world: int, model_name: str, offload: dict, bf16: bool,
                               nvme_path: str, sharding: str = "full") -> dict:
    torch.manual_seed(0)
    kwargs, blocks, prefetch = LEDGER_MODELS[model_name]
    model = models.GPT(**kwargs)
    mp = BF16 if bf16 else MixedPrecisionConfig()
    placement = Placement(param=offload.get("param", "none"), optimizer=offload.get("optimizer", "none"),
                          host_bytes=offload.get("host_bytes", 0), staging_bytes=offload.get("staging_bytes", 0),
                          device_bytes=offload.get("device_bytes", 0))
    inventory = Inventory.of(model, world=world, block_classes=blocks, mixed_precision=mp,
                             persistence_threshold=prefetch.persistence_threshold,
                             unit_size=unit_size_for(blocks, prefetch.unit_size, prefetch.bucket_size))
    predicted = predict(inventory, placement, bucket_size=prefetch.bucket_size, sharding=sharding)
    engine = ZeroEngine(model, block_classes=blocks, offload=OffloadConfig(**offload, nvme_path=nvme_path),
                        mixed_precision=mp, prefetch=prefetch, sharding=sharding)
    opt = engine.shard_optimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3))
    _steps(model, engine, opt, kwargs["vocab"])
    measured = {k: peak for k, (_, peak) in engine.memory().items()}
    return {"measured": measured, "predicted": predicted.categories, "device": predicted.device}


NVME = dict(staging_bytes=8 << 20)

# The models the ledger test runs: the small GPT in blocks; the same with LoRA adapters (frozen base
# groups beside tiny trainable ones, whose records host_bytes keeps); one unit per module, of odd sizes
# (padded shards and buffers), with a tied embedding gathered from its first use to the head and a
# prefetch bucket that ends mid-model (qkv, proj, up, down: backward's window at up, proj and qkv ahead,
# is larger than any of forward's); and most units persistent, re-gathered together after each step
# (their transient buffers outgrow the window); and the odd sizes grouped into units of at most the
# bucket, as without block_classes by default (runs of a block's layers, the embedding alone); and
# blocks wide enough for gloo's in-place reduce-scatter (1 MiB and more), only for its own test.
LEDGER_MODELS = {
    "gpt": (dict(d=128, layers=4, vocab=256, seq=16), ["Block"], PrefetchConfig()),
    "lora": (dict(d=128, layers=4, vocab=256, seq=16, lora_rank=4), ["Block"], PrefetchConfig()),
    "odd-units": (dict(d=100, layers=3, vocab=400, heads=2, seq=16), [],
                  PrefetchConfig(bucket_size=50_000, persistence_threshold=1_000, unit_size=0)),
    "persistent-units": (dict(d=128, layers=4, vocab=1024, seq=16), [], PrefetchConfig(unit_size=0)),
    "auto-units": (dict(d=100, layers=3, vocab=400, heads=2, seq=16), [],
                   PrefetchConfig(bucket_size=50_000, persistence_threshold=1_000)),
    "wide": (dict(d=256, layers=3, vocab=256, seq=16), ["Block"], PrefetchConfig()),
}


@pytest.mark.parametrize("offload", [{}, dict(param="nvme", optimizer="nvme", **NVME)], ids=["device", "nvme"])
@pytest.mark.parametrize("model_name", ["odd-units", "persistent-units", "auto-units"])
def test_prediction_bounds_the_ledger_under_grad_op(model_name: str, offload: dict, tmp_path) -> None:
    """Under ``sharding="grad_op"`` every unit a forward gathers is held until its backward: the
    predicted ``gathered`` peak is the whole model's units, and every ledger category stays at or
    below its prediction, the device total within 30% of it (one unit per module, a tied
    embedding; and most units persistent)."""
    for result in run_distributed(_ledger_against_prediction, 2, model_name, offload, False, str(tmp_path), "grad_op"):
        measured, predicted = result["measured"], result["predicted"]
        over = {k: (v, predicted.get(k, 0)) for k, v in measured.items() if v > predicted.get(k, 0)}
        assert not over, f"ledger peaks above the prediction (measured, predicted): {over}"
        assert measured["device_total"] >= 0.7 * result["device"], (measured["device_total"], result["device"])


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("offload", [
    {}, dict(optimizer="cpu"), dict(optimizer="cpu", device_bytes=3 << 20), dict(param="cpu", optimizer="cpu"),
    dict(param="nvme", optimizer="nvme", **NVME),
    dict(optimizer="nvme", host_bytes=2 << 20, **NVME), dict(param="nvme", optimizer="nvme", host_bytes=3 << 20, **NVME),
], ids=["device", "zero-offload", "zero-offload-split", "cpu", "nvme", "optimizer-nvme-kept", "nvme-kept"])
@pytest.mark.parametrize("model_name", [m for m in LEDGER_MODELS if m != "wide"])
def test_prediction_bounds_every_ledger_category(model_name: str, offload: dict, bf16: bool, tmp_path) -> None:
    for result in run_distributed(_ledger_against_prediction, 2, model_name, offload, bf16, str(tmp_path)):
        measured, predicted = result["measured"], result["predicted"]
        over = {k: (v, predicted.get(k, 0)) for k, v in measured.items() if v > predicted.get(k, 0)}
        assert not over, f"ledger peaks above the prediction (measured, predicted): {over}"
        # Not far above either: within 30% in blocks; one unit per module, of many sizes, leaves the CPU
        # gradient pool more ways to keep free buffers than it takes, and its bound is the looser.
        # Grouped units are looser still: the CPU pool's prediction for a few large bf16 gradient
        # buffers is 4x what it keeps (the measured case: auto-units, cpu, bf16 at 0.41 of the prediction).
        tight = 0.7 if model_name in ("gpt", "lora") else 0.4 if model_name == "auto-units" else 0.5
        assert measured["device_total"] >= tight * result["device"], (measured["device_total"], result["device"])


@pytest.mark.parametrize("offload", [{}, dict(optimizer="cpu")], ids=["device", "zero-offload"])
def test_prediction_bounds_the_ledger_with_gloo_receiving_copies(offload: dict, tmp_path) -> None:
    """Blocks of 3 MB: gloo's reduce-scatter within a node receives the peer's copy of this rank's
    gradient slice (1.6 MB) into a buffer of its own, counted in ``reduce_pending`` and in the
    device total. The prediction bounds both (it fell 0.6% short of the total before it counted
    the copies), and stays within 10% of the total."""
    for result in run_distributed(_ledger_against_prediction, 2, "wide", offload, False, str(tmp_path)):
        measured, predicted = result["measured"], result["predicted"]
        over = {k: (v, predicted.get(k, 0)) for k, v in measured.items() if v > predicted.get(k, 0)}
        assert not over, f"ledger peaks above the prediction (measured, predicted): {over}"
        assert measured["device_total"] >= 0.9 * result["device"], (measured["device_total"], result["device"])


#: The sweep's model: a GPT of 28 blocks of width 384, 50.0M parameters (the issue's "about 50M").
SWEEP_GPT = dict(d=384, layers=28, vocab=1024, seq=32, heads=6)


def _budget_run(rank: int, world: int, budget, nvme_path: str) -> dict:
    torch.manual_seed(0)
    open("/proc/self/clear_refs", "w").write("5")  # the peak RSS from here on
    before = _rss()[0]
    with meta_parameters():
        model = models.GPT(**SWEEP_GPT)
    model.example_input_array = models.make_batch("gpt", 0, 4)[0]  # the activations planned too
    options = ZeroOptions(block_classes=["Block"], offload=OffloadConfig(nvme_path=nvme_path), memory_budget=budget)
    try:  # as the strategies build it
        engine = build_engine(model, options, device=torch.device("cpu"), ranks_per_node=world,
                              precision=MixedPrecisionConfig(), loss_scaling=False, timeout=None, auto_pass=True)
    except BudgetError as error:
        return {"refused": str(error)}
    plan = engine.memory_plan
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    _steps(model, engine, opt, 1024)
    memory = engine.memory()
    return {"placement": plan.placement, "predicted": plan.prediction.total(False) + plan.activations,
            "device_peak": memory["device_total"][1], "predicted_device": plan.prediction.device,
            "staging_held": engine.space.pool.held if engine.space is not None else 0,
            "nvme": memory["shards_nvme"][0] + memory["optimizer_nvme"][0], "rss": _rss()[1] - before}


def test_budget_sweep_keeps_each_budget_and_refuses_one_too_small(tmp_path) -> None:
    """Budgets of 100%, 60%, 40% and 25% of the unplanned peak (the state and the example input's
    activations with everything in memory), and one too small, on 2 ranks: the ledger keeps each
    plan, and the process's RSS (an observer outside the engine) falls with the budget and stays
    within a fixed amount of it (what the process holds outside the ledger: Python, torch, gloo)."""
    with meta_parameters():
        model = models.GPT(**SWEEP_GPT)
    model.example_input_array = models.make_batch("gpt", 0, 4)[0]
    everything = memory_plan(model, ZeroOptions(block_classes=["Block"], memory_budget=1 << 40),
                             device=torch.device("cpu"), precision=MixedPrecisionConfig(), world=2)
    assert everything.placement == Placement() and everything.kept_blocks == SWEEP_GPT["layers"]
    unplanned = everything.prediction.total(False) + everything.activations
    runs = {}
    for share in (1.0, 0.6, 0.4, 0.25):
        budget = int(share * unplanned)
        results = run_distributed(_budget_run, 2, budget, str(tmp_path))
        print(share, [(r["placement"].describe(), r["rss"], r["predicted"]) for r in results])
        for r in results:
            assert r["predicted"] <= budget
            assert r["device_peak"] <= r["predicted_device"]  # the ledger keeps the plan's device part
            assert r["staging_held"] <= r["placement"].staging_bytes  # and its staging cap
            assert r["rss"] <= budget + (128 << 20), (share, r["rss"], budget)
        runs[share] = results[0]
    assert runs[1.0]["placement"] == Placement()
    assert runs[0.25]["nvme"] > 0 and runs[0.6]["nvme"] < runs[0.25]["nvme"]  # less budget, more on the disk
    # The process itself (RSS, outside the engine) holds less under a smaller budget: at least half of
    # the planned difference shows.
    assert runs[1.0]["rss"] - runs[0.25]["rss"] >= 0.5 * 0.75 * unplanned, {s: r["rss"] for s, r in runs.items()}
    refused = run_distributed(_budget_run, 2, unplanned // 20, str(tmp_path))
    smallest = []
    for r in refused:
        assert "Raise memory_budget to at least" in r["refused"], r
        smallest.append(int(r["refused"].split("at least ")[1].split(" bytes")[0]))
    assert smallest[0] == smallest[1] > unplanned // 20
    fits = run_distributed(_budget_run, 2, smallest[0], str(tmp_path))  # the size the refusal names fits
    assert all("placement" in r and r["predicted"] <= smallest[0] for r in fits)


def test_parse_bytes_and_bad_budgets() -> None:
    assert parse_bytes("40GiB") == 40 << 30
    assert parse_bytes("12GB") == 12_000_000_000
    assert parse_bytes("512 mib") == 512 << 20
    assert parse_bytes(12e9) == 12_000_000_000
    for bad in ("12 parsecs", "-1GB", 0, True, "GB", None, "0.5", 0.4):
        with pytest.raises(ValueError, match="memory_budget=.*positive number of bytes"):
            parse_bytes(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="give memory_budget too"):
        ZeroOptions(host_memory_budget="1GiB")


def test_plan_order_and_nvme_path() -> None:
    """The fastest placement that fits; without ``nvme_path`` a budget only NVMe meets asks for one."""
    with meta_parameters():
        model = models.GPT(d=192, layers=24, vocab=1024, seq=32, heads=4)
    inventory = Inventory.of(model, world=2, block_classes=["Block"])
    everything = predict(inventory, Placement(), bucket_size=10_000_000)
    assert plan_memory(inventory, everything.total(False), accelerator=False).placement == Placement()
    with pytest.raises(BudgetError, match="set offload.nvme_path"):
        plan_memory(inventory, everything.total(False) // 2, accelerator=False)
    # On an accelerator the plan may gather one unit ahead instead of the bucket: short of even that.
    shallow = predict(inventory, Placement(), bucket_size=0, accelerator=True)
    on_gpu = plan_memory(inventory, shallow.device - shallow.categories["optimizer"] // 2, accelerator=True)
    assert (on_gpu.placement.param, on_gpu.placement.optimizer) == ("none", "cpu")  # ZeRO-Offload first
    nvme = plan_memory(inventory, everything.total(False) // 2, accelerator=False,
                       offload=OffloadConfig(nvme_path="/tmp"))
    assert nvme.placement.optimizer == "nvme" and nvme.prediction.total(False) <= everything.total(False) // 2


FIT_GPT = dict(d=64, layers=6, heads=2)


def _fit(rank: int, world: int, budget, nvme_path: str, ask_first: bool = False) -> dict:
    from lightning_zinf import ZeroInfinityStrategy
    from tests.test_trainer import GLOBAL_BATCH, LitGPT, _trainer

    class Larger(LitGPT):  # large enough for NVMe to save more than its records' 4 KiB blocks take
        def configure_model(self) -> None:
            if self.model is None:
                torch.manual_seed(0)
                self.model = models.GPT(**FIT_GPT)

    # A unit per module: grouped, this small model is one flat group, which NVMe's staging (three
    # optimizer sub-groups of the largest group) would take more memory for than NVMe saves.
    strategy = ZeroInfinityStrategy(memory_budget=budget, offload={"nvme_path": nvme_path}, prefetch={"unit_size": 0})
    lit = Larger(GLOBAL_BATCH // world)
    trainer = _trainer(strategy, world)
    # The plan asked for first, as the docs show (the model is built in configure_model).
    asked = strategy.memory_plan(lit).placement if ask_first else None
    try:
        trainer.fit(lit)
    except BudgetError as error:
        return {"refused": str(error)}
    plan = trainer.strategy.engine.memory_plan
    return {"losses": lit.train_losses, "plan": plan.placement, "offload": trainer.strategy.engine.offload is not None,
            "asked": asked}


def test_the_trainer_plans_from_a_budget_string(tmp_path) -> None:
    """``ZeroInfinityStrategy(memory_budget=...)`` (a string, as a YAML config gives it): the plan
    moves state to NVMe under a tight budget, and the fit's losses are those of the unplanned fit
    (placement changes no value); a budget too small is refused on every rank, at setup.
    ``strategy.memory_plan(lit)`` asked before the fit, on a model ``configure_model`` builds, gives
    the fit's placement, and the fit's values are unchanged by it."""
    unplanned = predict(Inventory.of(models.GPT(**FIT_GPT), world=2), Placement(), bucket_size=10_000_000).total(False)
    refused = run_distributed(_fit, 2, "1KiB", str(tmp_path), init_pg=False)
    assert all("Raise memory_budget to at least" in r["refused"] for r in refused)
    smallest = int(refused[0]["refused"].split("at least ")[1].split(" bytes")[0])
    assert smallest < unplanned
    roomy = run_distributed(_fit, 2, f"{unplanned * 2}B", str(tmp_path), init_pg=False)
    tight = run_distributed(_fit, 2, f"{smallest}B", str(tmp_path), True, init_pg=False)
    assert roomy[0]["plan"] == Placement() and not roomy[0]["offload"]
    assert tight[0]["plan"].optimizer == "nvme" and tight[0]["offload"]
    assert tight[0]["asked"] == tight[0]["plan"]  # strategy.memory_plan(lit) on a model configure_model builds
    assert tight[0]["losses"] == roomy[0]["losses"]


_PLAN_CONFIG = """trainer:
  strategy:
    class_path: lightning_zinf.ZeroInfinityStrategy
    init_args:
      block_classes: [Block]
      memory_budget: {budget}
      offload: {{nvme_path: {nvme}}}
  accelerator: cpu
  devices: 2
  logger: false
model:
  class_path: examples.pretrain.GPTPretrain
  init_args: {{d_model: 256, n_layers: 4, n_heads: 4, seq_len: 128}}
data:
  class_path: examples.pretrain.StdlibBytes
  init_args: {{seq_len: 128, batch_size: 16}}
"""


@pytest.mark.parametrize("refused", [False, True], ids=["nvme", "refused"])
def test_zinf_plan_prints_the_plan_without_training(refused: bool, tmp_path) -> None:
    """``zinf plan --config run.yaml`` on the main example's model: the plan the fit would log (the
    same as the strategy's ``memory_plan``), or the refusal with exit status 2; nothing trains."""
    import subprocess
    import sys
    from pathlib import Path

    from examples.pretrain import GPTPretrain

    with meta_parameters():
        lit = GPTPretrain(d_model=256, n_layers=4, n_heads=4, seq_len=128)
        lit.configure_model()
    inventory = Inventory.of(lit, world=2, block_classes=["Block"])
    nvme = OffloadConfig(nvme_path=str(tmp_path))
    unplanned = predict(inventory, Placement(), bucket_size=10_000_000).total(False)
    budget = 1 << 20 if refused else next(  # the largest budget only NVMe meets
        b for b in range(unplanned, 0, -unplanned // 200)
        if (p := _plan_or_none(inventory, b, nvme)) is not None and p.placement.optimizer == "nvme")
    root = Path(__file__).resolve().parent.parent
    config = tmp_path / "run.yaml"
    config.write_text(_PLAN_CONFIG.format(budget=budget, nvme=tmp_path))
    done = subprocess.run([sys.executable, "-m", "lightning_zinf.cli", "plan", "--config", str(config)], cwd=root,
                          capture_output=True, text=True, timeout=300)
    if refused:
        assert done.returncode == 2 and "Raise memory_budget to at least" in done.stderr.splitlines()[-1], done.stderr
        return
    assert done.returncode == 0, done.stderr
    lines = plan_memory(inventory, budget, accelerator=False, offload=nvme).describe().splitlines()
    assert lines[1] in done.stdout.splitlines() and lines[2] in done.stdout.splitlines()  # placement, peak
    assert "s at the measured disk" in done.stdout  # the traffic timed at this disk's bandwidth
    # The step's terms; without example_input_array the compute is not predicted, and it says why.
    assert "predicted step: compute not predicted (no example_input_array on the model" in done.stdout
    assert not list(tmp_path.glob("**/*.swp"))  # no engine was built


class SavedInLastStep(pl.Callback):
    """Bytes of storage autograd keeps for backward in the last training step, seen by hooks of the
    test's own around the whole batch (checkpointed blocks hide theirs behind their own), and the
    activation plan as the first step found it (decided, and what it had measured)."""

    def __init__(self) -> None:
        self.nbytes = 0
        self.plan_at_first_step: Optional[tuple[bool, dict]] = None

    def on_train_batch_start(self, trainer, *args) -> None:
        if self.plan_at_first_step is None:
            plan = trainer.strategy.engine.activation_plan
            self.plan_at_first_step = (plan.decided, dict(plan.measured))
        self.seen: set[int] = set()
        self.count = 0
        params = {p.untyped_storage().data_ptr() for p in trainer.lightning_module.parameters()}

        def pack(t):
            s = t.untyped_storage()
            if s.nbytes() and s.data_ptr() not in self.seen and s.data_ptr() not in params \
                    and not trainer.strategy.engine.states.holds_storage_of(t):
                self.seen.add(s.data_ptr())
                self.count += s.nbytes()
            return t

        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self.hooks.__enter__()

    def on_train_batch_end(self, *args) -> None:
        self.hooks.__exit__(None, None, None)
        self.nbytes = self.count


def _fit_deep(rank: int, world: int, budget) -> dict:
    from lightning_zinf import ZeroInfinityStrategy
    from tests.test_trainer import GLOBAL_BATCH, LitGPT, _trainer

    class Deep(LitGPT):
        def configure_model(self) -> None:
            if self.model is None:
                torch.manual_seed(0)
                self.model = models.GPT(d=64, layers=6, heads=2)

    strategy = ZeroInfinityStrategy(block_classes=["Block"], memory_budget=budget)
    lit = Deep(GLOBAL_BATCH // world)
    saved = SavedInLastStep()
    trainer = _trainer(strategy, world, callbacks=[saved], gradient_clip_val=None)
    trainer.fit(lit)
    plan = trainer.strategy.engine.activation_plan
    return {"losses": lit.train_losses, "measured": plan.measured, "outside": plan.outside, "inputs": plan.inputs,
            "kept": plan.kept, "checkpointed": plan.checkpointed, "planned": plan.planned, "saved": saved.nbytes}


def test_activations_of_some_blocks_kept_within_the_budget() -> None:
    """The first step measures a block's activations; a budget with room for two of six blocks
    keeps those two and checkpoints four (what the test's own saved-tensor hooks see in the last
    step: the blocks kept and what is outside them), with the losses of a run that keeps all."""
    roomy = run_distributed(_fit_deep, 2, "1GiB", init_pg=False)[0]
    assert len(roomy["kept"]) == 6 and roomy["measured"]["Block"] > 0
    block = roomy["measured"]["Block"]
    budget = roomy["planned"] + roomy["outside"] + roomy["inputs"] + block + 2 * block + block // 2
    tight = run_distributed(_fit_deep, 2, budget, init_pg=False)
    for r in tight:
        assert r["kept"] == ["model.blocks.0", "model.blocks.1"] and len(r["checkpointed"]) == 4, r
        assert r["saved"] <= budget - r["planned"] - r["inputs"]
        assert r["saved"] >= r["outside"] + 2 * block * 0.9  # the two blocks' activations are kept
    assert tight[0]["losses"] == roomy["losses"]


FABRIC_GPT = dict(d=64, layers=8)


def _plan_or_none(inventory: Inventory, budget: int, offload: OffloadConfig):
    try:
        return plan_memory(inventory, budget, accelerator=False, offload=offload)
    except BudgetError:
        return None


def _fabric_across_plans(rank: int, world: int, folder: str, nvme_path: str, roomy: int, tight: int) -> dict:
    from lightning_zinf import ZeroInfinityFabricStrategy
    from tests.test_fabric import _fabric, _train

    def _build(fabric):
        torch.manual_seed(0)
        with fabric.init_module():
            model = models.GPT(**FABRIC_GPT)
        return fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))

    def strategy(budget: int) -> ZeroInfinityFabricStrategy:
        return ZeroInfinityFabricStrategy(block_classes=["Block"], memory_budget=budget,
                                          offload={"nvme_path": nvme_path})

    fabric = _fabric(strategy(roomy))
    with fabric.init_module():
        asked = fabric.strategy.memory_plan(models.GPT(**FABRIC_GPT)).placement  # before any setup
    model, optimizer = _build(fabric)
    _train(fabric, model, optimizer, range(2))
    fabric.save(folder, {"model": model, "optimizer": optimizer})
    straight, _ = _train(fabric, model, optimizer, range(2, 5))
    first = fabric.strategy.engine.memory_plan.placement

    fabric = _fabric(strategy(tight))  # another budget: another placement, the same checkpoint
    model, optimizer = _build(fabric)
    fabric.load(folder, {"model": model, "optimizer": optimizer})
    resumed, _ = _train(fabric, model, optimizer, range(2, 5))
    engine = fabric.strategy.engine
    return {"straight": straight, "resumed": resumed, "first": first, "asked": asked, "second": engine.memory_plan.placement,
            "activations": (engine.activation_plan.decided, len(engine.activation_plan.checkpointed))}


def test_fabric_budget_and_a_checkpoint_loaded_under_another_plan(tmp_path) -> None:
    """``ZeroInfinityFabricStrategy(memory_budget=...)``: a checkpoint saved under one plan (all
    on the device) resumes bit for bit under another (NVMe, blocks checkpointed): placement is not
    part of a checkpoint's meaning. ``fabric.strategy.memory_plan(model)`` gives the plan before
    any setup."""
    inventory = Inventory.of(models.GPT(**FABRIC_GPT), world=2, block_classes=["Block"])
    unplanned = predict(inventory, Placement(), bucket_size=10_000_000).total(False)
    nvme = OffloadConfig(nvme_path=str(tmp_path))
    tight = next(b for b in range(unplanned, 0, -unplanned // 100)  # the largest budget only NVMe meets
                 if _plan_or_none(inventory, b, nvme) is not None
                 and _plan_or_none(inventory, b, nvme).placement.optimizer == "nvme")
    out = run_distributed(_fabric_across_plans, 2, str(tmp_path / "ckpt"), str(tmp_path), 4 * unplanned, tight,
                          init_pg=False)
    for r in out:
        assert r["first"] == Placement() and r["second"].optimizer == "nvme"
        assert r["asked"] == r["first"]  # fabric.strategy.memory_plan(model) before setup
        assert r["activations"][0] and r["activations"][1] > 0  # the room left is too small for some blocks
        assert r["resumed"] == r["straight"]


def test_activation_memory_is_left_out_of_the_placement() -> None:
    """``activation_memory`` is the part of the budget the placement leaves free: a plan with it
    fits the rest, names it, and a refusal counts it; it needs a budget, and less than it."""
    with meta_parameters():
        model = models.GPT(d=192, layers=24, vocab=1024, seq=32, heads=4)
    inventory = Inventory.of(model, world=2, block_classes=["Block"])
    everything = predict(inventory, Placement(), bucket_size=10_000_000).total(False)
    nvme = OffloadConfig(nvme_path="/tmp")
    plain = plan_memory(inventory, everything, accelerator=False, offload=nvme)
    reserved = plan_memory(inventory, everything, accelerator=False, offload=nvme, activation_bytes=everything // 3)
    assert plain.placement == Placement() and reserved.placement.optimizer == "nvme"
    assert reserved.prediction.total(False) <= everything - everything // 3
    assert "left to activations" in reserved.describe()
    with pytest.raises(BudgetError, match="of it activation_memory"):
        plan_memory(inventory, everything // 3, accelerator=False, offload=nvme, activation_bytes=everything // 4)
    with pytest.raises(ValueError, match="give memory_budget too"):
        ZeroOptions(activation_memory="1GiB")
    with pytest.raises(ValueError, match="less than memory_budget"):
        ZeroOptions(memory_budget="1GiB", activation_memory="2GiB")


def _plan_or_refusal(rank: int, world: int, nvme_path: str) -> Optional[str]:
    with meta_parameters():
        model = models.GPT(d=64, layers=2)
    options = ZeroOptions(block_classes=["Block"], offload=OffloadConfig(nvme_path=nvme_path), memory_budget="1GiB")
    try:
        memory_plan(model, options, device=torch.device("cpu"), precision=MixedPrecisionConfig())
    except SwapError as error:
        return str(error)
    return None


def test_a_disk_rank_0_cannot_measure_is_refused_on_every_rank(tmp_path) -> None:
    """The disk is measured on rank 0 alone: when it cannot be (``nvme_path`` is a file), every
    rank raises the same error naming the path and the fix, instead of rank 0 raising while the
    others wait in the broadcast of its result."""
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    refusals = run_distributed(_plan_or_refusal, 2, str(not_a_folder), timeout=120)
    assert refusals[0] is not None and refusals[0] == refusals[1], refusals
    assert str(not_a_folder) in refusals[0] and "nvme_path" in refusals[0], refusals[0]


def _fp32_shards_beside_staging(rank: int, world: int, nvme_path: str) -> dict:
    torch.manual_seed(0)
    model = models.GPT(d=128, layers=4, vocab=256, seq=16)
    inventory = Inventory.of(model, world=world, block_classes=["Block"], mixed_precision=BF16)
    sub_group = max(g.shard_numel for g in inventory.groups if g.trainable)  # as a plan sets it
    offload = dict(optimizer="nvme", staging_bytes=4 << 20)
    predicted = predict(inventory, Placement(**offload), bucket_size=PrefetchConfig().bucket_size)
    engine = ZeroEngine(model, block_classes=["Block"], mixed_precision=BF16,
                        offload=OffloadConfig(**offload, sub_group_size=sub_group, nvme_path=nvme_path))
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    _steps(model, engine, opt, 256)
    memory = engine.memory()
    return {"host": memory["shards_cpu"][1] + memory["staging"][1], "predicted": predicted.host}


def test_zero_offload_layout_with_the_optimizer_on_nvme_keeps_fp32_shards_in_host_memory(tmp_path) -> None:
    """Parameters on the device in bf16 and the optimizer on NVMe: the fp32 shards stay in host
    memory (the 16-bit device copies are made from them after each step) beside a master of their
    own on NVMe and the staging pool; the plan's host memory counts them."""
    for r in run_distributed(_fp32_shards_beside_staging, 2, str(tmp_path)):
        assert r["host"] <= r["predicted"], r


@pytest.mark.parametrize("given, named", [
    (dict(offload=dict(optimizer="cpu")), "offload.optimizer='cpu'"),
    (dict(offload=dict(param="nvme", nvme_path="/tmp", staging_bytes=1 << 20)), "offload.param='nvme', "
                                                                                "offload.staging_bytes=1048576"),
    (dict(offload=dict(activations=True)), "offload.activations=True"),
    (dict(zero_pp=dict(hpz=True)), "zero_pp.hpz"),
    (dict(zero_pp=dict(qwz=True)), "zero_pp.qwz"),
    (dict(zero_pp=dict(frozen_bits=8)), "zero_pp.frozen_bits"),
    (dict(tiling=dict(tile_numel=1000)), "tiling"),
], ids=["tier", "tier-and-staging", "activation-offload", "hpz", "qwz", "frozen-bits", "tiling"])
def test_what_a_plan_would_override_or_cannot_count_is_refused(given: dict, named: str) -> None:
    """With ``memory_budget``, offload tiers and sizes the plan chooses itself (activation offload
    too, per block) would be silently replaced, and hpZ, qwZ, frozen weights stored quantized and tiling change what the engine holds
    beyond the planner's inventory: each is refused when the options are made, named."""
    ZeroOptions(**given)  # valid without a budget
    with pytest.raises(ValueError, match=re.escape(named)):
        ZeroOptions(memory_budget="1GiB", **given)


def _fabric_outside_and_loss(rank: int, world: int) -> dict:
    import torch.nn.functional as F

    from lightning_zinf import ZeroInfinityFabricStrategy
    from tests.test_fabric import _fabric

    fabric = _fabric(ZeroInfinityFabricStrategy(block_classes=["Block"], memory_budget="1GiB"))
    torch.manual_seed(0)
    with fabric.init_module():
        model = models.GPT(d=32, layers=2, vocab=1024)  # logits of 1024 per token: the loss's are the most
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x, y = models.make_batch("gpt", rank, 4)
    out = model(x)
    saved: dict[int, int] = {}  # the storages the loss saves for backward, by address

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))
    fabric.backward(loss)
    optimizer.step()
    plan = fabric.strategy.engine.activation_plan
    return {"outside": plan.outside, "loss": sum(saved.values())}


def test_fabric_counts_what_the_loss_saves_outside_the_forward() -> None:
    """Under Fabric the plan's scope is the model's forward; the loss is computed after it, and
    its log-softmax keeps a tensor the size of the logits, in fp32: counted as the output's."""
    for r in run_distributed(_fabric_outside_and_loss, 2, init_pg=False):
        assert r["outside"] >= r["loss"] > 0, r


def test_device_split_costs_add_up_to_the_prediction() -> None:
    """``device_split_costs`` says what each group stepped on the device adds to the predicted
    device peak (the planner sizes ``device_bytes`` with it, without predicting every count):
    for every count of groups, fp32 and bf16, on an accelerator and on the CPU, the prediction
    with those groups placed is the one without plus their sum, and ``stepped_on_device`` names
    exactly those groups."""
    from lightning_zinf.planning.cost import device_split_costs, stepped_on_device

    for mp in (MixedPrecisionConfig(), BF16):
        inventory = Inventory.of(models.GPT(d=64, layers=3, heads=2), world=2, block_classes=["Block"],
                                 mixed_precision=mp)
        trainable = [i for i, g in enumerate(inventory.groups) if g.trainable]
        for accelerator in (True, False):
            costs = device_split_costs(inventory, accelerator=accelerator)
            base = predict(inventory, Placement(optimizer="cpu"), bucket_size=10_000_000, accelerator=accelerator)
            for k in range(len(costs) + 1):
                placement = Placement(optimizer="cpu", device_bytes=sum(c for c, _ in costs[:k]))
                split = predict(inventory, placement, bucket_size=10_000_000, accelerator=accelerator)
                assert split.device == base.device + sum(a for _, a in costs[:k]), (mp, accelerator, k)
                assert [i for i, on in enumerate(stepped_on_device(inventory, placement)) if on] == trainable[:k]
                assert (split.categories.get("optimizer_device", 0) > 0) == (k > 0)


def test_an_accelerator_plan_steps_the_first_groups_on_the_device_where_there_is_room() -> None:
    """Between ZeRO-3's peak and ZeRO-Offload's, an accelerator's plan keeps ZeRO-Offload and
    steps the first groups on the device (``device_bytes``): as many as the room holds, the
    predicted peak within the budget, fewer bytes over the host link than all on the host, and an
    optimizer step timed at the device's rate for those groups and the host's for the rest."""
    from lightning_zinf.planning.cost import stepped_on_device

    inventory = Inventory.of(models.GPT(d=192, layers=24, vocab=1024, seq=32, heads=4), world=2,
                             block_classes=["Block"])
    zero3 = predict(inventory, Placement(), bucket_size=0, accelerator=True)
    offload = predict(inventory, Placement(optimizer="cpu"), bucket_size=10_000_000, accelerator=True)
    budget = (zero3.device + offload.device) // 2
    rates = Bandwidths(link=1e10, host_step=1e-8, device_step=1e-10)
    plan = plan_memory(inventory, budget, accelerator=True, bandwidths=rates)
    assert (plan.placement.param, plan.placement.optimizer) == ("none", "cpu"), plan.describe()
    assert 0 < plan.placement.device_bytes and plan.prediction.device <= budget
    on_device = stepped_on_device(inventory, plan.placement)
    assert 0 < sum(on_device) < sum(g.trainable for g in inventory.groups)
    more = dataclasses.replace(plan.placement, device_bytes=plan.placement.device_bytes
                               + 16 * inventory.groups[on_device.index(False)].shard_numel)
    assert predict(inventory, more, bucket_size=plan.prefetch.bucket_size, accelerator=True).device > budget
    assert plan.prediction.link_bytes < offload.link_bytes
    elements = [g.shard_numel for g in inventory.groups if g.trainable]
    device = sum(g.shard_numel for g, on in zip(inventory.groups, on_device) if on)
    assert plan.step.optimizer == pytest.approx(device * 1e-10 + (sum(elements) - device) * 1e-8)
    assert plan.offload_config(OffloadConfig()).device_bytes == plan.placement.device_bytes


def test_a_refusal_says_why_nvme_did_not_help_a_model_of_one_large_group() -> None:
    """A model whose state is mostly one flat group (a tied embedding of 50,000 x 64): NVMe's
    staging of whole sub-groups costs more than it saves, so with ``nvme_path`` the least budget is
    still an in-memory placement's, and the refusal says NVMe was weighed, what it needed, and why
    (a new user who adds ``nvme_path`` as told is otherwise left wondering)."""
    inventory = Inventory.of(models.GPT(vocab=50_000, d=64, layers=2, heads=2, seq=16), world=2,
                             block_classes=["Block"])
    unplanned = predict(inventory, Placement(), bucket_size=0).total(False)
    with pytest.raises(BudgetError) as refused:
        plan_memory(inventory, int(0.9 * unplanned), accelerator=False, offload=OffloadConfig(nvme_path="/tmp"))
    message = str(refused.value)
    assert "(param=none, optimizer=none" in message and "NVMe placements were weighed too" in message
    assert "largest trainable flat group (1600000 elements per rank" in message
    needed = message.split("the least needs ")[1].split(" (")[0]
    assert parse_bytes(needed.replace(" ", ""), "needed") > unplanned
