"""RLHF in three stages under ``zero_infinity``, as DeepSpeed-Chat runs them, on the Python stdlib:

S. **SFT**: a byte-level ``transformers`` Llama (:func:`examples.peft_lora.llama_config`) trained on
   stdlib source lines (each ending in a newline); writes a Hugging Face folder.
R. **Reward model**: ``LlamaForSequenceClassification`` (one label) trained with the Bradley-Terry
   loss ``-log sigmoid(r(real line) - r(corrupted line))`` (Ouyang et al. 2022, eq. 1), the
   corruptions a mix (random bytes substituted, a run of one repeated byte, the words shuffled, the
   line left unfinished) so that no single cheap feature separates the pairs; logs the pair
   accuracy on held-out lines.
G. **GRPO** (Shao et al. 2024, "DeepSeekMath", section 4.1): one LightningModule holds the actor, a
   PEFT LoRA model over the SFT weights, and the reward model, frozen, both under ONE
   ``ZeroInfinityStrategy`` (the frozen weights stored as INT8 codes with ``frozen_bits: 8``). Each
   step samples a group of responses per prompt inside ``strategy.generation()``, scores them with
   the reward model, takes the reference log-probabilities from the actor with its adapters
   disabled, and steps the adapters on ``-(A * log p) + beta * KL`` with group-normalised
   advantages ``A``. No critic: the group mean is the baseline.

Lines come from the stdlib's ``.py`` files; the ``email`` package is held out and gives every
validation metric (:func:`examples.pretrain.stdlib_sources`). Each stage is a ``zinf fit --config``
run (``examples/configs/rlhf_{sft,reward,grpo}.yaml``); this script chains them and prints the
held-out reward before and after GRPO:

    python examples/rlhf.py --out runs/rlhf [--preset small] [--devices 2] [--seed 0]
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
import time
from pathlib import Path
from typing import Optional

import lightning.pytorch as L
import peft
import torch
import torch.nn.functional as F
import transformers
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.peft_lora import llama_config  # noqa: E402
from examples.pretrain import stdlib_sources  # noqa: E402

__all__ = ["StdlibLines", "source_lines", "corrupt", "SupervisedFinetune", "RewardModel", "GRPO", "grpo_loss",
           "response_logprobs", "response_mask", "PRESETS", "main"]

NEWLINE = 10  # the end of a response: generation stops at it
PAD = 0  # llama_config's pad_token_id; no source line holds a NUL byte
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def source_lines(data: bytes, min_len: int, max_len: int) -> list[bytes]:
    """The distinct stripped ASCII lines of ``data`` with ``min_len <= len <= max_len`` bytes that
    are not comments, in order of first appearance, each with a newline appended."""
    seen: dict[bytes, None] = {}
    for line in data.split(b"\n"):
        line = line.strip()
        if min_len <= len(line) <= max_len and line.isascii() and not line.startswith(b"#"):
            seen.setdefault(line + b"\n", None)
    return list(seen)


def corrupt(line: bytes, rng: random.Random) -> bytes:
    """A corrupted copy of ``line`` (which ends in a newline), one of four kinds chosen by ``rng``:
    a quarter of the bytes replaced with random printable ones; a run of 8 copies of one of its
    bytes written over it; its space-separated words shuffled (a line of one word gets its last byte
    replaced by ``@``); or the line cut short with no newline, unfinished. The mix keeps the reward
    model from learning one cheap feature: the probe's substitution-only model rewarded runs of
    spaces, and one never shown an unfinished line rewarded responses that never end."""
    body = bytearray(line[:-1])
    kind = rng.randrange(4)
    if kind == 3:
        return bytes(body[:rng.randrange(len(body) // 2, len(body))])
    if kind == 0:
        for i in rng.sample(range(len(body)), max(1, len(body) // 4)):
            body[i] = rng.randrange(32, 127)
    elif kind == 1:
        start = rng.randrange(len(body) - 8)
        body[start:start + 8] = bytes([body[rng.randrange(len(body))]]) * 8
    else:
        words = bytes(body).split(b" ")
        rng.shuffle(words)
        shuffled = bytearray(b" ".join(words))
        body = shuffled if shuffled != body else body[:-1] + b"@"
    return bytes(body) + b"\n"


def _padded(line: bytes, width: int) -> torch.Tensor:
    return torch.tensor(list(line) + [PAD] * (width - len(line)))


class _Lines(Dataset):
    """Lines as int64 rows of ``width`` bytes, right-padded with ``PAD``; with ``pairs``, item i is
    ``(line, corrupt(line))``, the corruption fixed by ``(seed, i)``."""

    def __init__(self, lines: list[bytes], width: int, pairs: bool, seed: int) -> None:
        self.lines, self.width, self.pairs, self.seed = lines, width, pairs, seed

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, i: int):
        line = self.lines[i]
        if not self.pairs:
            return _padded(line, self.width)
        return _padded(line, self.width), _padded(corrupt(line, random.Random(self.seed * 1_000_003 + i)), self.width)


class StdlibLines(L.LightningDataModule):
    """Stdlib source lines (:func:`source_lines`), the ``held_out`` package's for validation.

    Batches are int64 ``[batch, max_len + 1]`` rows right-padded with 0 (each line ends in a
    newline); with ``pairs``, a ``(real, corrupted)`` tuple of two such tensors (:func:`corrupt`).

    Args:
        min_len, max_len: Line length range in bytes, newline excluded (``min_len > 8``: the
            repeated-byte corruption writes 8 bytes).
        batch_size: Lines (or pairs) per rank per step.
        val_lines: Held-out lines in the validation set (the first ones of ``held_out``, in file order).
        val_batch_size: Validation lines per rank per batch.
        pairs: Yield preference pairs (the reward model's data).
        held_out: Package whose lines are the validation set.
        corruption_seed: Seeds the corruptions.

    Raises:
        ValueError: ``min_len`` is 8 or less, or ``max_len < min_len``.
    """

    def __init__(self, min_len: int = 16, max_len: int = 40, batch_size: int = 8, val_lines: int = 64,
                 val_batch_size: int = 32, pairs: bool = False, held_out: str = "email",
                 corruption_seed: int = 0) -> None:
        super().__init__()
        if min_len <= 8 or max_len < min_len:
            raise ValueError(f"StdlibLines(min_len={min_len}, max_len={max_len}): need 8 < min_len <= max_len "
                             "(the repeated-byte corruption writes 8 bytes into a line).")
        self.save_hyperparameters()

    @override
    def setup(self, stage: str) -> None:
        h = self.hparams
        train, val = stdlib_sources(held_out=h.held_out)
        width = h.max_len + 1
        self.train_set = _Lines(source_lines(train, h.min_len, h.max_len), width, h.pairs, h.corruption_seed)
        self.val_set = _Lines(source_lines(val, h.min_len, h.max_len)[:h.val_lines], width, h.pairs,
                              h.corruption_seed + 1)

    @override
    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.val_batch_size)


def _export(module: L.LightningModule, model: transformers.PreTrainedModel, folder: Optional[str]) -> None:
    """Write ``model`` as ``save_pretrained`` does into ``folder`` (rank 0), its parameters gathered
    whole for the duration (collective: every rank calls it). For a model too large to gather, export
    the sharded checkpoint instead (:func:`lightning_zinf.hf_export.export_pretrained`)."""
    if folder is None:
        return
    with module.trainer.strategy.gathered_parameters():
        if module.trainer.is_global_zero:
            model.save_pretrained(folder)
    module.trainer.strategy.barrier("rlhf-export")
    rank_zero_info(f"rlhf: wrote {folder}")


def reward_config(width: int, layers: int, seq_len: int) -> transformers.LlamaConfig:
    """The reward model's config: :func:`examples.peft_lora.llama_config` with one label (a score)."""
    config = llama_config(width, layers, seq_len)
    config.num_labels = 1
    return config


def save_stand_in_models(folder: Path, width: int, layers: int, reward_width: int, reward_layers: int,
                         seq_len: int = 64) -> tuple[Path, Path]:
    """Stage S's and stage R's folders (``folder/sft``, ``folder/reward``), written as
    ``save_pretrained`` writes them, with models freshly initialised from seed 0 instead of trained:
    for running stage G where what is measured is the models' size, not their quality (the
    2-node benchmark, the config's smoke test)."""
    torch.manual_seed(0)
    sft, reward = folder / "sft", folder / "reward"
    transformers.LlamaForCausalLM(llama_config(width, layers, seq_len)).save_pretrained(sft)
    transformers.LlamaForSequenceClassification(reward_config(reward_width, reward_layers, seq_len)).save_pretrained(reward)
    return sft, reward


class _ExportedStage(L.LightningModule):
    """What stages S and R share: one constant-rate AdamW over every parameter, and the trained
    model written to ``hparams.export_dir`` at the end of fit (:func:`_export`)."""

    model: Optional[transformers.PreTrainedModel]

    @override
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    @override
    def on_train_end(self) -> None:
        _export(self, self.model, self.hparams.export_dir)


class SupervisedFinetune(_ExportedStage):
    """Stage S: the byte-level Llama trained on whole lines (next-byte cross-entropy over the
    non-padding targets, the final newline included, so that generation learns where a line ends).

    Args:
        width, layers: Model shape (:func:`examples.peft_lora.llama_config`; 4 heads).
        seq_len: Longest sequence in bytes (positions).
        lr: AdamW learning rate (constant).
        export_dir: Folder the trained model is written to at the end of fit (``from_pretrained``
            loads it); ``None``: not written.
    """

    def __init__(self, width: int = 128, layers: int = 2, seq_len: int = 64, lr: float = 3e-3,
                 export_dir: Optional[str] = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: Optional[transformers.LlamaForCausalLM] = None

    @override
    def configure_model(self) -> None:
        if self.model is None:
            h = self.hparams
            self.model = transformers.LlamaForCausalLM(llama_config(h.width, h.layers, h.seq_len))

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=batch).logits[:, :-1]
        targets = batch[:, 1:]
        mask = targets != PAD
        return F.cross_entropy(logits[mask].float(), targets[mask])

    @override
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)


