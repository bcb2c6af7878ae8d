"""Hybrid sharding (issue 41; MiCS, FSDP's ``HYBRID_SHARD``): ZeRO-3 within groups of
``shard_group_size`` consecutive ranks, the sharded state replicated across the groups.

Four ranks stand for two nodes of two (``ZeroPPConfig(ranks_per_node=2)``, so the engine's byte
counts split intra- and inter-node as on a cluster). The arithmetic differs from ``full`` sharding
only in the order of the mean's additions (within the group, then across the groups), so losses
and weights must match it to float rounding. What hybrid promises is checked from outside the
engine: every float collective the ranks issue (patched ``torch.distributed`` calls, with their
groups' ranks) stays within a node except one all-reduce of each gradient shard across the
groups, and each rank holds the state of a world of ``shard_group_size`` ranks.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_zinf import MixedPrecisionConfig, OffloadConfig, PrefetchConfig, TilingConfig, ZeroEngine, ZeroPPConfig
from lightning_zinf.options import ZeroOptions
from tests import models
from tests.harness import buffers_made, run_distributed

GPT = dict(d=64, layers=4, vocab=64, heads=2)
STEPS, BATCH, ACCUMULATE = 3, 8, 2
TWO_NODES = ZeroPPConfig(ranks_per_node=2)
#: Relative tolerance against ``full`` (the order of a mean's additions); bf16 rounds far more.
RTOL = {"fp32": 1e-6, "bf16": 2e-2}


class _Observer:
    """Records the world ranks of the group and the bytes of every float collective, and of every
    gather or all-to-all of codes (uint8), issued through ``torch.distributed`` while installed (the
    control plane's integer rows and uint8 flags are left out)."""

    NAMES = ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single",
             "broadcast", "isend", "irecv", "all_reduce", "all_to_all_single")

    def __init__(self, monkeypatch: Any) -> None:
        from lightning_zinf.comm import collectives

        self.calls: list[tuple[str, tuple[int, ...], int]] = []
        for name in self.NAMES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            wrapped = self._wrap(name, original)
            monkeypatch.setattr(dist, name, wrapped)
            for alias in ("_all_gather_tensor", "_reduce_scatter_flat"):
                if getattr(collectives, alias) is original:
                    monkeypatch.setattr(collectives, alias, wrapped)

    def _wrap(self, name: str, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            tensor = args[0] if args else next(iter(kwargs.values()))
            group = kwargs.get("group")
            if isinstance(tensor, torch.Tensor) and (tensor.is_floating_point()
                                                     or (name != "all_reduce" and tensor.dtype == torch.uint8)):
                ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else \
                    tuple(range(dist.get_world_size()))
                self.calls.append((name, ranks, tensor.numel() * tensor.element_size()))
            return original(*args, **kwargs)

        return call


def _train(rank: int, world: int, sharding: str, optimizer: str = "sgd", extra: dict | None = None,
           nvme_path: str = "", observe: bool = False) -> dict:
    monkeypatch = pytest.MonkeyPatch()
    observer = _Observer(monkeypatch) if observe else None
    try:
        torch.manual_seed(0)
        extra = dict(extra or {})
        if "offload" in extra and extra["offload"].get("optimizer") == "nvme":
            Path(nvme_path).mkdir(parents=True, exist_ok=True)
            extra["offload"] = OffloadConfig(**extra["offload"], nvme_path=nvme_path)
        elif "offload" in extra:
            extra["offload"] = OffloadConfig(**extra["offload"])
        model = models.GPT(**GPT, lora_rank=4 if extra.pop("lora", False) else 0)
        engine = ZeroEngine(model, block_classes=["Block"], prefetch=PrefetchConfig(persistence_threshold=0),
                            sharding=sharding, **{"zero_pp": TWO_NODES, **extra})
        params = [p for p in model.parameters() if p.requires_grad]
        # SGD for the weights' comparison: AdamW turns the rounding noise of exactly-zero gradients
        # (attention's key bias) into full-size steps that differ with the order of additions.
        opt = engine.shard_optimizer(torch.optim.SGD(params, lr=0.05, momentum=0.9) if optimizer == "sgd"
                                     else torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1))
        if observer is not None:  # the steps' traffic: construction's broadcasts of initial values left out
            observer.calls.clear()
        losses, norms = [], []
        for step in range(STEPS):
            losses += models.accumulate_step(model, rank, world, step, BATCH, ACCUMULATE)
            norms.append(float(engine.clip_grad_norm_(0.5)))
            opt.step()
            opt.zero_grad()
        calls = list(observer.calls) if observer is not None else []
        memory = engine.memory()
        with engine.gathered():
            weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        return {"losses": losses, "norms": norms, "weights": weights, "calls": calls,
                "bytes": dict(vars(engine.comm.bytes)),
                "state": {k: memory[k][1] for k in ("shards_device", "grad_shards", "optimizer")}}
    finally:
        monkeypatch.undo()


