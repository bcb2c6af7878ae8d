"""The memory plan's view of a training step before it runs (:mod:`lightning_zinf.planning.profile`,
:mod:`lightning_zinf.planning.timing`): the example input's forward on fake tensors against a real
forward seen by the test's own hooks, the collective bytes against the engine's own counters, and
a Trainer run whose blocks are planned at setup from ``example_input_array``.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_zinf import MixedPrecisionConfig, PrefetchConfig, ZeroEngine
from lightning_zinf.engine_setup import memory_plan
from lightning_zinf.options import ZeroOptions
from lightning_zinf.planning import Inventory, Placement, predict
from lightning_zinf.planning.bandwidth import Bandwidths, measure_collective
from lightning_zinf.planning.profile import ForwardProfile, profile_forward, time_blocks
from lightning_zinf.planning.timing import collective_bytes, step_time
from tests import models
from tests.harness import run_distributed
from tests.test_memory_budget import SavedInLastStep


def _real_saved(model: nn.Module, run) -> int:
    """Bytes of the storages autograd keeps during ``run()``, each once, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def _saved_per_block(blocks: list[tuple[str, nn.Module]], skip) -> dict[str, dict[int, int]]:
    """Hooks of the test's own around each block's forward: storage -> bytes of what autograd saves
    inside it, each storage once, those ``skip(tensor)`` names left out (filled as the forward runs;
    a checkpointed block's own hooks hide what it saves)."""
    saved: dict[str, dict[int, int]] = {}
    scopes: dict[str, object] = {}
    for name, block in blocks:
        def enter(_m, _a, name=name):
            storages: dict[int, int] = {}
            saved[name] = storages

            def pack(t):
                if not skip(t):
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            scopes[name] = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            scopes[name].__enter__()

        def leave(_m, _a, _o, name=name):
            scopes.pop(name).__exit__(None, None, None)

        block.register_forward_pre_hook(enter)
        block.register_forward_hook(leave)
    return saved


def _blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_profile_equals_a_real_forward(dtype) -> None:
    """Per block, the fake forward's saved bytes, inputs and FLOPs are those of the real forward of
    the same model in the same dtype, seen by the test's own saved-tensor hooks and FlopCounterMode;
    the model is not changed (no hooks left, no parameter touched)."""
    torch.manual_seed(0)
    model = models.GPT(d=64, layers=3, heads=2)
    x = models.make_batch("gpt", 0, 4)[0].clone()  # a storage of its own (the batch's is a slice)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    profile = profile_forward(model, x, _blocks(model), device=torch.device("cpu"), dtype=dtype)
    assert profile is not None and len(profile.blocks) == 3
    assert all(torch.equal(p, before[n]) for n, p in model.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())

    real = model.to(dtype) if dtype is not None else model
    hidden = torch.randn(4, x.shape[1], 64, dtype=dtype or torch.float32, requires_grad=True)
    block_saved = _real_saved(real, lambda: real.blocks[0](hidden))
    with FlopCounterMode(display=False) as flops:
        real(x)
    for b in profile.blocks:
        assert b.saved == block_saved, (b, block_saved)
        assert b.inputs == hidden.numel() * hidden.element_size()
    assert profile.flops == flops.get_total_flops()
    assert sum(b.flops for b in profile.blocks) < profile.flops  # the embeddings and the head are outside
    # All kept: what the whole forward saves, and the logits in fp32 for the loss.
    logits = real(x)
    whole = _real_saved(real, lambda: real(x))
    assert profile.activation_bytes(3) == whole + logits.numel() * 4
    # All checkpointed: outside, three inputs, one block's own to recompute.
    assert profile.activation_bytes(0) == profile.outside + 3 * profile.blocks[0].inputs + block_saved


