"""Issue 42, item 1: "ZeRO-3 is N times slower than DDP" on models of many small tensors.

Three models of ~25-50M parameters whose parameters come in many small tensors, each trained on
the same random data with AdamW (lr 1e-4, weight decay 0.01), fp32, 2 ranks on CPU with gloo, one
thread per rank, in plain PyTorch loops (no Lightning) so only the data parallelism differs:

  vlm  a PaliGemma-like vision-language model written here: a ViT encoder (conv patch embedding,
       17 blocks) on a 128 x 128 image, a projector, and a 17-block decoder LM that reads the 64
       image tokens as a prefix of 64 text tokens; next-token loss on the text. Every block's
       q/k/v projections are one small Linear per head (8 heads of 32): 29.3M parameters in 1,986
       tensors.
  t5   transformers' T5ForConditionalGeneration built from a T5Config with t5-small's sizes
       (d_model 512, d_ff 2048, 6 + 6 layers, 8 heads) but a vocabulary of 8,192 (32,128 would add
       12M parameters of embedding), dropout 0; seq-to-seq loss, 64 source and 32 label tokens:
       48.3M parameters in 131 tensors (few, large ones: the control).
  moe  6 blocks of attention and a mixture of 32 experts (d 256, ff 256) with top-2 routing.
       Each expert runs on the tokens routed to it (index_add of the gated outputs), and an
       expert chosen by no token still runs, on an empty batch: every expert's parameters are in
       every step's graph and get a gradient (zero when unused), so DDP needs no
       find_unused_parameters and every contender reduces the same tensors. No balancing loss.
       29.0M parameters in 827 tensors.

A step is one micro-batch of ``--batch`` samples (default 4) per rank, the same for every
contender (vlm: 64 image + 64 text positions per sample; t5: 64 + 32; moe: 128); tokens/s counts
those positions over both ranks.

Contenders, each a ``torchrun --nproc_per_node 2`` job of this script:

  ddp              DistributedDataParallel (full replicas: the ceiling, the model fits)
  zinf             ZeroEngine(model) with no block_classes (what a user who names none gets:
                   modules grouped into units of the default PrefetchConfig.unit_size,
                   the prefetch bucket's size),
                   optimizer through engine.shard_optimizer
  zinf_per_module  the same with unit_size=0: each module's own parameters a unit (the engine
                   before issue 42, and DeepSpeed's default granularity)
  fsdp2            fully_shard on each block (vlm's Block, T5Block, MoEBlock) and on the root
  deepspeed        DeepSpeed ZeRO-3 with its defaults (torch's AdamW as the client optimizer, so
                   every contender steps the same optimizer), run by ``--python-deepspeed``
  deepspeed_tuned  the same with ``stage3_module_granularity_threshold`` set to the largest block
                   granularity (DeepSpeed's: parameters / parameterised modules in the subtree,
                   containers not counted), so that every block is a leaf DeepSpeed gathers
                   whole; where a module above the blocks is that fine-grained too (t5's decoder
                   stack, finer than its encoder blocks), just below that module's instead, so
                   that no module above a block becomes the leaf (t5: the decoder blocks and the
                   encoder blocks' attention layers are leaves). A block's element count, the
                   obvious guess, exceeds the root's granularity on every model here and would
                   make the whole model one leaf, gathered whole: no ZeRO-3 left. The JSON
                   records the threshold and the leaves DeepSpeed made.

Per model and contender: tokens/s (mean over the steps after the first 2, rank 0), peak RSS (MiB,
the larger rank's), and the largest |loss - DDP's loss| over the steps (same model, data and
updates). A contender whose gap exceeds a tenth of what the updates moved DDP's losses (from the
untrained model's on the same batches) is flagged: it does not train as DDP does, and its speed
does not count. Adam amplifies rounding differences, so the gap need not be 0 (LOSS_FRACTION).
Each figure is the median of ``--repeats`` runs; within a repeat the contenders run one after another
in the order of ``--only``, so slow drifts of the machine hit all of them alike. The ratios are
zinf's tokens/s over each peer's (below 1: zinf slower). A contender that fails (e.g. DeepSpeed
missing or refusing a model) is recorded with the tail of its log; the others still run.

    python examples/benchmarks/small_tensors.py [--models vlm,t5,moe] [--steps 10] [--repeats 3]
        [--only ddp,zinf,zinf_per_module,fsdp2,deepspeed,deepspeed_tuned] [--python-deepspeed /path/to/venv/bin/python]
        [--out PATH]

``--python-deepspeed`` (default ``$ZINF_DEEPSPEED_PYTHON``, else this interpreter) is a Python with
DeepSpeed and transformers, e.g. a venv made with ``pip install torch==2.13.0`` (the CPU wheel on
this machine's disk) and then ``pip install deepspeed transformers``; its contenders run with
DS_ACCELERATOR=cpu.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from measure import (LR, SEED, add_self_launch_options, chosen_contenders, peak_rss_mib, run_record,  # noqa: E402
                     self_launched_rank)

MODELS = ("vlm", "t5", "moe")
CONTENDERS = ("ddp", "zinf", "zinf_per_module", "fsdp2", "deepspeed", "deepspeed_tuned")
WARMUP = 2
RANKS = 2
POSITIONS = {"vlm": 64 + 64, "t5": 64 + 32, "moe": 128}  # sequence positions of one sample (see batch())
# A contender is flagged when its losses differ from DDP's by more than this fraction of what the
# updates moved DDP's losses (from the untrained model's on the same batches). Not a fixed bound as
# in unit_cost.py: Adam's first steps divide by |g| + 1e-8, so where a gradient element is near 1e-8
# a rounding difference of ~1e-9 (DeepSpeed computes Linear's weight gradient with its own autograd
# function) changes the update by up to half the learning rate: seen here, DeepSpeed 3.5e-3 on t5
# where the updates moved the loss by 0.19, while a contender that did not train at all would
# differ by the whole of that.
LOSS_FRACTION = 0.1


class Attention(nn.Module):
    """Multi-head self-attention; ``per_head`` makes q, k and v one small Linear per head."""

    def __init__(self, d: int, heads: int, causal: bool, per_head: bool) -> None:
        super().__init__()
        self.heads, self.causal, self.per_head = heads, causal, per_head
        if per_head:
            self.q, self.k, self.v = (nn.ModuleList(nn.Linear(d, d // heads) for _ in range(heads)) for _ in range(3))
        else:
            self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.per_head:
            q, k, v = (torch.stack([lin(x) for lin in lins], 1) for lins in (self.q, self.k, self.v))
        else:
            q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out(y.transpose(1, 2).flatten(2))


class Block(nn.Module):
    """A pre-norm transformer block (vlm's encoder and decoder), per-head q/k/v projections."""

    def __init__(self, d: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, causal, per_head=True)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class VisionLanguageModel(nn.Module):
    def __init__(self, vocab=4096, d=256, heads=8, vision_layers=17, text_layers=17, image=128, patch=16, text=64):
        super().__init__()
        patches = (image // patch) ** 2
        self.patch_embed = nn.Conv2d(3, d, patch, stride=patch)
        self.vision_pos = nn.Parameter(torch.randn(1, patches, d) * 0.02)
        self.vision = nn.ModuleList(Block(d, heads, causal=False) for _ in range(vision_layers))
        self.vision_norm = nn.LayerNorm(d)
        self.projector = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))
        self.embed = nn.Embedding(vocab, d)
        self.text_pos = nn.Parameter(torch.randn(1, patches + text, d) * 0.02)
        # Causal over [image; text]: every text token sees the whole image (image tokens come first).
        self.decoder = nn.ModuleList(Block(d, heads, causal=True) for _ in range(text_layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, image: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(image).flatten(2).transpose(1, 2) + self.vision_pos
        for block in self.vision:
            x = block(x)
        prefix = self.projector(self.vision_norm(x))
        x = torch.cat([prefix, self.embed(tokens[:, :-1])], 1) + self.text_pos
        for block in self.decoder:
            x = block(x)
        logits = self.head(self.norm(x[:, prefix.shape[1]:]))
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


class Expert(nn.Module):
    def __init__(self, d: int, ff: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, ff), nn.Linear(ff, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MoE(nn.Module):
    """Top-k routing over small experts; see the module docstring for why every expert runs."""

    def __init__(self, d: int, experts: int, ff: int, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, ff) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(0, 1)
        weights, chosen = self.router(flat).softmax(-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            token, slot = (chosen == index).nonzero(as_tuple=True)  # possibly none: still called
            out = out.index_add(0, token, weights[token, slot, None] * expert(flat[token]))
        return out.view_as(x)


class MoEBlock(nn.Module):
    def __init__(self, d: int, heads: int, experts: int, ff: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, causal=True, per_head=False)
        self.moe = MoE(d, experts, ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class MoELM(nn.Module):
    def __init__(self, vocab=4096, d=256, heads=8, layers=6, experts=32, ff=256, seq=128):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, seq, d) * 0.02)
        self.blocks = nn.ModuleList(MoEBlock(d, heads, experts, ff) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1]) + self.pos
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), tokens[:, 1:].flatten())