def _assert_close(hybrid: list[dict], full: list[dict], rtol: float, weights_only: bool = False) -> None:
    for h, f in zip(hybrid, full):
        if not weights_only:
            torch.testing.assert_close(torch.tensor(h["losses"]), torch.tensor(f["losses"]), rtol=rtol, atol=0)
            torch.testing.assert_close(torch.tensor(h["norms"]), torch.tensor(f["norms"]), rtol=rtol, atol=0)
        for name, value in f["weights"].items():
            torch.testing.assert_close(h["weights"][name], value, rtol=rtol, atol=rtol * value.abs().max().item(),
                                       msg=name)
    for name, value in hybrid[0]["weights"].items():  # every replica holds the same model
        assert all(torch.equal(h["weights"][name], value) for h in hybrid[1:]), name


@pytest.mark.parametrize("world, size", [(4, 2), (4, 1), (2, 1)])
def test_hybrid_trains_as_full_sharding_up_to_the_order_of_the_mean(world: int, size: int) -> None:
    """Two micro-batches per step and clipping: losses, gradient norms and weights within 1e-6
    of ``full`` sharding over the same ranks (relative; the weights' tolerance relative to each
    tensor's largest value), every replica with the same weights. Size 1 is DDP's layout (each
    rank holds everything, gradients all-reduced)."""
    full = run_distributed(_train, world, "full")
    hybrid = run_distributed(_train, world, "hybrid", "sgd", {"shard_group_size": size})
    _assert_close(hybrid, full, RTOL["fp32"])


def test_hybrid_losses_with_adamw_match_full_sharding() -> None:
    """With AdamW (the main job's optimizer) the losses stay within 1e-6 of ``full``'s."""
    full = run_distributed(_train, 4, "full", "adamw")
    hybrid = run_distributed(_train, 4, "HYBRID_SHARD", "adamw")  # Lightning's name, a node per group
    for h, f in zip(hybrid, full):
        torch.testing.assert_close(torch.tensor(h["losses"]), torch.tensor(f["losses"]), rtol=1e-6, atol=0)


