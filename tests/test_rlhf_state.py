"""Several models in one LightningModule under ``ZeroInfinityStrategy`` (one engine), as an RLHF
run has them: what a checkpoint holds and how exactly a run resumes from it.

The module is a tiny GRPO step (no ``generate()``): a PEFT LoRA actor over a byte-level
``transformers`` Llama and a frozen ``LlamaForSequenceClassification`` reward model. Each step
samples a few tokens from the actor with a generator seeded from (seed, step, rank), scores them
with the reward model, takes the reference log-probs with the adapters off
(``actor.disable_adapter()``), and minimises the policy-gradient loss with group-normalised
advantages plus a KL term.

- With ``exclude_frozen_parameters=True``, sharded and full checkpoints hold the actor's ``lora_``
  parameters and their optimizer state, and nothing of the frozen base or the reward model
  (checked by key and by file bytes). The full type used to hold every frozen weight too.
- A run resumed from step 2's checkpoint reproduces steps 3-4 of the uninterrupted run (rewards,
  losses, KL): bit-equal in fp32, within 1e-6 with the frozen weights as INT8 codes. The frozen
  weights are not in the checkpoint: the module builds both models in ``__init__`` from a seed,
  so a fresh module has the same frozen values (and the same INT8 codes); ``load_full_weights``
  from the pretrained folders is the other way. Step 1's loss equals plain single-process PyTorch's.
- Two optimizers (the actor's adapters and a critic, as PPO has them) under manual optimization,
  two backwards, stepped separately: the losses equal plain PyTorch's.
- ``trainable_state_dict``/``load_trainable_state_dict``, which the full type uses, on a bare engine.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Optional

import lightning.pytorch as L
import peft
import pytest
import torch
import transformers
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_zinf import ZeroInfinityStrategy, ZeroPPConfig
from tests.harness import run_distributed

WORLD = 2
PROMPT = 4  # bytes per prompt
SAMPLES = 4  # responses per prompt (one GRPO group); one prompt per rank per step
NEW = 3  # sampled bytes per response
BETA = 0.1  # weight of the KL term
STEPS_PER_EPOCH = 2
SEED = 7


def _config(labels: Optional[int] = None) -> transformers.LlamaConfig:
    """A tiny byte-level Llama (examples/peft_lora.py's ``llama_config``, width 32, 2 layers)."""
    extra = {} if labels is None else {"num_labels": labels}
    return transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                    bos_token_id=None, eos_token_id=None, pad_token_id=0, **extra)


def _models(seed: int) -> tuple[peft.PeftModel, transformers.LlamaForSequenceClassification]:
    """The actor (LoRA r=4 on q/v, adapters initialised randomly so that the policy starts away
    from the reference) and the frozen reward model, from ``seed`` alone."""
    torch.manual_seed(seed)
    base = transformers.LlamaForCausalLM(_config())
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    actor = peft.get_peft_model(base, lora)
    reward = transformers.LlamaForSequenceClassification(_config(labels=1)).requires_grad_(False)
    return actor, reward


