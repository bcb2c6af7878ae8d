"""Ranks that run different modules keep training, with DDP's result (issue 38, deliverable 5).

Each case runs on 2 gloo ranks with no ``block_classes`` (a unit per module), and is compared with
DDP's arithmetic computed in this process in plain PyTorch: each step, the gradient is the mean over
ranks of the gradient of each rank's loss on its own data, through the modules that rank ran (a rank
that did not use a parameter contributes zero, as DDP with ``find_unused_parameters`` does).
The cases are those anchors' users report as hangs: a module called once on rank 0 and three times
on rank 1 (DeepSpeed #7998), MoE experts that get no tokens on some ranks, a data-dependent early
exit, and branches that diverge only in some steps, after the ranks agreed on a trace.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_zinf import PrefetchConfig, ZeroEngine
from tests.harness import run_distributed

WORLD = 2
STEPS = 6
NO_PERSIST = PrefetchConfig(persistence_threshold=0, unit_size=0)  # a unit per module: ranks part at modules


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


class RepeatedHead(nn.Module):
    """DeepSpeed #7998: the head runs once on rank 0 and three times on rank 1 (from step 2 on:
    the first steps agree, so later passes replay an agreed trace and leave it)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8)
        self.rank = 0
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        for _ in range(3 if self.rank == 1 and self.step >= 2 else 1):
            h = torch.tanh(self.head(h))
        return h


class Interleaved(nn.Module):
    """A head and a middle layer taking turns, three times on rank 0 and twice on rank 1: rank 1's
    backward asks for the middle layer while it holds the head, which rank 0's forward asks for
    then (rank 1 serves it without touching the head it uses)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8)
        self.mid = nn.Linear(8, 8)
        self.rank = 0
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        for turn in range(3 if self.rank % 2 == 0 else 2):
            if turn:
                h = torch.tanh(self.mid(h))
            h = torch.tanh(self.head(h))
        return h


class Branches(nn.Module):
    """A branch over units of the same size, by rank and step: the same on both ranks in the first
    steps (a trace is agreed), then different (rank 0 takes ``p``, rank 1 ``q``), the same, different."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.p = nn.Linear(8, 8)
        self.q = nn.Linear(8, 8)
        self.rank = 0
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        diverge = self.step in (3, 5)
        return self.p(h) if (self.rank == 0 or not diverge) else self.q(h)


class MoE(nn.Module):
    """Top-1 routing over four experts: on some ranks and steps an expert gets no tokens and is
    not called at all (the MoE hang of DeepSpeed's users)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.router = nn.Linear(8, 4)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.rank = 0
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        choice = self.router(h).argmax(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            mask = choice == e
            if mask.any():
                out = out.index_put((mask.nonzero().squeeze(1),), expert(h[mask]))
        return out + h


class EarlyExit(nn.Module):
    """Layer skipping: the stack ends after a number of layers that is the same on every rank in
    the first steps, then differs by rank and step."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(5))
        self.out = nn.Linear(8, 8)
        self.rank = 0
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        limit = 3 if self.step < 3 else 2 + (self.rank + self.step) % 3
        for i, layer in enumerate(self.layers):
            h = torch.tanh(layer(h)) + h
            if i + 1 >= limit:
                break
        return self.out(h)


def _set(model: nn.Module, rank: int, step: int) -> None:
    model.rank, model.step = rank, step


def _zinf(rank: int, world: int, build: Callable[[], nn.Module], steps: int, prefetch: PrefetchConfig,
          options: Optional[dict] = None, observe: Optional[Callable[[ZeroEngine, nn.Module], Callable[[], Any]]] = None
          ) -> dict:
    """Train ``build()`` under the engine; ``observe(engine, model)``, given, returns what to call
    after each step to record something of it (``"records"``)."""
    torch.manual_seed(0)
    model = build()
    engine = ZeroEngine(model, prefetch=prefetch, **(options or {}))
    optimizer = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    record = observe(engine, model) if observe is not None else None
    losses, records = [], []
    for step in range(steps):
        _set(model, rank, step)
        x, y = _batch(rank, step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if record is not None:
            records.append(record())
    with engine.gathered():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "negotiated": engine.agreement.negotiation.departed_passes,
            "units": len(engine.units), "records": records}


