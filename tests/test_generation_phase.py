"""The generation phase inside a training step (``ZeroEngine.generation_phase``,
``ZeroInfinityStrategy.generation()``): RLHF rollouts with ZeRO++'s behaviour.

A tiny ``transformers`` Llama with PEFT LoRA adapters; ``generate()`` is called on the
``PeftModel``. Collectives are counted by an observer outside the engine: it wraps the methods of
``torch.distributed``'s ``ProcessGroup`` that every collective goes through and records the ranks
of the group each one ran on (``dist.get_process_group_ranks``). 4 ranks are 2 simulated nodes of 2
where hpZ matters (``ZeroPPConfig(ranks_per_node=2)``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_distributed

RANKS_PER_NODE = 2
#: The ``ProcessGroup`` methods behind the collectives the engine and ``transformers`` run.
_GATHERS = ("allgather", "_allgather_base", "all_gather_single", "allgather_coalesced",
            "allgather_into_tensor_coalesced", "broadcast")
_OBSERVED = _GATHERS + ("allreduce",)


def _actor(seed: int = 0) -> Any:
    """A 2-layer byte-level Llama (width 32) with LoRA (r=4) on every projection, as
    ``examples/peft_lora.py`` builds its actor, smaller; the adapters start at zero."""
    import peft
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=0)
    base = transformers.LlamaForCausalLM(config)
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return peft.get_peft_model(base, lora)


class _Observer:
    """Records every collective this process runs, as ``(method, ranks of its group, group)``, by
    wrapping ``ProcessGroup``'s methods (what ``torch.distributed``'s functions call). ``control``:
    the engine's control group, whose exchanges (the ranks' checks) are counted apart from gathers."""

    def __init__(self, control: Any) -> None:
        self.control = control
        self.calls: list[tuple[str, tuple[int, ...], Any]] = []

    @contextlib.contextmanager
    def watching(self) -> Iterator["_Observer"]:
        cls = dist.ProcessGroup
        saved = {name: getattr(cls, name) for name in _OBSERVED if hasattr(cls, name)}

        def wrap(name: str, method: Any) -> Any:
            def observed(group: Any, *args: Any, **kwargs: Any) -> Any:
                self.calls.append((name, tuple(dist.get_process_group_ranks(group)), group))
                return method(group, *args, **kwargs)
            return observed

        for name, method in saved.items():
            setattr(cls, name, wrap(name, method))
        try:
            yield self
        finally:
            for name, method in saved.items():
                setattr(cls, name, method)

    def mark(self) -> int:
        return len(self.calls)

    def gathers(self, start: int = 0, stop: int | None = None) -> list[tuple[int, ...]]:
        return [ranks for name, ranks, group in self.calls[start:stop] if name in _GATHERS and group is not self.control]

    def cross_node_gathers(self, start: int = 0, stop: int | None = None) -> int:
        return sum(len({r // RANKS_PER_NODE for r in ranks}) > 1 for ranks in self.gathers(start, stop))

    def all_reduces_on(self, group: Any, start: int = 0, stop: int | None = None) -> int:
        return sum(name == "allreduce" and g is group for name, _, g in self.calls[start:stop])

    def exchanges(self, start: int = 0, stop: int | None = None) -> int:
        """Collectives on the control group (whatever the method)."""
        return sum(g is self.control for _, _, g in self.calls[start:stop])


def _engine(model: Any, bucket_size: int = 10_000_000, **zero_pp: Any) -> Any:
    from lightning_zinf import PrefetchConfig, ZeroEngine, ZeroPPConfig

    return ZeroEngine(model, block_classes=["LlamaDecoderLayer"],
                      prefetch=PrefetchConfig(persistence_threshold=0, bucket_size=bucket_size),
                      zero_pp=ZeroPPConfig(ranks_per_node=RANKS_PER_NODE, **zero_pp), auto_pass=False)


def _whole(engine: Any) -> int:
    """Bytes of every unit gathered in the compute dtype."""
    return sum(g.padded_numel * g.compute_dtype.itemsize for g in engine.groups)


def _prompt(rank: int) -> torch.Tensor:
    return torch.randint(1, 256, (2, 5), generator=torch.Generator().manual_seed(100 + rank))


def _train_step(engine: Any, model: Any, optimizer: Any, rank: int) -> None:
    engine.begin_pass("train")
    ids = torch.randint(1, 256, (2, 8), generator=torch.Generator().manual_seed(7))  # the same on every rank
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


# --- 1 and 6: what crosses nodes, and the control plane, per decode step ------------------------------
def _per_forward(rank: int, world: int, budget_share: float) -> dict:
    model = _actor()
    engine = _engine(model, hpz=True)
    optimizer = engine.shard_optimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    budget = int(budget_share * _whole(engine))
    observer = _Observer(engine.comm.control_group)
    world_group = dist.group.WORLD
    starts: list[int] = []
    model.base_model.model.register_forward_pre_hook(lambda *_: starts.append(observer.mark()))
    phases = []
    with observer.watching():
        for _ in range(2):  # generation, a training step, generation again (its adapters changed)
            starts.clear()
            engine.comm.bytes.reset()
            inter = []
            hook = model.base_model.model.register_forward_hook(lambda *_: inter.append(engine.comm.bytes.inter_node))
            with torch.no_grad(), engine.generation_phase(budget):
                model.generate(input_ids=_prompt(rank), max_new_tokens=5 + rank, do_sample=False)
                end = observer.mark()
            hook.remove()
            bounds = starts + [end]
            phases.append({
                "cross_node": [observer.cross_node_gathers(a, b) for a, b in zip(bounds, bounds[1:])],
                "gathers": [len(observer.gathers(a, b)) for a, b in zip(bounds, bounds[1:])],
                "control": [observer.exchanges(a, b) for a, b in zip(bounds, bounds[1:])],
                "synced_flag": observer.all_reduces_on(world_group, starts[0], end),
                "inter_node_bytes": [b - a for a, b in zip([0] + inter, inter)],
            })
            _train_step(engine, model, optimizer, rank)
    return {"phases": phases, "trainable_groups": sum(g.trainable for g in engine.groups)}


@pytest.mark.parametrize("budget_share", [0.0, 0.3], ids=["budget-0", "budget-0.3x"])
def test_decode_steps_cross_no_node_and_check_nothing_per_gather(budget_share: float) -> None:
    """hpZ at 4 ranks (2 nodes), ``generate()`` of a PEFT model in a phase, a training step, and a
    phase again: each phase's first forward (prefill) gathers across nodes (the adapters changed in
    the step; the frozen base already has its secondary partitions in the second phase), and every
    decode step after it makes no gather whose group spans nodes (the observer agrees with the
    engine's own inter-node byte count) and no control-plane exchange (no agreement check per
    gather or per pass). Ranks ask for different lengths, so ``synced_gpus`` (on below the whole
    model: ``transformers`` reads the engine's marker on the model ``PeftModel.generate`` calls)
    keeps every rank stepping; its flag all-reduce on the world group is counted apart."""
    ranks = run_distributed(_per_forward, 4, budget_share, timeout=120)
    longest = 5 + 3
    for rank, got in enumerate(ranks):
        for number, phase in enumerate(got["phases"]):
            forwards = len(phase["gathers"])
            assert forwards == longest, (rank, number, phase)  # synced_gpus: every rank ran the longest
            assert phase["cross_node"][0] > 0 and phase["inter_node_bytes"][0] > 0, (rank, number, phase)
            if number:  # the step changed only the adapters: the frozen base's secondaries serve it
                assert phase["cross_node"][0] == got["trainable_groups"], (rank, number, phase)
            assert phase["cross_node"][1:] == [0] * (forwards - 1), (rank, number, phase)
            assert phase["inter_node_bytes"][1:] == [0] * (forwards - 1), (rank, number, phase)
            # Decode steps re-gather the units outside the budget (within the node)...
            assert all(n > 0 for n in phase["gathers"][1:]), (rank, number, phase)
            # ... and check nothing with the other ranks: the first phase's prefill records the
            # trace (each gather checked), the next forward's pass validates it (counted with the
            # prefill: the pass starts before the observer's hook runs); the second phase replays it.
            assert phase["control"][1:] == [0] * (forwards - 1), (rank, number, phase)
            assert number == 0 or phase["control"][0] == 0, (rank, number, phase)
            assert phase["synced_flag"] >= forwards, (rank, number, phase)
    print("synced_gpus flag all-reduces per phase (rank 0):", [p["synced_flag"] for p in ranks[0]["phases"]],
          "control exchanges per forward:", [p["control"] for p in ranks[0]["phases"]])


# --- 2: qwZ quantizes each shard at most once per phase -----------------------------------------------
_QUANTIZE_CONFIGS = [({"qwz": True}, 0.0), ({"qwz": True}, 0.3), ({"qwz": True, "hpz": True}, 0.0),
                     ({"qwz": True, "hpz": True}, 0.3), ({"qwz": True, "frozen_bits": 8}, 0.0)]


def _quantize_counts(rank: int, world: int) -> list[dict]:
    import lightning_zinf.comm.collectives as collectives

    results = []
    for zero_pp, share in _QUANTIZE_CONFIGS:
        model = _actor()
        engine = _engine(model, **zero_pp)
        optimizer = engine.shard_optimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
        budget = int(share * _whole(engine))
        counts: dict[int, int] = {}
        quantize = collectives.quantize

        def counted(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counts[x.data_ptr()] = counts.get(x.data_ptr(), 0) + 1
            return quantize(x, *args, **kwargs)

        collectives.quantize = counted  # where Collectives looks it up
        per_phase = []
        try:
            for _ in range(2):
                counts.clear()
                with torch.no_grad(), engine.generation_phase(budget):
                    model.generate(input_ids=_prompt(rank), max_new_tokens=6, do_sample=False)
                per_phase.append(dict(counts))
                _train_step(engine, model, optimizer, rank)
        finally:
            collectives.quantize = quantize
        results.append({"per_phase": per_phase, "groups": len(engine.groups),
                        "trainable": sum(g.trainable for g in engine.groups), "kept_rows": engine.memory()["secondary"]})
    return results


def test_qwz_quantizes_each_shard_at_most_once_per_phase() -> None:
    """qwZ alone, qwZ with hpZ, and qwZ with the frozen base stored as INT8 codes, at budgets 0 and
    0.3x the model, 4 ranks (2 nodes): over a phase of 6 forwards (prefill and 5 decode steps) of
    ``PeftModel.generate``, and again after a training step, the quantize kernel runs at most once
    per shard (counted where ``Collectives`` looks it up, by the shard's address), for at most one
    shard per flat group (the trainable ones only with frozen codes); without the kept rows budget 0
    quantizes every shard once per forward. After the phase no row is kept."""
    ranks = run_distributed(_quantize_counts, 4, timeout=120)
    for rank, got in enumerate(ranks):
        for (zero_pp, share), config in zip(_QUANTIZE_CONFIGS, got):
            where = (rank, zero_pp, share, config)
            for counts in config["per_phase"]:
                assert counts and max(counts.values()) == 1, where
                assert len(counts) <= (config["trainable"] if "frozen_bits" in zero_pp else config["groups"]), where
            # The rows were accounted while kept; only hpZ's secondary partitions stay after the phase.
            assert config["kept_rows"][1] > 0 and (config["kept_rows"][0] == 0 or "hpz" in zero_pp), where


# --- 3: ranks ending at different lengths inside a Trainer's training_step ------------------------------
_PHASE_CONFIGS = [(share, hpz) for share in (0.0, 0.3, 1.0) for hpz in (False, True)]


def _rollout_module() -> Any:
    import lightning as L

    class Rollouts(L.LightningModule):
        """A GRPO-shaped step: sample in a generation phase, then the actor's loss on the samples."""

        def __init__(self) -> None:
            super().__init__()
            self.actor = _actor()
            self.lengths: list[int] = []
            self.losses: list[float] = []
            self.references: list[bool] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            torch.manual_seed(1000 * self.global_step + self.global_rank)  # sampling differs per rank
            prompt = _prompt(self.global_rank + 10 * self.global_step)
            with torch.no_grad(), self.trainer.strategy.generation():
                # Half the bytes end a sequence, and ranks ask for 1 to 7 tokens: they stop at
                # different lengths (rank 0 after its first forward, the pass that records the trace).
                out = self.actor.generate(input_ids=prompt, do_sample=True, max_new_tokens=1 + 2 * self.global_rank,
                                          eos_token_id=list(range(128)), pad_token_id=0)
                with self.actor.disable_adapter():  # the reference model: a pass of its own kind
                    reference = self.actor(input_ids=out).logits
            self.lengths.append(out.shape[1])
            self.references.append(bool(reference.isfinite().all()))
            loss = self.actor(input_ids=out, labels=out).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    return Rollouts()


def _fit_rollouts(rank: int, world: int) -> list[dict]:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zinf import ZeroInfinityStrategy

    whole = sum(p.numel() * p.element_size() for p in _actor().parameters())
    results = []
    for share, hpz in _PHASE_CONFIGS:
        module = _rollout_module()
        budget = 1 << 30 if share == 1.0 else int(share * whole)
        strategy = ZeroInfinityStrategy(block_classes=["LlamaDecoderLayer"],
                                        prefetch={"inference_budget": budget, "persistence_threshold": 0},
                                        zero_pp={"hpz": hpz, "ranks_per_node": RANKS_PER_NODE})
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=2, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                            use_distributed_sampler=False)
        trainer.fit(module, DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=1))
        with trainer.strategy.gathered_parameters():
            lora_b = sum(float(p.abs().sum()) for n, p in module.actor.named_parameters() if "lora_B" in n)
        results.append({"lengths": module.lengths, "losses": module.losses, "lora_b": lora_b,
                        "references": module.references,
                        "gathered": trainer.strategy.engine.gathered_bytes, "steps": trainer.global_step})
    return results