class T5Loss(nn.Module):
    """T5 taking positional tensors and returning its loss, as the other models do."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import T5Config, T5ForConditionalGeneration

        config = T5Config(vocab_size=8192, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=6,
                          num_heads=8, dropout_rate=0.0,  # no dropout: every contender's losses comparable
                          pad_token_id=0, decoder_start_token_id=0)  # t5-small's
        self.t5 = T5ForConditionalGeneration(config)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.t5(input_ids=input_ids, labels=labels).loss


def build(name: str) -> tuple[nn.Module, type]:
    """The model (seeded: the same values on every rank and contender) and its block class."""
    torch.manual_seed(SEED)
    if name == "vlm":
        return VisionLanguageModel(), Block
    if name == "t5":
        from transformers.models.t5.modeling_t5 import T5Block

        return T5Loss(), T5Block
    return MoELM(), MoEBlock


def batch(name: str, size: int, step: int, rank: int) -> tuple[torch.Tensor, ...]:
    """Rank ``rank``'s micro-batch of ``size`` samples for step ``step``: the same for every contender."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    if name == "vlm":
        return torch.randn(size, 3, 128, 128, generator=g), torch.randint(4096, (size, 65), generator=g)
    if name == "t5":
        return torch.randint(1, 8192, (size, 64), generator=g), torch.randint(1, 8192, (size, 32), generator=g)
    return (torch.randint(4096, (size, 129), generator=g),)


