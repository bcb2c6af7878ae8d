"""The offloaded optimizer step in the background (``OffloadConfig.overlap_step``, issue 39 item 2).

``optimizer.step()`` with the optimizer on the ``cpu`` or ``nvme`` tier only starts the step; the
next forward waits, unit by unit, for what it gathers. What the user pays for is exactness: the
weights, the optimizer states and everything read between steps must be bit-identical to the
synchronous step's, whatever the training code does between two steps. Each run below does all of
it at once, for 50 steps on 2 ranks: two optimizers, gradient accumulation, clipping by norm, a
learning-rate schedule stepped right after ``optimizer.step()`` (the step must use the rate it was
called with), a sharded checkpoint saved right after a step and loaded back later, a state dict
and the optimizer's ``state_dict()`` read right after a step. The reference is the same run with
``overlap_step=False``; ``test_bf16_gathers_read_16_bit_copies`` (test_offload.py) compares
offload with no offload.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_zinf import MixedPrecisionConfig, OffloadConfig, PrefetchConfig, ZeroEngine
from tests import models
from tests.harness import run_distributed

BATCH = 8
STEPS = 50


def _train(rank: int, world: int, offload: dict, ckpt: str, bf16: bool) -> dict:
    from lightning_zinf.checkpoint import load_sharded, save_sharded

    torch.manual_seed(0)
    model = models.GPT(d=64)
    engine = ZeroEngine(model, block_classes=["Block"], prefetch=PrefetchConfig(persistence_threshold=100),
                        offload=OffloadConfig(**offload),
                        mixed_precision=MixedPrecisionConfig(param_dtype="bf16") if bf16 else MixedPrecisionConfig())
    blocks = [p for n, p in model.named_parameters() if n.startswith("blocks.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
    opt_blocks = engine.shard_optimizer(torch.optim.AdamW(blocks, lr=1e-2, weight_decay=0.1))
    opt_rest = engine.shard_optimizer(torch.optim.SGD(rest, lr=0.5, momentum=0.9))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt_blocks, lambda s: 1.0 / (1 + s))
    per_rank = BATCH // world
    losses, norms, between = [], [], {}
    for step in range(STEPS):
        for micro in range(2):  # gradient accumulation
            x, y = models.make_batch("gpt", 2 * step + micro, BATCH)
            loss = models.loss_fn(model, x[rank * per_rank : (rank + 1) * per_rank],
                                  y[rank * per_rank : (rank + 1) * per_rank])
            (loss / 2).backward()
            losses.append(loss.item())
        norms.append(engine.clip_grad_norm_(1.0).item())
        opt_rest.step()
        opt_blocks.step()  # (the second step waits for the first one's: it is still in flight)
        schedule.step()  # at once: the step still running must keep the rate it was called with
        if step == 20:
            save_sharded(engine, [opt_blocks, opt_rest], ckpt, {})
        if step == 30:
            between["model"] = {k: v.clone() for k, v in model.state_dict().items()}
            between["optimizer"] = _tensors(opt_blocks.state_dict())
        if step == 40:
            load_sharded(engine, [opt_blocks, opt_rest], ckpt)  # back to step 20's state
        opt_blocks.zero_grad()
        opt_rest.zero_grad()
    with engine.gathered():
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    states = [_tensors(opt.state_dict()) for opt in (opt_blocks, opt_rest)]
    engine.release_all()
    return {"losses": losses, "norms": norms, "weights": weights, "states": states, "between": between}


def _tensors(state_dict: dict) -> dict:
    """The tensors of an optimizer state dict, by (parameter index, name)."""
    return {(i, k): v.clone() for i, s in state_dict["state"].items() for k, v in s.items() if isinstance(v, torch.Tensor)}


def _assert_same(got: dict, want: dict) -> None:
    assert got["losses"] == want["losses"]
    assert got["norms"] == want["norms"]
    for name, value in want["weights"].items():
        assert torch.equal(got["weights"][name], value), name
    for g, w in zip(got["states"], want["states"]):
        assert g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in w)
    for name, value in want["between"]["model"].items():
        assert torch.equal(got["between"]["model"][name], value), name
    assert all(torch.equal(got["between"]["optimizer"][k], v) for k, v in want["between"]["optimizer"].items())


@pytest.mark.parametrize("param, optimizer, bf16", [("none", "cpu", True), ("cpu", "cpu", False),
                                                   ("nvme", "nvme", True), ("none", "nvme", True)])
def test_the_step_in_the_background_is_bit_identical_to_the_synchronous_step(tmp_path: Path, param: str,
                                                                              optimizer: str, bf16: bool) -> None:
    """50 steps of everything a training loop does between steps (module docstring), with the
    step in the background and without: the same losses, gradient norms, weights, optimizer states,
    state dicts read between steps, and checkpoint contents (loaded back at step 40)."""
    offloads = []
    for overlap_step in (False, True):
        nvme = tmp_path / f"nvme{overlap_step}"
        nvme.mkdir()
        offloads.append({"param": param, "optimizer": optimizer, "overlap_step": overlap_step, "nvme_path": str(nvme),
                         "sub_group_size": 3_000})
    want = run_distributed(_train, 2, offloads[0], str(tmp_path / "want"), bf16)
    got = run_distributed(_train, 2, offloads[1], str(tmp_path / "got"), bf16)
    for g, w in zip(got, want):
        _assert_same(g, w)


class _Failing(torch.optim.AdamW):
    """AdamW whose update raises once ``boom`` is set (a subclass calling ``super().step()``, as
    user optimizers do): when it has gradients to apply, as a failing update (a NaN check, an
    allocation) would."""

    boom = False

    def step(self, closure=None):
        if self.boom and any(p.grad is not None for group in self.param_groups for p in group["params"]):
            raise ValueError("boom: the optimizer's step failed")
        return super().step(closure)


def _fail_at_step_2(rank: int, world: int, offload: dict) -> list:
    torch.manual_seed(0)
    model = models.GPT(d=64)
    engine = ZeroEngine(model, block_classes=["Block"], prefetch=PrefetchConfig(persistence_threshold=0),
                        offload=OffloadConfig(**offload))
    opt = engine.shard_optimizer(_Failing(model.parameters(), lr=1e-2))
    per_rank = BATCH // world
    for step in range(4):
        x, y = models.make_batch("gpt", step, BATCH)
        try:
            loss = models.loss_fn(model, x[rank * per_rank : (rank + 1) * per_rank],
                                  y[rank * per_rank : (rank + 1) * per_rank])
        except ValueError as error:
            return ["forward", step, str(error)]
        loss.backward()
        opt.boom = step == 2
        try:
            opt.step()
        except ValueError as error:
            return ["step", step, str(error)]
        opt.zero_grad()
    return ["no error"]


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_an_exception_in_the_step_in_the_background_is_raised_at_the_next_wait_on_every_rank(
        tmp_path: Path, tier: str) -> None:
    """The optimizer's step raises on every rank at step 2. Synchronous: from ``optimizer.step()``.
    In the background: from the next forward, at the gather of the first unit (its wait comes
    before any collective of the gather), on both ranks, with the step's own exception; nothing
    hangs (the harness times out otherwise)."""
    for overlap_step, where in ((False, ["step", 2]), (True, ["forward", 3])):
        nvme = tmp_path / str(overlap_step)
        nvme.mkdir()
        got = run_distributed(_fail_at_step_2, 2, {"param": tier, "optimizer": tier, "nvme_path": str(nvme),
                                                   "overlap_step": overlap_step})
        assert got == [[*where, "boom: the optimizer's step failed"]] * 2, got


def _both_modes(fn, tmp_path: Path) -> tuple:
    """``fn(rank, world, nvme_path, overlap_step)`` on one rank with the step in the background,
    then synchronous, each with a swap folder of its own: (in the background, synchronous)."""
    out = []
    for overlap_step in (True, False):
        nvme = tmp_path / f"nvme-{overlap_step}"
        nvme.mkdir()
        out.append(run_distributed(fn, 1, str(nvme), overlap_step)[0])
    return tuple(out)


def _full_state_after_each_step(rank: int, world: int, nvme: str, overlap_step: bool) -> list:
    from lightning_zinf.checkpoint.full import trainable_state_dict

    torch.manual_seed(0)
    model = models.GPT(d=64).to(torch.bfloat16)  # bf16 shards: the master is a record of its own
    engine = ZeroEngine(model, block_classes=["Block"], prefetch=PrefetchConfig(persistence_threshold=0),
                        offload=OffloadConfig(param="nvme", optimizer="nvme", nvme_path=nvme,
                                              overlap_step=overlap_step, sub_group_size=3_000))
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    states = []
    for step in range(3):
        x, y = models.make_batch("gpt", step, BATCH)
        models.loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        states.append(trainable_state_dict(engine, rank0_only=False))  # right after the step
    engine.release_all()
    return states


def test_a_full_state_dict_right_after_the_step_waits_for_it(tmp_path: Path) -> None:
    """A full state dict of the trainable parameters taken right after ``optimizer.step()`` (what
    ModelCheckpoint and ``fabric.save`` do with ``state_dict_type="full"``) holds the stepped
    values, as after a synchronous step: its read waits for the step in flight before any shard
    is swapped in (it failed with an empty shard when the wait came later)."""
    got, want = _both_modes(_full_state_after_each_step, tmp_path)
    for g, w in zip(got, want):
        assert g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in w)


def _reads_by_phase(rank: int, world: int, nvme: str, overlap_step: bool) -> list:
    torch.manual_seed(0)
    model = models.GPT(d=64)
    engine = ZeroEngine(model, block_classes=["Block"], prefetch=PrefetchConfig(persistence_threshold=0),
                        offload=OffloadConfig(param="nvme", optimizer="nvme", nvme_path=nvme, overlap_step=overlap_step,
                                              sub_group_size=3_000))
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    swapper, phases = engine.swapper, []
    # Bytes of the reads asked for (when they complete depends on the machine's load: a short
    # backward may end before its reads do).
    asked, read = [0], swapper.read

    def counted(key: str, out: torch.Tensor):
        asked[0] += out.numel() * out.element_size()
        return read(key, out)

    swapper.read = counted
    for step in range(4):
        x, y = models.make_batch("gpt", step, BATCH)
        loss = models.loss_fn(model, x, y)
        before = asked[0]
        loss.backward()
        during_backward = asked[0] - before
        opt.step()
        opt.zero_grad()
        engine.release_all()  # the step's reads complete (NVMe: ends it)
        phases.append((during_backward, asked[0] - before))
    return phases


def test_the_state_the_step_needs_first_is_read_behind_the_backward(tmp_path: Path) -> None:
    """With the step in the background on NVMe, a backward starts reading the masters and states
    of the sub-groups the step steps first, so the next forward, which waits for those, does not
    wait for their reads too: from the second step on (the states exist), more bytes are asked of
    the swapper during backward than with the synchronous step. (The total per step varies with
    when writes behind complete, in both modes: a record still in memory is not read back.)"""
    got, want = _both_modes(_reads_by_phase, tmp_path)
    for (backward, _), (backward_sync, _) in list(zip(got, want))[1:]:
        assert backward > backward_sync, (got, want)
