"""``generate()`` on a partitioned ``transformers`` model: the tokens of the unpartitioned model,
each unit gathered once per call within ``inference_budget``, and no hang when ranks finish at
different lengths (``synced_gpus``, which ``transformers`` turns on for a model the engine
partitions)."""

from __future__ import annotations

import pytest
import torch
import transformers

from lightning_zinf import PrefetchConfig, ZeroEngine
from tests.harness import run_distributed
from tests.test_reuse import _received

PROMPT = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(11))


def _gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=3, n_head=4, n_positions=64,
                                     eos_token_id=None, pad_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def _generate(rank: int, world: int, budget: int, new_tokens: list[int]) -> dict:
    model = _gpt2()
    engine = ZeroEngine(model, block_classes=["GPT2Block"], prefetch=PrefetchConfig(persistence_threshold=0))
    unit_bytes = sum(g.gathered_nbytes for u in engine.units if u.state == "gathered" for g in u.groups)
    full_gather = sum(g.padded_numel * g.full.element_size() * (world - 1) // world for g in engine.groups)
    engine.comm.bytes.reset()
    with torch.no_grad(), engine.keep_gathered(budget):
        out = model.generate(PROMPT, max_new_tokens=new_tokens[rank], do_sample=False)
    return {"tokens": out, "gathered": engine.comm.bytes.gathered, "one_gather_of_all": full_gather,
            "persistent": unit_bytes, "released": engine.gathered_bytes}


def _reference(new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return _gpt2().generate(PROMPT, max_new_tokens=new_tokens, do_sample=False)


def test_generate_within_the_budget_gathers_each_unit_once() -> None:
    """At 2 ranks with a budget above the model: the unpartitioned model's tokens, and the bytes
    gathered during ``generate`` are one gather of every unit (at most, for the persistent ones),
    against one per token without a budget; everything is released afterwards."""
    kept = run_distributed(_generate, 2, 1 << 30, [8, 8])
    plain = run_distributed(_generate, 2, 0, [8, 8])
    want = _reference(8)
    for got in kept + plain:
        assert torch.equal(got["tokens"], want)
        assert got["released"] == 0 or got["released"] <= got["persistent"]
    assert 0 < kept[0]["gathered"] <= kept[0]["one_gather_of_all"]
    assert plain[0]["gathered"] >= 8 * kept[0]["gathered"]


def _generate_in_one_pass(rank: int, world: int, bucket_size: int) -> dict:
    """Three ``generate()`` calls, each one pass as the strategy's predict loop runs them, inside one
    ``keep_gathered`` block of half the model's bytes; the bytes a rank receives by the third."""
    counter = {"bytes": 0}
    _received(counter)
    model = _gpt2()
    engine = ZeroEngine(model, block_classes=["GPT2Block"], auto_pass=False,
                        prefetch=PrefetchConfig(persistence_threshold=0, bucket_size=bucket_size))
    whole = sum(u.numel for u in engine.units) * 4
    received = []
    with torch.no_grad(), engine.keep_gathered(whole // 2):
        for _ in range(3):
            counter["bytes"] = 0
            engine.begin_pass("predict")
            out = model.generate(PROMPT, max_new_tokens=8, do_sample=False)
            received.append(counter["bytes"])
        kept = sum(u.numel for u in engine.units if u.kept) * 4
    return {"tokens": out, "received": received, "rest": (whole - kept) * (world - 1) // world}


def test_generate_at_half_the_budget_gathers_the_rest_once_when_it_fits_the_bucket() -> None:
    """Half the model kept by ``keep_gathered``: the other half (under the prefetch bucket) is
    used again, from one token's forward to the next, with no more than a bucket gathered in
    between, so once the trace is replayed each call gathers it once, not once per token as with
    ``bucket_size=0``; the tokens are the unpartitioned model's."""
    want = _reference(8)
    fits = run_distributed(_generate_in_one_pass, 2, PrefetchConfig.bucket_size)
    shallow = run_distributed(_generate_in_one_pass, 2, 0)
    for got in fits + shallow:
        assert torch.equal(got["tokens"], want)
    for got in fits:
        assert got["rest"] > 0 and got["received"][1:] == [got["rest"]] * 2, got
    for got in shallow:  # 8 forwards: the prompt's, then 7 decode steps
        assert got["received"][1:] == [8 * got["rest"]] * 2, got


@pytest.mark.parametrize("budget", [0, 1 << 30], ids=["gathers-every-step", "whole-model-kept"])
def test_ranks_that_stop_at_different_lengths_do_not_hang(budget: int) -> None:
    """Rank 0 asks for 3 new tokens, rank 1 for 9. With no budget every decode step gathers, so
    rank 0 keeps running forward passes until rank 1 is done (``synced_gpus``, as under DeepSpeed
    ZeRO-3 and FSDP); with the whole model kept only the first forward gathers, ``synced_gpus``
    is off and rank 0 simply stops. Nobody hangs; each gets the tokens it asked for."""
    ranks = run_distributed(_generate, 2, budget, [3, 9], timeout=120)
    assert torch.equal(ranks[0]["tokens"], _reference(3))
    assert torch.equal(ranks[1]["tokens"], _reference(9))


def _predict(rank: int, world: int, budget: int) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zinf import ZeroInfinityStrategy

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _gpt2()

        def predict_step(self, batch, batch_idx):
            return self.model.generate(batch[0], max_new_tokens=3 + 6 * self.global_rank, do_sample=False)

    strategy = ZeroInfinityStrategy(block_classes=["GPT2Block"], prefetch={"inference_budget": budget,
                                                                           "persistence_threshold": 0})
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    out = trainer.predict(Lit(), DataLoader(TensorDataset(PROMPT), batch_size=2))
    return {"tokens": out[0], "gathered": trainer.strategy.engine.gathered_bytes}


@pytest.mark.parametrize("budget", [0, 1 << 30], ids=["no-budget", "whole-model"])
def test_trainer_predict_generates_at_different_lengths_per_rank(budget: int) -> None:
    """``generate()`` in a ``predict_step`` through the Trainer at 2 ranks, rank 0 asking for 3 new
    tokens and rank 1 for 9: the unpartitioned model's tokens on each, and the units released after."""
    ranks = run_distributed(_predict, 2, budget, init_pg=False, timeout=180)
    assert torch.equal(ranks[0]["tokens"], _reference(3))
    assert torch.equal(ranks[1]["tokens"], _reference(9))
    assert ranks[0]["gathered"] == ranks[1]["gathered"] == 0


def _generate_hpz(rank: int, world: int) -> dict:
    from lightning_zinf import ZeroPPConfig

    model = _gpt2()
    engine = ZeroEngine(model, block_classes=["GPT2Block"], prefetch=PrefetchConfig(persistence_threshold=0),
                        zero_pp=ZeroPPConfig(hpz=True, ranks_per_node=2))
    engine.comm.bytes.reset()
    with torch.no_grad():
        model(PROMPT)  # the first gather of each unit crosses nodes and leaves its secondary partition
    first = engine.comm.bytes.inter_node
    engine.comm.bytes.reset()
    with torch.no_grad():
        out = model.generate(PROMPT, max_new_tokens=8, do_sample=False)
    return {"tokens": out, "first_inter": first, "generate_inter": engine.comm.bytes.inter_node,
            "generate_intra": engine.comm.bytes.intra_node}


def test_generation_regathers_from_hpz_secondaries_within_the_node() -> None:
    """4 ranks as 2 simulated nodes with hpZ and no budget: every decode step gathers every unit
    again, but from the secondary partitions inside the node; nothing crosses nodes."""
    ranks = run_distributed(_generate_hpz, 4)
    want = _reference(8)
    for got in ranks:
        assert torch.equal(got["tokens"], want)
        assert got["first_inter"] > 0 and got["generate_inter"] == 0 and got["generate_intra"] > 0


def _predict_loop(rank: int, world: int, budget: int, precision: str, read_weights: bool) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zinf import ZeroInfinityStrategy

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _gpt2()
            self.before: list[int] = []

        def predict_step(self, batch, batch_idx):
            self.before.append(self.trainer.strategy.engine.comm.bytes.gathered)
            return self.model.generate(batch[0], max_new_tokens=4, do_sample=False)

    class ReadWeights(L.Callback):
        """Reads every weight between two steps, as a callback logging them would."""

        def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
            self.sums = [v.float().sum() for v in pl_module.state_dict().values()]

    strategy = ZeroInfinityStrategy(block_classes=["GPT2Block"], prefetch={"inference_budget": budget,
                                                                           "persistence_threshold": 0})
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, precision=precision,
                        callbacks=[ReadWeights()] if read_weights else [])
    lit = Lit()
    prompts = torch.randint(0, 256, (3, 6), generator=torch.Generator().manual_seed(5))
    out = trainer.predict(lit, DataLoader(TensorDataset(prompts), batch_size=1))
    engine = trainer.strategy.engine
    per_step = [b - a for a, b in zip(lit.before, lit.before[1:] + [engine.comm.bytes.gathered])]
    full_gather = sum(g.padded_numel * g.full.element_size() * (world - 1) // world for g in engine.groups)
    return {"tokens": torch.cat(out), "per_step": per_step, "one_gather_of_all": full_gather,
            "left": engine.gathered_bytes}


def _reference_loop(precision: str) -> torch.Tensor:
    prompts = torch.randint(0, 256, (3, 6), generator=torch.Generator().manual_seed(5))
    model = _gpt2()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        return torch.cat([model.generate(p[None], max_new_tokens=4, do_sample=False) for p in prompts])


def test_a_predict_loop_gathers_the_kept_model_once_and_releases_it_at_its_end() -> None:
    """``trainer.predict`` over 3 batches with the whole model within ``inference_budget``: the
    first step gathers every unit once and the next two gather nothing (the loop keeps the units
    from step to step, as DeepSpeed's hybrid engine does between generate() calls), the tokens are
    the unpartitioned model's, and nothing stays gathered after the loop. Without a budget every
    step gathers every unit again (within a step, this model, smaller than the prefetch bucket,
    stays gathered from token to token once the trace is replayed: one gather of all from the
    second step on, against one per token in the first, which records it)."""
    kept = run_distributed(_predict_loop, 2, 1 << 30, "32-true", False, init_pg=False, timeout=180)
    plain = run_distributed(_predict_loop, 2, 0, "32-true", False, init_pg=False, timeout=180)
    want = _reference_loop("32-true")
    for got in kept + plain:
        assert torch.equal(got["tokens"], want)
        assert got["left"] == 0
    steps = kept[0]["per_step"]
    assert 0 < steps[0] <= kept[0]["one_gather_of_all"] and steps[1:] == [0, 0], kept[0]
    first, *later = plain[0]["per_step"]
    assert first >= 4 * steps[0] and later == [plain[0]["one_gather_of_all"]] * 2, plain[0]


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_weights_read_between_steps_of_a_kept_loop_leave_its_forwards_to_fresh_gathers(precision: str) -> None:
    """A callback reading the state dict between predict steps gathers the exact values (fp32:
    under bf16-mixed in buffers of their own); the units the loop kept are released for it, none
    is kept while it reads, and the next step gathers them again for compute, its tokens those of
    the run without the callback. Otherwise the next forward would read the read's buffers (fp32
    values under bf16-mixed; whatever a read without write-back left in them)."""
    read = run_distributed(_predict_loop, 2, 1 << 30, precision, True, init_pg=False, timeout=180)
    quiet = run_distributed(_predict_loop, 2, 1 << 30, precision, False, init_pg=False, timeout=180)
    for got, base in zip(read, quiet):
        assert torch.equal(got["tokens"], base["tokens"])
        assert got["per_step"][1] > 0 and base["per_step"][1] == 0  # gathered again after the read


def _kept_loop_then_train(rank: int, world: int, bypass: bool) -> dict:
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    engine = ZeroEngine(model, prefetch=PrefetchConfig(persistence_threshold=0, unit_size=0), auto_pass=False)
    if not bypass:
        engine.schedule.bypass = lambda: None  # the reference: every pass through the hooks
    seen: list[int] = []
    # A user's pre-hook registered after the engine's: it sees the gathered weight (the engine's
    # hook runs first), and must still do so once the engine's hooks are back in place.
    model[0].register_forward_pre_hook(lambda module, args: seen.append(module.weight.numel()))
    opt = engine.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))
    hookless, outputs = [], []
    with engine.keep_gathered(1 << 30):
        for _ in range(3):
            with torch.no_grad():
                engine.begin_pass("eval")
                hookless.append(not any(m._forward_pre_hooks or m._forward_hooks for m in model[1:]))
                outputs.append(model(x))
        with torch.enable_grad():  # a backward inside the block, with the hooks out for this pass
            model(x).square().sum().backward()
    losses = []
    for _ in range(2):
        engine.begin_pass("train")
        loss = model(x).square().sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"hookless": hookless, "outputs": torch.stack(outputs), "losses": torch.stack(losses), "seen": seen}


def test_a_pass_that_keeps_every_unit_runs_without_forward_hooks_and_training_goes_on() -> None:
    """Inside ``keep_gathered`` with the whole model kept, a pass begun after the units were kept
    (and the kind's trace agreed) runs with none of the engine's forward hooks (torch's call path
    of the unpartitioned model); its outputs, a backward inside the block and two training steps
    after it equal those of the same run through the hooks, and a user's pre-hook registered
    after the engine's still sees the gathered weight afterwards (the hooks are put back in their
    order)."""
    fast = run_distributed(_kept_loop_then_train, 2, True)
    slow = run_distributed(_kept_loop_then_train, 2, False)
    for a, b in zip(fast, slow):
        assert a["hookless"] == [False, True, True] and b["hookless"] == [False, False, False]
        assert torch.equal(a["outputs"], b["outputs"]) and torch.equal(a["losses"], b["losses"])
        assert a["seen"] == b["seen"] and all(n == 8 * 16 for n in a["seen"])


def _fit_with_validation(rank: int, world: int, budget: int, checkpoints: str = "") -> dict:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zinf import ZeroInfinityStrategy

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _gpt2()
            self.train_losses: list[torch.Tensor] = []
            self.val_losses: list[torch.Tensor] = []
            self.hookless: list[bool] = []

        def training_step(self, batch, batch_idx):
            loss = self.model(batch[0], labels=batch[0]).loss
            self.train_losses.append(loss.detach())
            return loss

        def validation_step(self, batch, batch_idx):
            self.val_losses.append(self.model(batch[0], labels=batch[0]).loss)
            self.hookless.append(not any(m._forward_pre_hooks for m in self.model.modules()))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = torch.randint(0, 256, (8, 12), generator=torch.Generator().manual_seed(2))
    # A full checkpoint at each validation's end (ModelCheckpoint runs before the strategy's loop
    # end): it reads every weight, and the full optimizer state, while the loop's keep is open.
    strategy = ZeroInfinityStrategy(prefetch={"inference_budget": budget},
                                    state_dict_type="full" if checkpoints else "sharded")
    callbacks = [L.pytorch.callbacks.ModelCheckpoint(dirpath=checkpoints, save_top_k=-1)] if checkpoints else []
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=bool(checkpoints), callbacks=callbacks,
                        max_epochs=2, num_sanity_val_steps=2)
    lit = Lit()
    trainer.fit(lit, DataLoader(TensorDataset(data), batch_size=2), DataLoader(TensorDataset(data), batch_size=2))
    return {"train": torch.stack(lit.train_losses), "val": torch.stack(lit.val_losses), "hookless": lit.hookless,
            "left": trainer.strategy.engine.gathered_bytes}


