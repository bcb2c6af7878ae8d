"""ZeRO++ and the node topology: 4 ranks as 2 simulated nodes x 2 ranks (gloo on CPU).

hpZ moves the same values by another route (the secondary partitions inside a node), so training
with it must be bit-for-bit the training without it, through gradient accumulation, evaluation
passes and a resume; and the backward gathers must not cross nodes. qwZ gathers blockwise INT8
codes: the gathered weights' error is well below that of one scale per shard, and training stays
close.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from unittest import mock


from typing import Any, Callable

import pytest
import torch

from lightning_zinf import OffloadConfig, PrefetchConfig, ZeroEngine, ZeroPPConfig
from lightning_zinf.checkpoint import load_sharded, save_sharded
from lightning_zinf.comm import Collectives, Topology
from tests import models
from tests.harness import buffers_made, run_distributed

BATCH, ACCUMULATE, STEPS = 8, 2, 4


def test_topology_numbers_ranks_node_by_node() -> None:
    t = Topology(world_size=6, rank=4, ranks_per_node=3)
    assert (t.nodes, t.node, t.local_rank) == (2, 1, 1)
    assert t.node_ranks(1) == [3, 4, 5] and t.peer_ranks(1) == [1, 4]
    assert t.split_bytes(range(6), 10) == (20, 30)  # 2 peers on its node, 3 on the other
    with pytest.raises(ValueError, match="ranks_per_node=4 must be a positive divisor of the world size 6"):
        Topology(world_size=6, rank=0, ranks_per_node=4)


def _engine(zero_pp: dict) -> tuple[torch.nn.Module, ZeroEngine, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = models.GPT()
    # One unit gathered ahead (bucket_size=1): backward gathers every unit but the last again (the
    # route hpZ changes); with the default bucket this small model stays gathered into backward.
    engine = ZeroEngine(model, block_classes=["Block"], prefetch=PrefetchConfig(persistence_threshold=0, bucket_size=1),
                        zero_pp=ZeroPPConfig(ranks_per_node=2, **zero_pp))
    return model, engine, engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))


def _steps(model, engine, opt, rank: int, world: int, steps: range) -> list[dict]:
    """Each step: ACCUMULATE micro-batches, a no-grad evaluation forward, the optimizer step."""
    rows = []
    per_rank = BATCH // world
    for step in steps:
        engine.comm.bytes.reset()
        losses = []
        for micro in range(ACCUMULATE):
            x, y = models.make_batch("gpt", step * ACCUMULATE + micro, BATCH)
            x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
            loss = models.loss_fn(model, x, y) / ACCUMULATE
            loss.backward()
            losses.append(loss.item())
        with torch.no_grad():
            evaluated = models.loss_fn(model, x, y).item()
        secondaries = sum(g.secondary is not None for g in engine.groups)
        opt.step()
        opt.zero_grad()
        rows.append({"losses": losses, "eval": evaluated, "intra": engine.comm.bytes.intra_node,
                     "inter": engine.comm.bytes.inter_node, "gathered": engine.comm.bytes.gathered,
                     "secondaries": secondaries, "after_step": sum(g.secondary is not None for g in engine.groups)})
    return rows


def _run(rank: int, world: int, zero_pp: dict, ckpt: str) -> dict:
    model, engine, opt = _engine(zero_pp)
    rows = _steps(model, engine, opt, rank, world, range(STEPS))
    with engine.gathered():
        weights = {k: v.clone() for k, v in model.state_dict().items()}
    # Resume: 2 steps, save, a fresh model loads the checkpoint and takes the last 2 steps.
    model, engine, opt = _engine(zero_pp)
    _steps(model, engine, opt, rank, world, range(2))
    save_sharded(engine, [opt], ckpt, {})
    model, engine, opt = _engine(zero_pp)
    load_sharded(engine, [opt], ckpt)
    resumed = _steps(model, engine, opt, rank, world, range(2, STEPS))
    # Inter-node bytes of one gather of every unit from the shards: 2 of the 3 peers are on the other node.
    once = sum((world - 2) * g.shard_numel * g.full.element_size() for g in engine.groups)
    return {"rows": rows, "weights": weights, "resumed": resumed, "groups": len(engine.groups), "once": once}


def test_hpz_is_bit_exact_and_keeps_backward_gathers_inside_the_node(tmp_path: Path) -> None:
    plain = run_distributed(_run, 4, {}, str(tmp_path / "plain"))
    hpz = run_distributed(_run, 4, {"hpz": True}, str(tmp_path / "hpz"))
    for rank in range(4):
        a, b = plain[rank], hpz[rank]
        assert [r["losses"] for r in a["rows"]] == [r["losses"] for r in b["rows"]]
        assert [r["eval"] for r in a["rows"]] == [r["eval"] for r in b["rows"]]
        assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
        # After a resume hpZ starts from the loaded shards: the same losses as without a break.
        assert [r["losses"] for r in b["resumed"]] == [r["losses"] for r in b["rows"][2:]]
        for p, h in zip(a["rows"], b["rows"]):
            assert p["secondaries"] == 0 and h["secondaries"] == b["groups"]  # every unit kept one
            assert h["after_step"] == 0  # the step made them stale: dropped
            # Only each unit's first gather after a step crosses nodes (later ones receive 1 of 2
            # secondary partitions, half the unit, instead of 3 of 4 shards).
            # Gradients (all trainable, fp32) are reduce-scattered once per micro-batch, crossing
            # nodes with as many bytes as one gather of everything: hpZ sends (1 + ACCUMULATE) x that
            # per step; plain ZeRO-3 gathers each unit at least 2 x ACCUMULATE + 1 times (forward
            # and backward of each micro-batch, the evaluation; the last unit, kept gathered into
            # its backward, is outweighed by the tied embedding's second gather in each forward).
            assert h["gathered"] < p["gathered"]
            assert h["inter"] == (1 + ACCUMULATE) * b["once"]
            assert p["inter"] >= (3 * ACCUMULATE + 1) * b["once"]
            assert h["intra"] > p["intra"]


def _quantized_gather(rank: int, world: int, dtype: torch.dtype) -> dict:
    comm = Collectives(ranks_per_node=2, qwz_block=256)
    # Gaussian values whose scale spans two decades along the shard, as a weight's rows may differ.
    shard = (torch.randn(5000, generator=torch.Generator().manual_seed(rank)) * torch.logspace(-2, 0, 5000)).to(dtype)
    exact, got = torch.empty(world * 5000, dtype=dtype), torch.empty(world * 5000, dtype=dtype)
    comm.all_gather(exact, shard)
    exact_inter = comm.bytes.inter_node
    comm.bytes.reset()
    comm.all_gather_quantized(got, shard, async_op=True).wait()
    return {"exact": exact, "got": got, "inter": comm.bytes.inter_node, "exact_inter": exact_inter}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_qwz_gather_is_within_the_int8_band(dtype: torch.dtype) -> None:
    ranks = run_distributed(_quantized_gather, 4, dtype)
    for got in ranks:
        assert torch.equal(got["got"], ranks[0]["got"])  # every rank dequantizes the same values
        exact, approx = got["exact"].double(), got["got"].double()
        err = float((approx - exact).norm() / exact.norm())
        # The same INT8 rounding with one scale per rank's shard (per tensor), in float64, rounded
        # to the dtype as the gather's values are: one scale per 256 elements follows the values'
        # scale, so its error is a fraction of this one (measured: 0.35x, 0.0073 against 0.021).
        shards = exact.view(4, -1)
        step = shards.abs().amax(dim=1, keepdim=True) / 127
        per_tensor = (torch.round(shards / step) * step).to(dtype).double().view(-1)
        per_tensor_err = float((per_tensor - exact).norm() / exact.norm())
        assert 0 < err < 0.5 * per_tensor_err, (err, per_tensor_err)
        # Codes (1 byte) and one fp32 scale per 256 elements, instead of the parameter dtype.
        ratio = got["inter"] / got["exact_inter"]
        assert ratio == pytest.approx((1 + 4 / 256) / torch.empty(0, dtype=dtype).element_size(), rel=0.01)


def test_qwz_with_hpz_trains_close_to_zero3(tmp_path: Path) -> None:
    plain = run_distributed(_run, 4, {}, str(tmp_path / "plain"))
    both = run_distributed(_run, 4, {"hpz": True, "qwz": True}, str(tmp_path / "both"))
    for a, b in zip(plain, both):
        want = torch.tensor([sum(r["losses"]) for r in a["rows"]])
        got = torch.tensor([sum(r["losses"]) for r in b["rows"]])
        assert not torch.equal(got, want)  # the weights were quantized...
        torch.testing.assert_close(got, want, rtol=1e-2, atol=0)  # ...within 1% of the exact losses
        assert [r["losses"] for r in b["resumed"]] == [r["losses"] for r in b["rows"][2:]]  # resume: exact
        # Across nodes per step: one INT8 gather of every unit (codes + a scale per 256 elements,
        # about a quarter of fp32) and the fp32 gradient reduce-scatters (qgZ is not used here).
        for q in b["rows"]:
            assert q["inter"] == pytest.approx((ACCUMULATE + (1 + 4 / 256) / 4) * b["once"], rel=0.01)


def _quantized_reduce(rank: int, world: int, ranks_per_node: int, bits: int) -> dict:
    comm = Collectives(ranks_per_node=ranks_per_node, qgz_bits=bits, block=256)
    n = 3001  # per rank: neither a multiple of the block nor even
    full = torch.randn(world * n, generator=torch.Generator().manual_seed(100 + rank))
    exact, got = torch.empty(n), torch.empty(n)
    comm.reduce_scatter_mean(exact, full.clone())
    exact_bytes = (comm.bytes.intra_node, comm.bytes.inter_node)
    comm.bytes.reset()
    made: list[int] = []
    with buffers_made(made):
        comm.reduce_scatter_mean_quantized(got, full, async_op=True).wait()
    return {"exact": exact, "got": got, "exact_bytes": exact_bytes, "bytes": (comm.bytes.intra_node, comm.bytes.inter_node),
            "made": sum(made), "accounted": comm.reduce_transient_nbytes(n, torch.float32)}


@pytest.mark.parametrize("nodes, ranks_per_node", [(1, 2), (2, 2), (3, 1), (3, 2)])
@pytest.mark.parametrize("bits, band", [(4, (0.10, 0.21)), (8, (0.004, 0.012))])
def test_qgz_reduce_scatter_gives_the_mean_within_the_band(nodes: int, ranks_per_node: int, bits: int, band: tuple) -> None:
    world = nodes * ranks_per_node
    ranks = run_distributed(_quantized_reduce, world, ranks_per_node, bits)
    for rank, got in enumerate(ranks):
        err = float((got["got"].double() - got["exact"].double()).norm() / got["exact"].double().norm())
        # The mean, not the sum (off by W - 1 times), within the error of the kernels' INT4/INT8 codes.
        assert band[0] < err < band[1], (rank, err)
        intra, inter = got["bytes"]
        exact_intra, exact_inter = got["exact_bytes"]
        # Across nodes: 1/nodes of the partitions, in codes plus a scale per block, instead of fp32.
        row = 3072 * bits // 8 + 4 * 12
        assert inter == (nodes - 1) * row and intra == (ranks_per_node - 1) * nodes * row
        if nodes > 1:
            assert inter / exact_inter == pytest.approx(row / 4 / 3001 / ranks_per_node, rel=1e-6)
        # What the engine's ledger adds for the reduce is what the collectives made.
        assert got["accounted"] == got["made"] > 0, got


def test_all_three_train_close_to_zero3_with_a_quarter_of_the_inter_node_bytes(tmp_path: Path) -> None:
    plain = run_distributed(_run, 4, {}, str(tmp_path / "plain"))
    zpp = run_distributed(_run, 4, {"hpz": True, "qwz": True, "qgz": True}, str(tmp_path / "zpp"))
    for a, b in zip(plain, zpp):
        want = torch.tensor([sum(r["losses"]) for r in a["rows"]])
        got = torch.tensor([sum(r["losses"]) for r in b["rows"]])
        torch.testing.assert_close(got, want, rtol=0.03, atol=0)
        assert got[-1] < got[0]
        assert [r["losses"] for r in b["resumed"]] == [r["losses"] for r in b["rows"][2:]]  # resume: exact
        for p, q in zip(a["rows"], b["rows"]):
            assert q["inter"] / p["inter"] <= 0.27  # ZeRO++'s 3M -> 0.75M, here with fp32 parameters


def _preset(rank: int, world: int, name: str) -> dict:
    from tests.test_trainer import GLOBAL_BATCH, LitGPT, _trainer

    lit = LitGPT(GLOBAL_BATCH // world)
    trainer = _trainer(name, world)
    trainer.fit(lit)
    strategy = trainer.strategy
    return {"losses": lit.train_losses, "zero_pp": strategy.options.zero_pp, "offload": strategy.options.offload.param,
            "nodes": strategy.engine.comm.topology.nodes}


def test_zero_pp_presets_under_the_trainer() -> None:
    base = run_distributed(_preset, 2, "zero_infinity", init_pg=False)[0]
    for name, tier in (("zero_pp", "none"), ("zero_pp_nvme", "nvme")):
        got = run_distributed(_preset, 2, name, init_pg=False)[0]
        assert (got["zero_pp"].hpz, got["zero_pp"].qwz, got["zero_pp"].qgz, got["offload"]) == (True, True, True, tier)
        assert got["nodes"] == 1  # the Trainer's 2 devices on one node
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(base["losses"]), rtol=0.03, atol=0)


def _frozen_run(rank: int, world: int, bits: int | None, ckpt: str, nvme: str | None = None) -> dict:
    offload = OffloadConfig(param="nvme", optimizer="nvme", nvme_path=nvme) if nvme else OffloadConfig()

    def build() -> tuple[torch.nn.Module, ZeroEngine, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = models.MLP()
        model.fc1.requires_grad_(False)  # the "base model" of a LoRA-style fine-tuning: frozen
        model.fc2.requires_grad_(False)
        engine = ZeroEngine(model, prefetch=PrefetchConfig(persistence_threshold=0), zero_pp=ZeroPPConfig(frozen_bits=bits),
                            offload=offload)
        trainable = [p for p in model.parameters() if p.requires_grad]
        return model, engine, engine.shard_optimizer(torch.optim.AdamW(trainable, lr=1e-2))

    def train(model, opt, steps: range) -> list[float]:
        losses = []
        for step in steps:
            x, y = models.make_batch("mlp", step, BATCH)
            loss = models.loss_fn(model, x[rank::world], y[rank::world])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    model, engine, opt = build()
    frozen_bytes = sum(t.numel() * t.element_size() for g in engine.groups if not g.trainable
                       for t in ((g.codes, g.scales) if g.codes is not None else (g.shard,)))
    losses = train(model, opt, range(4))
    with engine.gathered():
        frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    model, engine, opt = build()
    train(model, opt, range(2))
    save_sharded(engine, [opt], ckpt, {})
    model, engine, opt = build()
    load_sharded(engine, [opt], ckpt)
    return {"losses": losses, "resumed": train(model, opt, range(2, 4)), "frozen_bytes": frozen_bytes, "frozen": frozen}


@pytest.mark.parametrize("bits, rtol, band", [(8, 2e-3, (0.003, 0.01)), (4, 5e-2, (0.05, 0.2))])
def test_frozen_weights_stored_quantized(tmp_path: Path, bits: int, rtol: float, band: tuple) -> None:
    plain = run_distributed(_frozen_run, 2, None, str(tmp_path / "plain"))
    quant = run_distributed(_frozen_run, 2, bits, str(tmp_path / "quant"))
    for a, b in zip(plain, quant):
        # Codes plus a scale per 256 elements instead of fp32.
        assert b["frozen_bytes"] / a["frozen_bytes"] == pytest.approx((bits / 8 + 4 / 256) / 4, rel=0.1)
        for name, exact in a["frozen"].items():
            err = float((b["frozen"][name] - exact).norm() / exact.norm())
            assert band[0] < err < band[1], (name, err)  # the weights computed with are the codes' values
        assert not torch.equal(torch.tensor(b["losses"]), torch.tensor(a["losses"]))
        torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(a["losses"]), rtol=rtol, atol=0)
        assert b["resumed"] == b["losses"][2:]  # a checkpoint round trip keeps the same codes


def _bf16_run(rank: int, world: int, zero_pp: dict) -> list[float]:
    torch.manual_seed(0)
    model = models.GPT().to(torch.bfloat16)
    model.blocks[0].requires_grad_(False)  # a frozen part, for frozen_bits
    engine = ZeroEngine(model, block_classes=["Block"], prefetch=PrefetchConfig(persistence_threshold=0, bucket_size=1),
                        zero_pp=ZeroPPConfig(ranks_per_node=2, **zero_pp))
    opt = engine.shard_optimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    losses = []
    per_rank = BATCH // world
    for step in range(4):
        x, y = models.make_batch("gpt", step, BATCH)
        loss = models.loss_fn(model, x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_zero_pp_with_bf16_parameters() -> None:
    plain = run_distributed(_bf16_run, 4, {})
    zpp = run_distributed(_bf16_run, 4, {"hpz": True, "qwz": True, "qgz": True, "frozen_bits": 8})
    for a, b in zip(plain, zpp):
        assert all(torch.isfinite(torch.tensor(b)))
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=3e-2, atol=0)


def test_frozen_weights_stored_quantized_next_to_nvme_offload(tmp_path: Path) -> None:
    """The codes stay in memory while the trainable state is on NVMe: the same training and resume."""
    (tmp_path / "nvme").mkdir()
    in_memory = run_distributed(_frozen_run, 2, 8, str(tmp_path / "a"))
    on_nvme = run_distributed(_frozen_run, 2, 8, str(tmp_path / "b"), str(tmp_path / "nvme"))
    for a, b in zip(in_memory, on_nvme):
        assert b["losses"] == a["losses"] and b["resumed"] == a["resumed"]
        assert all(torch.equal(b["frozen"][k], v) for k, v in a["frozen"].items())


def _bad_group_size(rank: int, world: int, zero_pp: dict) -> list[str]:
    """The errors of an engine and of bare collectives built with ``zero_pp`` on this world."""
    messages = []
    with pytest.raises(ValueError) as engine_error:
        ZeroEngine(models.GPT(), zero_pp=ZeroPPConfig(**zero_pp))
    messages.append(str(engine_error.value))
    if zero_pp.get("hpz_partition_size") and rank == world - 1:
        # One rank alone: the argument must be refused before any group's rendezvous, which would
        # wait for the peer (here past the short timeout) or lose it mid-way (CI's failure).
        with pytest.raises(ValueError) as comm_error:
            Collectives(hpz_partition_size=zero_pp["hpz_partition_size"], timeout=timedelta(seconds=5))
        messages.append(str(comm_error.value))
    return messages


@pytest.mark.parametrize("zero_pp, option", [
    ({"hpz": True, "hpz_partition_size": 3}, "ZeroPPConfig.hpz_partition_size=3"),
    ({"ranks_per_node": 3}, "ZeroPPConfig.ranks_per_node=3"),
    ({"hpz": True, "ranks_per_node": 4, "qgz": True}, "ZeroPPConfig.ranks_per_node=4"),
])
def test_a_group_size_that_does_not_divide_the_world_names_the_option(zero_pp: dict, option: str) -> None:
    """On 2 ranks, each group size the user sets is refused naming that option (not the internal
    ``ranks_per_node`` it flows into), its value, the world size, the divisors allowed and the fix."""
    for rank, messages in enumerate(run_distributed(_bad_group_size, 2, zero_pp)):
        engine, *comm = messages
        assert f"{option} must be a positive divisor of the world size 2: one of 1 or 2" in engine, engine
        assert f"Set zero_pp.{option.split('.')[1].split('=')[0]} to" in engine
        assert len(comm) == (1 if rank == 1 and "hpz_partition_size" in zero_pp else 0)
        for message in comm:  # Collectives' own argument
            assert "hpz_partition_size=3 must be a positive divisor of the world size 2: one of 1 or 2" in message


def test_an_hpz_partition_size_without_hpz_is_refused() -> None:
    """A size given alone would be ignored (hpZ stays off) while DeepSpeed's
    zero_hpz_partition_size turns hpZ on: refused, naming the option and the fix."""
    with pytest.raises(ValueError, match=r"ZeroPPConfig.hpz_partition_size=2 is invalid: allowed values are None unless "
                                         r"hpz=True"):
        ZeroPPConfig(hpz_partition_size=2)
    assert ZeroPPConfig(hpz=True, hpz_partition_size=2).hpz_partition_size == 2


def _subgroup_timeout(rank: int, world: int) -> float:
    """Rank 1 stays alive without joining rank 0's hpZ gather; rank 0 reports how long it waited."""
    comm = Collectives(hpz_partition_size=2, timeout=timedelta(seconds=1))
    if rank == 1:
        time.sleep(7)
        return 0.0
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        comm.all_gather_secondary(torch.zeros(8), torch.zeros(4))
    return time.monotonic() - start


