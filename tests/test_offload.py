"""Optimizer offload (cpu, nvme) reproduces the non-offloaded engine bit for bit, W=2, fp32 AdamW.

The reference is the engine without offload, itself checked against single-process PyTorch in
test_parity.py; offload moves state between tiers and steps it in sub-groups, which must not
change one bit of arithmetic (same elementwise updates, same order of the gradient-norm sum).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_zinf import OffloadConfig, PrefetchConfig, ZeroEngine
from tests import models
from tests.harness import run_distributed

STEPS = 5
BATCH = 8


def _train(rank: int, world: int, offload: dict, accumulate: int, clip: float | None) -> dict:
    torch.manual_seed(0)
    model = models.GPT()
    engine = ZeroEngine(
        model, block_classes=["Block"], prefetch=PrefetchConfig(persistence_threshold=0), offload=OffloadConfig(**offload)
    )
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    losses, tiers = [], []
    for step in range(STEPS):
        for micro in range(accumulate):
            x, y = models.make_batch("gpt", step * accumulate + micro, BATCH)
            per_rank = BATCH // world
            loss = models.loss_fn(model, x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank])
            (loss / accumulate).backward()
            losses.append(loss.item())
        if clip is not None:
            engine.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
        tiers.append(engine.resident_bytes())
    with engine.gathered():
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "weights": weights, "tiers": tiers}


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    return {
        (acc, clip): run_distributed(_train, 2, {}, acc, clip) for acc, clip in ((1, None), (2, 0.5))
    }


@pytest.mark.parametrize("accumulate, clip", [(1, None), (2, 0.5)], ids=["plain", "accumulate-clip"])
@pytest.mark.parametrize(
    "offload",
    [
        {"optimizer": "cpu"},
    ],
    ids=["cpu"],
)
def test_optimizer_offload_is_bit_exact(reference: dict, tmp_path: Path, offload: dict, accumulate: int, clip) -> None:
    if offload["optimizer"] == "nvme":
        offload = {**offload, "nvme_path": str(tmp_path)}
    ranks = run_distributed(_train, 2, offload, accumulate, clip)
    expected = reference[(accumulate, clip)]
    for got, want in zip(ranks, expected):
        assert got["losses"] == want["losses"]
        for name, value in want["weights"].items():
            assert torch.equal(got["weights"][name], value), name
    tiers = ranks[0]["tiers"][-1]
    assert tiers["cpu"] > 0 if offload["optimizer"] == "cpu" else tiers["nvme"] > 0
    if offload["optimizer"] == "nvme":
        # Between steps no fp32 master, gradient or optimizer state stays in memory.
        assert tiers["cpu"] == 0, tiers
        assert list(tmp_path.iterdir()) == []  # each rank's swap folder is gone after the run
