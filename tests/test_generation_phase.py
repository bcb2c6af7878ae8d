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
    wrapping ``ProcessGroup``'s methods (what ``torch.distributed``'s functions call)."""

    def __init__(self) -> None:
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
        return [ranks for name, ranks, _ in self.calls[start:stop] if name in _GATHERS]

    def cross_node_gathers(self, start: int = 0, stop: int | None = None) -> int:
        return sum(len({r // RANKS_PER_NODE for r in ranks}) > 1 for ranks in self.gathers(start, stop))

    def all_reduces_on(self, group: Any, start: int = 0, stop: int | None = None) -> int:
        return sum(name == "allreduce" and g is group for name, _, g in self.calls[start:stop])


def _engine(model: Any, **zero_pp: Any) -> Any:
    from lightning_zinf import PrefetchConfig, ZeroEngine, ZeroPPConfig

    return ZeroEngine(model, block_classes=["LlamaDecoderLayer"], prefetch=PrefetchConfig(persistence_threshold=0),
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
    observer = _Observer()
    control, world_group = engine.comm.control_group, dist.group.WORLD
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
                "control": [observer.all_reduces_on(control, a, b) for a, b in zip(bounds, bounds[1:])],
                "synced_flag": observer.all_reduces_on(world_group, starts[0], end),
                "inter_node_bytes": [b - a for a, b in zip([0] + inter, inter)],
            })
            _train_step(engine, model, optimizer, rank)
    return {"phases": phases}


@pytest.mark.parametrize("budget_share", [0.0, 0.3], ids=["budget-0", "budget-0.3x"])
def test_decode_steps_cross_no_node_and_check_nothing_per_gather(budget_share: float) -> None:
    """hpZ at 4 ranks (2 nodes), ``generate()`` of a PEFT model in a phase, a training step, and a
    phase again: each phase's first forward (prefill) gathers across nodes (the adapters changed in
    the step; the frozen base already has its secondary partitions in the second phase), and every
    decode step after it makes no gather whose group spans nodes (the observer agrees with the
    engine's own inter-node byte count) and no control-plane all-reduce (no agreement check per
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
          "control all-reduces per forward:", [p["control"] for p in ranks[0]["phases"]])