def test_hpz_group_fails_within_the_given_timeout() -> None:
    """The groups hpZ and qgZ build get the strategy's timeout, not torch's 30-minute default: a
    rank that never joins is reported after the timeout (1 s), not when it finally exits (7 s)."""
    waited = run_distributed(_subgroup_timeout, 2)[0]
    assert waited < 4, waited


def _groups_built(rank: int, world: int, ranks_per_node: int, timeouts: list) -> list[dict]:
    """Collectives with hpZ (a partition per node) and qgZ, once per timeout; for each, the rank
    sets of the ``new_group`` calls it made (the observer: torch's own function, wrapped) and
    which process groups hpZ and qgZ use."""
    real_new_group = torch.distributed.new_group
    out = []
    for seconds in timeouts:
        built: list[tuple[int, ...]] = []

        def counting(ranks: list[int], *args: object, **kwargs: object) -> torch.distributed.ProcessGroup:
            built.append(tuple(ranks))
            return real_new_group(ranks, *args, **kwargs)

        with mock.patch.object(torch.distributed, "new_group", counting):
            comm = Collectives(ranks_per_node=ranks_per_node, hpz_partition_size=ranks_per_node, qgz_bits=8,
                               timeout=None if seconds is None else timedelta(seconds=seconds))
        world_group, hpz = torch.distributed.group.WORLD, comm._hpz_group
        intra, inter = comm._nodes.intra, comm._nodes.inter
        out.append({
            "built": built, "hpz_is_intra": hpz is intra, "hpz_is_world": hpz is world_group,
            "inter_is_world": inter is world_group,
            "hpz_ranks": None if hpz is None else torch.distributed.get_process_group_ranks(hpz),
            "inter_ranks": None if inter is None else torch.distributed.get_process_group_ranks(inter),
            # The timeout torch gave the group's backends (what a hung collective waits for).
            "hpz_timeouts": None if hpz is None else {hpz._get_backend(d).options._timeout.total_seconds()
                                                      for d in hpz._device_types},
        })
    return out