def _transformers_model(kind: str, width: int = 64, layers: int = 2) -> tuple[nn.Module, list[tuple[str, nn.Module]]]:
    """A Hugging Face causal LM of ``kind`` (GPT-2 or Llama) and its decoder layers (the blocks)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=layers, n_embd=width, n_head=4, vocab_size=512, n_positions=64))
        return model, [(f"transformer.h.{i}", b) for i, b in enumerate(model.transformer.h)]
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=64))
    return model, [(f"model.layers.{i}", b) for i, b in enumerate(model.model.layers)]


@pytest.mark.parametrize("kind, cls", [("gpt2", "GPT2Block"), ("llama", "LlamaDecoderLayer")])
def test_profile_of_a_transformers_model(kind: str, cls: str) -> None:
    """A Hugging Face GPT-2 and Llama (their masks, position ids, rotary embeddings, cache and SDPA)
    profile on fake tensors, each block saving what its real forward saves."""
    model, blocks = _transformers_model(kind)
    ids = torch.randint(0, 512, (2, 32))
    profile = profile_forward(model, {"input_ids": ids}, blocks, device=torch.device("cpu"), dtype=None)
    assert profile is not None and [b.cls for b in profile.blocks] == [cls, cls]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = _saved_per_block(blocks, lambda t: t.untyped_storage().data_ptr() in params)
    model(input_ids=ids)
    for b in profile.blocks:
        assert b.saved == sum(seen[b.name].values()) > 0, b


def test_a_model_in_eval_mode_is_profiled_as_it_trains() -> None:
    """A model fresh from ``from_pretrained`` is in eval mode; its training steps run in train
    mode, where GPT-2's dropout keeps masks for backward. The profile counts what a real forward
    in train mode saves per block, timing runs the blocks in train mode too, and both leave every
    submodule in the mode it was in."""
    model, blocks = _transformers_model("gpt2")
    ids = torch.randint(0, 512, (2, 32))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = _saved_per_block(blocks, lambda t: t.untyped_storage().data_ptr() in params)
    model.train()
    model(input_ids=ids)
    training = {name: sum(s.values()) for name, s in seen.items()}
    model.eval()
    model.transformer.h[1].attn.train()  # one submodule in a mode of its own
    modes = {name: m.training for name, m in model.named_modules()}
    profile = profile_forward(model, {"input_ids": ids}, blocks, device=torch.device("cpu"), dtype=None)
    assert {b.name: b.saved for b in profile.blocks} == training
    dropouts = []
    for _, block in blocks:
        for m in block.modules():
            if isinstance(m, nn.Dropout):
                m.register_forward_hook(lambda m, *_: dropouts.append(m.training))
    time_blocks(profile, blocks, device=torch.device("cpu"), dtype=None)
    assert dropouts and all(dropouts)
    assert {name: m.training for name, m in model.named_modules()} == modes


class _ReadsValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum().item() > 0:  # control flow on a value: no fake tensor has one
            x = x * 2
        return self.linear(x)


def test_a_forward_that_reads_values_is_not_profiled() -> None:
    assert profile_forward(_ReadsValues(), torch.ones(2, 8), [], device=torch.device("cpu"), dtype=None) is None


class _NormBlock(nn.Module):
    """A linear layer then batch norm, whose running statistics a forward in training updates in place."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x))


