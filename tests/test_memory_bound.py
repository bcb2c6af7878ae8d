"""ZeRO-3's memory bound (ZeRO §5.3, ZeRO-Infinity §4) in every configuration: a rank holds its
shards plus a few gathered units, whatever the depth.

For each cell, the same GPT is built with 4 and with 12 blocks (one unit each) and trained for two
steps at 2 ranks (4 for the offload and ZeRO++ cells). Two quantities of the second step must not
grow with depth, beyond one unit:

- the peak of gathered parameter bytes over forward and backward (the engine's ledger);
- the bytes of parameter values that autograd keeps for backward at the end of forward, seen by an
  observer outside the engine: saved-tensor hooks that recognise a parameter's values by storage
  (a view of a gathered buffer) or by value (a copy, such as autocast's cast of a weight), and
  count the bytes of storage those tensors still hold.

The grid: precision {32-true, bf16-mixed, bf16-true} x {all trainable, frozen base with rank-4
adapters} x {activation checkpointing off, on}, every cell.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from lightning_zinf import MixedPrecisionConfig, OffloadConfig, PrefetchConfig, ZeroEngine, ZeroPPConfig
from lightning_zinf.engine.buffers import SLACK
from lightning_zinf.engine.flat import shard_numel
from tests import models
from tests.harness import run_distributed

D = 64
DEPTHS = (4, 12)
BF16 = MixedPrecisionConfig(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@dataclass(frozen=True)
class Cell:
    precision: str = "32-true"
    lora: bool = False
    ac: str = ""  # activation checkpointing: "option" (the engine's), "hand" or "reentrant" (the model's)
    discarded_forward: bool = False  # a forward with gradients on whose graph is never run backward
    offload: dict = field(default_factory=dict)
    zero_pp: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        extra = "".join(f"-{k}={v}" for k, v in {**self.offload, **self.zero_pp}.items() if k != "nvme_path")
        extra += "-discarded-forward" if self.discarded_forward else ""
        return f"{self.precision}-{'lora' if self.lora else 'full'}-ac={self.ac or 'off'}{extra}"


class SavedWeightObserver:
    """Saved-tensor hooks that record every tensor autograd saves whose values are a parameter's:
    a view of the parameter's storage, or a tensor equal to it (or to its transpose) after a cast.
    Knows nothing of the engine."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = list(model.parameters())
        self.kept: list[torch.Tensor] = []

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and any(self._is_value_of(t, p) for p in self.params):
            self.kept.append(t)
        return t

    @staticmethod
    def _is_value_of(t: torch.Tensor, p: torch.Tensor) -> bool:
        if p.numel() == 0:
            return False
        if t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr():
            return True
        if t.numel() != p.numel():
            return False
        candidates = [p] + ([p.t()] if p.dim() == 2 else [])
        return any(c.shape == t.shape and torch.equal(t, c.to(t.dtype)) for c in candidates)

    def kept_bytes(self) -> int:
        """Bytes of storage that the recorded tensors hold now (a released gather holds none)."""
        storages = {}
        for t in self.kept:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())


def _schedule_peak(model: models.GPT, world: int, itemsize: int) -> int:
    """The gathered bytes the schedule holds at its fullest, from the parameters' sizes (read
    before partitioning), not from the engine's ledger: two blocks (the one in use and the next,
    gathered ahead: the bucket holds one block; the one before is released by then) and, when it
    is trainable, the tied embedding, which the head gathers at the start of backward and which
    stays gathered until the embedding's backward, the last, completes its gradient. Nothing is
    persistent. Each flat group (one per ``requires_grad``) is padded to ``world`` aligned shards."""

    def gathered(params) -> int:
        numel: dict[bool, int] = {}
        for p in params:
            numel[p.requires_grad] = numel.get(p.requires_grad, 0) + p.numel()
        return sum(shard_numel(n, world) * world * itemsize for n in numel.values())

    tied = gathered([model.wte.weight]) if model.wte.weight.requires_grad else 0
    return 2 * max(gathered(block.parameters()) for block in model.blocks) + tied