def test_hpz_and_qgz_build_one_group_per_rank_set() -> None:
    """With the hpZ partition a node (the usual setting), hpZ's partition groups are qgZ's intra-node
    groups: one process group (on NCCL, one communicator with its GPU buffers) per rank set, shared.
    4 ranks as 2 nodes: the control group, then {0,1}, {2,3} (hpZ and qgZ intra), {0,2}, {1,3}
    (qgZ inter), once each; before, 7 groups."""
    for rank, (got,) in enumerate(run_distributed(_groups_built, 4, 2, [60])):
        assert got["built"] == [(0, 1, 2, 3), (0, 1), (2, 3), (0, 2), (1, 3)], got["built"]
        assert got["hpz_is_intra"] and got["hpz_ranks"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert got["inter_ranks"] == [rank % 2, rank % 2 + 2]
        assert got["hpz_timeouts"] == {60.0}


def test_a_rank_set_of_the_whole_world_is_the_world_group_unless_its_timeout_differs() -> None:
    """On 2 ranks of one node hpZ's partition and qgZ's node are the world: with the world's
    timeout (torch's default here, 30 min, or none given) they use the world group and build only the
    control group; with another timeout (1 s) one group of their own carries it, shared by both.
    With one rank per node qgZ's inter-node group is the world (hpZ off: partitions of one rank)."""
    for got in run_distributed(_groups_built, 2, 2, [None, 1800, 1]):
        none_given, same, other = got
        for reused in (none_given, same):
            assert reused["built"] == [(0, 1)] and reused["hpz_is_world"] and reused["hpz_is_intra"], reused
            assert reused["hpz_timeouts"] == {1800.0}
        assert other["built"] == [(0, 1), (0, 1)] and not other["hpz_is_world"] and other["hpz_is_intra"], other
        assert other["hpz_timeouts"] == {1.0}
    for (got,) in run_distributed(_groups_built, 2, 1, [1800]):
        assert got["built"] == [(0, 1)] and got["inter_is_world"], got


def _collectives_ran(work: Callable[[], Any]) -> dict[str, int]:
    """Run ``work`` under torch's profiler, an observer outside the engine: how many times each
    gloo collective ran."""
    from torch.profiler import profile

    with profile() as prof:
        work()
    ran: dict[str, int] = {}
    for event in prof.events():
        if event.name.startswith("gloo:"):
            ran[event.name] = ran.get(event.name, 0) + 1
    return ran


def _one_collective_each(rank: int, world: int) -> dict:
    from triton_kernels import quantize

    n = 3001  # per rank: neither a multiple of a block nor even
    comm = Collectives(ranks_per_node=2, qwz_block=256, qgz_bits=4, block=256)
    shard = torch.randn(n, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    gathered, from_codes = torch.empty(world * n, dtype=torch.bfloat16), torch.empty(world * n, dtype=torch.bfloat16)
    codes, scales = quantize(shard, 4, 128)  # as a frozen group stored in INT4 holds them
    full = torch.randn(world * n, generator=torch.Generator().manual_seed(100 + rank))
    mean = torch.empty(n)
    counts, sent = {}, {}
    for name, work in [("qwz", lambda: comm.all_gather_quantized(gathered, shard, async_op=True).wait()),
                       ("codes", lambda: comm.all_gather_codes(from_codes, codes, scales, 4, 128)),
                       ("qgz", lambda: comm.reduce_scatter_mean_quantized(mean, full.clone(), async_op=True).wait())]:
        comm.bytes.reset()
        counts[name] = _collectives_ran(work)
        sent[name] = (comm.bytes.gathered, comm.bytes.reduce_scattered, comm.bytes.intra_node, comm.bytes.inter_node)
    return {"counts": counts, "sent": sent, "gathered": gathered, "from_codes": from_codes, "mean": mean}


def test_quantized_gathers_and_qgz_legs_are_one_collective_each() -> None:
    """qwZ's gather, the gather of frozen codes and each of qgZ's two all-to-all legs move codes
    and scales in one collective (torch's profiler counts those that ran), with the values of a
    single-process computation from the same references (quantize -> dequantize for the gathers;
    the five qgZ steps with the all-to-alls done by indexing) and the bytes of the packed rows,
    padding included."""
    from triton_kernels import PackedRows, QgzLayout, reference

    nodes, per_node, n = 2, 2, 3001
    world = nodes * per_node
    ranks = run_distributed(_one_collective_each, world)
    shards = [torch.randn(n, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16) for r in range(world)]
    want_gathered = torch.cat([reference.dequantize(*reference.quantize(s, 8, 256), n, 8, 256, torch.bfloat16)
                               for s in shards])
    want_from_codes = torch.cat([reference.dequantize(*reference.quantize(s, 4, 128), n, 4, 128, torch.bfloat16)
                                 for s in shards])
    layout = QgzLayout(world * n, nodes, per_node, bits=4, block=256)
    sent = [reference.reorder_quantize(torch.randn(world * n, generator=torch.Generator().manual_seed(100 + r)), layout)
            for r in range(world)]
    partial = {}
    for node in range(nodes):
        for local in range(per_node):  # intra-node leg: slots [local * N, (local + 1) * N) of each peer
            peers = [sent[node * per_node + d] for d in range(per_node)]
            rows = slice(local * nodes, (local + 1) * nodes)
            partial[node, local] = reference.dequantize_reduce_requantize(
                torch.stack([c[rows] for c, _ in peers]), torch.stack([s[rows] for _, s in peers]), layout, 1.0)
    rows8, rows4, qgz_row = PackedRows.of(n, 8, 256), PackedRows.of(n, 4, 128), layout.packed().row_bytes
    assert (rows8.row_bytes, rows4.row_bytes, qgz_row) == (3008 + 48, 1504 + 96, 1536 + 48)
    for rank, got in enumerate(ranks):
        node, local = divmod(rank, per_node)
        assert got["counts"]["qwz"] == {"gloo:all_gather": 1}
        assert got["counts"]["codes"] == {"gloo:all_gather": 1}
        assert got["counts"]["qgz"] == {"gloo:all_to_all": 2}  # one per leg
        assert torch.equal(got["gathered"], want_gathered)
        assert torch.equal(got["from_codes"], want_from_codes)
        # Inter-node leg: from each node m, row `node` of its ranks' (with this local rank) partial sums.
        mine = reference.dequantize_reduce(torch.stack([partial[m, local][0][node] for m in range(nodes)])[:, None],
                                           torch.stack([partial[m, local][1][node] for m in range(nodes)])[:, None],
                                           layout, 1 / world, torch.float32)
        assert torch.equal(got["mean"], mine.view(-1))
        # Bytes: what the one collective moved, the other ranks' packed rows (half of them across nodes).
        assert got["sent"]["qwz"] == (3 * rows8.row_bytes, 0, rows8.row_bytes, 2 * rows8.row_bytes)
        assert got["sent"]["codes"] == (3 * rows4.row_bytes, 0, rows4.row_bytes, 2 * rows4.row_bytes)
        assert got["sent"]["qgz"] == (0, 3 * qgz_row, 2 * qgz_row, qgz_row)
