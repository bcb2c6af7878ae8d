"""An optimizer step touches only what that optimizer steps: several models (or optimizers) in one
engine do not disturb each other.

- Two optimizers over two sub-models, stepped at different times (Lightning manual optimization,
  2 ranks): the parameters equal plain single-process PyTorch's doing the same, so the second
  optimizer's gradients accumulate across the first one's steps, as in PyTorch.
- hpZ with a frozen sub-model (2 ranks, one rank per hpZ partition): an observer outside the
  engine (wrapping the torch.distributed gathers the collectives issue) counts the gathers whose
  process group spans two partitions; the frozen model's forward after a step makes none (its
  secondary partitions survived the step), while the stepped model's does (its were dropped).
- A load or an edit of the frozen weights still refreshes their secondaries: the next forward
  computes with the new values (plain PyTorch with the same weights is the reference).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Iterator, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lightning_zinf  # noqa: F401  (registers "zero_infinity")
from lightning_zinf import PrefetchConfig, ZeroEngine, ZeroPPConfig
from lightning_zinf.comm import collectives
from tests.harness import run_distributed

BATCH = 8  # global
STEPS = 6
PARTITION = 1  # ranks per hpZ partition: with 2 ranks, each is a "node" of its own


class _Pair(nn.Module):
    """Two sub-models: ``first`` feeds ``second``; each gets an optimizer of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        self.second = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 8, generator=g)


def _optimizers(model: _Pair) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    return torch.optim.AdamW(model.first.parameters(), lr=1e-2), torch.optim.SGD(model.second.parameters(), lr=0.1)


def _step(model: nn.Module, a, b, step: int, x: torch.Tensor, y: torch.Tensor, backward) -> None:
    """A steps (and zeroes) every step, B every other step: B's gradient is the sum of two backwards."""
    backward(F.mse_loss(model(x), y))
    a.step()
    a.zero_grad()
    if step % 2 == 1:
        b.step()
        b.zero_grad()


def _plain_two_optimizers() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = _Pair()
    a, b = _optimizers(model)
    for step in range(STEPS):
        _step(model, a, b, step, *_batch(step), backward=torch.Tensor.backward)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class _TwoOptimizers(__import__("lightning.pytorch", fromlist=["LightningModule"]).LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model: Optional[_Pair] = None

    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(0)
            self.model = _Pair()

    def training_step(self, batch, batch_idx):
        a, b = self.optimizers()
        _step(self.model, a, b, batch_idx, *batch, backward=self.manual_backward)

    def configure_optimizers(self):
        return list(_optimizers(self.model))

    def train_dataloader(self):
        from torch.utils.data import DataLoader, TensorDataset
        rank, world = self.trainer.global_rank, self.trainer.world_size
        share = BATCH // world
        pieces = [tuple(t[rank * share:(rank + 1) * share] for t in _batch(step)) for step in range(STEPS)]
        return DataLoader(TensorDataset(torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])),
                          batch_size=share)


def _trainer_two_optimizers(rank: int, world: int) -> dict[str, torch.Tensor]:
    import lightning.pytorch as L

    from lightning_zinf import ZeroInfinityStrategy

    trainer = L.Trainer(strategy=ZeroInfinityStrategy(), accelerator="cpu", devices=world, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    lit = _TwoOptimizers()
    trainer.fit(lit)
    with trainer.strategy.gathered_parameters():
        return {n: p.detach().clone() for n, p in lit.model.named_parameters()}


def test_two_optimizers_stepped_at_different_times_match_pytorch() -> None:
    """B's gradient accumulates over two backwards although A steps in between (a step of A used
    to mark every group's gradients consumed, so B stepped on the last backward's alone). Grouped
    by default, the pair is one unit whose flat group holds both optimizers' parameters: A's step
    consumes only its own parameters' gradients (a GAN's generator and discriminator alike)."""
    want = _plain_two_optimizers()
    got = run_distributed(_trainer_two_optimizers, 2, init_pg=False)[0]
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=name)