def test_hybrid_keeps_traffic_in_the_group_and_a_group_of_the_state() -> None:
    """Seen from outside the engine (every float collective of ``torch.distributed``): under
    ``full`` on two nodes gathers and reduce-scatters span both; under hybrid every gather and
    reduce-scatter stays within a node, and what crosses is one all-reduce per gradient shard, over
    the ranks with this rank's place in its node, of the shard's bytes (and the clipping norm's
    scalar once a step). The engine's inter-node
    count agrees and is at most half of ``full``'s. Each rank holds the parameter, gradient and
    optimizer shards of a world of two: twice ``full``'s over four, exactly ``full``'s over two."""
    full = run_distributed(_train, 4, "full", "sgd", None, "", True)
    hybrid = run_distributed(_train, 4, "hybrid", "sgd", None, "", True)
    two = run_distributed(_train, 2, "full")
    node_of = {0: 0, 1: 0, 2: 1, 3: 1}
    assert any(len({node_of[r] for r in ranks}) == 2 for r in full for _, ranks, _ in r["calls"])
    for rank, r in enumerate(hybrid):
        crossing = [(name, ranks, nbytes) for name, ranks, nbytes in r["calls"]
                    if len({node_of[x] for x in ranks}) > 1]
        # Besides the shards' all-reduces, one scalar a step: the clipping norm's sum over the ranks.
        norms = [c for c in crossing if c[2] == 4]
        odd = [c for c in crossing if c not in norms and not (c[0] == "all_reduce" and c[1] == (rank % 2, rank % 2 + 2))]
        assert len(norms) == STEPS and not odd, odd
        # A ring all-reduce of R = 2 replicas sends the shard once: what the engine counts across nodes.
        assert r["bytes"]["inter_node"] == r["bytes"]["all_reduced"] == sum(c[2] for c in crossing if c not in norms)
        assert r["bytes"]["inter_node"] <= 0.5 * full[rank]["bytes"]["inter_node"]
        for key, value in r["state"].items():
            assert value == two[rank % 2]["state"][key] > full[rank]["state"][key], key


def _replica_mean(rank: int, world: int, group_size: int, bits: int, n: int) -> dict:
    from lightning_zinf.comm.collectives import Collectives

    comm = Collectives(ranks_per_node=group_size, qgz_bits=bits, block=256, shard_group_size=group_size)
    full = torch.randn(group_size * n, generator=torch.Generator().manual_seed(100 + rank))
    # The reference, outside the engine: the mean over every rank in float64, this rank's slice.
    exact = full.double()
    dist.all_reduce(exact)
    got, made, full = torch.empty(n), [], full.clone()
    with buffers_made(made):
        comm.reduce_scatter_mean(got, full)
    return {"got": got, "exact": exact[comm.shard_rank * n:][:n] / world, "shard_rank": comm.shard_rank,
            "bytes": dict(vars(comm.bytes)), "qgz_bits": comm.qgz_bits, "made": sum(made),
            "accounted": comm.reduce_transient_nbytes(n, torch.float32)}


@pytest.mark.parametrize("world, group_size, n", [(4, 2, 3001), (4, 2, 3000), (3, 1, 3001), (6, 2, 2999), (4, 2, 20),
                                                   (2, 2, 3001)],
                         ids=["2x2-odd", "2x2-whole", "3x1", "3x2", "2x2-tiny", "one-group"])
