"""LitGPT's own entry points driven through a Fabric that the test builds (``strategy="ddp"`` or
``"zero_infinity"``), on a tiny LitGPT config, a tokenizer trained here and local data only.

LitGPT's ``setup`` functions build their own Fabric (FSDP for pretraining, ModelParallel for LoRA),
so the tests call the ``main`` functions they hand that Fabric to, as LitGPT's CLI would after
``setup``: :func:`litgpt.pretrain.main` and :func:`litgpt.finetune.lora.main` (which loads the base
checkpoint with LitGPT's ``load_checkpoint``, saves ``lit_model.pth.lora`` and merges it with
:func:`litgpt.scripts.merge_lora.merge_lora`). ``sys.argv`` is set to the equivalent
``litgpt pretrain``/``litgpt finetune_lora`` command line, because LitGPT's
``save_hyperparameters`` parses it to write ``hyperparameters.yaml`` (which ``merge_lora`` reads
back for the LoRA settings).

Deviations from a plain ``litgpt`` run, all the same for DDP and zero_infinity:

- ``precision="32-true"`` (LitGPT's CPU default is bf16-mixed), so the two strategies can be
  compared to float tolerance;
- ``torch.compile``, which ``litgpt.pretrain.main`` applies to the model, is replaced by the
  identity unless ``compile=True`` (inductor on 2 CPU cores takes minutes);
- the pretraining data module is a small in-memory one (:class:`LocalTokens`) because every LitGPT
  pretraining data module (``TextFiles``, ``TinyStories``...) needs ``litdata``, whose requirements
  would replace this environment's torch; fine-tuning uses LitGPT's own ``JSON`` data module.

Installing LitGPT next to this project: ``pip install --no-deps litgpt==0.5.13 && pip install requests``.
LitGPT pins ``huggingface-hub<1.4`` and ``jsonargparse<=4.41``, older than ``transformers`` 5 and
this project need (``pip check`` reports both; the code paths used here work with the newer ones).
``requests`` is needed because LitGPT's ``CLI`` helper, which its command line and its
``save_hyperparameters`` use, enables ``jsonargparse``'s URL support; its other requirements
(``psutil``, ``tqdm``, ``safetensors``, ``tokenizers``, ``jsonargparse[signatures]``) are already
installed by ``pip install -e ".[test]"``.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader, Dataset

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# Pretraining text and the tokenizer's training text: a few stdlib modules (train), one (validation).
PRETRAIN_FILES = ["textwrap.py", "string.py", "shlex.py", "fnmatch.py"]
VAL_FILES = ["glob.py"]
# Fine-tuning examples: documented functions of these modules.
SFT_FILES = ["textwrap.py", "string.py", "shlex.py", "fnmatch.py", "glob.py", "posixpath.py", "genericpath.py",
             "bisect.py", "heapq.py", "keyword.py", "copy.py", "base64.py", "colorsys.py", "calendar.py"]
VOCAB = 512
EOS = "<|endoftext|>"
LORA = dict(lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_query=True, lora_key=False, lora_value=True,
            lora_projection=True, lora_mlp=True, lora_head=True)
# A training example's instruction, and its answer, which the fine-tuned model should give.
PROMPT, ANSWER = "Return the name of the function: Split the string *s* using shell-like syntax.", "split"


# --- the tiny model, tokenizer and data ---------------------------------------------------------

def tiny_config(**lora: Any):
    """A 2-layer Llama-style LitGPT config (RMSNorm, LLaMAMLP, GQA, RoPE; 140k parameters), 256
    tokens of context (LitGPT's alpaca prompts are ~145 tokens long); with ``lora`` keyword
    arguments the LoRA config of the same model."""
    if lora:
        from litgpt.lora import Config
    else:
        from litgpt.config import Config
    return Config(name="tiny-zinf", block_size=256, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_head=4,
                  n_query_groups=2, n_embd=64, rotary_percentage=1.0, parallel_residual=False, bias=False,
                  norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=128, **lora)


def build_tokenizer(out: Path) -> Path:
    """A byte-level BPE tokenizer (512 tokens) trained on the pretraining files, saved as LitGPT
    expects (``tokenizer.json`` and ``tokenizer_config.json``) in ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([(STDLIB / f).read_text() for f in PRETRAIN_FILES + VAL_FILES], trainer)
    assert tok.get_vocab_size() <= VOCAB
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": EOS, "eos_token": EOS, "add_bos_token": False, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return out


def build_sft_data(out: Path, n_train: int = 16, n_val: int = 8) -> Path:
    """``train.json``/``val.json`` for LitGPT's ``JSON`` data module: a documented stdlib
    function's docstring first line as the instruction, its name as the output."""
    samples = []
    for name in SFT_FILES:
        for node in ast.walk(ast.parse((STDLIB / name).read_text())):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and ast.get_docstring(node):
                line = ast.get_docstring(node).strip().splitlines()[0][:60]
                samples.append({"instruction": f"Return the name of the function: {line}", "output": node.name})
    samples = samples[:n_train + n_val]
    assert len(samples) == n_train + n_val, len(samples)
    assert {"instruction": PROMPT, "output": ANSWER} in samples[:n_train]
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.json").write_text(json.dumps(samples[:n_train]))
    (out / "val.json").write_text(json.dumps(samples[n_train:]))
    return out


class _Rows(Dataset):
    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.rows[i]


class _StatefulLoader(DataLoader):
    """A DataLoader with ``state_dict``: ``litgpt.pretrain`` puts its train dataloader in the state
    it saves (LitGPT's litdata loaders are stateful); a plain DataLoader would be pickled whole."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _make_local_tokens():
    from litgpt.data import DataModule

    @dataclass
    class LocalTokens(DataModule):
        """Pretraining data from local text files: each file tokenized with a BOS token (as
        LitGPT's ``TextFiles`` does), concatenated, cut into rows of ``max_seq_length + 1``."""

        train_files: list = field(default_factory=list)
        val_files: list = field(default_factory=list)
        tokenizer: Any = field(default=None, init=False, repr=False)
        batch_size: int = field(default=1, init=False, repr=False)
        seq: int = field(default=-1, init=False, repr=False)

        def __post_init__(self) -> None:
            super().__init__()

        def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length: int = -1) -> None:
            self.tokenizer, self.batch_size, self.seq = tokenizer, batch_size, max_seq_length + 1

        def _rows(self, files: list) -> torch.Tensor:
            ids = torch.cat([self.tokenizer.encode(Path(f).read_text().strip(), bos=True) for f in files]).long()
            n = len(ids) // self.seq
            return ids[: n * self.seq].view(n, self.seq)

        def train_dataloader(self) -> DataLoader:
            return _StatefulLoader(_Rows(self._rows(self.train_files)), batch_size=self.batch_size, drop_last=True)

        def val_dataloader(self) -> DataLoader:
            return _StatefulLoader(_Rows(self._rows(self.val_files)), batch_size=self.batch_size, drop_last=True)

    return LocalTokens


# --- recording what LitGPT logs -------------------------------------------------------------------

def _recorder():
    from lightning.fabric.loggers import Logger

    class Recorder(Logger):
        """A Fabric logger keeping every ``fabric.log_dict`` call of this rank."""

        def __init__(self) -> None:
            super().__init__()
            self.records: list[tuple[Optional[int], dict]] = []

        @property
        def name(self) -> str:
            return "recorder"

        @property
        def version(self) -> int:
            return 0

        def log_metrics(self, metrics: dict, step: Optional[int] = None) -> None:
            self.records.append((step, {k: float(v) for k, v in metrics.items()
                                        if isinstance(v, (int, float)) or torch.is_tensor(v)}))

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

    return Recorder()


def _fabric(strategy: str, logger, eager_init: bool = False):
    """A 2-process CPU Fabric. ``eager_init``: ``fabric.init_module(empty_init=...)`` builds the
    model for real whatever LitGPT asks (see :func:`finetune_rank`)."""
    import lightning as L

    import lightning_zinf  # noqa: F401  (registers "zero_infinity")

    if strategy == "zero_infinity_full":  # one-file checkpoints, as LitGPT's own FSDP (state_dict_type="full")
        strategy = lightning_zinf.ZeroInfinityFabricStrategy(state_dict_type="full")
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="32-true", loggers=[logger])
    fabric.launch()
    if eager_init:
        init_module = fabric.init_module
        fabric.init_module = lambda empty_init=None: init_module(empty_init=False)
    return fabric


