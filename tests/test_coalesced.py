"""Persistent units are re-gathered by one collective after a step, and bf16 gradients are cast
for the reduce-scatter by multi-tensor kernels.

The collectives are counted by torch's profiler (the ``gloo:*`` events of the collectives gloo
actually ran: an observer outside the engine); the values are checked against single-process
float64 PyTorch.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zinf import MixedPrecisionConfig, PrefetchConfig, ZeroEngine, ZeroPPConfig
from tests import models
from tests.harness import run_distributed

BF16 = MixedPrecisionConfig(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
LR = 0.5


class Mixed(nn.Module):
    """Six small Linear layers, the second and fifth in bf16: their units have no fp32 parameter,
    so the persistent units' groups have two compute dtypes without a precision policy."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))
        self.layers[1].to(torch.bfloat16)
        self.layers[4].to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x.to(layer.weight.dtype))).float()
        return x


def _build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return Mixed() if kind == "mixed" else models.GPT(layers=4, lora_rank=4 if kind == "lora" else 0)


def _loss(model: nn.Module, kind: str, rank: int, world: int) -> torch.Tensor:
    """The mean loss over this rank's equal share of the global batch (over all of it at world 1)."""
    if kind == "mixed":
        g = torch.Generator().manual_seed(7)
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
        out = model(x[rank::world])
        return torch.nn.functional.mse_loss(out.double(), y[rank::world].double())
    x, y = models.make_batch("gpt", 0, 4)
    return models.loss_fn(model, x[rank::world], y[rank::world])


def _count_gathers(fn) -> int:
    """All-gathers of parameters during ``fn()``: calls of the all-gather function the collectives
    hand flat gathers to (``collectives._all_gather_tensor``, bound at import), less the control
    plane's rows (int64: the ranks' checks); gloo's in-place form of large gathers (broadcasts,
    seen by torch's profiler) must not be used here."""
    from torch.profiler import profile

    from lightning_zinf.comm import collectives

    gather, count = collectives._all_gather_tensor, [0]

    def counted(out, shard, *args, **kwargs):
        count[0] += out.dtype != torch.int64
        return gather(out, shard, *args, **kwargs)

    collectives._all_gather_tensor = counted
    try:
        with profile() as prof:
            fn()
    finally:
        collectives._all_gather_tensor = gather
    assert not any(e.name == "gloo:broadcast" for e in prof.events())
    return count[0]


def _step_on_ranks(rank: int, world: int, kind: str, precision: str) -> dict:
    """One SGD step under the engine, every unit persistent: the all-gathers of the step (its
    post-hook, after_step, re-gathers every persistent unit that holds a stepped group) and the parameters forward sees
    afterwards (the persistent units' gathered buffers)."""
    model = _build(kind)
    engine = ZeroEngine(model, block_classes=["Linear"] if kind == "mixed" else ["Block"],
                        prefetch=PrefetchConfig(persistence_threshold=10**9),
                        mixed_precision=BF16 if precision == "bf16" else MixedPrecisionConfig(),
                        zero_pp=ZeroPPConfig(frozen_bits=8 if kind == "lora" else None))
    assert all(u.persistent for u in engine.units)
    opt = engine.shard_optimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR))
    _loss(model, kind, rank, world).backward()
    step = _count_gathers(opt.step)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    with engine.gathered():  # the shards' exact values, gathered unit by unit for reading
        exact = {n: p.detach().clone() for n, p in model.named_parameters()}
    # What a unit of frozen INT8 codes alone takes (the codes' own gathers, not packed).
    frozen_only = next((u for u in engine.units if u.trainable_groups == 0), None)
    frozen_each = _count_gathers(lambda: engine.states.gather_exact([frozen_only])) if frozen_only else 0
    return {"step": step, "groups": len(engine.groups), "frozen": sum(not g.trainable for g in engine.groups),
            "frozen_stepped": sum(not g.trainable for u in engine.units if u.trainable_groups for g in u.groups),
            "frozen_each": frozen_each, "params": params, "exact": exact}


