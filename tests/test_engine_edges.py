"""Edge cases of the engine, each against plain single-process PyTorch (the reference).

Most run in one process (the engine's collectives become local copies), which exercises the same
hooks, buffers and bookkeeping as several ranks; the parity tests cover the collectives.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_zinf import PrefetchConfig, ZeroEngine, meta_parameters
from tests import models

NO_PERSIST = PrefetchConfig(persistence_threshold=0)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def _train(build, optimizers, steps: int = 3, zero: str = "optimizer", loss_fn=None, engine_kw=None, prepare=None):
    """Train ``build()`` plainly and under the engine (after ``prepare(engine, model)``); return both
    models' final parameters."""
    results = []
    for use_engine in (False, True):
        torch.manual_seed(0)
        model = build()
        engine = ZeroEngine(model, **(engine_kw or {"prefetch": NO_PERSIST})) if use_engine else None
        if engine and prepare:
            prepare(engine, model)
        opts = optimizers(model)
        if engine:
            opts = [engine.shard_optimizer(o) for o in opts]
        for step in range(steps):
            x, y = _batch(step)
            (loss_fn or (lambda m, x, y: F.mse_loss(m(x), y)))(model, x, y).backward()
            for o in opts:
                o.step()
            if zero == "module":
                model.zero_grad()
            else:
                for o in opts:
                    o.zero_grad()
        if engine:
            with engine.gathered():
                results.append({n: p.detach().clone() for n, p in model.named_parameters()})
        else:
            results.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return results


def _assert_same(results, atol: float = 1e-6) -> None:
    reference, zero = results
    for name, value in reference.items():
        torch.testing.assert_close(zero[name], value, atol=atol, rtol=0, msg=name)


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def test_two_optimizers_both_step() -> None:
    _assert_same(_train(TwoLayers, lambda m: [torch.optim.AdamW(m.a.parameters(), lr=1e-2),
                                               torch.optim.AdamW(m.b.parameters(), lr=1e-2)]))


@pytest.mark.parametrize("block", [TwoLayers, "TwoLayers"], ids=["class", "name"])
def test_the_model_itself_as_one_unit(block) -> None:
    """``block_classes`` naming the model's own class (DeepSpeed's leaf-module tests set the whole
    model as a leaf): one unit of every parameter, trained as plain torch. It was refused with
    "matches no module" followed by a list that named the class."""
    results = _train(TwoLayers, lambda m: [torch.optim.AdamW(m.parameters(), lr=1e-2)],
                     engine_kw={"block_classes": [block], "prefetch": NO_PERSIST},
                     prepare=lambda engine, model: _one_unit(engine))
    _assert_same(results)


def _one_unit(engine: ZeroEngine) -> None:
    assert [(u.name, u.numel) for u in engine.units] == [("", 2 * (8 * 8 + 8))]


@pytest.mark.parametrize("zero", ["optimizer", "module"])
def test_gradients_do_not_leak_across_steps(zero: str) -> None:
    """``model.zero_grad()`` (not the optimizer's) and an optimizer over a subset of a unit."""
    _assert_same(_train(TwoLayers, lambda m: [torch.optim.AdamW([m.a.bias, *m.b.parameters()], lr=1e-2)], zero=zero))


class Holder(nn.Module):
    """A parameter used only in the loss, outside every module's forward (like a LightningModule's
    own ``temperature`` used in ``training_step``)."""

    def __init__(self):
        super().__init__()
        self.net = TwoLayers()
        self.extra = nn.Module()
        self.extra.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return self.net(x)


def test_parameter_used_outside_every_forward_gets_its_gradient() -> None:
    loss = lambda m, x, y: F.mse_loss(m(x) * m.extra.scale, y)  # noqa: E731
    _assert_same(_train(Holder, lambda m: [torch.optim.SGD(m.parameters(), lr=0.1)], loss_fn=loss,
                        engine_kw={"prefetch": PrefetchConfig(persistence_threshold=100)}))