def _measure(cell: Cell, depth: int, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = models.GPT(vocab=64, d=D, layers=depth, heads=2, seq=16, lora_rank=4 if cell.lora else 0,
                       checkpointing={"hand": True, "reentrant": "reentrant"}.get(cell.ac, False))
    if cell.precision == "bf16-true":
        model = model.to(torch.bfloat16)
    unit_numel = sum(p.numel() for p in model.blocks[0].parameters())
    schedule_peak = _schedule_peak(model, world, 4 if cell.precision == "32-true" else 2)
    engine = ZeroEngine(
        model,
        block_classes=["Block"],
        # The next unit is gathered ahead (the bucket holds one block), nothing stays gathered.
        prefetch=PrefetchConfig(bucket_size=unit_numel, persistence_threshold=0),
        mixed_precision=BF16 if cell.precision == "bf16-mixed" else MixedPrecisionConfig(),
        activation_checkpointing=["Block"] if cell.ac == "option" else (),
        offload=OffloadConfig(**cell.offload),
        zero_pp=ZeroPPConfig(**cell.zero_pp),
    )
    opt = engine.shard_optimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3))
    for step in range(2):  # the second replays the prefetch trace
        x, y = models.make_batch("gpt", step, 2 * world)
        x, y = x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]
        engine.reset_memory_peaks()
        if cell.discarded_forward:  # e.g. a metric computed with gradients on, never backpropagated
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cell.precision == "bf16-mixed"):
                models.loss_fn(model, x, y)
        observer = SavedWeightObserver(model)
        with torch.autograd.graph.saved_tensors_hooks(observer.pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cell.precision == "bf16-mixed"):
                loss = models.loss_fn(model, x, y)
        kept = observer.kept_bytes()
        observer.kept.clear()
        grad_shards_in_forward = engine.memory()["grad_shards"][0]
        loss.backward()
        opt.step()
        opt.zero_grad()
    memory = engine.memory()
    unit = max(sum(g.full.numel() * g.full.element_size() for g in u.groups) for u in engine.units)
    # One group's reduce-scatter buffers: the flat gradient in the reduce dtype, this rank's slice,
    # and the collective's own (gloo's copies of the slice received from the peers, qgZ's codes).
    one_reduce = max(g.reduce_dtype.itemsize * (g.padded_numel + g.shard_numel)
                     + engine.comm.reduce_transient_nbytes(g.shard_numel, g.reduce_dtype)
                     for g in engine.groups if g.trainable)
    engine.release_all()
    return {"gathered": memory["gathered"][1], "kept": kept, "unit": unit, "loss": loss.item(),
            "one_reduce": one_reduce, "pooled_after_step": memory["pooled"][0],
            "gathers_kept": memory["gathers_kept"][1],
            "grad_buffers": memory["grad_buffers"][1], "reduce_pending": memory["reduce_pending"][1],
            "secondary": memory["secondary"][1], "grad_shards_in_forward": grad_shards_in_forward,
            "offloaded_optimizer": cell.offload.get("optimizer", "none") != "none", "schedule_peak": schedule_peak}


def _cells(rank: int, world: int, cells: list[Cell]) -> dict:
    return {cell.name: {depth: _measure(cell, depth, rank, world) for depth in DEPTHS} for cell in cells}


def _check(results: dict) -> None:
    for name, by_depth in results.items():
        shallow, deep = by_depth[DEPTHS[0]], by_depth[DEPTHS[-1]]
        unit = deep["unit"]
        assert deep["loss"] == deep["loss"], f"{name}: NaN loss"
        for key in ("gathered", "kept", "grad_buffers", "reduce_pending", "gathers_kept"):
            assert deep[key] - shallow[key] <= unit, (
                f"{name}: {key} grows with depth: {shallow[key]} B at {DEPTHS[0]} blocks, {deep[key]} B at "
                f"{DEPTHS[-1]} (one unit: {unit} B)"
            )
        # The previous step's gradient shards were freed after zero_grad (offloaded ones are kept).
        if not deep["offloaded_optimizer"]:
            assert deep["grad_shards_in_forward"] == 0, (name, deep)
        # One reduce-scatter in flight at a time (in buffers the pool may serve from one up to
        # SLACK times larger), and no idle gradient buffer kept between steps.
        assert 0 < deep["reduce_pending"] <= SLACK * deep["one_reduce"], (name, deep)
        assert deep["pooled_after_step"] == 0, (name, deep)
        # Gather memory kept for reuse (the CPU's gather pool) never exceeds what the gathers held at once.
        assert deep["gathers_kept"] <= deep["gathered"], (name, deep)
        # A few units at most, at any depth: the one in use, the one gathered ahead, one whose
        # gradients are still being reduced, and the small ones (embeddings, final norm).
        assert deep["gathered"] <= 4 * unit, (name, deep)
        # Exactly the schedule's peak at both depths: a unit released late (one more block
        # gathered) or a prefetch beyond the bucket shows here, though it stays within the bounds above.
        for depth, r in by_depth.items():
            assert r["gathered"] == r["schedule_peak"], (
                f"{name}: peak of gathered bytes at {depth} blocks is {r['gathered']} B, the schedule's "
                f"{r['schedule_peak']} B (one block: {r['unit']} B)"
            )