def _summary(records: list) -> dict:
    train = [(step, m["loss"]) for step, m in records if "loss" in m]
    val = [(step, m["val_loss"]) for step, m in records if "val_loss" in m]
    lr = [(step, m["learning_rate"]) for step, m in records if "learning_rate" in m]
    return {"train": train, "val": val, "lr": lr}


# --- pretraining ----------------------------------------------------------------------------------

def pretrain_rank(rank: int, world: int, strategy: str, work: str, out: str, initial: Optional[str] = None,
                  resume: Any = False, max_iters: int = 12, compile: bool = False) -> dict:
    """``litgpt.pretrain.main`` under ``Fabric(strategy=strategy)``; returns this rank's logged
    train losses (per iteration) and validation losses."""
    import litgpt.pretrain as pretrain
    from litgpt import Tokenizer
    from litgpt.args import EvalArgs, TrainArgs

    if not compile:
        torch.compile = lambda model, *args, **kwargs: model  # noqa: E731  (see the module docstring)
    work_dir, out_dir = Path(work), Path(out)
    tok_dir = work_dir / "tokenizer"
    micro, seq = 2, 64
    train = TrainArgs(save_interval=3, log_interval=1, global_batch_size=8, micro_batch_size=micro,
                      max_tokens=max_iters * micro * seq * world, max_norm=1.0, min_lr=1e-4, lr_warmup_steps=2,
                      tie_embeddings=False, max_seq_length=seq)
    eval = EvalArgs(interval=3, max_iters=2, initial_validation=True, final_validation=True)
    optimizer = {"class_path": "torch.optim.AdamW",
                 "init_args": {"lr": 3e-3, "weight_decay": 0.1, "betas": [0.9, 0.95]}}
    sys.argv = ["litgpt", "pretrain", "tiny-zinf", "--out_dir", str(out_dir), "--precision", "32-true",
                "--tokenizer_dir", str(tok_dir), "--devices", str(world), "--train.max_tokens", str(train.max_tokens),
                "--train.global_batch_size", "8", "--train.micro_batch_size", str(micro),
                "--train.max_seq_length", str(seq)]
    LocalTokens = _make_local_tokens()
    data = LocalTokens(train_files=[str(STDLIB / f) for f in PRETRAIN_FILES],
                       val_files=[str(STDLIB / f) for f in VAL_FILES])
    logger = _recorder()
    fabric = _fabric(strategy, logger)
    pretrain.main(fabric=fabric, devices=world, seed=42, initial_checkpoint_dir=Path(initial) if initial else None,
                  resume=Path(resume) if isinstance(resume, str) else resume, config=tiny_config(), data=data,
                  out_dir=out_dir, tokenizer_dir=tok_dir, tokenizer=Tokenizer(tok_dir), train=train, eval=eval,
                  optimizer=optimizer)
    return _summary(logger.records)