class Functional(nn.Module):
    """The parent's forward reads ``b.weight`` directly, outside ``b``'s forward."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        return F.linear(torch.tanh(self.a(x)), self.b.weight)


def test_register_external_parameter() -> None:
    model = Functional()
    ZeroEngine(model, prefetch=NO_PERSIST)
    with pytest.raises(RuntimeError):  # without registering, b.weight is empty in the parent's forward
        model(torch.randn(2, 8))

    _assert_same(_train(Functional, lambda m: [torch.optim.SGD(m.parameters(), lr=0.1)],
                        prepare=lambda e, m: e.register_external_parameter(m, m.b.weight)))


class Queries(nn.Module):
    """Returns a view of its own parameter (learned queries)."""

    def __init__(self):
        super().__init__()
        self.q = nn.Parameter(torch.randn(3, 8))

    def forward(self, x):
        return self.q.expand(x.shape[0], -1, -1)


def test_output_that_is_a_view_of_a_parameter() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Queries())
    reference = model[0].q.detach().clone()
    ZeroEngine(model, prefetch=NO_PERSIST)
    with torch.no_grad():
        out = model(torch.zeros(2, 8))  # the unit is released before this is read
    assert torch.equal(out[1], reference)


@dataclasses.dataclass
class Output:
    hidden: torch.Tensor
    note: str = "x"


class DataclassOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return Output(self.fc(x))


def test_dataclass_outputs_get_the_backward_gather() -> None:
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = DataclassOut()
            self.out = nn.Linear(8, 8)

        def forward(self, x):
            return self.out(torch.tanh(self.inner(x).hidden))

    _assert_same(_train(Net, lambda m: [torch.optim.SGD(m.parameters(), lr=0.1)]))


def test_backward_that_raised_does_not_poison_the_next_step() -> None:
    torch.manual_seed(0)
    model = TwoLayers()
    engine = ZeroEngine(model, prefetch=NO_PERSIST)
    engine.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def boom(grad):
        raise RuntimeError("boom")

    x, y = _batch(0)
    out = model(x)
    out.register_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        F.mse_loss(out, y).backward()
    engine.begin_pass("train")
    F.mse_loss(model(x), y).backward()
    torch.manual_seed(0)
    plain = TwoLayers()
    F.mse_loss(plain(x), y).backward()
    got = torch.cat([f.grad for f in engine.master_fragments()])
    want = torch.cat([p.grad.reshape(-1) for p in plain.parameters()])
    torch.testing.assert_close(got, want)


def test_second_engine_on_the_same_model_is_rejected() -> None:
    model = TwoLayers()
    ZeroEngine(model)
    with pytest.raises(ValueError, match="already partitioned by a ZeroEngine"):
        ZeroEngine(model)


def test_meta_init_of_a_tied_module_before_others_matches_eager() -> None:
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.head = nn.Linear(8, 16, bias=False)
            self.head.weight = self.emb.weight  # head owns no parameter of its own
            self.post = nn.Linear(8, 8)  # built after head: its init depends on head's draws

    torch.manual_seed(0)
    eager = Tied()
    torch.manual_seed(0)
    with meta_parameters():
        meta = Tied()
    engine = ZeroEngine(meta)
    with engine.gathered():
        for name, value in eager.named_parameters():
            assert torch.equal(dict(meta.named_parameters())[name], value), name


def test_write_back_keeps_unedited_fp32_masters() -> None:
    torch.manual_seed(0)
    model = models.MLP().to(torch.bfloat16)
    engine = ZeroEngine(model, prefetch=NO_PERSIST)
    opt = engine.shard_optimizer(torch.optim.SGD(model.parameters(), lr=1e-4))
    x, y = models.make_batch("mlp", 0, 4)
    models.loss_fn(model, x.bfloat16(), y).backward()
    opt.step()
    masters = [g.master.clone() for g in engine.groups]
    with engine.gathered(write_back=True):
        model.fc3.bias.data.fill_(0.5)
    edited = {i for i, g in enumerate(engine.groups) if "fc3.bias" in g.names}
    for i, (group, before) in enumerate(zip(engine.groups, masters)):
        if i not in edited:
            assert torch.equal(group.master, before), group.names
    with engine.gathered():
        assert torch.all(model.fc3.bias == 0.5)


class PartlyUsed(nn.Module):
    """Unit ``a`` holds a parameter its forward never uses: plain torch leaves its ``.grad`` None
    and AdamW skips it (no weight decay); ZeRO must not step it with a zero gradient either."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.a.unused = nn.Parameter(torch.ones(8))
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def test_parameter_without_gradient_is_not_stepped() -> None:
    _assert_same(_train(PartlyUsed, lambda m: [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.5)]))


def _partly_used_rank(rank: int, world: int) -> list[float]:
    torch.manual_seed(0)
    model = PartlyUsed()
    engine = ZeroEngine(model, prefetch=NO_PERSIST)
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.5))
    for step in range(2):
        x, y = _batch(step)
        F.mse_loss(model(x[rank * 2 : rank * 2 + 2]), y[rank * 2 : rank * 2 + 2]).backward()
        opt.step()
        opt.zero_grad()
    with engine.gathered():
        return model.a.unused.tolist()


