"""The cost of a unit: engine time per unit per step, against FSDP2 with ``fully_shard`` per layer.

A model of many small units, where the per-unit bookkeeping (hooks, gathers, releases,
reduce-scatters, the trace) dominates: ``--layers`` Linear(100, 100) layers (10,100 parameters
each) with a tanh between them, a micro-batch of 8 x 100, SGD, 2 ranks on CPU with gloo, each
contender a ``torchrun`` job of its own, in plain PyTorch (no Lightning loop) so only the sharding
differs:

  zinf   ZeroEngine, one unit per Linear (``unit_size=0``), persistence threshold 0 so every unit is
         gathered and released each step (``--persistence-threshold 10100``: every unit persistent
         instead, gathered only after each step, all of them together; ``--layers-per-unit K``:
         units of K Linears each, grouped by ``unit_size``, so the cost per tensor shows apart from
         the cost per unit; ``--split T``: each Linear's weight in T parameters of its rows, the same
         bytes in T + 1 tensors, so the cost per tensor shows apart from the bytes)
  fsdp2  fully_shard on every Linear and on the root (reshard_after_forward=True)
  ddp    DistributedDataParallel (no sharding: the compute and the gradient all-reduce)

Per contender: s/step (mean over the steps after the first 3, rank 0; of it, the time in
``optimizer.step()``, which for zinf includes re-gathering the persistent units), the overhead
per unit and per tensor per step, in microseconds: (s/step - DDP's s/step) / units (or / the
(split + 1) x layers tensors), zinf's host time per unit in the engine's gather, release and
reduce-scatter ranges (one profiled step after the timed ones), and the largest difference between its
losses and DDP's over the steps (the same model, data and updates: a contender flagged there is not
training as DDP does, so its time does not count). The ratio is zinf's overhead per unit over
FSDP2's (below 1: zinf's units are cheaper), with a Linear per unit only.

    python examples/benchmarks/unit_cost.py [--layers 500] [--steps 20] [--lr 1e-3] [--only zinf,fsdp2,ddp]
                                            [--persistence-threshold 0] [--layers-per-unit 1] [--split 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from measure import add_self_launch_options, chosen_contenders, run_record, self_launched_rank  # noqa: E402
CONTENDERS = ("zinf", "fsdp2", "ddp")
WARMUP = 3
WIDTH, BATCH = 100, 8
_LOSS_TOLERANCE = 1e-5  # fp32 losses of the same updates, summed in another order


class SplitLinear(torch.nn.Module):
    """A Linear(WIDTH, WIDTH) whose weight is ``split`` parameters of WIDTH / ``split`` rows each:
    the same bytes and compute as the Linear, in ``split + 1`` tensors (the bias one)."""

    def __init__(self, split: int) -> None:
        super().__init__()
        full = torch.nn.Linear(WIDTH, WIDTH)  # the Linear's initialisation, from the same seed
        self.rows = torch.nn.ParameterList(torch.nn.Parameter(w.clone()) for w in full.weight.detach().chunk(split))
        self.bias = torch.nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, torch.cat(list(self.rows)), self.bias)


def _model(layers: int, split: int = 1) -> torch.nn.Sequential:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(WIDTH, WIDTH) if split == 1 else SplitLinear(split), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods)


def _phase_us(engine, step: Callable[[], None], units: int) -> dict[str, float]:
    """Host microseconds per unit of one step in each of the engine's profiler ranges (gather,
    release, reduce-scatter; the rest of its overhead is in its hooks), from one profiled step."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    totals = {e.key: e.cpu_time_total for e in prof.key_averages() if e.key.startswith("zinf.")}
    return {name: totals.get(f"zinf.{name}", 0.0) / units for name in ("gather", "release", "reduce_scatter")}