class RewardModel(_ExportedStage):
    """Stage R: ``LlamaForSequenceClassification`` (one label: the score at the last non-padding
    byte) trained with the Bradley-Terry loss ``-log sigmoid(r(real) - r(corrupted))`` on pairs of
    :class:`StdlibLines` (``pairs: true``); logs ``val_pair_acc``, the share of held-out pairs
    ranked right, and ``val_reward_real``, the mean score of the held-out real lines.

    Args:
        width, layers: Model shape (:func:`examples.peft_lora.llama_config`).
        seq_len: Longest sequence in bytes.
        lr: AdamW learning rate (constant).
        export_dir: Folder the trained model is written to at the end of fit; ``None``: not written.
    """

    def __init__(self, width: int = 64, layers: int = 2, seq_len: int = 64, lr: float = 3e-3,
                 export_dir: Optional[str] = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: Optional[transformers.LlamaForSequenceClassification] = None

    @override
    def configure_model(self) -> None:
        if self.model is None:
            h = self.hparams
            self.model = transformers.LlamaForSequenceClassification(reward_config(h.width, h.layers, h.seq_len))

    def _scores(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        real, fake = batch
        scores = self.model(input_ids=torch.cat([real, fake])).logits[:, 0].float()
        return scores[:len(real)], scores[len(real):]

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        real, fake = self._scores(batch)
        loss = -F.logsigmoid(real - fake).mean()
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_pair_acc", (real > fake).float().mean())
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        real, fake = self._scores(batch)
        self.log("val_pair_acc", (real > fake).float().mean(), sync_dist=True)
        self.log("val_reward_real", real.mean(), sync_dist=True)


def response_mask(responses: torch.Tensor) -> torch.Tensor:
    """True at each response byte up to and including its first newline (``[n, length]`` bool):
    what ``generate`` wrote before it stopped; the padding after a finished response is False."""
    ends = (responses == NEWLINE).int()
    return (ends.cumsum(1) - ends) == 0


def response_logprobs(model: torch.nn.Module, sequences: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """``log p(byte_t | bytes_<t)`` under ``model`` of each byte after the prompt (``[n, length -
    prompt_len]`` fp32). The padding after a response sits after every byte it scores (causal)."""
    logits = model(input_ids=sequences).logits[:, prompt_len - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, sequences[:, prompt_len:, None]).squeeze(-1)


def grpo_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor,
              group_size: int, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's objective for one on-policy update (Shao et al. 2024, eq. 3 with the ratio at 1, so no
    clipping): ``mean_i 1/|o_i| sum_t [-A_i log p_t + beta KL_t]``.

    ``A_i = (r_i - mean(group)) / (std(group) + 1e-4)`` over each prompt's ``group_size`` responses
    (consecutive rows), and ``KL_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1``, the
    non-negative, unbiased "k3" estimator of ``KL(policy || reference)`` (eq. 4).

    Args:
        logprobs: ``[n, length]`` fp32, with gradients: the policy's response log-probabilities.
        ref_logprobs: ``[n, length]`` fp32: the reference's.
        rewards: ``[n]``: one score per response.
        mask: ``[n, length]`` bool: the response bytes (:func:`response_mask`).
        group_size: Responses per prompt; ``n`` must be a multiple of it.
        beta: Weight of the KL penalty.

    Returns:
        ``(loss, kl)``: the scalar loss and each response's mean KL ``[n]`` (no gradient).
    """
    grouped = rewards.float().view(-1, group_size)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1, 1)
    log_ratio = ref_logprobs - logprobs
    kl = torch.exp(log_ratio) - log_ratio - 1
    weights = mask.float() / mask.sum(1, keepdim=True).clamp(min=1)
    per_response = ((-advantages * logprobs + beta * kl) * weights).sum(1)
    return per_response.mean(), (kl.detach() * weights).sum(1)


class GRPO(L.LightningModule):
    """Stage G: GRPO of a LoRA actor against a frozen learned reward, one AdamW over the adapters.

    ``self.actor`` is a PEFT LoRA model (rank ``r`` on every projection) over the SFT model,
    ``self.reward`` the stage-R model with ``requires_grad`` off; the strategy loads both
    (``load_full_weights={"actor.base_model.model.": sft_dir, "reward.": reward_dir}``). The
    reference policy is the actor with its adapters disabled: no third model. With
    ``exclude_frozen_parameters`` a checkpoint holds the adapters and their optimizer state only.

    A training batch is lines whose first ``prompt_len`` bytes are the prompts; each is answered
    ``group_size`` times. Sampling is seeded by ``(seed, global_step, rank)`` (``generate`` takes no
    generator), so a resumed run samples what the uninterrupted one did. Logs ``reward``, ``kl``
    (mean k3 per response) and ``response_len`` (bytes, newline included). Validation answers the
    held-out lines' prompts ``val_samples`` times each with a fixed seed and logs ``val_reward`` (mean score),
    ``val_reward_std`` (across responses) and ``val_nll``, the actor's byte cross-entropy on the
    held-out lines themselves, a measure the reward model never sees: it rises if the policy
    drifts into text the reward model over-scores.

    Args:
        sft_dir: Stage S's folder (its config builds the actor).
        reward_dir: Stage R's folder (its config builds the reward model).
        r: LoRA rank.
        lr: AdamW learning rate of the adapters.
        beta: KL penalty weight.
        group_size: Responses sampled per prompt (G).
        prompt_len: Prompt length in bytes (a prefix of each line).
        new_tokens: Most bytes generated per response (a newline ends one earlier).
        val_samples: Responses sampled per held-out prompt in validation.
        seed: Seeds sampling.
    """

    def __init__(self, sft_dir: str, reward_dir: str, r: int = 8, lr: float = 3e-3, beta: float = 0.02,
                 group_size: int = 4, prompt_len: int = 12, new_tokens: int = 24, val_samples: int = 2,
                 seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.actor: Optional[peft.PeftModel] = None
        self.reward: Optional[transformers.PreTrainedModel] = None

    @override
    def configure_model(self) -> None:
        if self.actor is not None:
            return
        h = self.hparams
        for stage, folder in (("S (rlhf_sft.yaml)", h.sft_dir), ("R (rlhf_reward.yaml)", h.reward_dir)):
            if not Path(folder, "config.json").is_file():
                raise FileNotFoundError(f"GRPO needs stage {stage}'s model folder, and {folder!r} holds no config.json: "
                                        "run that stage first (python examples/rlhf.py chains all three), or point "
                                        "sft_dir/reward_dir (and load_full_weights) at its folder.")
        base = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(h.sft_dir))
        self.actor = peft.get_peft_model(base, peft.LoraConfig(r=h.r, target_modules=LORA_TARGETS))
        config = transformers.AutoConfig.from_pretrained(h.reward_dir)
        self.reward = transformers.AutoModelForSequenceClassification.from_config(config).requires_grad_(False)

    def _sample(self, prompts: torch.Tensor, seed: int) -> torch.Tensor:
        """``generate`` sampling (temperature 1, no top-k) until a newline or ``new_tokens``, under
        ``torch.manual_seed(seed)`` with the caller's random state restored after."""
        cuda = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda, device_type=self.device.type):
            torch.manual_seed(seed)
            return self.actor.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                                       top_k=0, top_p=1.0, max_new_tokens=self.hparams.new_tokens,
                                       eos_token_id=NEWLINE, pad_token_id=PAD)

    @override
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        h = self.hparams
        prompts = batch[:, :h.prompt_len].repeat_interleave(h.group_size, 0)
        seed = (h.seed * 1_000_003 + self.global_step) * 1009 + self.global_rank
        with self.trainer.strategy.generation(), torch.no_grad():
            sequences = self._sample(prompts, seed)
            rewards = self.reward(input_ids=sequences).logits[:, 0].float()
            with self.actor.disable_adapter():  # the reference policy: the SFT weights
                ref = response_logprobs(self.actor, sequences, h.prompt_len)
        mask = response_mask(sequences[:, h.prompt_len:])
        loss, kl = grpo_loss(response_logprobs(self.actor, sequences, h.prompt_len), ref, rewards, mask,
                             h.group_size, h.beta)
        self.log("reward", rewards.mean(), prog_bar=True, sync_dist=True)
        self.log("kl", kl.mean(), prog_bar=True, sync_dist=True)
        self.log("response_len", mask.sum(1).float().mean(), sync_dist=True)
        return loss

    @override
    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        h = self.hparams
        prompts = batch[:, :h.prompt_len].repeat_interleave(h.val_samples, 0)
        sequences = self._sample(prompts, (h.seed * 1_000_003 + 7919 + batch_idx) * 1009 + self.global_rank)
        rewards = self.reward(input_ids=sequences).logits[:, 0].float()
        logits = self.actor(input_ids=batch).logits[:, :-1]
        targets = batch[:, 1:]
        real = targets != PAD
        self.log("val_reward", rewards.mean(), sync_dist=True)
        self.log("val_reward_std", rewards.std(), sync_dist=True)
        self.log("val_nll", F.cross_entropy(logits[real].float(), targets[real]), sync_dist=True)
        if batch_idx == 0:
            shown = [bytes(s[s != PAD].tolist()).decode("ascii", "replace") for s in sequences[:4]]
            rank_zero_info(f"rlhf: step {self.global_step} samples (reward): " + " | ".join(
                f"{text!r} ({score:.2f})" for text, score in zip(shown, rewards.tolist())))

    @override
    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr)


