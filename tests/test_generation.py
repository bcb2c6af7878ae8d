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