def test_parameter_without_gradient_is_not_stepped_on_any_rank() -> None:
    from tests.harness import run_distributed

    for values in run_distributed(_partly_used_rank, 2):
        assert values == [1.0] * 8  # untouched everywhere: no rank stepped its slice


def test_single_rank_reduce_keeps_no_second_gradient_buffer() -> None:
    """With one rank the reduce-scatter is the identity: the flat gradient itself is accumulated,
    so a reduce holds one fp32 flat gradient (it held two: the gradient and a copy of it), and
    training matches plain PyTorch."""
    torch.manual_seed(0)
    model, plain = models.GPT(), models.GPT()
    plain.load_state_dict(model.state_dict())
    engine = ZeroEngine(model, block_classes=["Block"])
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for step in range(2):
        engine.reset_memory_peaks()
        for m, o in ((model, opt), (plain, plain_opt)):
            models.loss_fn(m, *models.make_batch("gpt", step, 4)).backward()
            o.step()
            o.zero_grad()
    assert 0 < engine.memory()["reduce_pending"][1] <= max(4 * g.padded_numel for g in engine.groups)
    with engine.gathered():
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_a_dropped_model_frees_its_engine_and_shards() -> None:
    """A notebook that rebuilds its model drops the old one: the garbage collector (an observer
    outside the engine) must then free the engine and every shard it held, though gradient hooks on
    the parameters point at the engine."""
    import gc
    import weakref

    def train_one_step() -> tuple[weakref.ref, list[weakref.ref]]:
        model = models.MLP()
        engine = ZeroEngine(model, prefetch=NO_PERSIST)
        optimizer = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        model(torch.randn(4, 16)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        return weakref.ref(engine), [weakref.ref(g.shard) for g in engine.groups]

    engine, shards = train_one_step()
    gc.collect()
    assert engine() is None
    assert all(s() is None for s in shards)


def test_an_engine_collected_during_another_optimizers_step() -> None:
    """The collection that frees a dropped engine can run in the middle of any optimizer's step,
    while torch iterates its global step hooks: it must not change that table (it did, with one
    hook per engine removed by a finalizer: "OrderedDict mutated during iteration")."""
    import gc
    import weakref

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def collect_now(*_) -> None:
        gc.collect()

    # Registered before the engines: it runs first, with their hooks (if any) still to come.
    collect = register_optimizer_step_pre_hook(collect_now)
    gc.disable()
    try:
        kept = models.MLP()
        optimizer = ZeroEngine(kept).shard_optimizer(torch.optim.SGD(kept.parameters(), lr=0.1))
        dropped = models.MLP()
        engine = weakref.ref(ZeroEngine(dropped))
        del dropped  # a cycle (model <-> engine): freed only by the collection in the step
        kept(torch.randn(4, 16)).sum().backward()
        assert engine() is not None
        optimizer.step()
        assert engine() is None  # the step's collection did free it, during the hooks' iteration
    finally:
        collect.remove()
        gc.enable()


@pytest.mark.parametrize("current, local_rank, count, expected", [
    (0, None, 8, 0),  # not launched by torchrun: the current device
    (3, "3", 8, 3),   # torch.cuda.set_device(LOCAL_RANK) was called
    (0, "0", 8, 0),
    (0, "1", 1, 0),   # more local ranks than devices: they share them by choice
    (0, "5", 4, 0),
])  # fmt: skip
def test_an_accelerator_without_index_is_the_local_ranks(current: int, local_rank: str | None, count: int,
                                                          expected: int) -> None:
    from lightning_zinf.engine.transfer import local_device_index

    assert local_device_index(current, local_rank, count) == expected


def test_a_local_rank_that_is_not_an_integer_is_named() -> None:
    from lightning_zinf.engine.transfer import local_device_index

    with pytest.raises(ValueError, match=r"LOCAL_RANK='one' is not an integer"):
        local_device_index(0, "one", 4)


@pytest.mark.parametrize("current, local_rank", [(0, "1"), (2, "1")])
def test_an_accelerator_without_index_that_could_be_two_devices_is_refused(current: int, local_rank: str) -> None:
    """Rank 1 of a machine with four GPUs that never chose one would put its shards on GPU 0 (or
    another rank's): refused, naming the two fixes."""
    from lightning_zinf.engine.transfer import local_device_index

    with pytest.raises(ValueError, match=rf"LOCAL_RANK=1\) has cuda:{current} current .* Call torch.cuda.set_device\(1\) "
                                         rf".* or pass device='cuda:1' \(or 'cuda:{current}' to share"):
        local_device_index(current, local_rank, 4)