def _prompts(step: int) -> torch.Tensor:
    """The global batch of step ``step`` (0-based within an epoch): one prompt per rank."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(1, 256, (WORLD, PROMPT), generator=g)


def _grpo_step(actor, reward, prompt: torch.Tensor, step: int, rank: int) -> dict[str, torch.Tensor]:
    """One rank's GRPO loss for one prompt (shape ``(1, PROMPT)``, int64), as the LightningModule
    and the plain reference compute it."""
    g = torch.Generator().manual_seed(SEED * 1_000_003 + step * 1009 + rank)
    seq = prompt.repeat(SAMPLES, 1)
    with torch.no_grad():
        for _ in range(NEW):  # full forwards, no KV cache: the sampling needs nothing but logits
            probs = actor(input_ids=seq).logits[:, -1].float().softmax(-1)
            seq = torch.cat([seq, torch.multinomial(probs, 1, generator=g)], dim=1)
        scores = reward(input_ids=seq).logits.squeeze(-1)
        with actor.disable_adapter():
            ref = _token_logprobs(actor, seq)
    logp = _token_logprobs(actor, seq)
    advantages = (scores - scores.mean()) / (scores.std() + 1e-4)
    log_ratio = ref - logp  # k3 estimator of KL(policy || reference), per token
    kl = (log_ratio.exp() - log_ratio - 1).mean()
    loss = -(advantages[:, None] * logp).mean() + BETA * kl
    return {"loss": loss, "reward": scores.mean(), "kl": kl.detach()}


def _token_logprobs(actor, seq: torch.Tensor) -> torch.Tensor:
    logits = actor(input_ids=seq).logits[:, PROMPT - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, seq[:, PROMPT:, None]).squeeze(-1)


class _Grpo(L.LightningModule):
    """The actor and the frozen reward model in one LightningModule, built in ``__init__`` from a
    seed (real weights: the strategy partitions them from rank 0's values)."""

    def __init__(self) -> None:
        super().__init__()
        self.actor, self.reward = _models(SEED)
        self.history: dict[str, list[float]] = {"loss": [], "reward": [], "kl": []}

    def training_step(self, batch, batch_idx):
        out = _grpo_step(self.actor, self.reward, batch[0], self.global_step, self.global_rank)
        for key, value in out.items():
            self.history[key].append(self.trainer.strategy.reduce(value.detach()).item())
        self.log_dict({"reward": out["reward"], "kl": out["kl"]}, sync_dist=True, batch_size=1)
        return out["loss"]

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    def train_dataloader(self):
        prompts = torch.cat([_prompts(s)[self.global_rank : self.global_rank + 1] for s in range(STEPS_PER_EPOCH)])
        return DataLoader(TensorDataset(prompts), batch_size=1)


def _trainer(kind: str, frozen_bits: int, epochs: int, root: str) -> L.Trainer:
    strategy = ZeroInfinityStrategy(block_classes=["LlamaDecoderLayer"], exclude_frozen_parameters=True,
                                    state_dict_type=kind,
                                    zero_pp=ZeroPPConfig(frozen_bits=frozen_bits) if frozen_bits else None)
    every_epoch = ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1)
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=WORLD, max_epochs=epochs, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                     callbacks=[every_epoch], default_root_dir=root)


def _fit(rank: int, world: int, root: str, kind: str, frozen_bits: int) -> dict:
    """The uninterrupted 4-step run (saving after steps 2 and 4), then a fresh module and Trainer
    resumed from step 2's checkpoint running to step 4."""
    straight = _Grpo()
    trainer = _trainer(kind, frozen_bits, 2, root)
    trainer.fit(straight)
    engine = trainer.strategy.engine
    names = {id(p): n for n, p in straight.named_parameters()}
    lora = sorted(names[id(p)] for g in engine.groups if g.trainable for p in g.params)
    frozen_bytes = sum(p.numel() * p.element_size() for p in straight.parameters() if not p.requires_grad)
    resumed = _Grpo()
    _trainer(kind, frozen_bits, 2, root + "-resumed").fit(resumed, ckpt_path=str(Path(root) / "epoch=0-step=2.ckpt"))
    return {"straight": straight.history, "resumed": resumed.history, "lora": lora, "frozen_bytes": frozen_bytes,
            "frozen_codes": [g.codes is not None for g in engine.groups if not g.trainable]}


def _plain_first_loss() -> float:
    """Step 1 in one process: each rank's loss on its prompt, then their mean (what DDP's loss is)."""
    actor, reward = _models(SEED)
    prompts = _prompts(0)
    return sum(_grpo_step(actor, reward, prompts[r : r + 1], 0, r)["loss"].item() for r in range(WORLD)) / WORLD