GRID = [Cell(precision=p, lora=lora, ac=ac) for p in ("32-true", "bf16-mixed", "bf16-true")
        for lora in (False, True) for ac in ("", "option")]
# torch.utils.checkpoint applied by the model itself to each block's __call__, non-reentrant and
# reentrant: the route Hugging Face's gradient_checkpointing_enable() takes. (Reentrant
# checkpointing of a frozen-embedding LoRA model gets no gradients without the inputs made to
# require grad, which is a torch rule, so it is run with everything trainable.)
HAND = [Cell(precision="bf16-mixed", lora=lora, ac="hand") for lora in (False, True)] + [
    Cell(precision="bf16-mixed", ac="reentrant"), Cell(precision="bf16-mixed", lora=True, discarded_forward=True)]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_bound_holds_in_every_cell_of_the_grid(precision: str) -> None:
    cells = [c for c in GRID if c.precision == precision] + [c for c in HAND if c.precision == precision]
    _check(run_distributed(_cells, 2, cells)[0])


def test_bound_with_offload_and_zero_pp(tmp_path) -> None:
    """At 4 ranks: parameters and optimizer in CPU memory, and on NVMe; hpZ + qwZ over 2 simulated
    nodes (whose secondary partitions, ZeRO++'s stated cost, are the one category that grows)."""
    cells = [
        Cell(precision="bf16-mixed", lora=True, offload={"param": "cpu", "optimizer": "cpu"}),
        Cell(precision="bf16-mixed", ac="option", offload={"param": "nvme", "optimizer": "nvme", "nvme_path": str(tmp_path)}),
        Cell(precision="bf16-mixed", lora=True, zero_pp={"ranks_per_node": 2, "hpz": True, "qwz": True}),
        Cell(precision="32-true", ac="option", zero_pp={"ranks_per_node": 2, "hpz": True, "qwz": True}),
    ]
    results = run_distributed(_cells, 4, cells)[0]
    _check(results)
    hpz = results[cells[2].name]
    assert hpz[DEPTHS[-1]]["secondary"] > hpz[DEPTHS[0]]["secondary"] > 0


def test_observer_sees_autocast_copies() -> None:
    """The observer is not blind: in plain PyTorch under bf16 autocast, the bf16 casts of the
    Linear weights it keeps for backward are found, and their bytes grow with depth."""
    kept = {}
    for depth in DEPTHS:
        torch.manual_seed(0)
        model = models.GPT(vocab=64, d=D, layers=depth, heads=2, seq=16)
        observer = SavedWeightObserver(model)
        x, _ = models.make_batch("gpt", 0, 2)
        with torch.autograd.graph.saved_tensors_hooks(observer.pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(x)
        kept[depth] = observer.kept_bytes()
    linear_bf16 = 2 * sum(m.weight.numel() for m in models.GPT(d=D, layers=1).blocks[0].modules()
                          if isinstance(m, torch.nn.Linear))
    assert kept[DEPTHS[-1]] - kept[DEPTHS[0]] >= (DEPTHS[-1] - DEPTHS[0]) * linear_bf16


def _overlap(rank: int, world: int, overlap: bool) -> dict:
    torch.manual_seed(0)
    model = models.GPT(vocab=64, d=D, layers=4, heads=2, seq=16)
    engine = ZeroEngine(model, block_classes=["Block"], mixed_precision=BF16,
                        prefetch=PrefetchConfig(persistence_threshold=0, overlap_reduce=overlap))
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    losses, in_flight = [], []  # reduce-scatter bytes in flight as each block's backward starts
    for block in model.blocks:
        block.register_full_backward_pre_hook(lambda *_: in_flight.append(engine.memory()["reduce_pending"][0]))
    for step in range(2):
        x, y = models.make_batch("gpt", step, 2 * world)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = models.loss_fn(model, x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    block = next(u for u in engine.units if u.name == "blocks.0").groups[0]
    return {"losses": losses, "in_flight": in_flight, "block_reduce": 4 * (block.padded_numel + block.shard_numel)}


def test_reduce_without_overlap_is_finished_before_the_next_backward() -> None:
    """With ``overlap_reduce`` (default) a block's fp32 reduce-scatter is still in flight while the
    next block's backward starts (its cast and slice, nothing more); with ``False`` none is, and the
    training is the same."""
    overlapped = run_distributed(_overlap, 2, True)[0]
    waited = run_distributed(_overlap, 2, False)[0]
    assert waited["losses"] == overlapped["losses"]
    assert set(waited["in_flight"]) == {0}
    # Per step (4 blocks, last first): the last block finds the final LayerNorm's reduce in flight,
    # each other block the reduce of the block after it, and nothing more.
    last, *others = overlapped["in_flight"][:4]
    assert overlapped["in_flight"] == overlapped["in_flight"][:4] * 2, overlapped
    assert 0 < last < overlapped["block_reduce"] and others == [overlapped["block_reduce"]] * 3, overlapped


def _grad_storages(rank: int, world: int, policy: MixedPrecisionConfig) -> list:
    torch.manual_seed(0)
    model = models.GPT(vocab=64, d=D, layers=2, heads=2, seq=16)
    weight = model.blocks[0].up.weight
    numel, unit = weight.numel(), sum(p.numel() for p in model.blocks[0].parameters())
    ZeroEngine(model, block_classes=["Block"], mixed_precision=policy, prefetch=PrefetchConfig(persistence_threshold=0))
    seen = []  # bytes of the storage behind the weight's gradient, as autograd hands it over
    weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.untyped_storage().nbytes()))
    x, y = models.make_batch("gpt", 0, 2 * world)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=policy.param_dtype is not None):
        models.loss_fn(model, x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]).backward()
    return [seen, numel, unit]