def granularities(module: nn.Module, found: dict[nn.Module, int]) -> tuple[int, int]:
    """DeepSpeed ZeRO-3's granularity of every module under ``module`` that it may make a leaf
    (one with children, not a container such as ModuleList), into ``found``: the parameters of its
    subtree over the modules there that hold parameters (itself included, containers not), each
    counted as often as the walk down the children reaches it, as DeepSpeed counts (a shared
    embedding twice). ``stage3_module_granularity_threshold`` is held against it, from the root
    down: the first module at or under the threshold becomes a leaf. Returns ``module``'s
    (modules, parameters)."""
    if next(module.parameters(), None) is None:
        return 0, 0
    params = sum(p.numel() for p in module.parameters(recurse=False))
    children = [granularities(child, found) for child in module.children()]
    if not children:
        return 1, params
    layers, params = sum(c[0] for c in children), params + sum(c[1] for c in children)
    if isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
        return layers, params
    found[module] = params // (layers + 1)
    return layers + 1, params


def granularity_threshold(model: nn.Module, block_class: type) -> tuple[int, dict]:
    """The tuned DeepSpeed contender's ``stage3_module_granularity_threshold``: the largest block
    granularity, so that every block is a leaf, unless a module above the blocks has a granularity
    that low (it would become the leaf, the whole model for the root): then one below that, so no
    module above a block is a leaf and the blocks under it are. Also what it was chosen from."""
    found: dict[nn.Module, int] = {}
    granularities(model, found)
    blocks = [g for m, g in found.items() if isinstance(m, block_class)]
    above = [g for m, g in found.items()
             if not isinstance(m, block_class) and any(isinstance(sub, block_class) for sub in m.modules())]
    threshold = min(max(blocks), min(above) - 1)
    return threshold, {"largest_block_granularity": max(blocks), "smallest_granularity_above_blocks": min(above)}


