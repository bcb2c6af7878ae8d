"""RLHF's generation phase: an actor's ``generate()`` under zinf against DeepSpeed ZeRO-3, as TRL
runs it, on this machine.

    python examples/benchmarks/rlhf_generation.py [--ranks 2] [--width 512] [--layers 8]
        [--new-tokens 32] [--repeats 3] [--out results/rlhf_generation.json]

The actor is the RLHF example's: a byte-level ``transformers`` Llama with PEFT LoRA (rank 8 on the
attention projections; weights from a fixed seed, so every contender holds the same model). Every
rank greedily generates ``--new-tokens`` bytes for its own ``--batch`` prompts (different per rank,
so ranks may finish at different lengths when ``--eos`` is set) after one untimed warm-up call; each
contender is its own ``torchrun`` of ``--ranks`` gloo processes, run ``--repeats`` times, alternated,
and the median is reported.

Contenders:
  replicated   the whole model on every rank (the bound: no communication)
  zinf@F       ``ZeroEngine.generation_phase(F x the model's bytes)``, the strategy's
               ``generation()``: F=0 gathers every unit per forward (``synced_gpus``), F=1 gathers
               the model once per phase
  ds3_hooks    DeepSpeed ZeRO-3 with its hooks and ``synced_gpus`` (TRL with
               ``ds3_gather_for_generation=False``): every unit gathered per token
  ds3_gather   DeepSpeed ZeRO-3, all parameters gathered with ``GatheredParameters`` and the hooks
               removed for the call (TRL's default, ``ds3_gather_for_generation=True``)

The DeepSpeed contenders run under ``--python-deepspeed`` (default ``$ZINF_DEEPSPEED_PYTHON``, else
this interpreter), a venv with DeepSpeed, ``transformers`` and ``peft``
(pip's ``deepspeed`` builds its CPU ops on first use; ``DS_ACCELERATOR=cpu`` is set). Prints tokens/s per rank, the ratio to ``ds3_hooks`` and
to ``replicated``, and whether each contender produced the replicated model's tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CONTENDERS = ("replicated", "zinf@0", "zinf@1", "ds3_hooks", "ds3_gather")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4, help="prompts per rank")
    parser.add_argument("--prompt", type=int, default=12, help="prompt bytes")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--python-deepspeed", default=os.environ.get("ZINF_DEEPSPEED_PYTHON", sys.executable))
    parser.add_argument("--out", default=str(HERE / "results" / "rlhf_generation.json"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # in a torchrun rank: this contender
    parser.add_argument("--result-dir", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _actor(args: argparse.Namespace):
    """The byte Llama with LoRA, from seed 0 (the same weights in every process and venv)."""
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=args.width, intermediate_size=2 * args.width, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.prompt + args.new_tokens + 8,
        bos_token_id=None, eos_token_id=None, pad_token_id=0)
    model = transformers.LlamaForCausalLM(config)
    lora = peft.LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False)
    return peft.get_peft_model(model, lora).eval()


def _ds_config() -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}


def _phase(contender: str, model: Any, model_bytes: int) -> Callable[[], contextlib.AbstractContextManager]:
    """What each ``generate()`` call of ``contender`` runs inside (partitioning ``model`` first)."""
    if contender.startswith("zinf@"):
        from lightning_zinf import PrefetchConfig, ZeroEngine

        engine = ZeroEngine(model, block_classes=["LlamaDecoderLayer"], prefetch=PrefetchConfig(persistence_threshold=0))
        budget = int(float(contender.split("@")[1]) * model_bytes)
        return lambda: engine.generation_phase(budget)  # what the strategy's generation() runs
    if not contender.startswith("ds3"):
        return contextlib.nullcontext
    import deepspeed

    trainable = [p for p in model.parameters() if p.requires_grad]
    ds_engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=_ds_config())
    if contender == "ds3_hooks":
        return contextlib.nullcontext
    offload = ds_engine.optimizer.parameter_offload

    @contextlib.contextmanager
    def gathered() -> Iterator[None]:  # TRL's unwrap for generation: everything gathered, no per-module hooks
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            offload._remove_module_hooks()
            try:
                yield
            finally:
                offload.setup_zero_stage3_hooks()
    return gathered


def worker(args: argparse.Namespace) -> None:
    """One rank of one contender: warm up, time one ``generate()``, write tokens/s and a checksum."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    contender = args.worker
    if contender.startswith("ds3"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = _actor(args)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    phase = _phase(contender, model, model_bytes)
    prompts = torch.randint(1, 256, (args.batch, args.prompt), generator=torch.Generator().manual_seed(rank + 1))
    # ZeRO-3 without the whole model gathered needs every rank in every forward (synced_gpus).
    synced = contender in ("ds3_hooks", "zinf@0")

    def generate() -> torch.Tensor:
        with torch.no_grad(), phase():
            return model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                                  max_new_tokens=args.new_tokens, do_sample=False, synced_gpus=synced)

    generate()
    dist.barrier()
    start = time.perf_counter()
    tokens = generate()
    seconds = time.perf_counter() - start
    result = {"seconds": seconds, "tokens_per_s": args.batch * (tokens.shape[1] - args.prompt) / seconds,
              "checksum": int(tokens.sum()), "model_mb": model_bytes / 2**20}
    Path(args.result_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def run(args: argparse.Namespace, contender: str) -> dict:
    """One torchrun of ``contender``; rank 0's result, or the failure."""
    python = args.python_deepspeed if contender.startswith("ds3") else sys.executable
    passed = ["--ranks", "--width", "--layers", "--batch", "--prompt", "--new-tokens"]
    forwarded = [x for name in passed for x in (name, str(getattr(args, name[2:].replace("-", "_"))))]
    with tempfile.TemporaryDirectory() as out:
        cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
               str(Path(__file__).resolve()), "--worker", contender, "--result-dir", out, *forwarded]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), DS_ACCELERATOR="cpu")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        results = [Path(out, f"rank{r}.json") for r in range(args.ranks)]
        if not all(p.exists() for p in results):  # judged by what the ranks wrote (DeepSpeed may abort at exit)
            return {"error": proc.stderr[-3000:]}
        ranks = [json.loads(p.read_text()) for p in results]
        return {**ranks[0], "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in ranks),
                "checksum": sum(r["checksum"] for r in ranks)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    contenders = args.contenders.split(",")
    runs: dict[str, list[dict]] = {c: [] for c in contenders}
    for _ in range(args.repeats):
        for contender in contenders:  # alternated: a machine's drift touches every contender alike
            runs[contender].append(run(args, contender))
    summary = {}
    for contender, results in runs.items():
        good = [r for r in results if "error" not in r]
        if not good:
            summary[contender] = {"error": results[0]["error"]}
            continue
        summary[contender] = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in good),
                              "all_tokens_per_s": [r["tokens_per_s"] for r in good],
                              "checksum": good[0]["checksum"], "model_mb": good[0]["model_mb"]}
    ok = {c: s for c, s in summary.items() if "error" not in s}
    ref = ok.get("replicated")
    print(f"{args.ranks} ranks, {args.batch} prompts x {args.new_tokens} new tokens per rank, "
          f"model {next(iter(ok.values()))['model_mb']:.1f} MiB" if ok else "every contender failed")
    print("contender   | tokens/s per rank | x ds3_hooks | x replicated | same tokens as replicated")
    for contender, s in summary.items():
        if "error" in s:
            print(f"{contender:<11} | failed: {s['error'].strip().splitlines()[-1] if s['error'].strip() else '?'}")
            continue
        vs_ds = s["tokens_per_s"] / ok["ds3_hooks"]["tokens_per_s"] if "ds3_hooks" in ok else float("nan")
        vs_ref = s["tokens_per_s"] / ref["tokens_per_s"] if ref else float("nan")
        same = s["checksum"] == ref["checksum"] if ref else None
        print(f"{contender:<11} | {s['tokens_per_s']:>17.1f} | {vs_ds:>11.2f} | {vs_ref:>12.2f} | {same}")
    record = {"date": datetime.date.today().isoformat(), "machine": platform.platform(),
              "args": {k: v for k, v in vars(args).items() if k not in ("worker", "result_dir")}, "results": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"results: {args.out}")


if __name__ == "__main__":
    sys.exit(main())
