"""Units sized automatically (issue 42): without ``block_classes`` the engine groups modules into
units of at most ``unit_size`` elements (:mod:`lightning_zinf.engine.grouping`).

The grouping is checked against the module tree itself (every unit's parameters are one module's
subtree, no larger than the size, and no larger subtree would have fitted), the default size
(the prefetch bucket) alike on every rank, the training against a single-process
PyTorch run of a ``transformers`` T5 that nobody grouped by hand, and the memory bound by the
engine's ledger at two depths.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zinf import PrefetchConfig, ZeroEngine
from lightning_zinf.engine.grouping import auto_blocks
from tests import models
from tests.harness import run_distributed


def _subtree(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class _Experts(nn.Module):
    """A stack whose experts sit in a ModuleList (a container: no forward of its own)."""

    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.router = nn.Linear(d, n)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d)) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.router(x).softmax(-1)
        return sum(w.unsqueeze(-1) * e(x) for w, e in zip(weights.unbind(-1), self.experts))


@pytest.mark.parametrize("unit_size", [100, 2_000, 20_000, 10**9])
def test_the_blocks_are_the_largest_subtrees_within_the_size(unit_size: int) -> None:
    """Every run is consecutive siblings (in their parent's order, layers without parameters
    aside), each a module with a forward, together at most ``unit_size`` elements, packed
    greedily (a run and the next sibling's would not fit together); no run holds another's
    module; the root is in none; and every module outside the runs that owns parameters in its
    subtree is over the size or has no forward (a container), so grouping it would be wrong or
    too large."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), _Experts(6, 32), nn.LayerNorm(32), _Experts(3, 32), nn.Linear(32, 4))
    runs = auto_blocks(model, unit_size)
    parent = {id(c): m for m in model.modules() for c in m.children()}
    members = {id(m) for run in runs for m in run}
    assert id(model) not in members
    inside: set[int] = set()
    for run in runs:
        siblings = [c for c in parent[id(run[0])].children() if _subtree(c)]
        first = next(i for i, c in enumerate(siblings) if c is run[0])
        assert siblings[first:first + len(run)] == run  # consecutive, in order
        assert sum(_subtree(m) for m in run) <= unit_size
        for module in run:
            assert type(module).forward is not nn.Module.forward and id(module) not in inside
            inside.update(id(m) for m in module.modules() if m is not module)
        following = siblings[first + len(run):first + len(run) + 1]
        if following and id(following[0]) in members:  # the next run could not have joined this one
            assert sum(_subtree(m) for m in run) + _subtree(following[0]) > unit_size
    for module in model.modules():
        if id(module) in members or id(module) in inside or module is model or _subtree(module) == 0:
            continue
        assert _subtree(module) > unit_size or type(module).forward is nn.Module.forward, module
    assert auto_blocks(model, unit_size) == runs  # the same walk every time
    if unit_size >= 10**9:  # one run of every child
        assert runs == [list(model.children())]
    if unit_size == 20_000:  # the experts of a mixture packed together, not one unit each
        assert any(len(run) > 1 for run in runs)


def _experts_engine(rank: int, world: int, unit_size: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), _Experts(6, 32), nn.LayerNorm(32), nn.Linear(32, 4))
    engine = ZeroEngine(model, prefetch=PrefetchConfig(unit_size=unit_size, persistence_threshold=0))
    optimizer = engine.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    losses, gathered = [], []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        engine.comm.bytes.reset()
        loss = torch.nn.functional.mse_loss(model(x[rank::world]), y[rank::world])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        gathered.append(engine.comm.bytes.gathered)
    return {"losses": losses, "gathered": gathered, "units": [u.name for u in engine.units]}


def test_a_run_of_siblings_is_gathered_once_for_all_of_them() -> None:
    """Six experts packed into runs of three: each run is one unit, gathered once for the forward
    of all its experts and once for their backward (the trace keeps it between two members), so
    a step gathers no more than with a unit per module, not once per member; and the training is
    the same, bit for bit."""
    expert = sum(p.numel() for p in nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)).parameters())
    packed = run_distributed(_experts_engine, 2, 3 * expert)
    single = run_distributed(_experts_engine, 2, 0)  # a unit per module
    assert "1.experts.0..1.experts.2" in packed[0]["units"], packed[0]["units"]
    assert not any(".." in name for name in single[0]["units"])
    for a, b in zip(packed, single):
        assert a["losses"] == b["losses"]
        assert a["gathered"][-1] <= b["gathered"][-1], (a, b)  # replayed steps: no extra gather