def run_rank(args: argparse.Namespace) -> None:
    """One rank of one contender on one model (under torchrun): train, time each step, and on rank 0
    write the times, losses and every rank's peak RSS to ``args.result``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    contender, name = args.rank_of, args.models
    if contender.startswith("deepspeed"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, block_class = build(name)
    blocks = [m for m in model.modules() if isinstance(m, block_class)]
    info = {"parameters": sum(p.numel() for p in model.parameters()), "tensors": len(list(model.parameters()))}
    batches = [batch(name, args.batch, step, rank) for step in range(args.steps)]  # made before timing starts
    if contender == "ddp":  # the scale of the loss check (see LOSS_FRACTION); before any update
        with torch.no_grad():
            info["untrained_losses"] = [model(*inputs).item() for inputs in batches]
    engine = None
    if contender.startswith("zinf"):
        from lightning_zinf import PrefetchConfig, ZeroEngine

        # No block_classes: the point of the benchmark.
        engine = ZeroEngine(model, prefetch=PrefetchConfig(unit_size=0 if contender == "zinf_per_module" else None))
        info["zinf_units"] = len(engine.units)
        info["zinf_unit_size"] = engine.unit_size
        optimizer = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=LR))
    elif contender == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    elif contender == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in blocks:
            fully_shard(block)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    else:
        from deepspeed.utils import get_z3_leaf_modules

        config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 3}, "steps_per_print": 1_000_000}
        if contender == "deepspeed_tuned":
            threshold, chosen_from = granularity_threshold(model, block_class)
            config["zero_optimization"]["stage3_module_granularity_threshold"] = threshold
            info.update(granularity_threshold=threshold, **chosen_from)
        model, optimizer, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR), config=config)
        leaves = [type(m).__name__ for m in get_z3_leaf_modules(model.module)]
        info["deepspeed_leaf_modules"] = {kind: leaves.count(kind) for kind in sorted(set(leaves))}
        engine = model  # DeepSpeed's engine does backward and the step itself
    times, losses = [], []
    for inputs in batches:
        start = time.perf_counter()
        loss = model(*inputs)
        if contender.startswith("deepspeed"):
            engine.backward(loss)
            engine.step()  # steps and zeroes the gradients
        else:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    rss = [None] * dist.get_world_size()
    dist.all_gather_object(rss, peak_rss_mib())  # also: every rank is done before rank 0 writes
    if rank == 0:
        args.result.write_text(json.dumps({"step_times_s": times, "losses": losses, "peak_rss_mib": rss, **info}))
    del model, engine, optimizer
    dist.destroy_process_group()


def deepspeed_environment(python: str) -> dict[str, str]:
    """What DeepSpeed's runs add to the environment, as run_deepspeed.py's launcher does: the CPU
    accelerator; that venv's ninja first on PATH (another ninja version rebuilds DeepSpeed's cached
    ops); no per-step FutureWarnings."""
    return {"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore::FutureWarning",
            "PATH": os.pathsep.join([str(Path(python).parent), os.environ.get("PATH", "")])}


def run_once(name: str, contender: str, args: argparse.Namespace) -> dict:
    options = ["--models", name, "--steps", str(args.steps), "--batch", str(args.batch)]
    deepspeed = contender.startswith("deepspeed")
    data, error = self_launched_rank(__file__, contender, options, args.timeout,
                                     python=args.python_deepspeed if deepspeed else None,
                                     env=deepspeed_environment(args.python_deepspeed) if deepspeed else None)
    if data is None:
        return {"status": "failed", "error": error}
    timed = data["step_times_s"][WARMUP:]
    return {"status": "ok", "mean_step_s": sum(timed) / len(timed), **data}


def summarize(runs: dict[str, list[dict]], tokens_per_step: int) -> dict[str, dict]:
    """Per contender: the medians over its repeats, its largest loss difference from DDP's, and
    whether that exceeds LOSS_FRACTION of what the updates moved DDP's losses."""
    summary: dict[str, dict] = {}
    ddp_run = next((run for run in runs.get("ddp", []) if run["status"] == "ok"), None)
    ddp = ddp_run and ddp_run["losses"]
    moved = ddp_run and max(abs(a - b) for a, b in zip(ddp, ddp_run["untrained_losses"]))
    for contender, done in runs.items():
        ok = [run for run in done if run["status"] == "ok"]
        if not ok:
            summary[contender] = {"status": "failed", "error": done[-1]["error"]}
            continue
        summary[contender] = {
            "status": "ok",
            "tokens_per_s": statistics.median(tokens_per_step / run["mean_step_s"] for run in ok),
            "peak_rss_mib": statistics.median(max(run["peak_rss_mib"]) for run in ok),
            "loss_gap_to_ddp": None if ddp is None else max(
                abs(a - b) for run in ok for a, b in zip(run["losses"], ddp)),
            "training_moved_ddp_loss": moved,
            "runs_ok": len(ok),
        }
        gap = summary[contender]["loss_gap_to_ddp"]
        summary[contender]["trains_as_ddp"] = None if gap is None else gap <= LOSS_FRACTION * moved
    return summary


def ratios(summary: dict[str, dict]) -> dict[str, float | None]:
    """zinf's tokens/s over each peer's."""
    zinf = summary.get("zinf", {})
    return {f"zinf/{peer}": zinf["tokens_per_s"] / summary[peer]["tokens_per_s"]
            if zinf.get("status") == "ok" and summary.get(peer, {}).get("status") == "ok" else None
            for peer in ("ddp", "deepspeed_tuned", "fsdp2", "zinf_per_module")}