def pretrained_weights(out: Path) -> dict:
    """The model weights of ``litgpt.pretrain``'s final checkpoint: the ``lit_model.pth`` file
    (``{"model": ..., "optimizer": ...}``) DDP writes, and zero_infinity with ``state_dict_type="full"``."""
    return torch.load(out / "final" / "lit_model.pth", weights_only=False)["model"]


def make_base_checkpoint(pretrain_out: Path, base: Path) -> Path:
    """LitGPT's ``convert_pretrained_checkpoint``: the pretraining checkpoint (DDP's) as a
    ``lit_model.pth`` checkpoint directory that ``litgpt finetune_lora``/``generate`` load."""
    from litgpt.scripts.convert_pretrained_checkpoint import convert_pretrained_checkpoint

    convert_pretrained_checkpoint(pretrain_out / "final", base)
    return base


# --- LoRA fine-tuning -----------------------------------------------------------------------------

def finetune_rank(rank: int, world: int, strategy: str, work: str, base: str, out: str, max_steps: int = 6,
                  eval_interval: int = 1000, eager_init: Optional[bool] = None, lr: float = 1e-2,
                  global_batch: int = 8, epochs: int = 100) -> dict:
    """``litgpt.finetune.lora.main`` under ``Fabric(strategy=strategy)``: LitGPT loads the base
    checkpoint (``load_checkpoint``), trains the adapters, saves ``final/lit_model.pth.lora`` and
    merges it into ``final/lit_model.pth``; returns this rank's logged losses.

    LitGPT builds the LoRA model in ``fabric.init_module(empty_init=(fabric.world_size > 1))``,
    meant for FSDP, which initialises the model itself. Under DDP that leaves ``lora_A`` as
    uninitialised memory (the base checkpoint does not hold it): the DDP run's losses are then
    random from the second step, NaN at times. The DDP reference is therefore built with
    ``empty_init=False`` (what LitGPT does on one device: the LoRA init from the seed);
    zero_infinity gets what LitGPT asks for, ``empty_init=True``, unless ``eager_init`` says
    otherwise."""
    import litgpt.finetune.lora as lora
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.data import JSON

    base_dir, out_dir = Path(base), Path(out)
    train = TrainArgs(save_interval=None, log_interval=1, global_batch_size=global_batch, micro_batch_size=2,
                      lr_warmup_steps=2, epochs=epochs, max_steps=max_steps, max_seq_length=None)
    eval = EvalArgs(interval=eval_interval, max_new_tokens=8, max_iters=4, initial_validation=True,
                    final_validation=True)
    optimizer = {"class_path": "torch.optim.AdamW", "init_args": {"lr": lr, "weight_decay": 0.0}}
    sys.argv = ["litgpt", "finetune_lora", str(base_dir), "--out_dir", str(out_dir), "--precision", "32-true",
                "--devices", str(world), "--train.max_steps", str(max_steps), "--train.epochs", str(epochs),
                "--train.global_batch_size", str(global_batch), "--train.micro_batch_size", "2",
                "--train.lr_warmup_steps", "2",
                "--eval.interval", str(eval_interval), "--eval.max_new_tokens", "8", "--eval.max_iters", "4",
                "--eval.initial_validation", "true"]
    for key, value in LORA.items():
        sys.argv += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    data = JSON(json_path=Path(work) / "sft", mask_prompt=True, prompt_style="alpaca", num_workers=0)
    logger = _recorder()
    fabric = _fabric(strategy, logger, eager_init=strategy == "ddp" if eager_init is None else eager_init)
    lora.main(fabric, world, 1337, tiny_config(**LORA), data, base_dir, out_dir, train, eval, optimizer, 1, "32-true")
    return _summary(logger.records)