def test_engine_units_follow_the_blocks_and_the_size_zero_keeps_a_unit_per_module() -> None:
    assert PrefetchConfig().unit_size is None  # the default: units of the prefetch bucket's size
    torch.manual_seed(0)
    model = models.GPT(d=64, layers=4, vocab=64, heads=2)
    block = _subtree(model.blocks[0])
    grouped = ZeroEngine(model, prefetch=PrefetchConfig(unit_size=block))
    assert [u.name for u in grouped.units if u.name.startswith("blocks")] == [f"blocks.{i}" for i in range(4)]
    torch.manual_seed(0)
    per_module = ZeroEngine(models.GPT(d=64, layers=4, vocab=64, heads=2), prefetch=PrefetchConfig(unit_size=0))
    assert "blocks.0.qkv" in [u.name for u in per_module.units]
    assert grouped.unit_size == block and per_module.unit_size == 0
    with pytest.raises(ValueError, match="unit_size"):
        PrefetchConfig(unit_size=-1)


def _sized(rank: int, world: int, bucket_size: int) -> dict:
    torch.manual_seed(0)
    engine = ZeroEngine(models.GPT(d=64, layers=24, vocab=64, heads=2),
                        prefetch=PrefetchConfig(bucket_size=bucket_size, unit_size=None))
    return {"unit_size": engine.unit_size, "units": [u.name for u in engine.units]}


def test_units_sized_by_the_bucket_are_the_same_on_every_rank() -> None:
    """``unit_size=None`` takes the prefetch bucket, on every rank alike (a divergent grouping
    would pair different collectives): units of two blocks each with a bucket of two blocks' elements,
    a unit per module with no bucket, and no unit larger than the bucket."""
    torch.manual_seed(0)
    model = models.GPT(d=64, layers=24, vocab=64, heads=2)
    pair = 2 * _subtree(model.blocks[0])
    results = run_distributed(_sized, 2, pair)
    assert [r["unit_size"] for r in results] == [pair, pair]
    assert results[0]["units"] == results[1]["units"]
    assert "blocks.0..blocks.1" in results[0]["units"] and "blocks.22..blocks.23" in results[0]["units"], results[0]
    assert [r["unit_size"] for r in run_distributed(_sized, 2, 0)] == [0, 0]


def _t5(rank: int, world: int, steps: int) -> dict:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=128, d_model=32, d_ff=64, d_kv=8, num_layers=2, num_decoder_layers=2, num_heads=4,
                      dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config)
    if world > 1:
        # Units of at most 3,000 elements: T5's attention projections and layer norms packed
        # into runs, its embedding (tied to the head) a unit of its own.
        engine = ZeroEngine(model, prefetch=PrefetchConfig(unit_size=3000, persistence_threshold=0))
        optimizer = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
        units = len(engine.units)
    else:
        optimizer, units = torch.optim.AdamW(model.parameters(), lr=1e-2), 0
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randint(2, 128, (4, 12), generator=g), torch.randint(2, 128, (4, 6), generator=g)
        rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
        loss = model(input_ids=x[rows], labels=y[rows]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    runs = [u.name for u in engine.units if u.run] if world > 1 else []
    return {"losses": losses, "units": units, "runs": runs,
            "modules": sum(1 for m in model.modules() if m._parameters)}


def test_a_transformers_t5_without_block_classes_trains_as_plain_pytorch() -> None:
    """T5 from ``transformers`` with no ``block_classes``: the engine groups its modules itself
    (fewer units than modules with parameters, some of them runs of siblings), and two ranks'
    mean loss per step equals a single process's over the whole batch (fp32, within the order of
    the mean's additions)."""
    reference = _t5(0, 1, 4)["losses"]
    ranks = run_distributed(_t5, 2, 4)
    assert 0 < ranks[0]["units"] < ranks[0]["modules"] and ranks[0]["runs"], ranks[0]
    mean = [sum(r["losses"][s] for r in ranks) / 2 for s in range(4)]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(reference), rtol=1e-5, atol=0)


def _gathered_peak(rank: int, world: int, depth: int) -> dict:
    torch.manual_seed(0)
    model = models.GPT(vocab=64, d=64, layers=depth, heads=2, seq=16)
    # The bucket: three blocks' elements, so that the automatic size makes units of a few blocks.
    bucket = 3 * sum(p.numel() for p in model.blocks[0].parameters())
    engine = ZeroEngine(model, prefetch=PrefetchConfig(persistence_threshold=0, bucket_size=bucket, unit_size=None))
    optimizer = engine.shard_optimizer(torch.optim.SGD(model.parameters(), lr=1e-2))
    for step in range(2):  # the second replays the prefetch trace
        engine.reset_memory_peaks()
        models.accumulate_step(model, rank, world, step, 4, 1)
        optimizer.step()
        optimizer.zero_grad()
    unit = max(sum(g.full.numel() * g.full.element_size() for g in u.groups) for u in engine.units)
    return {"gathered": engine.memory()["gathered"][1], "unit": unit, "unit_size": engine.unit_size}