def error_line(error: str) -> str:
    """The telling line of a failed job's stderr: the last exception a rank raised (torchrun's own
    ChildFailedError only says that one did), else the last line."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    raised = [line for line in lines if ("Error" in line or "Exception" in line) and "ChildFailedError" not in line]
    return (raised or lines or ["(no output)"])[-1][:150]


def print_tables(results: dict) -> None:
    print(f"\n{'model':<5} {'contender':<16} {'tokens/s':>9} {'peak RSS MiB':>13} {'max |loss-DDP|':>15} "
          f"{'runs':>5}  note")
    for name, res in results.items():
        for contender, got in res["summary"].items():
            if got["status"] != "ok":
                print(f"{name:<5} {contender:<16} {'FAILED':>9}  {error_line(got['error'])}")
                continue
            gap = got["loss_gap_to_ddp"]
            print(f"{name:<5} {contender:<16} {got['tokens_per_s']:>9.1f} {got['peak_rss_mib']:>13.0f} "
                  f"{'-' if gap is None else f'{gap:.2e}':>15} {got['runs_ok']:>5}  "
                  f"{'NOT TRAINING AS DDP DOES' if got['trains_as_ddp'] is False else ''}")
    print(f"\n{'model':<5} {'parameters':>11} {'tensors':>8} {'zinf units':>11} {'DDP loss moved':>15} "
          + " ".join(f"{key:>21}" for key in ratios({})) + "   (tokens/s)")
    for name, res in results.items():
        moved = res["summary"].get("ddp", {}).get("training_moved_ddp_loss")
        cells = " ".join(f"{'-' if v is None else f'{v:.2f}':>21}" for v in res["ratios"].values())
        print(f"{name:<5} {res['parameters'] or 0:>11,} {res['tensors'] or 0:>8,} {res['zinf_units'] or '-':>11} "
              f"{'-' if moved is None else f'{moved:.2e}':>15} {cells}")


def drive(args: argparse.Namespace) -> None:
    results: dict[str, dict] = {}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        runs: dict[str, list[dict]] = {contender: [] for contender in args.only}
        tokens_per_step = RANKS * args.batch * POSITIONS[name]
        for repeat in range(args.repeats):
            for contender in args.only:  # alternated: a slow spell of the machine hits every contender
                print(f"[small_tensors] {name} {contender} (repeat {repeat + 1}/{args.repeats}) ...", flush=True)
                runs[contender].append(run_once(name, contender, args))
            summary = summarize(runs, tokens_per_step)
            ok = [run for done in runs.values() for run in done if run["status"] == "ok"]
            results[name] = {"parameters": ok[0]["parameters"] if ok else None,
                             "tensors": ok[0]["tensors"] if ok else None,
                             "zinf_units": next((run["zinf_units"] for run in runs.get("zinf", [])
                                                 if run["status"] == "ok"), None),
                             "tokens_per_step": tokens_per_step, "summary": summary, "ratios": ratios(summary),
                             "runs": runs}
            # Written after every repeat so that an interrupted run keeps what it measured.
            record = run_record(models=args.models, steps=args.steps, warmup=WARMUP, repeats=args.repeats,
                                micro_batch=args.batch, ranks=RANKS, lr=LR, python_deepspeed=args.python_deepspeed,
                                results=results)
            args.out.write_text(json.dumps(record, indent=2))
    print_tables(results)
    print(f"\nresults: {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated models (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=10,
                        help=f"steps per run; the first {WARMUP} are warm-up (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=4, help="samples per rank and step (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per model and contender (default: %(default)s)")
    parser.add_argument("--python-deepspeed", default=os.environ.get("ZINF_DEEPSPEED_PYTHON", sys.executable),
                        help="interpreter of a venv with DeepSpeed, for the deepspeed contenders "
                             "(default: $ZINF_DEEPSPEED_PYTHON, else this interpreter)")
    add_self_launch_options(parser, CONTENDERS, HERE / "results" / "small_tensors.json")
    args = parser.parse_args()
    if args.rank_of:
        run_rank(args)
        return
    chosen_contenders(parser, args, CONTENDERS)
    args.models = [name.strip() for name in args.models.split(",") if name.strip()]
    if not args.models or set(args.models) - set(MODELS):
        parser.error(f"--models must name some of {MODELS}")
    if args.steps <= WARMUP:
        parser.error(f"--steps must exceed the {WARMUP} warm-up steps")
    drive(args)


if __name__ == "__main__":
    main()
