"""Greedy ``generate()`` tokens/s on a partitioned model against a replicated one (what DDP runs),
for ``PrefetchConfig.inference_budget`` from 0 to the whole model.

    python examples/benchmarks/generation.py [--ranks 2] [--layers 6] [--width 384] [--new-tokens 32]
        [--budgets 0,0.25,0.5,1.0] [--block-classes GPT2Block] [--out results/generation.json]

Each contender runs on ``--ranks`` processes joined by gloo (CPU); every rank generates
``--new-tokens`` tokens for its own batch of prompts after one untimed warm-up call. ``replicated``
is the ``transformers`` model whole on every rank (DDP's inference); ``zinf@f`` partitions it with
``inference_budget`` = f x the model's gathered bytes, one pass per ``generate()`` call as the
strategy's ``predict_step`` runs it, its modules grouped into units automatically (no
``block_classes``, as a user who names none; ``--block-classes GPT2Block`` for a unit per block).
Below the whole model ``transformers`` runs with ``synced_gpus`` (one all-reduce per token, which
the replicated model does not need); at the whole model it does not. Prints tokens/s per rank and the ratio to
``replicated``, and checks that every contender produced the same tokens.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4, help="prompts per rank")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--budgets", default="0,0.25,0.5,1.0", help="inference_budget as fractions of the model's bytes")
    parser.add_argument("--block-classes", nargs="*", default=[],
                        help="zinf's block_classes (default: none, the modules grouped automatically; GPT2Block: a "
                             "unit per transformer block)")
    parser.add_argument("--out", default=str(HERE / "results" / "generation.json"))
    return parser.parse_args(argv)


def _model(args: argparse.Namespace):
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=args.vocab, n_embd=args.width, n_layer=args.layers, n_head=6,
                                     n_positions=args.prompt + args.new_tokens, eos_token_id=None, pad_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def _worker(rank: int, args: argparse.Namespace, port: int, fraction: float | None, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    from lightning_zinf import PrefetchConfig, ZeroEngine

    model = _model(args)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    keep = None
    if fraction is not None:
        # As the strategy runs a predict step: one pass per generate() call.
        # No block_classes unless asked: the engine groups the modules itself, as for a user who names none.
        engine = ZeroEngine(model, block_classes=args.block_classes, prefetch=PrefetchConfig(persistence_threshold=0),
                            auto_pass=False)
        budget = int(fraction * model_bytes)

        def keep():
            engine.begin_pass("predict")
            return engine.keep_gathered(budget)
    prompts = torch.randint(1, args.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(rank))

    def generate() -> torch.Tensor:
        with torch.no_grad(), (keep() if keep else torch.no_grad()):
            return model.generate(prompts, max_new_tokens=args.new_tokens, do_sample=False)

    generate()  # warm-up (records the prefetch trace)
    dist.barrier()
    start = time.perf_counter()
    tokens = generate()
    seconds = time.perf_counter() - start
    dist.barrier()
    if rank == 0:
        out["seconds"] = seconds
        out["tokens_per_s"] = args.batch * args.new_tokens / seconds
        out["checksum"] = int(tokens.sum())
        out["model_mb"] = model_bytes / 2**20
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace, fraction: float | None) -> dict:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(args, _free_port(), fraction, out), nprocs=args.ranks)
        return dict(out)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    fractions = [float(f) for f in args.budgets.split(",")]
    results = {"replicated": run(args, None)}
    for fraction in fractions:
        results[f"zinf@{fraction:g}"] = run(args, fraction)
    base = results["replicated"]["tokens_per_s"]
    print(f"model {results['replicated']['model_mb']:.1f} MiB, {args.ranks} ranks, {args.batch} prompts x "
          f"{args.new_tokens} new tokens per rank")
    print("contender      | tokens/s per rank | x replicated | same tokens")
    for name, r in results.items():
        same = r["checksum"] == results["replicated"]["checksum"]
        print(f"{name:<14} | {r['tokens_per_s']:>17.1f} | {r['tokens_per_s'] / base:>12.2f} | {same}")
    record = {"date": datetime.date.today().isoformat(), "machine": platform.platform(), "args": vars(args),
              "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
