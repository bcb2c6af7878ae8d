"""Greedy ``generate()`` tokens/s on a partitioned model against a replicated one (what DDP runs),
for ``PrefetchConfig.inference_budget`` from 0 to the whole model.

    python examples/benchmarks/generation.py [--ranks 2] [--layers 6] [--width 384] [--new-tokens 32]
        [--budgets 0,0.25,0.5,1.0] [--calls 5] [--block-classes GPT2Block] [--out results/generation.json]

Each contender runs on ``--ranks`` processes joined by gloo (CPU); every rank generates
``--new-tokens`` tokens for its own batch of prompts after one untimed warm-up call, then
``--calls`` timed ones (the median counts). ``replicated``
is the ``transformers`` model whole on every rank (DDP's inference); ``zinf@f`` partitions it with
``inference_budget`` = f x the model's gathered bytes, one pass per ``generate()`` call as the
strategy's ``predict_step`` runs it, the timed call a later step of the predict loop than the
warm-up (the strategy keeps the units within the budget gathered from step to step), its modules grouped into units automatically (no
``block_classes``, as a user who names none; ``--block-classes GPT2Block`` for a unit per block).
Below the whole model ``transformers`` runs with ``synced_gpus`` (one all-reduce per token, which
the replicated model does not need); at the whole model it does not. Prints tokens/s per rank and the ratio to
``replicated``, checks that every contender produced the same tokens, and for each zinf contender the
MiB its timed call gathered and the ratio it would reach if those gathers took their time alone
(measured: the same bytes all-gathered by themselves) and nothing else differed: on this machine's
shared cores the gathers cannot overlap the compute, so that is the bound.
"""

from __future__ import annotations

import argparse
import contextlib
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
    parser.add_argument("--calls", type=int, default=5, help="timed generate() calls (the median counts)")
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
    keep, loop = None, contextlib.nullcontext()
    if fraction is not None:
        # As the strategy runs a predict loop: one pass per generate() call (a predict step), and
        # the units kept within the budget from one step to the next (the loop's keep_gathered).
        # No block_classes unless asked: the engine groups the modules itself, as for a user who names none.
        engine = ZeroEngine(model, block_classes=args.block_classes, prefetch=PrefetchConfig(persistence_threshold=0),
                            auto_pass=False)
        budget = int(fraction * model_bytes)
        loop = engine.keep_gathered(budget)

        def keep():
            engine.begin_pass("predict")
            return engine.keep_gathered(budget)
    prompts = torch.randint(1, args.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(rank))

    def generate() -> torch.Tensor:
        with torch.no_grad(), (keep() if keep else torch.no_grad()):
            return model.generate(prompts, max_new_tokens=args.new_tokens, do_sample=False)

    with loop:
        generate()  # warm-up: the loop's first step (records the prefetch trace, gathers what is kept)
        dist.barrier()
        before = engine.comm.bytes.gathered if keep else 0
        calls = []
        for _ in range(args.calls):
            start = time.perf_counter()
            tokens = generate()
            calls.append(time.perf_counter() - start)
            dist.barrier()
        seconds = sorted(calls)[len(calls) // 2]
    if keep:
        # The bound of this machine's collectives: the same bytes all-gathered alone, in one flat
        # buffer (what the timed call's gathers move, without the compute they share the cores with).
        received = (engine.comm.bytes.gathered - before) // args.calls  # the same on every rank: each calls the collective
        gather_s = _gather_seconds(engine.comm, received // 4 // (args.ranks - 1)) if received else 0.0
        if rank == 0:
            out["gathered_mb"], out["gather_s"] = received / 2**20, gather_s
    if rank == 0:
        out["seconds"] = seconds
        out["tokens_per_s"] = args.batch * args.new_tokens / seconds
        out["checksum"] = int(tokens.sum())
        out["model_mb"] = model_bytes / 2**20
    dist.destroy_process_group()


def _gather_seconds(comm, shard_numel: int) -> float:
    """Seconds to all-gather a shard of ``shard_numel`` fp32 elements from every rank with the
    engine's collectives (median of 5, after one untimed)."""
    shard = torch.randn(shard_numel)
    full = torch.empty(shard_numel * dist.get_world_size())
    times = []
    for _ in range(6):
        dist.barrier()
        start = time.perf_counter()
        comm.all_gather(full, shard)
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[2]


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
    print("contender      | tokens/s per rank | x replicated | same tokens | gathered MiB | bound x replicated")
    for name, r in results.items():
        same = r["checksum"] == results["replicated"]["checksum"]
        # The bound if the gathers could not overlap the compute at all (both share the same cores):
        # the replicated model's time plus the gathers' time alone.
        bound = (results["replicated"]["seconds"] / (results["replicated"]["seconds"] + r["gather_s"])
                 if "gather_s" in r else None)
        print(f"{name:<14} | {r['tokens_per_s']:>17.1f} | {r['tokens_per_s'] / base:>12.2f} | {str(same):<11} | "
              f"{r.get('gathered_mb', 0.0):>12.1f} | {'-' if bound is None else f'{bound:.2f}':>18}")
    record = {"date": datetime.date.today().isoformat(), "machine": platform.platform(), "args": vars(args),
              "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