def test_the_memory_bound_holds_with_units_sized_automatically() -> None:
    """ZeRO-3's bound with units sized automatically (the bucket), which does not depend on the model's: the
    gathered parameter bytes at their peak do not grow from 12 to 24 blocks beyond one unit, and
    stay a few units (the one in use, the next, the tied embedding)."""
    peaks = {depth: run_distributed(_gathered_peak, 2, depth)[0] for depth in (12, 24)}
    shallow, deep = peaks[12], peaks[24]
    assert deep["gathered"] <= shallow["gathered"] + deep["unit"], peaks
    assert deep["gathered"] <= 4 * deep["unit"], peaks


class _Generator(nn.Module):
    """A model whose ``generate`` calls its encoder without its own forward (as ``transformers``'
    encoder-decoders do), and whose forward uses both parts."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder[2](torch.tanh(self.encoder[0](x)))


class _Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = _Generator()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def test_a_module_called_without_its_units_forward_gathers_the_unit() -> None:
    """The whole inner model fits one unit, which its forward gathers; its ``generate`` calls
    the encoder's layers directly, without that forward: they gather the unit themselves (and
    the values are the model's), and training through them and through the forward matches
    plain PyTorch."""
    torch.manual_seed(0)
    reference = _Wrapper()
    torch.manual_seed(0)
    wrapped = _Wrapper()
    engine = ZeroEngine(wrapped, prefetch=PrefetchConfig(unit_size=10_000, persistence_threshold=0))
    assert [u.name for u in engine.units] == ["model"]
    ours = engine.shard_optimizer(torch.optim.SGD(wrapped.parameters(), lr=0.1))
    theirs = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        for model, optimizer in ((wrapped, ours), (reference, theirs)):
            loss = model(x).square().mean() + model.model.generate(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():
            torch.testing.assert_close(wrapped.model.generate(x), reference.model.generate(x))
    assert engine.units[0].state == "released"


def test_a_memory_budget_plans_the_units_the_engine_will_group() -> None:
    """``memory_budget`` with the default unit size: the plan (also the strategy's preview,
    ``memory_plan()``) predicts the units the engine groups (of the bucket's size), not a unit
    per module."""
    from lightning_zinf import MixedPrecisionConfig, meta_parameters
    from lightning_zinf.engine_setup import memory_plan
    from lightning_zinf.options import ZeroOptions

    with meta_parameters():
        model = models.GPT(d=64, layers=4, vocab=64, heads=2)

    def plan(unit_size):
        return memory_plan(model, ZeroOptions(memory_budget="1GiB", prefetch=PrefetchConfig(unit_size=unit_size)),
                           device=torch.device("cpu"), precision=MixedPrecisionConfig())

    default, as_built, per_module = plan(None), plan(PrefetchConfig().bucket_size), plan(0)
    assert default.prediction == as_built.prediction
    assert default.prediction != per_module.prediction


class _Containers(nn.Module):
    """Parameters held in a ParameterList and a ParameterDict, which are never called: the
    module holding them reads them in its own forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rows = nn.ParameterList(nn.Parameter(torch.randn(2, 8) * 0.3) for _ in range(4))
        self.extra = nn.ParameterDict({"scale": nn.Parameter(torch.ones(8)), "shift": nn.Parameter(torch.zeros(8))})
        self.banks = nn.ModuleList([nn.ParameterList([nn.Parameter(torch.randn(8) * 0.1)])])  # one level deeper
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x @ torch.cat(list(self.rows)).T * self.extra["scale"] + self.extra["shift"] + self.banks[0][0]
        return self.out(torch.tanh(hidden))


def _containers_model() -> nn.Module:
    # Below the root, whose own unit stays gathered: the holder's unit is gathered by its forward.
    model = nn.Sequential(_Containers(), nn.Tanh(), nn.Linear(3, 2))
    return model


def _containers(rank: int, world: int, unit_size: int) -> dict:
    model = _containers_model()
    engine = ZeroEngine(model, prefetch=PrefetchConfig(unit_size=unit_size, persistence_threshold=0))
    opt = engine.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    losses = []
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "units": [u.name for u in engine.units]}


@pytest.mark.parametrize("unit_size", [0, None], ids=["unit-per-module", "grouped"])
def test_parameter_containers_belong_to_the_unit_of_the_module_that_holds_them(unit_size) -> None:
    """A ParameterList and a ParameterDict (and a ParameterList in a ModuleList) are never called,
    so with a unit per module their parameters are in the unit of the module holding them (a unit
    of their own was never gathered:
    the forward read empty tensors and raised); 2 ranks train as single-process PyTorch on both
    ranks' batches."""
    ranks = run_distributed(_containers, 2, unit_size)
    model = _containers_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    want = []
    for step in range(3):
        xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(2)]
        losses = [model(x).square().mean() for x in xs]
        (sum(losses) / 2).backward()
        opt.step()
        opt.zero_grad()
        want.append(torch.stack([loss.detach() for loss in losses]))
    for rank, got in enumerate(ranks):
        torch.testing.assert_close(got["losses"], torch.stack(want)[:, rank], rtol=1e-5, atol=1e-6)
        assert not any(name.startswith(("0.rows", "0.extra", "0.banks")) for name in got["units"]), got["units"]