# --- generation -----------------------------------------------------------------------------------

def litgpt_generate(checkpoint_dir: Path, max_new_tokens: int = 16) -> str:
    """``litgpt generate`` (the command line, one process, greedy: ``--top_k 1``) on a checkpoint
    directory; returns what it prints on stdout after its arguments (``pprint(locals())``): the
    prompt in its prompt style and the generated text."""
    command = [str(Path(sys.executable).parent / "litgpt"), "generate", str(checkpoint_dir), "--prompt", PROMPT,
               "--max_new_tokens", str(max_new_tokens), "--top_k", "1", "--precision", "32-true"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"litgpt generate failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done.stdout[done.stdout.index("}\n") + 2:]


def generate_rank(rank: int, world: int, strategy: str, checkpoint_dir: str, max_new_tokens: int = 16) -> dict:
    """``litgpt.generate.base.main``'s steps with a 2-process Fabric of ``strategy`` instead of its
    one-device Fabric: build the GPT in ``fabric.init_module``, KV cache, ``fabric.setup_module``,
    LitGPT's ``load_checkpoint``, then LitGPT's ``generate`` (greedy); returns the tokens and text.
    Not for DDP: its wrapper cannot be built under ``generate``'s ``torch.inference_mode()``
    ("Inference tensors do not track version counter"); the one-process ``litgpt generate`` is
    the reference."""
    from litgpt.config import Config
    from litgpt.generate.base import generate
    from litgpt.model import GPT
    from litgpt.prompts import PromptStyle, has_prompt_style, load_prompt_style
    from litgpt.tokenizer import Tokenizer
    from litgpt.utils import load_checkpoint

    checkpoint_dir = Path(checkpoint_dir)
    fabric = _fabric(strategy, _recorder())
    config = Config.from_file(checkpoint_dir / "model_config.yaml")
    tokenizer = Tokenizer(checkpoint_dir)
    style = load_prompt_style(checkpoint_dir) if has_prompt_style(checkpoint_dir) else PromptStyle.from_config(config)
    encoded = tokenizer.encode(style.apply(PROMPT), device=fabric.device)
    max_returned = encoded.size(0) + max_new_tokens
    with torch.inference_mode():
        with fabric.init_module(empty_init=True):
            model = GPT(config)
        with fabric.init_tensor():
            model.max_seq_length = max_returned
            model.set_kv_cache(batch_size=1)
        model.eval()
        model = fabric.setup_module(model)
        load_checkpoint(fabric, model, checkpoint_dir / "lit_model.pth")
        torch.manual_seed(1234)
        y = generate(model, encoded, max_returned, temperature=0.8, top_k=1, eos_id=tokenizer.eos_id)
    return {"tokens": y.tolist(), "text": tokenizer.decode(y)}