def _ddp_reference(build: Callable[[], nn.Module], steps: int) -> dict:
    """DDP's arithmetic: each step, the mean over ranks of each rank's gradient, then one step."""
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses: list[list[float]] = [[] for _ in range(WORLD)]
    for step in range(steps):
        for rank in range(WORLD):
            _set(model, rank, step)
            x, y = _batch(rank, step)
            loss = F.mse_loss(model(x), y)
            (loss / WORLD).backward()
            losses[rank].append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("build", [RepeatedHead, Interleaved, Branches, MoE, EarlyExit],
                         ids=["head-once-vs-three-times", "interleaved", "branches", "moe-empty-experts", "early-exit"])
def test_ranks_running_different_modules_train_as_ddp(build: Callable[[], nn.Module]) -> None:
    """Every rank ends each step with DDP's losses and parameters (AdamW, so a wrong or missing
    gradient anywhere shows), including steps that leave a trace all ranks had agreed on."""
    ranks = run_distributed(_zinf, WORLD, build, STEPS, NO_PERSIST, timeout=240)
    want = _ddp_reference(build, STEPS)
    for rank, got in enumerate(ranks):
        assert got["losses"] == pytest.approx(want["losses"][rank], rel=1e-5), rank
        for name, value in want["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {name}")
    assert ranks[0]["negotiated"] > 0  # the ranks did run different modules