@pytest.mark.parametrize("kind, frozen_bits", [("sharded", 0), ("sharded", 8), ("full", 0), ("full", 8)])
def test_grpo_checkpoint_holds_adapters_only_and_resumes_exactly(tmp_path: Path, kind: str, frozen_bits: int) -> None:
    root = tmp_path / "ckpt"
    got = run_distributed(_fit, WORLD, str(root), kind, frozen_bits, init_pg=False)[0]
    lora = got["lora"]
    assert lora and all("lora_" in n and n.startswith("actor.") for n in lora)
    assert all(got["frozen_codes"]) == bool(frozen_bits)
    step2 = root / "epoch=0-step=2.ckpt"
    lora_numel = sum(p.numel() for n, p in _models(SEED)[0].named_parameters() if "lora_" in n)
    if kind == "sharded":
        from lightning_zinf.checkpoint import read_meta

        groups = read_meta(step2)["zinf"]["groups"]
        kept = [g for g in groups if not g["excluded"]]
        assert sorted(n for g in kept for n in g["names"]) == lora
        assert all(not g["trainable"] for g in groups if g["excluded"])
        # Each rank's file: its header, then its shard of each adapter group, with the AdamW moments
        # (fp32: 3 copies) and one fp64 step per parameter; no other byte.
        want = WORLD * sum(3 * 4 * g["shard_numel"] + 8 * len(g["names"]) for g in kept)
        files = list(step2.glob("save-*/rank_*.safetensors"))
        assert len(files) == WORLD
        data = sum(f.stat().st_size - 8 - struct.unpack("<Q", f.read_bytes()[:8])[0] for f in files)
        assert data == want
        assert want < 4 * 4 * lora_numel  # the shards' padding, at most 16 elements per rank and group
    else:
        checkpoint = torch.load(step2, weights_only=True)
        assert sorted(checkpoint["state_dict"]) == lora
        (state,) = checkpoint["optimizer_states"]
        assert sorted(state["state"]) == list(range(len(lora)))  # AdamW's numbering over the adapters
        shapes = {n: p.shape for n, p in _models(SEED)[0].named_parameters()}
        assert all(v.shape == shapes[n.removeprefix("actor.")] for n, v in checkpoint["state_dict"].items())
        data = sum(v.numel() * v.element_size() for v in checkpoint["state_dict"].values())
        data += sum(v.numel() * v.element_size() for s in state["state"].values() for v in s.values())
        assert data == 3 * 4 * lora_numel + 4 * len(lora)
        # The rest of the file is Lightning's loop and callback state, and the zip's framing.
        assert step2.stat().st_size < data + 16 * 1024 and 8 * step2.stat().st_size < got["frozen_bytes"]
    # The frozen weights (the base model and the reward model) are over 20x the tensors written.
    assert 20 * data < got["frozen_bytes"]

    steps = range(STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH)
    for key in ("loss", "reward", "kl"):
        want = torch.tensor([got["straight"][key][s] for s in steps])
        resumed = torch.tensor(got["resumed"][key])
        if frozen_bits:
            torch.testing.assert_close(resumed, want, rtol=1e-6, atol=0)
        else:
            assert torch.equal(resumed, want), key
    if not frozen_bits:
        assert got["straight"]["kl"][0] > 0  # the adapters start away from the reference
        torch.testing.assert_close(got["straight"]["loss"][0], _plain_first_loss(), rtol=1e-5, atol=1e-6)


# --- two optimizers: the actor's adapters and a critic (PPO's shape) -------------------------------
MINIBATCHES = 2  # per rollout: the actor steps after each, the critic once on their summed gradients
ROWS = 4  # sequences per minibatch (global)


def _rollout(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s rollout: ``MINIBATCHES * ROWS`` byte sequences (int64, length 8) and their returns (fp32)."""
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randint(1, 256, (MINIBATCHES * ROWS, 8), generator=g), torch.randn(MINIBATCHES * ROWS, generator=g)


def _critic() -> transformers.LlamaForSequenceClassification:
    torch.manual_seed(SEED + 1)
    return transformers.LlamaForSequenceClassification(_config(labels=1))


def _ppo_losses(actor, critic, seq: torch.Tensor, returns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy loss (advantages from the critic's values, detached) and the critic's value loss."""
    values = critic(input_ids=seq).logits.squeeze(-1)
    logits = actor(input_ids=seq).logits[:, :-1].float()
    logp = logits.log_softmax(-1).gather(-1, seq[:, 1:, None]).squeeze(-1)
    policy = -((returns - values.detach())[:, None] * logp).mean()
    return policy, ((values - returns) ** 2).mean()


def _ppo_step(actor, critic, rows, backward, actor_opt, critic_opt, reduce) -> list[float]:
    """One rollout: per minibatch, both backwards and the actor's step; then the critic's step."""
    losses = []
    for seq, returns in rows:
        policy, value = _ppo_losses(actor, critic, seq, returns)
        backward(policy)
        backward(value)
        actor_opt.step()
        actor_opt.zero_grad()
        losses += [reduce(policy.detach()).item(), reduce(value.detach()).item()]
    critic_opt.step()
    critic_opt.zero_grad()
    return losses


def _ppo_optimizers(actor, critic) -> list[torch.optim.Optimizer]:
    return [torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=1e-2),
            torch.optim.AdamW(critic.parameters(), lr=1e-2)]


def _plain_ppo() -> list[float]:
    actor, critic = _models(SEED)[0], _critic()
    actor_opt, critic_opt = _ppo_optimizers(actor, critic)
    losses = []
    for step in range(3):
        seq, returns = _rollout(step)
        rows = [(seq[m * ROWS : (m + 1) * ROWS], returns[m * ROWS : (m + 1) * ROWS]) for m in range(MINIBATCHES)]
        losses += _ppo_step(actor, critic, rows, torch.Tensor.backward, actor_opt, critic_opt, lambda t: t)
    return losses


