"""A unit used again within one prefetch bucket stays gathered (DeepSpeed's
``stage3_max_reuse_distance``, bounded by ``PrefetchConfig.bucket_size``).

The last units of a forward are the first ones its backward uses, and a module called twice in a
row uses its unit twice: releasing such a unit and gathering it again moves its bytes once more
(on a GPU the re-gather at the forward/backward turn waits fully exposed). The engine keeps it
gathered instead, counted as gathered ahead, so the memory bound stays the one prefetch keeps.

Observed from outside the engine, at 2 gloo ranks: the bytes every collective of
``torch.distributed`` receives (patched in the worker), split into forward and backward, and the
parameters that hold values (a released parameter is an empty tensor) at every module's forward and
backward; training must be bit-identical to the engine without prefetch (every unit gathered on
demand and released after each use).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_zinf import MixedPrecisionConfig, PrefetchConfig, ZeroEngine
from lightning_zinf.comm import collectives
from tests.harness import run_distributed

LAYERS, WIDTH = 8, 32
UNIT = WIDTH * WIDTH + WIDTH  # one Linear: a unit


class Chain(nn.Module):
    """``LAYERS`` linear layers (a unit each), the first called twice in a row."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.layers[0](x))
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


def _received(counter: dict) -> None:
    """Count the bytes each rank receives through ``torch.distributed``'s gathers (broadcast
    into a slice on gloo, all-gather elsewhere) into ``counter["bytes"]``: the calls are wrapped
    where the engine hands them to torch (``dist.broadcast``, and the all-gather function
    ``collectives`` bound at import). The control plane's rows (int64, the ranks' checks) are not
    parameters' bytes."""
    broadcast, gather = dist.broadcast, collectives._all_gather_tensor

    def counted_broadcast(tensor, *args, group_src=None, **kwargs):
        if group_src is not None and group_src != dist.get_rank(kwargs.get("group")):
            counter["bytes"] += tensor.numel() * tensor.element_size()
        return broadcast(tensor, *args, group_src=group_src, **kwargs)

    def counted_gather(out, shard, *args, **kwargs):
        if out.dtype != torch.int64:
            counter["bytes"] += (out.numel() - shard.numel()) * out.element_size()
        return gather(out, shard, *args, **kwargs)

    dist.broadcast, collectives._all_gather_tensor = counted_broadcast, counted_gather


def _train(rank: int, world: int, bucket_units: int, enabled: bool) -> dict:
    counter = {"bytes": 0}
    _received(counter)
    torch.manual_seed(0)
    model = Chain()
    engine = ZeroEngine(model, block_classes=[nn.Linear],
                        prefetch=PrefetchConfig(bucket_size=bucket_units * UNIT, persistence_threshold=0,
                                                enabled=enabled))
    opt = engine.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    weights = [layer.weight for layer in model.layers]
    live: list[int] = []  # parameters holding values, at each module's forward and backward

    def look(*_: object) -> None:
        live.append(sum(w.numel() > 0 for w in weights))

    for layer in model.layers:  # registered after the engine's hooks: they see what it gathered
        layer.register_forward_pre_hook(look)
        layer.register_full_backward_pre_hook(look)
    rows, losses = [], []
    for step in range(4):
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step * world + rank))
        live.clear()
        counter["bytes"] = 0
        loss = model(x)
        forward = counter["bytes"]
        loss.backward()
        backward = counter["bytes"] - forward
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        with torch.no_grad():
            model(x)
        rows.append({"forward": forward, "backward": backward, "peak": max(live),
                     "after_eval": sum(w.numel() > 0 for w in weights)})
    with engine.gathered():
        final = {k: v.clone() for k, v in model.state_dict().items()}
    return {"rows": rows, "losses": losses, "final": final}


def _ddp(rank: int, world: int) -> list[float]:
    """The same training under torch's DistributedDataParallel: the reference."""
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Chain())
    return _losses(model, torch.optim.SGD(model.parameters(), lr=0.1), rank, world)


def _losses(model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int) -> list[float]:
    """Four SGD steps on each rank's own batches; the losses."""
    losses = []
    for step in range(4):
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(step * world + rank))
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("bucket_units", [1, 2])
def test_units_used_again_within_a_bucket_stay_gathered(bucket_units: int) -> None:
    """Once the trace is replayed, the forward gathers each unit once (the first layer's second
    call reuses its gather) and the backward gathers all but the last ``bucket_units + 1`` units
    again; at most ``bucket_units + 1`` layers hold values at any module's forward or backward
    (the unit in use and a bucket ahead, as without reuse); nothing stays gathered after an
    evaluation forward; losses and weights equal, bit for bit, the engine's without prefetch, and
    the losses DDP's."""
    world = 2
    reused = run_distributed(_train, world, bucket_units, True)
    on_demand = run_distributed(_train, world, bucket_units, False)
    ddp = run_distributed(_ddp, world)
    for got, want in zip(reused, ddp):
        assert got["losses"] == want
    per_unit = UNIT * 4 // world  # fp32 bytes a rank receives for one unit's gather
    kept = bucket_units + 1
    for got, want in zip(reused, on_demand):
        assert got["losses"] == want["losses"]
        assert all(torch.equal(got["final"][k], want["final"][k]) for k in want["final"])
        for row in got["rows"][1:]:  # the first step records the trace
            assert row["forward"] == LAYERS * per_unit, row
            assert row["backward"] == (LAYERS - kept) * per_unit, row
            assert row["peak"] <= kept, row
            assert row["after_eval"] == 0, row
        for row in want["rows"]:  # on demand: the first layer twice, every unit again for backward
            assert row["forward"] == (LAYERS + 1) * per_unit and row["backward"] == LAYERS * per_unit, row
            assert row["peak"] == 1 and row["after_eval"] == 0, row


def _read_inside_forward(rank: int, world: int, read: bool) -> dict:
    """bf16 compute copies; with ``read``, every step reads all weights exactly from inside the
    forward of the last layer, whose unit the trace keeps gathered into its backward."""
    torch.manual_seed(0)
    model = Chain()
    engine = ZeroEngine(model, block_classes=[nn.Linear], prefetch=PrefetchConfig(persistence_threshold=0),
                        mixed_precision=MixedPrecisionConfig(param_dtype=torch.bfloat16))
    opt = engine.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    sums: list[float] = []

    def read_weights(*_: object) -> None:
        with engine.gathered():
            sums.append(sum(float(p.double().sum()) for p in model.parameters()))

    if read:
        # Before the engine's post-hook: after the layer computed, before the engine lets go of it.
        model.layers[-1].register_forward_hook(read_weights, prepend=True)
    return {"losses": _losses(model, opt, rank, world), "sums": sums}


def test_a_read_inside_the_forward_of_a_kept_unit_leaves_training_unchanged() -> None:
    """``gathered()`` inside the forward of a unit kept for its backward regathers it exactly (fp32,
    for reading): after that forward the unit is released, not kept with the read's buffers, so
    its backward gathers the bf16 compute copy again and training is bit-identical to the run
    without the read."""
    read = run_distributed(_read_inside_forward, 2, True)
    quiet = run_distributed(_read_inside_forward, 2, False)
    for got, want in zip(read, quiet):
        assert got["losses"] == want["losses"]
        assert len(got["sums"]) == 4