#: Steps per stage: ``small`` is what the end-to-end test runs (about 40 s at 2 CPU ranks).
PRESETS = {
    "small": {"sft_steps": 150, "reward_steps": 200, "grpo_steps": 40},
    "default": {"sft_steps": 400, "reward_steps": 600, "grpo_steps": 100},
}


def _metrics(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """A CSVLogger's ``metrics.csv`` as ``{name: [(step, value), ...]}``."""
    out: dict[str, list[tuple[int, float]]] = {}
    with open(log_dir / "metrics.csv") as f:
        for row in csv.DictReader(f):
            for name, value in row.items():
                if name not in ("step", "epoch") and value:
                    out.setdefault(name, []).append((int(row["step"]), float(value)))
    return out


def _stage(config: str, out: Path, name: str, steps: int, devices: int, seed: int, extra: list[str]) -> dict:
    """``zinf fit --config examples/configs/{config}`` for ``steps`` steps, logging to ``out/logs/name``;
    returns its logged metrics (:func:`_metrics`)."""
    from lightning_zinf.cli import main as zinf

    root = Path(__file__).resolve().parents[1]
    zinf(["fit", "--config", str(root / "examples" / "configs" / config), "--seed_everything", str(seed),
          "--trainer.devices", str(devices), "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(steps),
          "--trainer.logger.init_args.save_dir", str(out / "logs"), "--trainer.logger.init_args.name", name,
          "--trainer.logger.init_args.version", "0",
          "--trainer.default_root_dir", str(out / name), *extra])
    return _metrics(out / "logs" / name / "version_0") if rank_zero_only.rank == 0 else {}


def main(argv: Optional[list[str]] = None) -> dict:
    """Run stages S, R and G (:func:`_stage`) into ``--out`` and print (and return, on rank 0) the
    held-out figures: the reward model's pair accuracy, ``val_reward`` before and after GRPO, the
    last KL, ``val_nll`` before and after, and the seconds taken."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/rlhf"))
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    steps = PRESETS[args.preset]
    start = time.perf_counter()
    out = args.out.resolve()
    sft, reward = out / "sft_model", out / "reward_model"
    run = dict(out=out, devices=args.devices, seed=args.seed)
    s = _stage("rlhf_sft.yaml", name="sft", steps=steps["sft_steps"], extra=["--model.init_args.export_dir", str(sft)], **run)
    r = _stage("rlhf_reward.yaml", name="reward", steps=steps["reward_steps"],
               extra=["--model.init_args.export_dir", str(reward), "--data.init_args.corruption_seed", str(args.seed)], **run)
    weights = json.dumps({"actor.base_model.model.": str(sft), "reward.": str(reward)})
    g = _stage("rlhf_grpo.yaml", name="grpo", steps=steps["grpo_steps"],
               extra=["--model.init_args.sft_dir", str(sft), "--model.init_args.reward_dir", str(reward),
                      "--model.init_args.seed", str(args.seed), "--trainer.strategy.init_args.load_full_weights", weights],
               **run)
    if rank_zero_only.rank != 0:  # the launcher runs this script on every rank; rank 0 has the logs
        return {}
    result = {
        "sft_val_loss": s["val_loss"][-1][1], "pair_acc": r["val_pair_acc"][-1][1],
        "val_reward_real": r["val_reward_real"][-1][1],
        "val_reward_first": g["val_reward"][0][1], "val_reward_last": g["val_reward"][-1][1],
        "val_reward_std": g["val_reward_std"][0][1], "kl_last": g["kl"][-1][1],
        "val_nll_first": g["val_nll"][0][1], "val_nll_last": g["val_nll"][-1][1],
        "seconds": time.perf_counter() - start,
    }
    print(f"rlhf: SFT val_loss {result['sft_val_loss']:.3f}; reward model held-out pair accuracy "
          f"{result['pair_acc']:.3f} (real held-out lines score {result['val_reward_real']:.3f})")
    print(f"rlhf: val_reward {result['val_reward_first']:.3f} -> {result['val_reward_last']:.3f} "
          f"(std across responses {result['val_reward_std']:.3f}), KL {result['kl_last']:.4f}, "
          f"val_nll {result['val_nll_first']:.3f} -> {result['val_nll_last']:.3f}, {result['seconds']:.0f} s")
    return result


if __name__ == "__main__":
    main()
