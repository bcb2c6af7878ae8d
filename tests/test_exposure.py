"""The warning that the gathers cost more than the compute they overlap (issue 42, units sized
automatically): measured on one training forward (``engine.exposure``), warned on rank 0 only.

Two models at 2 ranks on gloo, a unit per Linear, one unit gathered ahead: wide Linears on one row
of input (4 MiB gathered per unit for a matrix-vector product: the gathers dominate) and narrow ones
on 64k rows (16 KiB gathered per unit for tens of milliseconds of matrix products: they hide). The
observer outside the engine is the test's own clock around the measured step and Python's warning
record.
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch

from lightning_zinf import PrefetchConfig, ZeroEngine
from lightning_zinf.engine.exposure import MEASURED
from tests.harness import run_distributed


def _train(rank: int, world: int, width: int, rows: int, reference: bool = False) -> dict:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width) for _ in range(6)]
    model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.Tanh())])
    engine = ZeroEngine(model, prefetch=PrefetchConfig(unit_size=0, persistence_threshold=0,
                                                       bucket_size=width * width + width))
    opt = engine.shard_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rank))
    # The model's call after the engine's pass start (its root pre-hook, registered first, runs
    # first): the meeting of the ranks there may wait for the other rank, outside the window measured.
    inside: list[float] = []
    model.register_forward_pre_hook(lambda module, args: inside.append(time.perf_counter()))
    outer = forward = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(MEASURED + 1):
            start = time.perf_counter()
            out = model(x)
            forwarded, began = time.perf_counter(), inside[-1]
            if reference:  # a forward without gradients before the backward (RLHF's reference model)
                with torch.no_grad():
                    model(x)
            loss = out.square().mean()
            loss.backward()
            if step == MEASURED - 1:
                outer, forward = time.perf_counter() - start, forwarded - began
            opt.step()
            opt.zero_grad()
    ours = [str(w.message) for w in caught if "lightning_zinf: in training forward" in str(w.message)]
    return {"warnings": ours, "report": engine.exposure.report, "outer": outer, "forward": forward,
            "names": [u.name for u in engine.units]}


@pytest.mark.parametrize("reference", [False, True], ids=["plain", "reference-forward-before-backward"])
def test_gathers_longer_than_the_compute_warn_on_rank_0_naming_the_units(reference: bool) -> None:
    """4 MiB a unit for a matrix-vector product each: the gathers take longer than the compute; rank
    0 warns once, naming units of the model and what to change; rank 1 measures the same but stays
    silent. Every unit is reported, and the seconds measured span most of the model's call as the
    test's own clock saw it, within the step. A forward without gradients between the forward and
    its backward (the pass it begins ends the measured one) changes none of it."""
    results = run_distributed(_train, 2, 1024, 1, reference)
    for rank, result in enumerate(results):
        waited, computed, waits = result["report"]
        assert waited > computed > 0, result["report"]
        assert set(waits) == set(result["names"]), waits  # persistence_threshold=0: every unit gathered
        # The window measured is the forward from its pass's start (after the engine's pass
        # boundary work) to the backward's start: within the step as the test's own clock saw it,
        # and most of the model's call after the pass start.
        assert result["forward"] / 2 <= waited + computed <= result["outer"], (waited, computed, result)
        assert len(result["warnings"]) == (1 if rank == 0 else 0), result["warnings"]
    message = results[0]["warnings"][0]
    assert f"training forward {MEASURED}," in message and "ms on parameter all-gathers" in message
    assert "qwz=True" in message and "grad_op" in message
    assert any(f"'{name}'" in message for name in results[0]["names"])


def test_gathers_hidden_behind_the_compute_do_not_warn() -> None:
    """16 KiB a unit for a 64k-row matrix product each: the waits are a small part of the forward,
    and no rank warns."""
    for result in run_distributed(_train, 2, 64, 65536):
        waited, computed, _ = result["report"]
        assert computed > 2 * waited, result["report"]
        assert result["warnings"] == []
