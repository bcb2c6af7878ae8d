"""Where a training step's time goes: zinf against DDP on ``throughput.py``'s model, side by side.

Each contender runs as in ``throughput.py`` (the 91M GPT, fp32, 2 ranks on CPU with gloo, one
``torchrun`` job each); rank 0 records ``--profiled`` steps after ``--warmup`` with torch.profiler
(CPU activity, its main thread only) and splits their wall time into:

  compute           self time of the model's operators (matmuls, attention, activations...) in
                    forward and backward
  copies/casts      self time of copy_, to/_to_copy, clone, cat, fill_/zero_ and allocations
                    outside the optimizer
  collective calls  self time of the c10d operators on the main thread (launching them)
  collective waits  time blocked on the engine's collective handles (zinf only; DDP's reducer
                    waits inside C++ and lands in "rest")
  engine Python     the engine's hooks' own time: their duration minus the operators and waits in
                    them (zinf only; measured by wrapping the hooks in record_function scopes for
                    this run only)
  optimizer         the optimizer's update, operators included (not the forward and backward that
                    Lightning's closure runs inside the step for DDP)
  rest              wall time minus all of the above: Lightning's loop, autograd's engine, Python
                    outside the hooks, DDP's waits

    python examples/benchmarks/profile_step.py [--warmup 3] [--profiled 2] [--only zinf,ddp]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from measure import run_record, self_launched_rank  # noqa: E402
CONTENDERS = ("zinf", "ddp")
CATEGORIES = ("compute", "copies/casts", "collective calls", "collective waits", "engine Python", "optimizer", "rest")
_COPIES = ("aten::copy_", "aten::to", "aten::_to_copy", "aten::clone", "aten::cat", "aten::fill_", "aten::zero_",
           "aten::empty", "aten::empty_strided", "aten::zeros", "aten::new_empty", "aten::contiguous")
# The engine's entry points from autograd and the optimizer, and its blocking waits.
_HOOKS = ("_pre_forward", "_post_forward", "_pre_backward", "_post_backward", "_on_grad", "_backward_end")
_STEP_HOOKS = ("_before_step", "after_step")  # the optimizer's hooks, on OptimizerSteps


def _scoped(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)
    return wrapper


def _instrument_engine() -> None:
    """Wrap the engine's hooks and waits in record_function scopes (before the engine is built,
    which binds the hooks)."""
    from lightning_zinf.comm import collectives
    from lightning_zinf.engine.engine import ZeroEngine
    from lightning_zinf.engine.schedule import Schedule
    from lightning_zinf.engine.steps import OptimizerSteps
    from lightning_zinf.engine.units import UnitStates

    for name in _HOOKS:
        setattr(Schedule, name, _scoped(f"zinf.hook.{name}", getattr(Schedule, name)))
    for name in _STEP_HOOKS:
        setattr(OptimizerSteps, name, _scoped(f"zinf.hook.{name}", getattr(OptimizerSteps, name)))
    ZeroEngine.begin_pass = _scoped("zinf.hook.begin_pass", ZeroEngine.begin_pass)
    UnitStates.wait_gather = _scoped("zinf.wait", UnitStates.wait_gather)
    collectives._Then.wait = _scoped("zinf.wait", collectives._Then.wait)


def categorize(events: list, wall_s: float, steps: int) -> dict[str, float]:
    """Milliseconds per step in each of :data:`CATEGORIES`, from the profiler's events of the thread
    that ran the optimizer step (the main thread)."""
    main = next(e.thread for e in events if e.name.startswith("Optimizer.step"))
    totals: dict[str, float] = defaultdict(float)
    for event in events:
        if event.thread != main:
            continue
        ancestors, parent = [], event.cpu_parent
        while parent is not None:
            ancestors.append(parent.name)
            parent = parent.cpu_parent
        self_ms = event.self_cpu_time_total / 1e3
        if event.name.startswith("Optimizer.step"):
            totals["optimizer"] += event.cpu_time_total / 1e3
        elif event.name == "lightning.closure" and any(a.startswith("Optimizer.step") for a in ancestors):
            totals["optimizer"] -= event.cpu_time_total / 1e3  # the step ran it; not the optimizer's
        elif any(a.startswith("Optimizer.step") for a in ancestors) and "lightning.closure" not in ancestors:
            continue  # inside the optimizer's own update, counted with it
        elif event.name == "zinf.wait":
            totals["collective waits"] += self_ms
        elif event.name.startswith("zinf."):  # the hooks' scopes here and the engine's own ranges
            totals["engine Python"] += self_ms
        elif event.name.startswith("c10d::"):
            totals["collective calls"] += self_ms
        elif event.name in _COPIES:
            totals["copies/casts"] += self_ms
        elif event.name.startswith("aten::"):
            totals["compute"] += self_ms
    per_step = {c: totals[c] / steps for c in CATEGORIES if c != "rest"}
    per_step["rest"] = wall_s * 1e3 / steps - sum(per_step.values())
    return per_step


def run_rank(contender: str, warmup: int, profiled: int, out: Path) -> None:
    """One rank of one contender under torchrun (rank 0 profiles and writes ``out``)."""
    import lightning as L

    from measure import MICRO_BATCH
    from run_lightning import GPTModule, make_strategy

    if contender == "zinf":
        _instrument_engine()
    # Lightning runs forward and backward in a closure the optimizer's step calls (DDP) or before it
    # (zinf's precision plugin): scoped, so the optimizer's own time is told apart either way.
    from lightning.pytorch.loops.optimization import automatic
    automatic.Closure.__call__ = _scoped("lightning.closure", automatic.Closure.__call__)

    class Profile(L.Callback):
        def __init__(self) -> None:
            self.profiler, self.start = None, 0.0

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            if batch_idx == warmup and trainer.global_rank == 0:
                self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self.profiler.__enter__()
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if self.profiler is not None and batch_idx == warmup + profiled - 1:
                wall = time.perf_counter() - self.start
                self.profiler.__exit__(None, None, None)
                out.write_text(json.dumps({"wall_s_per_step": wall / profiled,
                                           "ms_per_step": categorize(self.profiler.events(), wall, profiled)}))
                self.profiler = None

    steps = warmup + profiled
    world = int(os.environ["WORLD_SIZE"])
    trainer = L.Trainer(strategy=make_strategy(contender), accelerator="cpu", devices=world, max_steps=steps,
                        callbacks=[Profile()], enable_checkpointing=False, logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(GPTModule(contender, num_samples=steps * world * MICRO_BATCH))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profiled", type=int, default=2)
    parser.add_argument("--only", default=",".join(CONTENDERS))
    parser.add_argument("--out", type=Path, default=HERE / "results" / "profile_step.json")
    parser.add_argument("--rank-of", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of:
        run_rank(args.rank_of, args.warmup, args.profiled, args.result)
        return
    results = {}
    for name in [n.strip() for n in args.only.split(",") if n.strip()]:
        print(f"[profile_step] running {name} ...", flush=True)
        data, error = self_launched_rank(__file__, name, ["--warmup", str(args.warmup), "--profiled", str(args.profiled)],
                                         1800)
        if data is None:
            print(error)
            continue
        results[name] = data
    names = list(results)
    print(f"\nms per step on rank 0 ({args.profiled} profiled steps after {args.warmup})\n")
    print(f"{'':18s}" + "".join(f"{n:>10s}" for n in names))
    for category in CATEGORIES:
        print(f"{category:18s}" + "".join(f"{results[n]['ms_per_step'][category]:10.0f}" for n in names))
    print(f"{'wall':18s}" + "".join(f"{results[n]['wall_s_per_step'] * 1e3:10.0f}" for n in names))
    record = run_record(warmup=args.warmup, profiled=args.profiled, results=results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(f"\nresults: {args.out}")


if __name__ == "__main__":
    main()