def test_timing_blocks_leaves_the_model_as_it_was() -> None:
    """Profiling and timing the blocks run them for real on copies: the model's parameters and
    buffers (batch norm's running statistics, updated in place by a forward in training) are the
    same afterwards, no gradient is left on them and no hook."""
    torch.manual_seed(0)
    model = nn.Sequential(_NormBlock(), _NormBlock())
    blocks = [(str(i), b) for i, b in enumerate(model)]
    before = {n: t.clone() for n, t in model.state_dict().items()}
    profile = profile_forward(model, torch.randn(16, 8), blocks, device=torch.device("cpu"), dtype=None)
    assert profile is not None
    timed = time_blocks(profile, blocks, device=torch.device("cpu"), dtype=None)
    assert timed.seconds_per_flop is not None and timed.seconds_per_flop > 0
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert all(p.grad is None for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


class _Activated(nn.Module):
    """A linear layer whose forward takes the activation to apply, and notes whose method it is."""

    def __init__(self, seen: list) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.seen = seen

    def forward(self, x: torch.Tensor, activation) -> torch.Tensor:
        self.seen.append(activation.__self__)
        return activation(self.linear(x))


class _PassesItsMethod(nn.Module):
    """Two :class:`_Activated` blocks, each given a bound method of this model."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []
        self.blocks = nn.ModuleList(_Activated(self.seen) for _ in range(2))

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, self.activation)
        return x


def test_timing_passes_callables_through_uncopied() -> None:
    """A block argument that is a callable holding the model (a bound method) reaches the timed
    runs as itself, not as a deep copy of the whole model."""
    model = _PassesItsMethod()
    blocks = [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
    profile = profile_forward(model, torch.randn(4, 8), blocks, device=torch.device("cpu"), dtype=None)
    assert profile is not None
    model.seen.clear()
    time_blocks(profile, blocks, device=torch.device("cpu"), dtype=None)
    assert model.seen and all(owner is model for owner in model.seen)


def _collective_against_the_clock(rank: int, world: int, repeats: int) -> tuple[float, float]:
    measured = measure_collective(torch.device("cpu"), nbytes=4 << 20, repeats=repeats)
    part = torch.ones((4 << 20) // world, dtype=torch.uint8)
    whole = torch.empty(part.numel() * world, dtype=torch.uint8)
    torch.distributed.all_gather_single(whole, part)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.distributed.all_gather_single(whole, part)
    seconds = torch.tensor([(time.perf_counter() - start) / repeats], dtype=torch.float64)
    torch.distributed.all_reduce(seconds, op=torch.distributed.ReduceOp.MAX)
    return measured, whole.numel() / seconds.item()


def test_the_collective_probe_is_the_all_gather_bandwidth() -> None:
    """The probe's all-gather bandwidth is the one the test's own clock sees for the same gathers
    (within a factor of 3 on a shared machine; timing one gather of ten would be 10 times off)."""
    for measured, clock in run_distributed(_collective_against_the_clock, 2, 10, timeout=120):
        assert clock / 3 <= measured <= 3 * clock, (measured, clock)


def _deep_model_with_example(batch) -> nn.Module:
    torch.manual_seed(0)
    model = models.GPT(d=64, layers=6, heads=2)
    if batch is not None:
        model.example_input_array = models.make_batch("gpt", 0, batch)[0].clone()
    return model


def _plan_with_examples(rank: int, world: int, batches: list, budget: int) -> tuple:
    model = _deep_model_with_example(batches[rank])
    options = ZeroOptions(block_classes=["Block"], memory_budget=budget)
    plan = memory_plan(model, options, device=torch.device("cpu"), precision=MixedPrecisionConfig())
    torch.distributed.barrier()  # the engine's first collective: every rank got here from the same ones
    return plan.kept_blocks, plan.placement


@pytest.mark.parametrize("batches", [[4, 8], [4, None], [None, 4]])
def test_every_rank_plans_with_rank_0s_example(batches) -> None:
    """Every rank reaches the same plan from rank 0's example: with a larger example on rank 1 (which
    alone would keep fewer blocks, or fit none) the count rank 0's example gives alone, the one of
    a single process; with an example on one rank only, none is planned at setup (the first step
    decides) on every rank, instead of one rank waiting in an exchange the others skip."""
    options = ZeroOptions(block_classes=["Block"], memory_budget="1GiB")
    alone = memory_plan(_deep_model_with_example(4), options, device=torch.device("cpu"),
                        precision=MixedPrecisionConfig(), world=2)
    budget = alone.prediction.total(False) + alone.profile.activation_bytes(2) + alone.profile.blocks[0].saved // 2
    plans = run_distributed(_plan_with_examples, 2, batches, budget, timeout=120)
    assert plans[0] == plans[1], plans
    assert plans[0][0] == (2 if None not in batches else None), plans


def _seconds_of_steps(model: nn.Module, x: torch.Tensor, repeats: int = 7) -> tuple[float, float]:
    """The fastest forward and backward pass without checkpointing, and the median of what
    checkpointing every block adds to the pass next to it. The two kinds alternate, after a warm-up
    of each, so that a machine whose speed drifts within the test (2x swings were seen on a shared
    2-core VM) slows both alike; a difference of two separate minimums came out negative there."""
    def one(checkpointing: bool) -> float:
        model.checkpointing = checkpointing
        start = time.perf_counter()
        model(x).sum().backward()
        return time.perf_counter() - start

    one(False), one(True)
    plain, added = [], []
    for _ in range(repeats):
        plain.append(one(False))
        added.append(one(True) - plain[-1])
    model.checkpointing = False
    return min(plain), statistics.median(added)


def test_a_block_timed_for_real_gives_the_step_its_compute() -> None:
    """The rates of one block run for real time the whole model: the predicted forward and backward
    are within a factor of 2 of a real step of the whole model (the test's clock), and the predicted
    recompute of every block within a factor of 3 of what checkpointing every block adds to it."""
    torch.manual_seed(0)
    model = models.GPT(d=256, layers=4, heads=4, seq=64)
    x = torch.randint(0, 64, (8, 64))
    profile = profile_forward(model, x, _blocks(model), device=torch.device("cpu"), dtype=None)
    assert profile is not None and profile.seconds_per_flop is None
    profile = time_blocks(profile, _blocks(model), device=torch.device("cpu"), dtype=None)
    inventory = Inventory.of(model, world=1, block_classes=["Block"])
    placement = Placement()
    prediction = predict(inventory, placement, bucket_size=0)
    kept = step_time(inventory, placement, prediction, Bandwidths(), accelerator=False, profile=profile, kept=4)
    recomputed = step_time(inventory, placement, prediction, Bandwidths(), accelerator=False, profile=profile, kept=0)
    plain, added = _seconds_of_steps(model, x)
    assert 0.5 * plain <= kept.total <= 2 * plain, (kept, plain)
    assert kept.recompute == 0 and added / 3 <= recomputed.recompute <= 3 * added, (recomputed, added)
    assert recomputed.total == pytest.approx(kept.total + recomputed.recompute)
    assert kept.collectives == 0.0  # one rank


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_transformers_block_is_timed(kind: str) -> None:
    """The decoder layers of Hugging Face models, which append to the forward's ``DynamicCache``,
    time for real: each run gets the cache as the forward gave it to the block, not the one the
    fake forward and the earlier runs filled (whose keys belong to a graph already backpropagated
    through). How close the rates come to a real step is
    :func:`test_a_block_timed_for_real_gives_the_step_its_compute`'s; on 2 busy cores the clock is
    too noisy for a second such check. The model is left as it was."""
    model, blocks = _transformers_model(kind)
    ids = torch.randint(0, 512, (2, 32))
    before = {n: t.clone() for n, t in model.state_dict().items()}
    profile = profile_forward(model, {"input_ids": ids}, blocks, device=torch.device("cpu"), dtype=None)
    assert profile is not None
    profile = time_blocks(profile, blocks, device=torch.device("cpu"), dtype=None)
    assert profile.seconds_per_flop > 0 and profile.recompute_seconds_per_flop is not None
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def _comm_bytes_of_a_step(rank: int, world: int, lora_rank: int, threshold: int, sharding: str = "full") -> dict:
    torch.manual_seed(0)
    model = models.GPT(d=64, layers=4, heads=2, lora_rank=lora_rank)
    group = 2 if sharding == "hybrid" else world  # hybrid: groups of 2 ranks, the inventory one group's
    inventory = Inventory.of(model, world=group, block_classes=["Block"], persistence_threshold=threshold,
                             mixed_precision=MixedPrecisionConfig(param_dtype="bf16"))
    engine = ZeroEngine(model, block_classes=["Block"], mixed_precision=MixedPrecisionConfig(param_dtype="bf16"),
                        prefetch=PrefetchConfig(persistence_threshold=threshold), sharding=sharding,
                        **({"shard_group_size": group} if sharding == "hybrid" else {}))
    opt = engine.shard_optimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3))
    counted = []
    for step in range(3):
        engine.comm.bytes.reset()
        x, y = models.make_batch("gpt", step, 4)
        models.loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        counted.append(engine.comm.bytes.gathered + engine.comm.bytes.reduce_scattered + engine.comm.bytes.all_reduced)
    return {"counted": counted, "predicted": collective_bytes(inventory, sharding, world // group)}


@pytest.mark.parametrize("lora_rank, threshold, sharding", [
    (0, 100_000, "full"), (0, 0, "full"), (4, 100_000, "full"), (4, 0, "full"), (0, 0, "grad_op"), (4, 0, "grad_op"),
    (0, 0, "hybrid"), (4, 100_000, "hybrid")],
    ids=["persistent", "gathered", "lora-persistent", "lora-gathered", "grad-op", "lora-grad-op", "hybrid",
         "lora-persistent-hybrid"])
def test_collective_bytes_are_what_the_engine_moves(lora_rank: int, threshold: int, sharding: str) -> None:
    """The bytes the time model gives the collectives of a step are what the engine's own counters
    see a step move (each rank receives all but its own part of every gather and sends all but its
    own of every reduce-scatter: the whole times (world - 1) / world): with every unit persistent
    (re-gathered once, after the step), with the blocks gathered for the forward and again for
    backward, and under LoRA (frozen units are not reduce-scattered, and a persistent one that the
    step does not change is not re-gathered); under ``sharding="grad_op"`` each unit gathered
    once a step; under ``sharding="hybrid"`` (4 ranks, groups of 2) the group's collectives and
    the all-reduce of each gradient shard across the groups, given as a gather over the world."""
    world = 4 if sharding == "hybrid" else 2
    for r in run_distributed(_comm_bytes_of_a_step, world, lora_rank, threshold, sharding):
        assert r["counted"][-1] == r["counted"][-2]  # a steady step
        assert abs(r["counted"][-1] - r["predicted"] * (world - 1) / world) <= 1, r


def test_step_time_terms_add_as_the_schedule_runs() -> None:
    """On a CPU device the collectives and the optimizer step add to the compute, and at least half
    of the disk shows; on an accelerator what the compute hides does not show."""
    profile = ForwardProfile(flops=10**9, outside=0, blocks=(), seconds_per_flop=1e-10,
                             recompute_seconds_per_flop=1e-10)  # forward 0.1 s
    inventory = Inventory.of(models.GPT(d=64, layers=2, heads=2), world=2, block_classes=["Block"])
    placement = Placement(param="nvme", optimizer="nvme")
    prediction = dataclasses.replace(predict(inventory, placement, bucket_size=0), disk_bytes=10**8, link_bytes=10**8)
    rates = Bandwidths(disk=10**9, link=10**10, collective=collective_bytes(inventory) / 0.05, host_step=1e-9,
                       device_step=1e-10)
    cpu = step_time(inventory, placement, prediction, rates, accelerator=False, profile=profile)
    trainable = sum(g.shard_numel for g in inventory.groups if g.trainable)
    assert cpu.disk == pytest.approx(0.1) and cpu.exposed_disk == pytest.approx(0.05)
    assert cpu.total == pytest.approx(0.3 + 0.05 + trainable * 1e-9 + 0.05)
    gpu = step_time(inventory, placement, prediction, rates, accelerator=True, profile=profile)
    assert gpu.exposed_collectives == 0 and gpu.exposed_disk == 0 and gpu.exposed_link == 0
    assert gpu.total == pytest.approx(0.3 + trainable * 1e-9)  # the optimizer steps on the host here
    assert step_time(inventory, placement, prediction, rates, accelerator=False).total is None


def test_offloaded_activations_show_where_a_pass_cannot_hide_them() -> None:
    """The copies out of offloaded activations overlap the forward alone (each offloaded block
    waits for the block before's), the copies back backward: a link whose whole traffic the step's
    compute would cover still shows where the forward is shorter than the copies out."""
    from lightning_zinf.planning.timing import StepTime

    def step(activation_link: float, other: float) -> StepTime:
        return StepTime(forward=0.1, backward=0.2, recompute=0.0, collectives=0.0, optimizer=0.0, disk=0.0,
                        link=2 * activation_link + other, accelerator=True, activation_link=activation_link)

    assert step(0.15, 0.0).exposed_link == pytest.approx(0.05)  # 0.3 s of copies against 0.3 s of compute
    assert step(0.05, 0.0).exposed_link == 0
    assert step(0.0, 0.3).exposed_link == pytest.approx(0.05)  # other copies: half in each pass
    assert step(0.0, 0.3).total == pytest.approx(0.35)


def _fit_with_example(rank: int, world: int, budget) -> dict:
    from lightning_zinf import ZeroInfinityStrategy
    from tests.test_trainer import GLOBAL_BATCH, LitGPT, _trainer

    class Deep(LitGPT):
        """Six blocks, one micro-batch as ``example_input_array`` (Lightning's convention)."""

        def __init__(self, batch_size: int) -> None:
            super().__init__(batch_size)
            self.example_input_array = models.make_batch("gpt", 0, batch_size)[0]

        def configure_model(self) -> None:
            if self.model is None:
                torch.manual_seed(0)
                self.model = models.GPT(d=64, layers=6, heads=2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

    strategy = ZeroInfinityStrategy(block_classes=["Block"], memory_budget=budget)
    lit = Deep(GLOBAL_BATCH // world)
    saved = SavedInLastStep()
    # The model summary on: with example_input_array it runs a forward on every rank at fit start.
    trainer = _trainer(strategy, world, callbacks=[saved], gradient_clip_val=None, enable_model_summary=True)
    trainer.fit(lit)
    plan = trainer.strategy.engine.memory_plan
    return {"losses": lit.train_losses, "kept": trainer.strategy.engine.activation_plan.kept,
            "kept_blocks": plan.kept_blocks, "state": plan.prediction.total(False), "activations": plan.activations,
            "by_count": [plan.profile.activation_bytes(k) for k in range(7)], "saved": saved.nbytes,
            "before_step": saved.plan_at_first_step, "step": plan.step, "block": plan.profile.blocks[0].saved}


def test_the_trainer_plans_activations_at_setup_from_example_input_array() -> None:
    """With ``example_input_array`` the blocks that keep their activations are chosen at setup with
    the placement, nothing measured in the first step: with room for all, all six keep theirs, as
    many bytes as the test's own hooks see a step keep; with room for two, the first two, what the
    hooks see within the budget, and the losses of keeping all."""
    roomy = run_distributed(_fit_with_example, 2, "1GiB", init_pg=False)[0]
    assert roomy["kept_blocks"] == 6 and len(roomy["kept"]) == 6
    assert roomy["before_step"] == (True, {})
    assert roomy["saved"] == pytest.approx(roomy["activations"], rel=0.005), roomy  # the logits in fp32: 1%
    assert roomy["step"].total > 0 and roomy["step"].collectives > 0
    budget = roomy["state"] + roomy["by_count"][2] + roomy["block"] // 2
    tight = run_distributed(_fit_with_example, 2, budget, init_pg=False)
    for r in tight:
        assert r["kept_blocks"] == 2 and r["kept"] == ["model.blocks.0", "model.blocks.1"], r
        assert r["state"] + r["saved"] <= budget
        assert r["saved"] >= 2 * r["block"]  # the two blocks' activations are kept
    assert tight[0]["losses"] == roomy["losses"]


class _Reversed(nn.Module):
    """A GPT whose forward calls its blocks in the reverse of their module order."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = models.GPT(d=64, layers=4, heads=2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        g = self.gpt
        x = g.wte(idx) + g.wpe(torch.arange(idx.shape[1]))
        for block in reversed(g.blocks):
            x = block(x)
        return g.head(g.ln_f(x))


def _blocks_saving(rank: int, world: int) -> dict:
    from lightning_zinf.engine_setup import build_engine, memory_plan
    from lightning_zinf.options import ZeroOptions

    torch.manual_seed(0)
    model = _Reversed()
    x = models.make_batch("gpt", 0, 4)[0]
    model.example_input_array = x
    roomy = memory_plan(model, ZeroOptions(block_classes=["Block"], memory_budget=1 << 40),
                        device=torch.device("cpu"), precision=MixedPrecisionConfig())
    budget = roomy.prediction.total(False) + roomy.profile.activation_bytes(2) + roomy.profile.blocks[0].saved // 2
    engine = build_engine(model, ZeroOptions(block_classes=["Block"], memory_budget=budget),
                          device=torch.device("cpu"), ranks_per_node=world, precision=MixedPrecisionConfig(),
                          loss_scaling=False, timeout=None, auto_pass=True)
    blocks = [(f"gpt.blocks.{i}", b) for i, b in enumerate(model.gpt.blocks)]
    saved = _saved_per_block(blocks, engine.states.holds_storage_of)  # the engine's gathered parameters out
    models.loss_fn(model, x, x).backward()
    plan = engine.memory_plan
    return {"kept_blocks": plan.kept_blocks, "saved": {name: sum(s.values()) for name, s in saved.items()},
            "planned": {b.name: b.saved for b in plan.profile.blocks[:plan.kept_blocks]}}


def test_the_blocks_kept_are_those_the_plan_counted() -> None:
    """A forward that calls its blocks in the reverse of their module order, with room for two: the
    blocks that keep their activations, as the test's own saved-tensor hooks around each block see
    them (a checkpointed block's own hooks hide what it saves), are the two whose activations the
    plan counted, with as many bytes."""
    for r in run_distributed(_blocks_saving, 2):
        assert r["kept_blocks"] == 2, r
        inputs = 4 * 16 * 64 * 4  # a checkpointed block keeps its input alone
        assert {name: n for name, n in r["saved"].items() if n > inputs} == r["planned"], r


_S = 1 << 20  # bytes one synthetic block saves


def _offload_case(link: float, *, accelerator: bool = True, host_room: int = None):
    """Eight blocks saving 1 MiB each, checkpointed each keeping 256 KiB of input, a 10 ms step:
    planned on a budget that holds the state, 64 KiB outside the blocks and 4.5 blocks' worth."""
    from lightning_zinf.planning import plan_memory
    from lightning_zinf.planning.profile import BlockProfile

    blocks = tuple(BlockProfile(f"blocks.{i}", "Block", flops=10**8, saved=_S, inputs=_S // 4) for i in range(8))
    profile = ForwardProfile(flops=9 * 10**8, outside=1 << 16, blocks=blocks, seconds_per_flop=1e-11,
                             recompute_seconds_per_flop=1e-11)
    inventory = Inventory.of(models.GPT(d=64, layers=8, heads=2), world=1, block_classes=["Block"])
    rates = Bandwidths(link=link, host_step=1e-8, device_step=1e-10)
    state = predict(inventory, Placement(), bucket_size=PrefetchConfig().bucket_size, accelerator=accelerator)
    budget = state.total(accelerator) + profile.outside + 4 * _S + _S // 2
    host_budget = None if host_room is None else state.host + host_room
    plan = plan_memory(inventory, budget, accelerator=accelerator, bandwidths=rates, profile=profile,
                       host_budget=host_budget)
    return plan, budget, host_budget


def test_on_an_accelerator_the_plan_offloads_the_activations_the_link_hides() -> None:
    """With a host link fast enough to hide the copies behind the compute, the blocks that do not
    keep their activations offload them instead of being checkpointed: no recompute, and one block
    more kept than checkpointing leaves room for (an offloaded block keeps nothing on the device; a
    checkpointed one its input). With a slow link the same budget checkpoints them. On a CPU device
    (host and device one memory) nothing is offloaded."""
    fast, budget, _ = _offload_case(link=1e12)
    assert fast.placement == Placement()
    # Room: outside + kept blocks + one block in flight <= 4.5 blocks.
    assert (fast.kept_blocks, fast.offloaded_blocks) == (3, 5), fast.describe()
    assert fast.step.recompute == 0 and fast.step.exposed_link == 0
    assert fast.prediction.total(True) + fast.activations <= budget
    assert fast.host_activations == 5 * _S
    assert "the first 3 of 8 blocks keeping theirs and the next 5 keeping theirs in host memory" in fast.describe()
    assert "10.00 MiB of offloaded activations" in fast.describe()  # to the host and back
    slow, _, _ = _offload_case(link=1e6)  # 2 s to copy a block there and back, against 1 ms to recompute it
    # Checkpointing: outside + kept blocks + the others' inputs + one block recomputed <= 4.5 blocks.
    assert (slow.kept_blocks, slow.offloaded_blocks) == (2, 0), slow.describe()
    assert slow.step.recompute == pytest.approx(6 * 10**8 * 1e-11)
    cpu, _, _ = _offload_case(link=1e12, accelerator=False)
    assert cpu.offloaded_blocks == 0


def test_offloaded_activations_fit_the_host_memory_budget() -> None:
    """Under ``host_memory_budget`` the offloaded blocks' activations count against the host: with
    room there for two and a half blocks, at most two are offloaded, and the placement's host
    memory and theirs fit together."""
    plan, budget, host_budget = _offload_case(link=1e12, host_room=2 * _S + _S // 2)
    assert 1 <= plan.offloaded_blocks <= 2, plan.describe()
    assert plan.prediction.host + plan.host_activations <= host_budget
    assert plan.prediction.total(True) + plan.activations <= budget


def _offloading_blocks(rank: int, world: int, offloaded: int) -> dict:
    """A six-block GPT with ``example_input_array`` built under a budget whose plan is then told to
    keep block 0's activations, offload the next ``offloaded`` and checkpoint the rest (what an
    accelerator's plan chooses; a CPU device's never offloads, its host and device being one
    memory). Three AdamW steps: the losses, how often each block's forward ran, and the bytes the
    engine copied to host memory against what the test's own hooks see the blocks save."""
    import lightning_zinf.engine_setup as setup

    torch.manual_seed(0)
    model = models.GPT(d=64, layers=6, heads=2)
    x = models.make_batch("gpt", 0, 4)[0]
    model.example_input_array = x
    blocks = _blocks(model)
    # What autograd saves in each block of a plain forward, per saved tensor (the offload copies each
    # one it is handed), the weights and their views left out.
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    plain = {name: 0 for name, _ in blocks}
    pinned = {name: 0 for name, _ in blocks}  # each copy in a page-locked block of a power of two
    scopes = []

    def enter(name):
        def pack(t):
            if t.untyped_storage().data_ptr() not in weights:
                plain[name] += t.numel() * t.element_size()
                pinned[name] += 1 << (t.numel() * t.element_size() - 1).bit_length()
            return t
        scopes.append(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        scopes[-1].__enter__()

    for name, block in blocks:
        block.register_forward_pre_hook(lambda *_, name=name: enter(name))
        block.register_forward_hook(lambda *_: scopes.pop().__exit__(None, None, None))
    models.loss_fn(model, x, x).backward()
    torch.manual_seed(0)
    model = models.GPT(d=64, layers=6, heads=2)
    model.example_input_array = x
    options = ZeroOptions(block_classes=["Block"], memory_budget=1 << 40)
    plan = memory_plan(model, options, device=torch.device("cpu"), precision=MixedPrecisionConfig())
    forced = dataclasses.replace(plan, kept_blocks=1, offloaded_blocks=offloaded)
    original, setup.memory_plan = setup.memory_plan, lambda *a, **k: forced
    try:
        engine = setup.build_engine(model, options, device=torch.device("cpu"), ranks_per_node=world,
                                    precision=MixedPrecisionConfig(), loss_scaling=False, timeout=None, auto_pass=True)
    finally:
        setup.memory_plan = original
    calls = {name: 0 for name, _ in _blocks(model)}
    for name, block in _blocks(model):  # (a recompute calls the block's forward, not the block)
        block.ln1.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    losses = []
    for step in range(3):
        batch = models.make_batch("gpt", step, 4)[0]
        loss = models.loss_fn(model, batch, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    activation_plan = engine.activation_plan
    copied = engine._activation_offload.copied_bytes if engine._activation_offload is not None else 0
    return {"losses": losses, "calls": calls, "copied": copied, "plain": plain, "pinned": pinned,
            "plan": (activation_plan.kept, activation_plan.offloaded, activation_plan.checkpointed),
            "profiled": (forced.profile.offloaded_traffic(1, offloaded), forced.profile.offloaded_bytes(1, offloaded))}


def test_blocks_the_plan_offloads_run_once_and_copy_what_they_save() -> None:
    """The engine runs a plan's per-block choice: with block 0 kept, blocks 1-3 offloaded and 4-5
    checkpointed, the test's forward hooks see blocks 0-3 run once a step and 4-5 twice (the
    recompute, as hooks on their first layer see it); the engine copies to host memory what the test's own hooks see blocks 1-3 save in a
    plain forward, the weights and their views left out (the engine's re-gather restores those), which
    is what the plan's profile says they move and, rounded per copy, hold in page-locked memory;
    the losses equal those of no offload, bit for bit."""
    offloaded = run_distributed(_offloading_blocks, 2, 3)
    checkpointed = run_distributed(_offloading_blocks, 2, 0)
    for r, c in zip(offloaded, checkpointed):
        kept, off, ckpt = r["plan"]
        assert kept == ["blocks.0"] and off == ["blocks.1", "blocks.2", "blocks.3"] and ckpt == ["blocks.4", "blocks.5"]
        assert r["calls"] == {"blocks.0": 3, "blocks.1": 3, "blocks.2": 3, "blocks.3": 3, "blocks.4": 6, "blocks.5": 6}
        assert c["calls"]["blocks.1"] == 6 and c["copied"] == 0
        per_step = sum(r["plain"][f"blocks.{i}"] for i in (1, 2, 3))
        assert r["copied"] == 3 * per_step, (r["copied"], per_step)
        # The plan's profile (fake tensors) gives those bytes, and the page-locked blocks they take.
        assert r["profiled"] == (per_step, sum(r["pinned"][f"blocks.{i}"] for i in (1, 2, 3)))
        assert r["losses"] == c["losses"]


def _depth_case(accelerator: bool, roomy: bool):
    """Eight blocks each saving a third of what gathering one unit ahead instead of the default
    bucket frees, on a budget that keeps every block only one unit ahead (or twice that, ``roomy``)."""
    from lightning_zinf.planning import plan_memory
    from lightning_zinf.planning.profile import BlockProfile

    # Blocks of 200K elements: above the persistence threshold, so that the bucket changes what is gathered.
    inventory = Inventory.of(models.GPT(d=128, layers=8, heads=2), world=2, block_classes=["Block"])
    deep = predict(inventory, Placement(), bucket_size=PrefetchConfig().bucket_size, accelerator=accelerator)
    shallow = predict(inventory, Placement(), bucket_size=0, accelerator=accelerator)
    saved = (deep.total(accelerator) - shallow.total(accelerator)) // 3
    blocks = tuple(BlockProfile(f"blocks.{i}", "Block", flops=10**8, saved=saved, inputs=saved // 4) for i in range(8))
    profile = ForwardProfile(flops=9 * 10**8, outside=0, blocks=blocks, seconds_per_flop=1e-11,
                             recompute_seconds_per_flop=1e-11)
    budget = shallow.total(accelerator) + 8 * saved * (2 if roomy else 1)
    rates = Bandwidths(collective=1e12, host_step=1e-8, device_step=1e-10)
    return plan_memory(inventory, budget, accelerator=accelerator, bandwidths=rates, profile=profile), deep, shallow


def test_on_an_accelerator_the_plan_gathers_one_unit_ahead_when_that_keeps_activations() -> None:
    """The prefetch depth is chosen with the rest on an accelerator: where the default bucket's
    gathers leave room to keep only some blocks' activations and one unit ahead (which the time
    model says hides the gathers as well) leaves room for all, the plan gathers one unit ahead and
    recomputes nothing; with room for both, it keeps the user's bucket. On a CPU device the bucket
    shrinks only when nothing fits."""
    tight, deep, shallow = _depth_case(accelerator=True, roomy=False)
    assert tight.prefetch.bucket_size == 0 and tight.kept_blocks == 8, tight.describe()
    assert tight.step.recompute == 0 and tight.prediction.total(True) == shallow.total(True)
    roomy, _, _ = _depth_case(accelerator=True, roomy=True)
    assert roomy.prefetch.bucket_size == PrefetchConfig().bucket_size and roomy.kept_blocks == 8
    cpu, _, _ = _depth_case(accelerator=False, roomy=False)
    assert cpu.prefetch.bucket_size == PrefetchConfig().bucket_size and cpu.kept_blocks < 8, cpu.describe()