@pytest.mark.parametrize("bits, band", [(4, (0.10, 0.30)), (8, (0.004, 0.02))])
def test_qgz_under_hybrid_quantizes_the_replicas_all_reduce(world: int, group_size: int, n: int, bits: int,
                                                            band: tuple) -> None:
    """qgZ under hybrid sharding: the gradient shard's all-reduce across the groups moves INT4/INT8
    codes and a scale per block: a reduce-scatter and an all-gather of rows of ``ceil(n / R)`` elements,
    ``2 (R - 1)`` rows a rank sends across, counted as such. The result is the float64 mean over every
    rank within the codes' error band (the mean, not a sum: off by R times), and the ranks holding the
    same shard in different groups hold the same values, bit for bit (their weights would drift
    apart otherwise). The reduce-scatter within the group stays unquantized. A shard so small that
    its rows, padded to whole blocks, would send more than the fp32 ring (20 elements) is
    all-reduced unquantized; one group of every rank quantizes nothing."""
    from triton_kernels import PackedRows

    ranks = run_distributed(_replica_mean, world, group_size, bits, n)
    replicas = world // group_size
    part = -(-n // replicas)  # each replica's partition, quantized in whole blocks of 256
    coded, plain = 2 * PackedRows.of(-(-part // 256) * 256, bits, 256).row_bytes, 2 * n * 4 // replicas
    for rank, got in enumerate(ranks):
        err = float((got["got"].double() - got["exact"]).norm() / got["exact"].norm())
        quantized = replicas > 1 and coded < plain
        assert band[0] < err < band[1] if quantized else err < 1e-6, (rank, err)
        assert got["bytes"]["all_reduced"] == got["bytes"]["inter_node"] == (replicas - 1) * (coded if quantized
                                                                                              else plain)
        assert got["bytes"]["reduce_scattered"] == (group_size - 1) * n * 4 and got["qgz_bits"] is None
        same = [r["got"] for r in ranks if r["shard_rank"] == got["shard_rank"]]
        assert len(same) == replicas and all(torch.equal(s, got["got"]) for s in same)
        # What the engine's ledger adds for the reduce is what the collectives made.
        assert got["accounted"] == got["made"] and (got["made"] > 0) == quantized, got


def test_qgz_under_hybrid_trains_close_to_full_sharding_with_codes_across_the_nodes() -> None:
    """Hybrid sharding with qgZ (INT8 codes) on two nodes of two: the losses within 2% of ``full``
    sharding's in fp32, every replica with the same weights, bit for bit. Seen from outside the
    engine, what crosses between the nodes is the codes' all-to-all and all-gather over the ranks
    with this rank's place in its node (and the clipping norm's scalar; and an fp32 all-reduce of
    the shards so small that their rows, padded to a block, would be larger), a quarter of hybrid's
    fp32 all-reduce bytes or less; the gathers and reduce-scatters stay within the node, in fp32."""
    from triton_kernels import PackedRows

    codes = {"zero_pp": ZeroPPConfig(ranks_per_node=2, qgz=True, qgz_bits=8)}
    row = PackedRows.of(256, 8, 256).row_bytes  # a partition of at most one block
    full = run_distributed(_train, 4, "full")
    plain = run_distributed(_train, 4, "hybrid", "sgd", None, "", True)
    hybrid = run_distributed(_train, 4, "hybrid", "sgd", codes, "", True)
    node_of = {0: 0, 1: 0, 2: 1, 3: 1}
    for rank, (h, f, p) in enumerate(zip(hybrid, full, plain)):
        assert h["losses"] != f["losses"]  # the gradients were quantized...
        torch.testing.assert_close(torch.tensor(h["losses"]), torch.tensor(f["losses"]), rtol=0.02, atol=0)
        crossing = [c for c in h["calls"] if len({node_of[x] for x in c[1]}) > 1]
        norms = [c for c in crossing if c[2] == 4]
        legs = [c for c in crossing if c not in norms]
        assert len(norms) == STEPS and legs, crossing
        small = [c for c in legs if c[0] == "all_reduce" and c[2] <= 2 * row]  # two replicas: a shard of 2 rows
        odd = [c for c in legs if c not in small and c[0] not in ("all_to_all_single", "all_gather_into_tensor",
                                                                  "all_gather_single")
               or c[1] != (rank % 2, rank % 2 + 2)]
        assert not odd and len(small) < len(legs) / 2, (odd, small)
        assert h["bytes"]["inter_node"] == h["bytes"]["all_reduced"] <= 0.27 * p["bytes"]["all_reduced"]
    for name, value in hybrid[0]["weights"].items():
        assert all(torch.equal(h["weights"][name], value) for h in hybrid[1:]), name


def _composition(feature: str) -> tuple[dict, str]:
    return {
        "offload_cpu": ({"offload": {"param": "cpu", "optimizer": "cpu"}}, "fp32"),
        "offload_nvme": ({"offload": {"param": "nvme", "optimizer": "nvme"}}, "fp32"),
        "bf16": ({"mixed_precision": MixedPrecisionConfig(param_dtype="bf16")}, "bf16"),
        "tiling": ({"tiling": TilingConfig(tile_numel=4096)}, "fp32"),
        "checkpointing": ({"activation_checkpointing": [models.Block]}, "fp32"),
        "lora_frozen_int8": ({"lora": True, "zero_pp": ZeroPPConfig(ranks_per_node=2, frozen_bits=8)}, "fp32"),
        "qwz": ({"zero_pp": ZeroPPConfig(ranks_per_node=2, qwz=True)}, "bf16"),
    }[feature]


@pytest.mark.parametrize("feature", ["offload_cpu", "offload_nvme", "bf16", "tiling", "checkpointing",
                                     "lora_frozen_int8", "qwz"])
def test_hybrid_composes_with_the_other_features(feature: str, tmp_path: Path) -> None:
    """Hybrid sharding with CPU and NVMe offload, bf16, tiling, activation checkpointing, LoRA over
    frozen INT8 weights and qwZ's quantized gathers (within the group): the losses and weights of
    ``full`` sharding with the same feature. Frozen INT8 codes are quantized shard by shard, so
    their blocks follow the shard group: there the reference is ``full`` over a world of the
    group's size (the same codes), whose weights hybrid's must equal to the mean's rounding."""
    extra, tolerance = _composition(feature)
    hybrid = run_distributed(_train, 4, "hybrid", "sgd", extra, str(tmp_path / "hybrid"))
    if feature == "lora_frozen_int8":
        full = run_distributed(_train, 2, "full", "sgd", extra, str(tmp_path / "full"))
        _assert_close(hybrid, full + full, RTOL["fp32"], weights_only=True)
        return
    full = run_distributed(_train, 4, "full", "sgd", extra, str(tmp_path / "full"))
    _assert_close(hybrid, full, RTOL[tolerance])


MICRO_BATCH = 2


def _fabric(world: int, options: dict) -> Any:
    import lightning.fabric as L

    from lightning_zinf import ZeroInfinityFabricStrategy

    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=ZeroInfinityFabricStrategy(
        block_classes=["Block"], zero_pp={"ranks_per_node": min(2, world)}, **options))
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module():
        model = models.GPT(**GPT)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return fabric, model, optimizer


def _fabric_steps(fabric: Any, model: Any, optimizer: Any, steps: range) -> list[float]:
    """Each step a global batch of ``MICRO_BATCH`` rows per rank, clipped; the losses (mean over ranks)."""
    losses = []
    for step in steps:
        x, y = models.make_batch("gpt", step, MICRO_BATCH * fabric.world_size)
        rows = slice(fabric.global_rank * MICRO_BATCH, (fabric.global_rank + 1) * MICRO_BATCH)
        loss = models.loss_fn(model, x[rows], y[rows])
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach()).item())
    return losses