def run_rank(contender: str, layers: int, steps: int, lr: float, out: Path, persistence: int = 0,
             per_unit: int = 1, split: int = 1) -> None:
    """One rank of one contender (under torchrun): train, time each step, write rank 0's times."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = _model(layers, split)
    engine = None
    if contender == "zinf":
        from lightning_zinf import PrefetchConfig, ZeroEngine

        # unit_size 0: a unit per Linear; K Linears' elements: runs of K consecutive Linears.
        size = 0 if per_unit == 1 else per_unit * (WIDTH * WIDTH + WIDTH)
        engine = ZeroEngine(model, prefetch=PrefetchConfig(persistence_threshold=persistence, unit_size=size))
    elif contender == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, (torch.nn.Linear, SplitLinear)):
                fully_shard(layer)
        fully_shard(model)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    if engine is not None:
        engine.shard_optimizer(optimizer)  # steps this rank's shards (and casts them back after each step)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    times, opt_times, losses = [], [], []
    for _ in range(steps):
        start = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        before_step = time.perf_counter()
        optimizer.step()  # zinf: with its post-hook, which re-gathers the persistent units
        opt_times.append(time.perf_counter() - before_step)
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())

    def one_step() -> None:
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    # One more step, profiled (after the timed ones): the engine's time per unit in each range.
    phases = _phase_us(engine, one_step, len(engine.units)) if engine is not None else {}
    dist.barrier()  # every rank done: what rank 0 writes stands whatever the teardown does
    if rank == 0:
        out.write_text(json.dumps({"step_times_s": times, "optimizer_step_times_s": opt_times, "losses": losses,
                                   "phase_us_per_unit": phases}))
    dist.destroy_process_group()


def drive(args: argparse.Namespace) -> None:
    results: dict[str, dict] = {}
    for name in args.only:
        print(f"[unit_cost] running {name} ...", flush=True)
        options = ["--layers", str(args.layers), "--steps", str(args.steps), "--lr", str(args.lr),
                   "--persistence-threshold", str(args.persistence_threshold),
                   "--layers-per-unit", str(args.layers_per_unit), "--split", str(args.split)]
        data, error = self_launched_rank(__file__, name, options, args.timeout)
        if data is None:
            results[name] = {"status": "failed", "error": error}
            print(error)
            continue
        timed, opt_timed = data["step_times_s"][WARMUP:], data["optimizer_step_times_s"][WARMUP:]
        results[name] = {"status": "ok", "mean_step_s": sum(timed) / len(timed),
                         "mean_optimizer_step_s": sum(opt_timed) / len(opt_timed), **data}
    ddp = results.get("ddp", {}).get("mean_step_s")
    ddp_losses = results.get("ddp", {}).get("losses")
    for res in results.values():
        if res["status"] == "ok" and ddp is not None:
            units = -(-args.layers // args.layers_per_unit) if res is results.get("zinf") else args.layers
            res["overhead_us_per_unit"] = (res["mean_step_s"] - ddp) / units * 1e6
            res["overhead_us_per_tensor"] = (res["mean_step_s"] - ddp) / ((args.split + 1) * args.layers) * 1e6
        if res["status"] == "ok" and ddp_losses is not None:
            # Same model, data and updates: a contender that does not train the same is not timed fairly.
            res["loss_gap_to_ddp"] = max(abs(a - b) for a, b in zip(res["losses"], ddp_losses))
    ours, peer = results.get("zinf", {}), results.get("fsdp2", {})
    # Per unit alike only when zinf's units are FSDP2's (a Linear each).
    ratio = (ours["overhead_us_per_unit"] / peer["overhead_us_per_unit"]
             if args.layers_per_unit == 1 and "overhead_us_per_unit" in ours and "overhead_us_per_unit" in peer
             else None)
    print(f"\n{args.layers} Linear layers of {WIDTH * WIDTH + WIDTH:,} parameters ({args.split + 1} tensors each), "
          f"zinf's units of {args.layers_per_unit}, 2 ranks, gloo\n")
    print(f"{'contender':<10} {'s/step':>8} {'of it step()':>13} {'us/unit/step over DDP':>22} "
          f"{'us/tensor/step over DDP':>24} {'max |loss - DDP loss|':>22}")
    for name, res in results.items():
        if res["status"] != "ok":
            print(f"{name:<10} FAILED")
            continue
        extra, gap, per_tensor = res.get("overhead_us_per_unit"), res.get("loss_gap_to_ddp"), res.get("overhead_us_per_tensor")
        flag = "  (NOT TRAINING AS DDP DOES)" if gap is not None and gap > _LOSS_TOLERANCE else ""
        print(f"{name:<10} {res['mean_step_s']:>8.4f} {res['mean_optimizer_step_s']:>13.4f} "
              f"{'-' if extra is None else f'{extra:.1f}':>22} {'-' if per_tensor is None else f'{per_tensor:.1f}':>24} "
              f"{'-' if gap is None else f'{gap:.2e}':>22}{flag}")
        if "exit_note" in res:
            print(f"  note: {res['exit_note']}")
    if ratio is not None:
        print(f"\nzinf / fsdp2 overhead per unit: {ratio:.2f}")
    phases = ours.get("phase_us_per_unit")
    if phases:
        print("zinf host us per unit in one profiled step: "
              + ", ".join(f"{name} {us:.1f}" for name, us in phases.items())
              + f" (the rest of its {ours.get('overhead_us_per_unit', float('nan')):.1f} in hooks and the step)")
    record = run_record(layers=args.layers, steps=args.steps, warmup=WARMUP, results=results, zinf_over_fsdp2=ratio,
                        persistence_threshold=args.persistence_threshold, layers_per_unit=args.layers_per_unit,
                        split=args.split)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(f"results: {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=500, help="Linear layers, each its own unit (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per contender (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=1e-3, help="SGD's learning rate (default: %(default)s)")
    parser.add_argument("--persistence-threshold", type=int, default=0,
                        help="zinf's persistence threshold in elements; 10100 or more makes every unit persistent "
                             "(default: %(default)s)")
    parser.add_argument("--layers-per-unit", type=int, default=1,
                        help="Linear layers per zinf unit (1: a unit per Linear; default: %(default)s)")
    parser.add_argument("--split", type=int, default=1,
                        help="parameters each Linear's weight is split into (rows; the same bytes in more tensors: "
                             "the cost per tensor apart from the bytes; default: %(default)s)")
    add_self_launch_options(parser, CONTENDERS, HERE / "results" / "unit_cost.json")
    args = parser.parse_args()
    if args.rank_of:
        run_rank(args.rank_of, args.layers, args.steps, args.lr, args.result, args.persistence_threshold,
                 args.layers_per_unit, args.split)
        return
    chosen_contenders(parser, args, CONTENDERS)
    if args.layers_per_unit < 1:
        parser.error("--layers-per-unit must be at least 1")
    if args.split < 1 or WIDTH % args.split:
        parser.error(f"--split must divide {WIDTH}")
    if args.steps <= WARMUP:
        parser.error(f"--steps must exceed the {WARMUP} warm-up steps")
    drive(args)


if __name__ == "__main__":
    main()