def test_mixed_precision_gradients_are_not_copied_into_a_unit_wide_buffer() -> None:
    """Under the bf16 policy a weight's gradient is autograd's own tensor (its storage holds that
    weight alone, cast into the fp32 reduce-scatter input afterwards, as FSDP2 does); in fp32 it is
    a view of the unit's flat gradient buffer, which is the reduce-scatter input itself."""
    seen, numel, unit = run_distributed(_grad_storages, 2, BF16)[0]
    assert seen == [2 * numel], (seen, numel)
    seen, numel, unit = run_distributed(_grad_storages, 2, MixedPrecisionConfig())[0]
    assert len(seen) == 1 and seen[0] >= 4 * unit, (seen, unit)


class _ActorAndReward(torch.nn.Module):
    """Two models in one module, as in RLHF (issue 31): an actor with rank-4 adapters on a frozen
    base, and a frozen reward model; each of its own depth."""

    def __init__(self, actor_depth: int, reward_depth: int) -> None:
        super().__init__()
        self.actor = models.GPT(vocab=64, d=D, layers=actor_depth, heads=2, seq=16, lora_rank=4)
        self.reward = models.GPT(vocab=64, d=D, layers=reward_depth, heads=2, seq=16)
        self.reward.requires_grad_(False)


def _two_models(rank: int, world: int, frozen_bits) -> dict:
    out = {}
    for depths in ((4, 4), (12, 4), (4, 12)):
        torch.manual_seed(0)
        module = _ActorAndReward(*depths)
        unit_numel = sum(p.numel() for p in module.actor.blocks[0].parameters())
        engine = ZeroEngine(module, block_classes=["Block"], prefetch=PrefetchConfig(bucket_size=unit_numel, persistence_threshold=0),
                            zero_pp=ZeroPPConfig(frozen_bits=frozen_bits))
        opt = engine.shard_optimizer(torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-3))
        for step in range(2):
            x, y = models.make_batch("gpt", step, 2 * world)
            x, y = x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]
            engine.reset_memory_peaks()
            with torch.no_grad():
                score = module.reward(x).mean()  # the reward phase: forward only
            loss = models.loss_fn(module.actor, x, y) - 0.0 * score
            loss.backward()
            opt.step()
            opt.zero_grad()
        memory = engine.memory()
        unit = max(sum(g.full.numel() * g.full.element_size() for g in u.groups) for u in engine.units)
        out[depths] = {"gathered": memory["gathered"][1], "grad_buffers": memory["grad_buffers"][1],
                       "reduce_pending": memory["reduce_pending"][1], "unit": unit, "loss": loss.item()}
        engine.release_all()
    return out