# --- hpZ: a frozen model's secondary partitions survive a step ------------------------------------
class _PolicyAndReward(nn.Module):
    """A trainable policy and a frozen reward model, as in RLHF."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8))
        self.reward = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.reward.requires_grad_(False)


def _reward_weights(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {f"reward.{k}": v for k, v in _PolicyAndReward().reward.state_dict().items()}


@contextmanager
def _observed(log: list[tuple[int, ...]]) -> Iterator[None]:
    """Record the ranks of the process group of every gather torch.distributed runs for the
    collectives: the flat all-gather (torch's ``all_gather_into_tensor``) and the broadcasts
    gloo's in-place form uses. The control plane's rows (int64: the ranks' checks, over every
    rank) are not gathers of parameters."""
    flat, broadcast = collectives._all_gather_tensor, dist.broadcast

    def ranks(group) -> tuple[int, ...]:
        return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))

    def observed_flat(out, shard, group=None, async_op=False):
        if out.dtype != torch.int64:
            log.append(ranks(group))
        return flat(out, shard, group=group, async_op=async_op)

    def observed_broadcast(*args, group=None, **kwargs):
        log.append(ranks(group))
        return broadcast(*args, group=group, **kwargs)

    collectives._all_gather_tensor, dist.broadcast = observed_flat, observed_broadcast
    try:
        yield
    finally:
        collectives._all_gather_tensor, dist.broadcast = flat, broadcast


def _crossing(log: list[tuple[int, ...]]) -> int:
    """Gathers whose group spans more than one hpZ partition."""
    return sum(len({r // PARTITION for r in ranks}) > 1 for ranks in log)


def _hpz_run(rank: int, world: int, frozen_bits: Optional[int]) -> dict:
    torch.manual_seed(0)
    model = _PolicyAndReward()
    # A unit per module: the two models' units apart (grouped, both would share one).
    engine = ZeroEngine(model, prefetch=PrefetchConfig(persistence_threshold=0, unit_size=0),
                        zero_pp=ZeroPPConfig(hpz=True, ranks_per_node=PARTITION, frozen_bits=frozen_bits))
    opt = engine.shard_optimizer(torch.optim.AdamW(model.policy.parameters(), lr=1e-2))
    share = BATCH // world
    rows = []
    for step in range(3):
        x, y = (t[rank * share:(rank + 1) * share] for t in _batch(step))
        reward_log, policy_log = [], []
        engine.begin_pass("score")
        with torch.no_grad(), _observed(reward_log):
            scores = model.reward(x)
        engine.begin_pass("train")
        with _observed(policy_log):
            out = model.policy(x)
        F.mse_loss(out, y).backward()
        opt.step()
        opt.zero_grad()
        rows.append({"reward": _crossing(reward_log), "policy": _crossing(policy_log), "scores": scores, "x": x})
    # A load of new frozen weights (load_state_dict), then an edit (gathered(write_back=True)):
    # each must reach the next forward, whose secondaries held the old values.
    x = _batch(0)[0][rank * share:(rank + 1) * share]
    full = model.state_dict()
    full.update(_reward_weights(7))
    model.load_state_dict(full)
    engine.begin_pass("score")
    with torch.no_grad():
        loaded = model.reward(x)
    with engine.gathered(write_back=True), torch.no_grad():
        for p in model.reward.parameters():
            p.mul_(-1.0)
    engine.begin_pass("score")
    with torch.no_grad():
        edited = model.reward(x)
    with engine.gathered():
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"rows": rows, "loaded": loaded, "edited": edited, "weights": weights, "x": x}


@functools.lru_cache(maxsize=None)
def _hpz(frozen_bits: Optional[int]) -> list[dict]:
    return run_distributed(_hpz_run, 2, frozen_bits)


def _plain_policy() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = _PolicyAndReward()
    opt = torch.optim.AdamW(model.policy.parameters(), lr=1e-2)
    for step in range(3):
        x, y = _batch(step)
        F.mse_loss(model.policy(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("policy.")}


@pytest.mark.parametrize("frozen_bits", [None, 8])
def test_frozen_secondaries_survive_a_step(frozen_bits: Optional[int]) -> None:
    ranks = _hpz(frozen_bits)
    want = _plain_policy()
    tol = {} if frozen_bits is None else {"rtol": 0, "atol": 3e-2}  # INT8 codes: within their rounding
    torch.manual_seed(0)
    reward = _PolicyAndReward().reward
    for got in ranks:
        rows = got["rows"]
        # The first forward of each model gathers across partitions (nothing kept yet); after a
        # step the policy's does again (stepped: its secondaries dropped), the reward's never.
        assert rows[0]["reward"] > 0 and all(r["policy"] > 0 for r in rows)
        assert [r["reward"] for r in rows[1:]] == [0, 0]
        with torch.no_grad():
            for row in rows:  # the kept secondaries hold the frozen values
                torch.testing.assert_close(row["scores"], reward(row["x"]), **tol)
        for name, value in want.items():
            torch.testing.assert_close(got["weights"][name], value, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("frozen_bits", [None, 8])
def test_a_load_or_an_edit_refreshes_frozen_secondaries(frozen_bits: Optional[int]) -> None:
    """The values after ``load_state_dict`` of new frozen weights, then after an in-place edit,
    are the new ones in the next forward (INT8 codes: within their rounding)."""
    tol = {} if frozen_bits is None else {"rtol": 0, "atol": 3e-2}
    for got in _hpz(frozen_bits):
        torch.manual_seed(0)
        reward = _PolicyAndReward().reward
        reward.load_state_dict({k.removeprefix("reward."): v for k, v in _reward_weights(7).items()})
        with torch.no_grad():
            torch.testing.assert_close(got["loaded"], reward(got["x"]), **tol)
            for p in reward.parameters():
                p.mul_(-1.0)
            torch.testing.assert_close(got["edited"], reward(got["x"]), **tol)


class _GAN(nn.Module):
    """A generator and a discriminator small enough to be one unit, one flat group, when grouped."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
        self.d = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.d(self.g(z))


def _gan(engine_options: Optional[dict]) -> dict[str, torch.Tensor]:
    """The usual GAN loop: D's zero_grad, backward and step, then G's, whose loss flows back
    through D (so D's slices of the shared group receive G's loss too); once, G's gradient
    accumulates over a second backward before the next zero_grad."""
    torch.manual_seed(0)
    model = _GAN()
    opt_g = torch.optim.SGD(model.g.parameters(), lr=0.1, momentum=0.9)
    opt_d = torch.optim.Adam(model.d.parameters(), lr=0.01)
    engine = None
    if engine_options is not None:
        engine = ZeroEngine(model, **engine_options)
        assert len(engine.groups) == 1, [g.names for g in engine.groups]
        opt_g, opt_d = engine.shard_optimizer(opt_g), engine.shard_optimizer(opt_d)
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        z, real = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
        opt_d.zero_grad()
        (F.softplus(-model.d(real)).mean() + F.softplus(model.d(model.g(z).detach())).mean()).backward()
        opt_d.step()
        opt_g.zero_grad()
        F.softplus(-model(z)).mean().backward()
        opt_g.step()
        if step == 1:
            F.softplus(-model(z)).mean().backward()
    if engine is None:
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    with engine.gathered():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_a_gan_in_one_flat_group_trains_as_plain_pytorch(offload: Optional[str]) -> None:
    """Grouped, a GAN's generator and discriminator share one flat group: each optimizer's step and
    zero_grad consume only its own parameters' gradients, the other's keep accumulating (G's loss
    reaches D's parameters), as each ``.grad`` does in torch: the weights equal plain PyTorch's
    exactly, with the optimizers on the device and offloaded to the host (stepped in the background)."""
    from lightning_zinf import OffloadConfig

    want = _gan(None)
    got = _gan({"prefetch": PrefetchConfig(unit_size=10_000),
                "offload": OffloadConfig(optimizer=offload) if offload else OffloadConfig()})
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