class _Ppo(L.LightningModule):
    """The LoRA actor and a trainable critic, each with its optimizer, under manual optimization."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.actor, self.critic = _models(SEED)[0], _critic()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        seq, returns = batch[0][0], batch[1][0]  # (MINIBATCHES, ROWS // WORLD, ...): this rank's rows
        actor_opt, critic_opt = self.optimizers()
        self.losses += _ppo_step(self.actor, self.critic, list(zip(seq, returns)), self.manual_backward, actor_opt,
                                 critic_opt, self.trainer.strategy.reduce)

    def configure_optimizers(self):
        return _ppo_optimizers(self.actor, self.critic)

    def train_dataloader(self):
        share = ROWS // WORLD
        rank = self.global_rank
        rollouts = [_rollout(step) for step in range(3)]
        seq = torch.stack([s.view(MINIBATCHES, ROWS, -1)[:, rank * share : (rank + 1) * share] for s, _ in rollouts])
        returns = torch.stack([r.view(MINIBATCHES, ROWS)[:, rank * share : (rank + 1) * share] for _, r in rollouts])
        return DataLoader(TensorDataset(seq, returns), batch_size=1)


def _fit_ppo(rank: int, world: int) -> list[float]:
    lit = _Ppo()
    L.Trainer(strategy=ZeroInfinityStrategy(block_classes=["LlamaDecoderLayer"]), accelerator="cpu", devices=WORLD,
              max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, use_distributed_sampler=False).fit(lit)
    return lit.losses


def test_actor_and_critic_with_two_optimizers_match_pytorch() -> None:
    """PPO's shape: per minibatch a policy backward, a value backward and the actor's step; the
    critic steps once per rollout on the gradients of both minibatches, accumulated across the
    actor's steps. The policy and value losses of 3 rollouts equal plain PyTorch's on the same
    global batches (each rank's loss the mean over its half; their mean, the global batch's)."""
    got = run_distributed(_fit_ppo, WORLD, init_pg=False)[0]
    want = _plain_ppo()
    assert len(got) == len(want) == 3 * MINIBATCHES * 2
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)


# --- the trainable parameters' full state dict, directly ---------------------------------------------
def _frozen_and_trainable() -> torch.nn.Module:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8), torch.nn.Linear(8, 3))
    model[0].requires_grad_(False)
    return model


def _round_trip(rank: int, world: int) -> dict:
    from lightning_zinf import ZeroEngine
    from lightning_zinf.checkpoint import CheckpointError
    from lightning_zinf.checkpoint.full import load_trainable_state_dict, trainable_state_dict

    engine = ZeroEngine(_frozen_and_trainable())
    saved = trainable_state_dict(engine, rank0_only=False)
    everywhere = trainable_state_dict(engine, rank0_only=True)
    edited = {k: v + 1 for k, v in saved.items()}
    load_trainable_state_dict(engine, edited)
    with engine.gathered():
        after = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    errors = []
    for bad in ({k: v for k, v in saved.items() if k != "2.bias"}, {**saved, "2.bias": torch.zeros(4)}):
        with pytest.raises(CheckpointError) as info:
            load_trainable_state_dict(engine, bad)
        errors.append(str(info.value))
    return {"saved": saved, "rank0_only": everywhere, "after": after, "errors": errors}


def test_trainable_state_dict_round_trip_leaves_frozen_alone() -> None:
    """``trainable_state_dict`` gives the trainable parameters' full values (nothing frozen), on
    rank 0 alone with ``rank0_only``; ``load_trainable_state_dict`` writes edited values into
    them and leaves the frozen ones as they were; a missing or mis-shaped entry is refused on
    every rank, naming it (2 ranks; the reference is the plain module)."""
    plain = _frozen_and_trainable()
    results = run_distributed(_round_trip, WORLD)
    for rank, got in enumerate(results):
        assert sorted(got["saved"]) == ["1.bias", "1.weight", "2.bias", "2.weight"]
        for name, value in got["saved"].items():
            assert torch.equal(value, plain.state_dict()[name])
        assert sorted(got["rank0_only"]) == (sorted(got["saved"]) if rank == 0 else [])
        for name, value in plain.named_parameters():
            assert torch.equal(got["after"][name], value if name.startswith("0.") else value + 1), name
        assert "'2.bias' missing" in got["errors"][0]
        assert "'2.bias' of shape (4,)" in got["errors"][1] and "has shape (3,)" in got["errors"][1]