@pytest.mark.parametrize("frozen_bits", [None, 8])
def test_each_of_two_models_keeps_the_bound_as_it_deepens(frozen_bits) -> None:
    """One engine over an actor (adapters on a frozen base) and a frozen reward model, stepped as an
    RLHF step runs them (the reward's forward without gradients, the actor's forward, backward and
    step): deepening either model by 8 blocks adds at most one unit to the peak of gathered bytes
    and nothing to the gradient buffers, with the frozen weights as they are or stored as INT8."""
    results = run_distributed(_two_models, 2, frozen_bits)[0]
    base = results[(4, 4)]
    for depths in ((12, 4), (4, 12)):
        deep = results[depths]
        assert deep["loss"] == deep["loss"]
        for key in ("gathered", "grad_buffers", "reduce_pending"):
            assert deep[key] - base[key] <= deep["unit"], (depths, key, base, deep)
        assert 0 < deep["gathered"] <= 4 * deep["unit"], (depths, deep)


LIMIT = 2_000  # persistence_limit of the test below: elements


def _small_units(rank: int, world: int, depth: int, limit: int) -> dict:
    """A stack of ``depth`` Linear(16, 16) + LayerNorm(16) pairs, a unit per module (every one under
    the persistence threshold), bucket of 600 elements; two steps. What an observer outside the
    engine sees: the elements of parameters holding values (a released one is an empty tensor)
    after the last step, and their peak over every module call of its forward."""
    from lightning_zinf.planning.inventory import Inventory

    torch.manual_seed(0)
    layers = [m for _ in range(depth) for m in (torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))]
    model = torch.nn.Sequential(*layers)
    # What the planner predicts, from the model as the user built it.
    inventory = Inventory.of(model, world=world, unit_size=0, persistence_limit=limit)
    prefetch = PrefetchConfig(unit_size=0, bucket_size=600, persistence_limit=limit)
    engine = ZeroEngine(model, prefetch=prefetch)
    opt = engine.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    params = list(model.parameters())

    def holding() -> int:
        return sum(p.numel() for p in params)

    peak = [0]
    for layer in layers:  # after the engine's own pre-hooks: the unit is gathered when it runs
        layer.register_forward_pre_hook(lambda *_: peak.__setitem__(0, max(peak[0], holding())))
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(2):
        peak[0] = 0
        loss = model(torch.randn(4, 16, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    planned = sorted({(f.unit, f.persistent) for f in inventory.groups})
    with engine.gathered():
        weights = [p.detach().clone() for p in params]
    return {"between_steps": holding(), "peak": peak[0], "losses": losses, "weights": weights,
            "planned": [persistent for _, persistent in planned],
            "engine": [unit.persistent for unit in engine.units]}


def test_persistent_units_stay_within_the_limit_and_flat_in_depth() -> None:
    """``persistence_limit``: in a stack of hundreds of units under the persistence threshold, the
    parameters an observer sees holding values between steps stay within the limit at 8 and at 48
    layer pairs (without it, the whole model: the observer does see persistence), the smallest
    units are the ones kept (the LayerNorms first), the peak over the forward grows by no more than
    a unit with depth, the planner's inventory marks the same units persistent, and training is the
    same, bit for bit, as with every unit persistent."""
    def run(depth: int, limit: int) -> dict:
        return run_distributed(_small_units, 2, depth, limit)[0]

    shallow, deep, unlimited = run(8, LIMIT), run(48, LIMIT), run(48, 1 << 40)
    total = 48 * (16 * 16 + 16 + 2 * 16)
    assert unlimited["between_steps"] == total  # every unit persistent: all held
    for r in (shallow, deep):
        assert 0 < r["between_steps"] <= LIMIT, r["between_steps"]
        assert r["planned"] == r["engine"]
    # The smallest first: every LayerNorm (32 elements) of the deep stack, then as many Linears
    # (272) as the rest of the limit holds, the first ones.
    linears = (LIMIT - 48 * 32) // 272
    assert deep["engine"][1::2] == [True] * 48
    assert deep["engine"][0::2] == [True] * linears + [False] * (48 - linears)
    assert deep["peak"] - shallow["peak"] <= 16 * 16 + 16, (shallow["peak"], deep["peak"])
    assert deep["peak"] < total / 4
    assert deep["losses"] == unlimited["losses"]
    assert all(torch.equal(a, b) for a, b in zip(deep["weights"], unlimited["weights"]))