def test_ranks_stopping_at_different_lengths_in_training_step_do_not_hang() -> None:
    """Through the Trainer at 4 ranks (2 nodes), for budgets 0, 0.3x and the whole model, hpZ off
    and on: ``training_step`` samples with ``generate()`` in ``strategy.generation()`` (different
    prompts and seeds per rank, an eos that ends sequences early) and runs the reference forward
    (adapters disabled) there, then takes the actor's loss on
    the samples and the optimizer steps. Nobody hangs (the run has a timeout), two steps run, the
    ranks' lengths differ, the adapters (zero at the start) moved, and nothing stays gathered."""
    ranks = run_distributed(_fit_rollouts, 4, init_pg=False, timeout=240)
    for i, (share, hpz) in enumerate(_PHASE_CONFIGS):
        runs = [r[i] for r in ranks]
        for run in runs:
            assert run["steps"] == 2 and len(run["losses"]) == 2 and run["references"] == [True, True], (share, hpz, run)
            assert all(torch.isfinite(torch.tensor(run["losses"]))) and run["lora_b"] > 0, (share, hpz, run)
            assert run["gathered"] == 0, (share, hpz, run)
        assert len({tuple(run["lengths"]) for run in runs}) > 1, (share, hpz, runs)


# --- 4: the tokens of plain PyTorch after the same step ----------------------------------------------
def _int8_base(model: Any, layout: list[tuple[list[str], int, int]], world: int) -> None:
    """Replace ``model``'s frozen parameters by what INT8 codes of their shards hold: each flat
    group's values (``layout``: its parameter names, shard length, block) concatenated, padded,
    split into ``world`` shards, each quantized blockwise and dequantized."""
    from triton_kernels import dequantize, quantize

    params = dict(model.named_parameters())
    for names, shard, block in layout:
        flat = torch.zeros(shard * world)
        values = torch.cat([params[n].detach().reshape(-1) for n in names])
        flat[: values.numel()] = values
        rebuilt = torch.cat([dequantize(*quantize(part, 8, block), shard, 8, block) for part in flat.split(shard)])
        offset = 0
        for name in names:
            p = params[name]
            p.data.copy_(rebuilt[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def _tokens_after_a_step(rank: int, world: int, mode: str, folder: str) -> dict:
    from lightning_zinf import OffloadConfig, PrefetchConfig, ZeroEngine, ZeroPPConfig

    model = _actor()
    if mode.startswith("qwz-"):  # the shards offloaded: a kept row is sent without reading them
        offload = OffloadConfig(param=mode[4:], nvme_path=folder if mode == "qwz-nvme" else None)
        engine = ZeroEngine(model, block_classes=["LlamaDecoderLayer"], prefetch=PrefetchConfig(persistence_threshold=0),
                            zero_pp=ZeroPPConfig(qwz=True), offload=offload, auto_pass=False)
    else:
        engine = _engine(model, **{"fp32": {}, "frozen-int8": {"frozen_bits": 8}, "qwz": {"qwz": True}}[mode])
    optimizer = engine.shard_optimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    budget = int(0.3 * _whole(engine))

    def greedy() -> torch.Tensor:
        return model.generate(input_ids=_prompt(0), max_new_tokens=8, do_sample=False)

    with torch.no_grad(), engine.generation_phase(budget):
        before = greedy()  # keeps qwZ rows of the adapters' shards as they are before the step
    _train_step(engine, model, optimizer, rank)
    with torch.no_grad(), engine.generation_phase(budget):
        tokens = greedy()
    with torch.no_grad():
        outside = greedy()  # no phase: every gather quantizes afresh under qwZ
    layout = [(g.names, g.shard_numel, 256) for g in engine.groups if g.codes is not None]
    return {"tokens": tokens, "before": before, "outside": outside, "layout": layout}


def _plain_tokens_after_a_step(layout: list, world: int) -> torch.Tensor:
    model = _actor()
    if layout:
        _int8_base(model, layout, world)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(1, 256, (2, 8), generator=torch.Generator().manual_seed(7))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    with torch.no_grad():
        return model.generate(input_ids=_prompt(0), max_new_tokens=8, do_sample=False)


@pytest.mark.parametrize("mode", ["fp32", "frozen-int8", "qwz", "qwz-cpu", "qwz-nvme"])
def test_greedy_tokens_in_the_phase_match_plain_pytorch_after_a_step(mode: str, tmp_path: Any) -> None:
    """2 ranks: greedy ``generate()`` in a phase at 0.3x the model, one AdamW step on the adapters
    (the same batch on both ranks, so the mean gradient is plain PyTorch's), and a phase again.
    fp32: the second phase's tokens are the unpartitioned PEFT model's after the same step (and
    differ from the first phase's); with the frozen base stored as INT8 codes, those of the plain
    model whose base is dequantize(quantize(w)) over the same shards; with qwZ, those generated
    outside any phase, where every gather quantizes the current shards afresh: no row kept from
    the first phase outlives the step (also with the shards offloaded to CPU memory or NVMe, where
    gathers sending a kept row neither copy nor swap in the shard)."""
    ranks = run_distributed(_tokens_after_a_step, 2, mode, str(tmp_path), timeout=120)
    assert bool(ranks[0]["layout"]) == (mode == "frozen-int8")
    for got in ranks:
        assert torch.equal(got["tokens"], got["outside"]), mode
        assert not torch.equal(got["tokens"], got["before"]), mode  # the step changed what is generated
    if not mode.startswith("qwz"):
        want = _plain_tokens_after_a_step(ranks[0]["layout"], 2)
        for got in ranks:
            assert torch.equal(got["tokens"], want), mode


# --- 5: the switch between phases costs at most one gather more per unit --------------------------------
def _switch_counts(rank: int, world: int) -> dict:
    from lightning_zinf.engine.units import UnitStates

    model = _actor()
    engine = _engine(model, bucket_size=1)  # prefetch gathers the next unit only
    optimizer = engine.shard_optimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    budget = int(0.3 * _whole(engine))
    counts: dict[int, int] = {}
    start_gather = UnitStates.start_gather

    def counted(states: Any, unit: Any, *args: Any, **kwargs: Any) -> None:
        counts[unit.index] = counts.get(unit.index, 0) + 1
        start_gather(states, unit, *args, **kwargs)

    def generate() -> int:
        forwards: list[int] = []
        hook = model.base_model.model.register_forward_pre_hook(lambda *_: forwards.append(1))
        engine.reset_memory_peaks()
        with torch.no_grad(), engine.generation_phase(budget):
            model.generate(input_ids=_prompt(rank), max_new_tokens=5, do_sample=False)
        hook.remove()
        peaks.append(engine.memory()["gathered"][1])
        return len(forwards)

    UnitStates.start_gather = counted  # counting only
    phases, trains, steady, phase_bytes, peaks = [], [], [], [], []
    try:
        for step in range(4):
            engine.begin_pass("train")
            if step < 3:
                counts.clear()
                engine.comm.bytes.reset()
                forwards = generate()
                phases.append((dict(counts), forwards))
                phase_bytes.append(engine.comm.bytes.gathered)
            counts.clear()
            ids = torch.randint(1, 256, (2, 8), generator=torch.Generator().manual_seed(step))
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            (trains if step < 3 else steady).append(dict(counts))
    finally:
        UnitStates.start_gather = start_gather
    sizes = {u.index: sum(g.padded_numel * g.compute_dtype.itemsize for g in u.groups) for u in engine.units}
    return {"phases": phases, "trains": trains, "steady": steady[0], "sizes": sizes, "budget": budget,
            "phase_bytes": phase_bytes, "peaks": peaks}


def test_switching_phases_gathers_each_unit_at_most_once_more() -> None:
    """2 ranks; steps that generate in a phase (budget 0.3x the model) and then train, and a step
    that only trains: the training forward and backward after a phase gather each unit at most once
    more than the step without a phase, and a phase gathers each unit once, plus once per further
    forward for the units the budget does not keep (those kept fit the budget); the gathered bytes
    peak within the budget plus the unit in use and the one gathered ahead. Gathers counted per unit by wrapping
    ``UnitStates.start_gather`` (counting only)."""
    ranks = run_distributed(_switch_counts, 2, timeout=120)
    for got in ranks:
        steady = got["steady"]
        for train in got["trains"][1:]:  # the first step records the traces
            for unit, n in train.items():
                assert n <= steady.get(unit, 0) + 1, (unit, train, steady)
        for counts, forwards in got["phases"][1:]:
            kept = [u for u, n in counts.items() if n == 1]
            assert all(n in (1, forwards) for n in counts.values()), (counts, forwards)
            assert set(counts) == set(got["sizes"]), counts
            assert 0 < sum(got["sizes"][u] for u in kept) <= got["budget"], (counts, got["sizes"], got["budget"])
            assert len(kept) < len(counts), counts  # the budget is below the model: some units are re-gathered
        # The kept units, the one in use and the one gathered ahead (a prefetch bucket of one
        # element) are what the phase holds at once.
        assert all(peak <= got["budget"] + 2 * max(got["sizes"].values()) for peak in got["peaks"]), got["peaks"]
    print("gathered bytes per phase (rank 0):", ranks[0]["phase_bytes"], "peaks:", ranks[0]["peaks"],
          "budget:", ranks[0]["budget"], "gathers per unit, phase:",
          ranks[0]["phases"][-1], "train after phase:", ranks[0]["trains"][-1], "steady train:", ranks[0]["steady"])


# --- the end of a phase whose ranks ran different numbers of forwards ----------------------------------
def _backward_then_uneven_phase(rank: int, world: int) -> dict:
    model = _actor()
    engine = _engine(model)
    optimizer = engine.shard_optimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    lengths = []
    for step in range(2):
        engine.begin_pass("train")
        ids = torch.randint(1, 256, (2, 8), generator=torch.Generator().manual_seed(step))
        model(input_ids=ids, labels=ids).loss.backward()  # gathers and reduce-scatters before the phase
        with torch.no_grad(), engine.generation_phase(_whole(engine)):
            # The whole model kept: no synced_gpus, rank 0 runs 1 forward and rank 1 runs 4.
            lengths.append(model.generate(input_ids=_prompt(rank), max_new_tokens=1 + 3 * rank,
                                          do_sample=False).shape[1])
        optimizer.step()
        optimizer.zero_grad()
    return {"lengths": lengths, "gathered": engine.gathered_bytes}


def test_a_phase_whose_ranks_ran_different_numbers_of_forwards_ends_in_step() -> None:
    """2 ranks, the whole model within the budget (so ``synced_gpus`` is off): after a training
    forward and backward in the same pass, rank 0 generates 1 token (one forward, the one that
    records the phase's trace) and rank 1 four. The recorded trace is validated at the phase's end
    on rank 0 and at its second forward on rank 1, so the check of the ranks' collectives at the
    end pairs on both; the optimizer steps, twice, and nothing stays gathered."""
    ranks = run_distributed(_backward_then_uneven_phase, 2, timeout=60)
    assert [r["lengths"] for r in ranks] == [[6, 6], [9, 9]]
    assert all(r["gathered"] == 0 for r in ranks)


class _PrefillTower(torch.nn.Sequential):
    """A unit only the first forward of a phase runs (as a vision tower runs only in a VLM's prefill)."""


class _WithPrefillTower(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tower = _PrefillTower(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        self.blocks = torch.nn.ModuleList(_PrefillTower(torch.nn.Linear(8, 8)) for _ in range(3))

    def forward(self, x: torch.Tensor, prefill: bool) -> torch.Tensor:
        if prefill:
            x = self.tower(x)
        for block in self.blocks:
            x = block(x)
        return x


def _prefill_only_unit(rank: int, world: int) -> dict:
    from lightning_zinf import PrefetchConfig, ZeroEngine

    model = _WithPrefillTower()
    engine = ZeroEngine(model, block_classes=[_PrefillTower], prefetch=PrefetchConfig(persistence_threshold=0),
                        auto_pass=False)
    outs = []
    for _ in range(2):  # a second phase replays what the first agreed on
        with torch.no_grad(), engine.generation_phase(_whole(engine)):
            x = torch.ones(1, 8)
            for step in range(1 + 3 * rank):  # rank 0: the prefill alone; rank 1: prefill and 3 decodes
                x = model(x, prefill=step == 0)
            outs.append(x)
    with engine.gathered():
        want = torch.ones(1, 8)
        for step in range(1 + 3 * rank):
            want = model(want, prefill=step == 0)
    return {"same": all(torch.equal(o, want) for o in outs), "gathered": engine.gathered_bytes}


def test_whole_model_phase_whose_decodes_skip_a_prefill_unit_does_not_hang() -> None:
    """The whole model kept (no ``synced_gpus``): rank 0 runs one forward, rank 1 four, and the
    decodes skip a unit the prefill ran, so they leave the prefill's trace. A departure must not
    start a new recording there: its validation (a collective at a later pass's start) would run on
    rank 1 alone and pair with rank 0's check at the phase's end (a hang, or a false "ranks
    diverged"). Two phases; the outputs equal the same forwards on the gathered model."""
    ranks = run_distributed(_prefill_only_unit, 2, timeout=60)
    assert all(r["same"] and r["gathered"] == 0 for r in ranks)


# --- Fabric: one engine per set-up model -------------------------------------------------------------
def _fabric_rollouts(rank: int, world: int) -> dict:
    from lightning.fabric import Fabric

    from lightning_zinf import ZeroInfinityFabricStrategy

    strategy = ZeroInfinityFabricStrategy(block_classes=["LlamaDecoderLayer"],
                                          prefetch={"inference_budget": 0, "persistence_threshold": 0})
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    actor = _actor()
    actor, optimizer = fabric.setup(actor, torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=1e-2))
    engine = fabric.strategy.engine_of(actor)
    observer = _Observer(engine.comm.control_group)
    per_phase = []
    with observer.watching():
        for step in range(2):
            marks: list[int] = []
            hook = actor.module.base_model.model.register_forward_pre_hook(lambda *_: marks.append(observer.mark()))
            with torch.no_grad(), fabric.strategy.generation(actor):
                out = actor.module.generate(input_ids=_prompt(rank), max_new_tokens=3 + 2 * rank, do_sample=False)
                end = observer.mark()
            hook.remove()
            bounds = marks + [end]
            per_phase.append([observer.exchanges(a, b) for a, b in zip(bounds, bounds[1:])])
            loss = actor(input_ids=out, labels=out).loss
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return {"control": per_phase, "length": out.shape[1], "kinds": [k for k in engine.tracer._traces if isinstance(k, tuple) and k[0] == "generation"]}


def test_fabric_generation_of_a_set_up_model() -> None:
    """Fabric at 2 ranks (its engines start a pass at every forward of the set-up model): in
    ``strategy.generation(model)`` the passes are the phase's, one per decode forward, so after the
    first phase's prefill no forward checks anything with the other ranks (rank 1 asks for more
    tokens: ``synced_gpus`` keeps rank 0 stepping); the training step between the phases runs."""
    ranks = run_distributed(_fabric_rollouts, 2, init_pg=False, timeout=120)
    assert [r["length"] for r in ranks] == [5 + 3, 5 + 5]
    for got in ranks:
        first, second = got["control"]
        assert len(first) == len(second) == 5 and first[1:] == [0] * 4 and second == [0] * 5, got["control"]
        assert got["kinds"] == [("generation", "base_model.model")], got["kinds"]  # the model generate() runs


@pytest.mark.parametrize("budget", [-1, 0.5, True])
def test_a_budget_that_is_not_a_byte_count_is_refused(budget: Any) -> None:
    """One process: a negative, fractional or boolean budget raises before anything changes, naming
    the argument and what to pass."""
    from lightning_zinf import ZeroEngine

    engine = ZeroEngine(_actor(), block_classes=["LlamaDecoderLayer"], auto_pass=False)
    with pytest.raises(ValueError, match=r"budget must be a non-negative number of bytes.*inference_budget"):
        with engine.generation_phase(budget):
            pass
    assert engine.schedule._outer is None and not engine.generation.active