def _reference(kind: str) -> dict[str, torch.Tensor]:
    """The same step in one process, in float64, on the whole global batch."""
    model = _build(kind)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    model.double()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    _loss(model, kind, 0, 1).backward()
    opt.step()
    return {n: p.detach().to(dtypes[n]) for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind, precision", [("gpt", "fp32"), ("gpt", "bf16"), ("mixed", "fp32"), ("lora", "fp32")])
def test_persistent_units_are_gathered_by_one_collective_per_dtype(kind: str, precision: str) -> None:
    """After a step, every persistent unit (the GPT's 4 blocks, 2 embeddings and final norm; the
    Mixed model's 6 layers) is re-gathered by ONE all-gather per compute dtype, where it took one
    per flat group; frozen groups stored as INT8 codes (LoRA) keep their own gathers, and units of
    frozen groups only (LoRA's embeddings and final norm) are not re-gathered: the step cannot
    have changed them. Forward then
    sees the stepped parameters: bit for bit the exact values (the unit-by-unit gather for
    reading) in the compute dtype, and the float64 reference's."""
    world = 2
    results = run_distributed(_step_on_ranks, world, kind, precision)
    reference = _reference(kind)
    dtypes = 2 if kind == "mixed" else 1
    for got in results:
        assert got["groups"] - got["frozen"] >= 3 * dtypes  # so one collective per group would show
        assert got["step"] == dtypes + got["frozen_stepped"] * got["frozen_each"]
        assert kind != "lora" or (got["frozen_each"] > 0 and 0 < got["frozen_stepped"] < got["frozen"])
        for name, value in reference.items():
            param = got["params"][name]
            assert param.dtype == (torch.bfloat16 if precision == "bf16" else value.dtype)
            assert torch.equal(param, got["exact"][name].to(param.dtype)), name
            if kind == "gpt" and precision == "fp32":
                torch.testing.assert_close(param, value, rtol=1e-5, atol=1e-6, msg=name)
            else:  # bf16 layers: gradients about 1% off float64's; INT8 frozen weights: up to 3%
                bound = 0.05 if kind == "lora" else 0.02
                assert (param.double() - value.double()).norm() <= bound * value.double().norm(), name
    torch.testing.assert_close(results[0]["params"], results[1]["params"], rtol=0, atol=0)


def test_bf16_gradient_cast_launches_multi_tensor_kernels() -> None:
    """The cast of a bf16 unit's gradients into the fp32 reduce-scatter input is one
    ``_foreach_copy_`` (and one ``_foreach_zero_`` for the padding and parameters without a
    gradient), not a copy per parameter (torch's profiler, counting aten calls); the step matches
    the float64 reference."""
    from torch.profiler import profile

    model = _build("gpt")
    engine = ZeroEngine(model, block_classes=["Block"], prefetch=PrefetchConfig(persistence_threshold=0),
                        mixed_precision=BF16)
    opt = engine.shard_optimizer(torch.optim.SGD(model.parameters(), lr=LR))
    with profile() as prof:
        _loss(model, "gpt", 0, 1).backward()
    names = [e.name for e in prof.events()]
    reduced = sum(g.trainable for g in engine.groups)
    assert names.count("aten::_foreach_copy_") == reduced
    assert names.count("aten::_foreach_zero_") == reduced
    opt.step()
    reference = _reference("gpt")
    with engine.gathered():
        for name, p in model.named_parameters():
            # bf16 forward and backward: gradients about 1% off float64's.
            value = reference[name].double()
            assert (p.detach().double() - value).norm() <= 0.02 * value.norm(), name


def _coalesced_against_one_by_one(rank: int, world: int, sizes: list[int]) -> dict:
    """Shards of several sizes (fp32, rank-dependent values) gathered into bf16 buffers by one
    coalesced collective and, for comparison, one ``all_gather`` each."""
    from datetime import timedelta

    from lightning_zinf.comm import Collectives

    comm = Collectives(timeout=timedelta(seconds=60))
    shards = [torch.arange(n, dtype=torch.float32).mul_(0.37).add_(100 * rank + i) for i, n in enumerate(sizes)]
    together = [torch.full((world * n,), -1.0, dtype=torch.bfloat16) for n in sizes]
    comm.all_gather_coalesced(together, shards, async_op=True).wait()
    bytes_together = (comm.bytes.gathered, comm.bytes.intra_node, comm.bytes.inter_node)
    comm.bytes.reset()
    alone = [torch.full((world * n,), -1.0, dtype=torch.bfloat16) for n in sizes]
    for out, shard in zip(alone, shards):
        comm.all_gather(out, shard.to(torch.bfloat16))
    return {"together": together, "alone": alone, "bytes_together": bytes_together,
            "bytes_alone": (comm.bytes.gathered, comm.bytes.intra_node, comm.bytes.inter_node)}


@pytest.mark.parametrize("world", [2, 3])
def test_coalesced_gather_against_the_definition(world: int) -> None:
    """Every buffer holds every rank's shard in rank order, cast to its dtype, bit for bit what one
    all-gather per buffer gives, and the byte counts are those of the separate gathers."""
    sizes = [16, 48, 32 * 5]
    for got in run_distributed(_coalesced_against_one_by_one, world, sizes):
        for i, n in enumerate(sizes):
            expected = torch.cat([torch.arange(n, dtype=torch.float32).mul_(0.37).add_(100 * r + i)
                                  for r in range(world)])
            assert torch.equal(got["together"][i], expected.to(torch.bfloat16)), i
            assert torch.equal(got["alone"][i], got["together"][i])
        assert got["bytes_together"] == got["bytes_alone"]
        assert got["bytes_together"][0] == sum((world - 1) * n * 2 for n in sizes)


@pytest.mark.parametrize("tier", ["none", "nvme"])
def test_an_error_while_issuing_the_regather_leaves_no_unit_with_old_values(monkeypatch, tmp_path, tier) -> None:
    """An error in the middle of issuing the re-gather after a step (an out-of-memory in one
    group's buffer, here injected; with NVMe parameters after the units' shards were swapped in)
    reaches the caller, and no unit is left looking gathered with the previous step's
    values: the forward afterwards equals plain PyTorch's after the same SGD step, and so does a
    second step (the swapped-in shards went back: none is held twice)."""
    from lightning_zinf import OffloadConfig
    from lightning_zinf.engine.flat import FlatGroup

    torch.manual_seed(0)
    reference = models.GPT(layers=4)
    model = models.GPT(layers=4)
    model.load_state_dict(reference.state_dict())
    offload = OffloadConfig(param="nvme", nvme_path=str(tmp_path)) if tier == "nvme" else OffloadConfig()
    engine = ZeroEngine(model, block_classes=["Block"], prefetch=PrefetchConfig(persistence_threshold=10**9),
                        offload=offload)
    assert all(u.persistent for u in engine.units)
    opt = engine.shard_optimizer(torch.optim.SGD(model.parameters(), lr=LR))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for net in (model, reference):
        _loss(net, "gpt", 0, 1).backward()
    ref_opt.step()

    real, calls = FlatGroup.open_gather, []

    def failing(self, *args, **kwargs):
        calls.append(self)
        if len(calls) == 3:
            raise RuntimeError("out of memory (injected)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FlatGroup, "open_gather", failing)
    with pytest.raises(RuntimeError, match="injected"):
        opt.step()
    monkeypatch.setattr(FlatGroup, "open_gather", real)
    assert len(calls) == 3
    with torch.no_grad():
        got, want = _loss(model, "gpt", 0, 1), _loss(reference, "gpt", 0, 1)
    assert torch.allclose(got, want, rtol=1e-5, atol=0), (got, want)
    for net, optimizer in ((model, opt), (reference, ref_opt)):
        optimizer.zero_grad()
        _loss(net, "gpt", 0, 1).backward()
        optimizer.step()
    with torch.no_grad():
        got, want = _loss(model, "gpt", 0, 1), _loss(reference, "gpt", 0, 1)
    assert torch.allclose(got, want, rtol=1e-5, atol=0), (got, want)
    engine.release_all()


def _bounded_buckets(rank: int, world: int) -> dict:
    from lightning_zinf.comm.collectives import Collectives
    from lightning_zinf.engine import units as units_module

    units_module.COALESCE_BYTES = 64 << 10  # this rank process's own copy of the module
    real, live, most = Collectives.all_gather_coalesced, [], []

    def observed(self, outs, sources, async_op=False):
        handle = real(self, outs, sources, async_op=async_op)
        live.append(handle)
        most.append(sum(h.finish is not None for h in live))  # issued and not waited for
        return handle

    Collectives.all_gather_coalesced = observed
    torch.manual_seed(0)
    reference = models.GPT(layers=4)
    model = models.GPT(layers=4)
    model.load_state_dict(reference.state_dict())
    engine = ZeroEngine(model, block_classes=["Block"], prefetch=PrefetchConfig(persistence_threshold=10**9))
    opt = engine.shard_optimizer(torch.optim.SGD(model.parameters(), lr=LR))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    _loss(model, "gpt", rank, world).backward()
    _loss(reference, "gpt", 0, 1).backward()  # the whole batch: the mean of the ranks' equal shares
    ref_opt.step()
    live.clear(), most.clear()
    opt.step()
    with torch.no_grad():
        got, want = _loss(model, "gpt", 0, 1), _loss(reference, "gpt", 0, 1)
    return {"most": most, "got": got.item(), "want": want.item()}


def test_at_most_two_coalesced_gathers_are_in_flight() -> None:
    """With buckets far smaller than the persistent units (so there are many), each bucket's
    collective is issued only once the one two before it was waited for: at most two buckets'
    packing buffers exist at once. The values after the step still equal plain PyTorch's."""
    for result in run_distributed(_bounded_buckets, 2):
        assert len(result["most"]) >= 4 and max(result["most"]) == 2, result
        assert result["got"] == pytest.approx(result["want"], rel=1e-5), result