def _weights(fabric: Any, model: Any) -> dict[str, torch.Tensor]:
    with fabric.strategy.engine.gathered():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _fabric_save(rank: int, world: int, folder: str, options: dict) -> dict:
    """Train 2 steps, save, train 2 more (the run that never stopped)."""
    fabric, model, optimizer = _fabric(world, options)
    _fabric_steps(fabric, model, optimizer, range(2))
    fabric.save(folder, {"model": model, "optimizer": optimizer})
    saved = _weights(fabric, model)
    return {"saved": saved, "straight": _fabric_steps(fabric, model, optimizer, range(2, 4))}


def _fabric_load(rank: int, world: int, folder: str, options: dict) -> dict:
    """Build, load the checkpoint and train the same 2 steps on."""
    fabric, model, optimizer = _fabric(world, options)
    fabric.load(folder, {"model": model, "optimizer": optimizer})
    return {"loaded": _weights(fabric, model), "resumed": _fabric_steps(fabric, model, optimizer, range(2, 4))}


@pytest.mark.parametrize("first, second", [({"sharding": "hybrid"}, {"sharding": "full"}),
                                           ({"sharding": "full"}, {"sharding": "hybrid"})],
                         ids=["hybrid-to-full", "full-to-hybrid"])
def test_a_checkpoint_moves_between_hybrid_and_full_sharding(tmp_path: Path, first: dict, second: dict) -> None:
    """Under Fabric on 4 ranks (two nodes of two), a checkpoint saved under one mode loads under
    the other: the weights are the saved ones exactly, and training on gives the losses of the run
    that never stopped, to the order of the mean's additions."""
    before = run_distributed(_fabric_save, 4, str(tmp_path / "ckpt"), first, init_pg=False)
    after = run_distributed(_fabric_load, 4, str(tmp_path / "ckpt"), second, init_pg=False)
    for b, a in zip(before, after):
        for name, value in b["saved"].items():
            assert torch.equal(a["loaded"][name], value), name
        torch.testing.assert_close(torch.tensor(a["resumed"]), torch.tensor(b["straight"]), rtol=1e-5, atol=0)