@pytest.mark.parametrize("full_checkpoints", [False, True], ids=["no-checkpoint", "full-checkpoint-each-epoch"])
def test_fit_with_validation_loops_that_keep_the_whole_model_trains_as_without(full_checkpoints: bool,
                                                                               tmp_path) -> None:
    """``trainer.fit`` for 2 epochs, a validation loop of 2 steps per rank before (the sanity
    check) and after each, the whole model within ``inference_budget``: each loop keeps the units
    from step to step and releases them at its end (from the second loop on, once the kept steps'
    trace is agreed, its second step runs without forward hooks), and the training and validation
    losses are those of the run that keeps nothing, bit for bit. Also with a full checkpoint saved
    at each validation's end, inside the loop's keep (its reads stop the keeping; a keep budget
    that outlived the loop kept training's units gathered across optimizer steps: stale weights)."""
    folder = str(tmp_path / "ckpt") if full_checkpoints else ""
    kept = run_distributed(_fit_with_validation, 2, 1 << 30, folder, init_pg=False, timeout=240)
    plain = run_distributed(_fit_with_validation, 2, 0, folder + "-plain" if folder else "", init_pg=False, timeout=240)
    for a, b in zip(kept, plain):
        assert torch.equal(a["train"], b["train"]) and torch.equal(a["val"], b["val"])
        assert len(a["val"]) == 2 + 2 * 2  # two sanity steps, then two per rank each epoch
        # The second step of each loop after the first (whose second step records the kept steps' trace).
        assert a["hookless"] == [False, False] + [False, True] * 2 and not any(b["hookless"])
        assert a["left"] == b["left"]