@pytest.mark.parametrize("world, options, tolerance, atol", [
    (2, {"offload": {"param": "cpu", "optimizer": "cpu"}}, 1e-5, 1e-6),
    (2, {"offload": {"param": "nvme", "optimizer": "cpu", "nvme_path": "NVME"}}, 1e-5, 1e-6),
    (4, {"zero_pp": {"ranks_per_node": 2, "hpz": True}}, 1e-5, 1e-6),
    # INT8 weights and INT4 gradients: AdamW turns a small gradient's quantization error into a
    # step of up to lr (1e-2) the other way; four steps bound the weights' difference.
    (2, {"zero_pp": {"qwz": True, "qgz": True}}, 3e-2, 8e-2),
], ids=["cpu-offload", "nvme-parameters", "hpz-4-ranks", "qwz-qgz"])
def test_ranks_running_different_modules_with_offload_and_zero_pp(world: int, options: dict, tolerance: float,
                                                                   atol: float, tmp_path) -> None:
    """The interleaved case (served gathers of units in use, zero reduce-scatters) with the shards
    offloaded to the host or NVMe, hpZ's secondary partitions at 4 ranks on 2 "nodes" (gathers
    that only some ranks ask for are exact, since the ranks' secondary partitions then differ), and
    qwZ/qgZ's quantized collectives (within their error band): DDP's result at every rank count."""
    from lightning_zinf import OffloadConfig, ZeroPPConfig

    built = {}
    for key, value in options.items():
        value = {k: (str(tmp_path) if v == "NVME" else v) for k, v in value.items()}
        built[key] = OffloadConfig(**value) if key == "offload" else ZeroPPConfig(**value)
    ranks = run_distributed(_zinf, world, Interleaved, 4, NO_PERSIST, built, timeout=300)
    want = _ddp_reference_world(Interleaved, 4, world)
    for rank, got in enumerate(ranks):
        assert got["losses"] == pytest.approx(want["losses"][rank], rel=tolerance), rank
        for name, value in want["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=tolerance, atol=atol, msg=f"rank {rank}: {name}")


def _ddp_reference_world(build: Callable[[], nn.Module], steps: int, world: int) -> dict:
    """:func:`_ddp_reference` at another world size (ranks above 1 take rank 1's branch)."""
    torch.manual_seed(0)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses: list[list[float]] = [[] for _ in range(world)]
    for step in range(steps):
        for rank in range(world):
            _set(model, rank, step)
            x, y = _batch(rank, step)
            loss = F.mse_loss(model(x), y)
            (loss / world).backward()
            losses[rank].append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _step_on_rank0_only(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = Branches()
    engine = ZeroEngine(model, prefetch=NO_PERSIST)
    optimizer = engine.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _batch(rank, 0)
    try:
        F.mse_loss(model(x), y).backward()
        if rank == 0:
            optimizer.step()
        else:
            F.mse_loss(model(x), y).backward()  # another micro-batch where rank 0 steps
            optimizer.step()
    except RuntimeError as error:
        return str(error)
    return "stepped"


def test_ranks_at_different_steps_stop_with_each_ranks_place_named() -> None:
    """What cannot be served: rank 0 steps the optimizer while rank 1 runs another backward (the
    ranks would reach different steps). Every rank raises, naming where each rank is, instead of
    hanging (DDP would hang in its gradient all-reduce)."""
    messages = run_distributed(_step_on_rank0_only, WORLD, timeout=120)
    for message in messages:
        assert "Ranks diverged: rank 0 is at an optimizer step, rank 1 is at the end of backward" in message, message


def _gpt2() -> nn.Module:
    import transformers

    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                                     bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # each rank draws its own dropout
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _prompt(rank: int) -> torch.Tensor:
    return torch.randint(1, 64, (1, 5), generator=torch.Generator().manual_seed(rank))


def _generate_then_train(rank: int, world: int) -> dict:
    model = _gpt2()
    engine = ZeroEngine(model, prefetch=NO_PERSIST)
    optimizer = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    model.eval()
    with torch.no_grad():  # each rank to its own length, without synced_gpus: no collective per token
        tokens = model.generate(_prompt(rank), max_new_tokens=3 + 5 * rank, do_sample=False, synced_gpus=False)
    model.train()
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    with engine.gathered():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"tokens": tokens, "loss": loss.item(), "params": params}


def test_generate_to_different_lengths_without_synced_gpus_then_train() -> None:
    """``generate()`` to 3 new tokens on rank 0 and 8 on rank 1, without ``synced_gpus`` (each
    decode step is a pass of its own; the rank that finishes first goes on to its training step
    and serves the other's decode steps from there), then a training step on what each generated:
    each rank's tokens are the unpartitioned model's, and the step is DDP's (the mean of the two
    ranks' gradients)."""
    ranks = run_distributed(_generate_then_train, WORLD, timeout=240)
    reference = _gpt2()
    reference.eval()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for rank, got in enumerate(ranks):
        with torch.no_grad():
            want = reference.generate(_prompt(rank), max_new_tokens=3 + 5 * rank, do_sample=False)
        assert torch.equal(got["tokens"], want), rank
    reference.train()
    for rank, got in enumerate(ranks):
        loss = reference(input_ids=got["tokens"], labels=got["tokens"]).loss
        assert got["loss"] == pytest.approx(loss.item(), rel=1e-5), rank
        (loss / WORLD).backward()
    optimizer.step()
    for name, value in reference.named_parameters():
        for rank, got in enumerate(ranks):
            torch.testing.assert_close(got["params"][name], value.detach(), rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {name}")


def _lightning_run(rank: int, world: int, strategy: str) -> dict:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class Lit(L.LightningModule):
        """Rank 0 runs an extra module in each validation step (rendering samples, say), outside
        the model's forward; every rank logs with ``sync_dist``."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body = nn.Linear(8, 8)
            self.head = nn.Linear(8, 8)
            self.extra = nn.Linear(8, 8)
            self.val_losses: list[float] = []
            self.samples: list[torch.Tensor] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.body(x)))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.mse_loss(self(x), y)
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            out = self(x)
            if self.global_rank == 0:
                self.samples.append(self.extra(out).sum())
            self.log("val_loss", F.mse_loss(out, y), sync_dist=True)

        def on_validation_epoch_end(self) -> None:
            self.val_losses.append(self.trainer.callback_metrics["val_loss"].item())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def data(seed: int) -> DataLoader:
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
        return DataLoader(TensorDataset(x[rank::world], y[rank::world]), batch_size=4)

    lit = Lit()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, use_distributed_sampler=False)
    trainer.fit(lit, data(1), data(2))
    context = trainer.strategy.gathered_parameters() if strategy == "zero_infinity" else torch.no_grad()
    with context:
        params = {n: p.detach().clone() for n, p in lit.named_parameters()}
    return {"val": lit.val_losses, "samples": [s.item() for s in lit.samples], "params": params}


def test_a_validation_step_with_modules_on_rank_0_only_runs_as_under_ddp() -> None:
    """Lightning's Trainer, two epochs with validation in which rank 0 alone runs an extra module
    and every rank logs with ``sync_dist``: the logged validation losses, rank 0's extra outputs
    and the trained weights are DDP's (the other rank serves rank 0's gathers while it waits at
    the logging collective)."""
    zinf = run_distributed(_lightning_run, WORLD, "zero_infinity", init_pg=False, timeout=300)
    ddp = run_distributed(_lightning_run, WORLD, "ddp_find_unused_parameters_true", init_pg=False, timeout=300)
    assert zinf[0]["val"] == pytest.approx(ddp[0]["val"], rel=1e-5)
    assert len(zinf[0]["samples"]) == 4 and zinf[0]["samples"] == pytest.approx(ddp[0]["samples"], rel=1e-5)
    for name, value in ddp[0]["params"].items():
        for rank in zinf:
            torch.testing.assert_close(rank["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)


class LateBranches(Branches):
    """``Branches`` diverging in step 4 only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.q(h) if self.rank == 1 and self.step == 4 else self.p(h)


def _rounds_per_collective(rank: int, world: int) -> dict:
    """Train ``LateBranches``: steps 0-3 agree (the trace is recorded, checked once, then
    followed), step 4 diverges. Counts the control plane's rounds (all-gathers) and all its
    exchanges (rounds, flags and checks alike: each is one small collective that every rank
    waits in) per step."""
    torch.manual_seed(0)
    model = LateBranches()
    engine = ZeroEngine(model, prefetch=NO_PERSIST)
    optimizer = engine.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    comm = engine.comm
    counts = {"rounds": 0, "exchanges": 0}
    gather_ints, exchange, any_rank = comm.all_gather_ints, comm.exchange, comm.any_rank

    def counted(name: str, fn: Callable) -> Callable:
        def call(*args):
            counts[name] += 1
            return fn(*args)
        return call

    # (An instance attribute: the rounds, flags and checks all call it through self.)
    comm.all_gather_ints, comm.exchange = counted("rounds", gather_ints), counted("exchanges", exchange)
    comm.any_rank = counted("exchanges", any_rank)
    steps = []
    for step in range(6):
        before = dict(counts, collectives=engine.collectives_issued)
        _set(model, rank, step)
        x, y = _batch(rank, step)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        steps.append({k: (engine.collectives_issued if k == "collectives" else counts[k]) - v for k, v in before.items()})
    return {"steps": steps}


def test_a_step_on_the_trace_checks_nothing_per_collective_and_one_that_diverges_one_round_each() -> None:
    """The cost, counted: a step that follows the agreed trace makes no round at all and one
    exchange at each of its meeting points (the pass start, the end of backward, the optimizer
    step), which carries the checks made there too (the collectives issued, the trace, the mode,
    the gradients received), however many collectives it issues; the step that diverges makes at
    most one round per collective plus one per meeting point."""
    steps = run_distributed(_rounds_per_collective, WORLD, timeout=120)[0]["steps"]
    on_trace = steps[3]  # step 0 records the trace, step 1 checks it once (writing the script)
    # Two gathers (each unit stays gathered from its forward into its backward: the model is
    # within the prefetch bucket) and two reduce-scatters.
    assert on_trace["rounds"] == 0 and on_trace["collectives"] == 4, steps
    assert on_trace["exchanges"] == 3, steps
    diverged = steps[4]
    assert 0 < diverged["rounds"] <= diverged["collectives"] + 3, steps


def _experts_and_flag_reduces(engine: ZeroEngine, model: nn.Module) -> Callable[[], tuple[list[int], int]]:
    """Per step: the experts this rank ran, and how often the engine agreed on the received
    gradients by an all-reduce of their flags."""
    calls, any_rank, ran = [0], engine.comm.any_rank, []

    def counted(flags: list) -> list:
        calls[0] += 1
        return any_rank(flags)

    engine.comm.any_rank = counted
    for e, expert in enumerate(model.experts):
        expert.register_forward_hook(lambda *_, e=e: ran.append(e))

    def step() -> tuple[list[int], int]:
        seen = (sorted(ran), calls[0])
        ran.clear()
        calls[0] = 0
        return seen

    return step


def test_experts_unused_on_one_rank_inside_a_replayed_unit_get_the_other_ranks_gradient() -> None:
    """The end of backward agrees on which parameters received a gradient within its meeting's
    exchange when every rank's flags are the same, and by an all-reduce of the flags when they
    differ: an expert that only some ranks ran, inside a unit every rank gathers (``MoE`` as one
    unit, its class a block, so the pass stays on its trace), is stepped with the mean gradient
    on every rank, as under DDP."""
    ranks = run_distributed(_zinf, WORLD, MoE, STEPS, NO_PERSIST, {"block_classes": [MoE]},
                            _experts_and_flag_reduces, timeout=120)
    want = _ddp_reference(MoE, STEPS)
    for got in ranks:
        got["experts"], got["flag_reduces"] = (list(column) for column in zip(*got["records"]))
    for rank, got in enumerate(ranks):
        assert got["units"] == 1 and got["negotiated"] == 0, got
        assert got["losses"] == pytest.approx(want["losses"][rank], rel=1e-5), rank
        for name, value in want["params"].items():
            torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {name}")
    # From step 2 on the passes follow their script (step 0 records the trace, step 1 writes the
    # script): the flags travel alone exactly in the steps whose ranks ran different experts.
    differ = [a != b for a, b in zip(ranks[0]["experts"], ranks[1]["experts"])]
    assert any(differ[2:]) and not all(differ[2:]), ranks[0]["experts"]  # both cases occur
    for got in ranks:
        assert got["flag_reduces"][2:] == [int(d) for d in differ[2:]], (got["flag_reduces"], differ)


def _predict_uneven(rank: int, world: int, strategy: str, budget: int = 0, samples: int = 5) -> list:
    import lightning as L
    from torch.utils.data import DataLoader

    if budget:
        from lightning_zinf import ZeroInfinityStrategy

        strategy = ZeroInfinityStrategy(prefetch={"inference_budget": budget, "persistence_threshold": 0,
                                                  "unit_size": 0})

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

        def predict_step(self, batch, batch_idx):
            return self.net(batch)

    data = torch.randn(samples, 4, generator=torch.Generator().manual_seed(3))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    return [p.clone() for p in trainer.predict(Lit(), DataLoader(data, batch_size=1))]


@pytest.mark.parametrize("budget, samples", [(0, 5), (200, 5), (1 << 30, 3)],
                         ids=["no-budget", "part-kept", "whole-kept"])
def test_a_predict_loop_whose_batches_do_not_split_evenly_runs_as_under_ddp(budget: int, samples: int) -> None:
    """``trainer.predict`` over 5 samples on 2 ranks (Lightning's predict sampler does not pad:
    rank 0 has 3 steps, rank 1 two, as a new user's run had): rank 1 serves rank 0's last step from
    the end of its loop, and every rank returns DDP's predictions (it crashed, rank 1's process
    gone while rank 0 waited in a gather). Also with units kept from step to step of the loop
    (``inference_budget``: one unit of two over 5 samples, or the whole model over 3: 2 steps and
    1): the steps' passes still meet and check (a loop's keep left them unchecked: rank 0's last
    step hung, alone in trusted gathers or in a trace's validation)."""
    zinf = run_distributed(_predict_uneven, WORLD, "zero_infinity", budget, samples, init_pg=False, timeout=240)
    ddp = run_distributed(_predict_uneven, WORLD, "ddp", 0, samples, init_pg=False, timeout=240)
    assert [len(r) for r in zinf] == [len(r) for r in ddp] == [(samples + 1) // 2, samples // 2]
    for mine, theirs in zip(zinf, ddp):
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _tracer_after(setup: list[tuple[str, list[int]]]):
    """A one-rank tracer that ran ``setup``'s passes: (kind, units requested), the last one left in
    progress (its recording not yet validated)."""
    from lightning_zinf.comm import Collectives
    from lightning_zinf.engine.trace import Tracer

    tracer = Tracer(Collectives())
    for kind, units in setup:
        tracer.begin_pass(kind)
        for unit in units:
            tracer.request(unit)
    return tracer


@pytest.mark.parametrize("setup", [
    [],  # nothing recorded yet
    [("train", [0, 1])],  # train's first pass, recording
    [("eval", [1])],  # another kind recording
    [("train", [0, 1]), ("eval", [1])],  # train replays, eval recording
    [("train", [0, 1]), ("train", [0, 1])],  # train replaying
    [("train", [0, 1]), ("train", [0, 1]), ("train", [1, 0])],  # train left its trace
    [("train", [])],  # a pass that gathered nothing
], ids=["new", "recording", "other-recording", "replays-other-recording", "replaying", "departed", "empty"])
@pytest.mark.parametrize("agreed", [True, False])
def test_a_pass_start_predicts_whether_its_pass_replays_before_the_ranks_validate_the_recording(
        setup: list[tuple[str, list[int]]], agreed: bool) -> None:
    """What a rank sends at a pass start before knowing whether the ranks validate the previous
    pass's recording (``Tracer.certifies``) is what the tracer then says once it knows: the start
    of a pass checks both answers in one exchange and keeps the one that holds."""
    for kind in ("train", "eval"):
        predicted = _tracer_after(setup).certifies(kind, agreed)
        tracer = _tracer_after(setup)
        tracer.finish(agreed if tracer.pending() is not None else False)
        tracer.begin_pass(kind, finished=True)
        assert predicted == tracer.certified, (kind, agreed)