def test_a_hybrid_checkpoint_loads_at_another_world_size(tmp_path: Path) -> None:
    """Saved under hybrid sharding on 4 ranks, which write one copy of the state (the first
    group's shard files: the checkpoint of a world of two), loaded under ``full`` on 2 ranks and
    under hybrid on 2 (one rank per group): the weights are the saved ones exactly."""
    before = run_distributed(_fabric_save, 4, str(tmp_path / "ckpt"), {"sharding": "hybrid"}, init_pg=False)
    meta = torch.load(tmp_path / "ckpt" / "meta.pt", weights_only=False)
    assert meta["zinf"]["world_size"] == 2 and len(meta["zinf"]["sha256"]) == 2
    for options in ({"sharding": "full"}, {"sharding": "hybrid", "shard_group_size": 1}):
        for a in run_distributed(_fabric_load, 2, str(tmp_path / "ckpt"), options, init_pg=False):
            for name, value in before[0]["saved"].items():
                assert torch.equal(a["loaded"][name], value), (options, name)


def _trainer_losses(rank: int, world: int, strategy: Any) -> tuple[list[float], str, int]:
    from lightning_zinf import ZeroInfinityStrategy
    from tests.test_trainer import GLOBAL_BATCH, LitGPT, _trainer

    if isinstance(strategy, dict):
        strategy = ZeroInfinityStrategy(**strategy)
    lit = LitGPT(GLOBAL_BATCH // world)
    trainer = _trainer(strategy, world)
    trainer.fit(lit)
    return lit.train_losses, trainer.strategy.options.sharding, trainer.strategy.engine.comm.shard_size


def test_the_trainer_takes_lightnings_name_the_group_size_and_a_preset() -> None:
    """``ZeroInfinityStrategy(sharding="HYBRID_SHARD", shard_group_size=1)`` under a real Trainer
    (validation and clipping included) trains with the default's losses; the
    ``"zero_infinity_hybrid"`` preset shards within the node (here both ranks)."""
    full = run_distributed(_trainer_losses, 2, "zero_infinity", init_pg=False)
    named = run_distributed(_trainer_losses, 2, {"sharding": "HYBRID_SHARD", "shard_group_size": 1}, init_pg=False)
    preset = run_distributed(_trainer_losses, 2, "zero_infinity_hybrid", init_pg=False)
    assert named[0][1:] == ("hybrid", 1) and preset[0][1:] == ("hybrid", 2) and full[0][1:] == ("full", 2)
    torch.testing.assert_close(torch.tensor(named[0][0]), torch.tensor(full[0][0]), rtol=1e-6, atol=0)
    assert preset[0][0] == full[0][0]


def _refused(rank: int, world: int, cases: list[dict]) -> list[str]:
    """Each case's error building an engine with it (every case fails before any collective)."""
    messages = []
    for kwargs in cases:
        try:
            ZeroEngine(models.GPT(**GPT), block_classes=["Block"], **kwargs)
            messages.append("built")
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_what_hybrid_sharding_refuses() -> None:
    """Lightning's and torch's names are accepted (NO_SHARD and _HYBRID_SHARD_ZERO2 are told what
    to use instead, a misspelling the nearest name); a group size that does not divide the world,
    one given without hybrid sharding, and hpZ with it are refused on every rank, each
    message naming the option and the fix."""
    from torch.distributed.fsdp import ShardingStrategy

    assert ZeroOptions(sharding="HYBRID_SHARD").sharding == "hybrid"
    assert ZeroOptions(sharding=ShardingStrategy.HYBRID_SHARD, shard_group_size=2).shard_group_size == 2
    with pytest.raises(ValueError, match="_HYBRID_SHARD_ZERO2 .* is not available; the nearest are 'hybrid'"):
        ZeroOptions(sharding=ShardingStrategy._HYBRID_SHARD_ZERO2)
    with pytest.raises(ValueError, match="NO_SHARD keeps every parameter on every rank: use Lightning's 'ddp'"):
        ZeroOptions(sharding=ShardingStrategy.NO_SHARD)
    with pytest.raises(ValueError, match="sharding='hybird': Did you mean 'hybrid'"):
        ZeroOptions(sharding="hybird")
    # Refused at construction, before any process starts, as the engine refuses them too.
    with pytest.raises(ValueError, match="sharding='hybrid' does not combine with ZeroPPConfig"):
        ZeroOptions(sharding="hybrid", zero_pp={"hpz": True})
    assert ZeroOptions(sharding="hybrid", zero_pp={"qgz": True}).zero_pp.qgz  # the replicas' all-reduce as codes
    with pytest.raises(ValueError, match="shard_group_size=2 sets the groups of hybrid sharding"):
        ZeroOptions(shard_group_size=2)
    with pytest.raises(ValueError, match="shard_group_size=0: give a positive number"):
        ZeroOptions(sharding="hybrid", shard_group_size=0)
    cases = [({"sharding": "hybrid", "shard_group_size": 3}, "shard_group_size=3 must be a positive divisor of the "
                                                               "world size 4"),
             ({"sharding": "full", "shard_group_size": 2}, "give sharding='hybrid' with it"),
             ({"sharding": "hybrid", "zero_pp": ZeroPPConfig(hpz=True)}, r"hpz=True\) does not combine")]
    for texts in run_distributed(_refused, 4, [kwargs for kwargs, _ in cases]):
        for (kwargs, message), text in zip(cases, texts):
            assert re.search(message, text), (kwargs, text)


def test_a_memory_budget_plans_hybrid_sharding_as_a_world_of_one_group() -> None:
    """``memory_budget`` under hybrid sharding plans the state a rank holds: the shard group's
    share, the prediction of ``full`` sharding over a world of ``shard_group_size`` ranks, and
    more than ``full``'s over every rank."""
    from lightning_zinf import meta_parameters
    from lightning_zinf.engine_setup import memory_plan

    with meta_parameters():
        model = models.GPT(**GPT)
    plan = {}
    for name, options, world in (("hybrid", {"sharding": "hybrid", "shard_group_size": 2}, 4),
                                 ("full over 2", {}, 2), ("full over 4", {}, 4)):
        plan[name] = memory_plan(model, ZeroOptions(block_classes=["Block"], memory_budget="1GiB", **options),
                                 device=torch.device("cpu"), precision=MixedPrecisionConfig(), world=world)
    assert plan["hybrid"].prediction == plan["full over 2"].prediction
    assert plan["hybrid"].prediction.total(False) > plan["full over 4"].prediction.total(False)


def test_after_a_failed_all_reduce_the_later_ones_raise_without_running() -> None:
    """The gloo thread that runs hybrid's all-reduces after their reduce-scatters: a task that
    raises hands its error to its waiter, and every later task raises that error without running
    (a rank that skipped one collective must not pair its next with the peers' skipped one)."""
    from lightning_zinf.comm.collectives import _Sequence

    ran: list[int] = []
    sequence = _Sequence()
    first = sequence.submit(lambda: ran.append(1))

    def fail() -> None:
        raise RuntimeError("Connection closed by peer (simulated)")

    failed = sequence.submit(fail)
    later = sequence.submit(lambda: ran.append(3))
    assert first.wait()
    for handle in (failed, later):
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            handle.wait()
    assert ran == [1]
