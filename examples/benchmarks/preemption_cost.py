"""What the preemption agreement costs per training step: 2 ranks, gloo, on this machine.

    python examples/benchmarks/preemption_cost.py [--calls 3000] [--steps 30] [--repeats 3]

Every optimizer step of a ``zero_infinity`` run ends with :meth:`lightning_zinf.preemption.Preemption.agree`:
one all-reduce (max) of one int32 on a gloo group (``PreemptionConfig``; ``docs/checkpoints.md``,
"Preemption"). Measured here, in two processes joined by gloo on this machine:

1. the call alone, ``--calls`` times back to back (after 200 warm-up calls): mean and median
   microseconds per call;
2. inside real Trainer runs of the examples' GPT at a small size (width 256, 4 layers, 5.3M
   parameters, 1 x 64 tokens per rank): seconds per step with preemption enabled and disabled
   (``PreemptionConfig(enabled=False)``: no handler, no agreement), ``--repeats`` runs of each in
   one process after a discarded warm-up run, in the order enabled, disabled, disabled,
   enabled, ... the first 5 steps of each run left out; the median of each run is printed too
   (on a shared machine they spread more than the agreement costs); and the time spent in ``agree()`` per step in the enabled runs, timed around the
   call (inside a step it includes waiting for the slower rank, which otherwise waits at the next
   step's first gather).

Prints a table and writes ``results/preemption_cost.json`` beside this script.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))


def _micro(calls: int) -> list[float]:
    from lightning_zinf import PreemptionConfig
    from lightning_zinf.preemption import Preemption

    preemption = Preemption(PreemptionConfig())
    preemption.connect()
    for _ in range(200):
        preemption.agree()
    times = []
    dist.barrier()
    for _ in range(calls):
        start = time.perf_counter()
        preemption.agree()
        times.append(time.perf_counter() - start)
    return times


def _trainer_run(enabled: bool, steps: int) -> dict[str, list[float]]:
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    from examples.benchmarks.data import RandomTokens
    from examples.gpt import GPT, GPTConfig, lm_loss
    from lightning_zinf import ZeroInfinityStrategy

    CONFIG = GPTConfig(d_model=256, n_layers=4, n_heads=4, seq_len=64)

    record: dict[str, list[float]] = {"step_s": [], "agree_s": []}

    class Lit(L.LightningModule):
        def configure_model(self) -> None:
            if not hasattr(self, "gpt"):
                torch.manual_seed(0)
                self.gpt = GPT(CONFIG)

        def training_step(self, batch, batch_idx):
            return lm_loss(self.gpt(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Clock(L.Callback):
        """Step times as the time between consecutive ``on_train_batch_start`` (the whole step:
        forward, backward, optimizer, every ``on_train_batch_end`` hook, the agreement included);
        and, with preemption enabled, the time inside ``agree()``, timed around the call."""

        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_start(self, trainer, pl_module):
            if enabled:
                preemption = trainer.strategy.preemption
                agree = preemption.agree

                def timed():
                    start = time.perf_counter()
                    try:
                        return agree()
                    finally:
                        record["agree_s"].append(time.perf_counter() - start)

                preemption.agree = timed

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.starts.append(time.perf_counter())

    clock = Clock()
    trainer = L.Trainer(
        strategy=ZeroInfinityStrategy(block_classes=["Block"], preemption={"enabled": enabled}),
        accelerator="cpu", devices=2, max_steps=steps + 1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[clock])
    trainer.fit(Lit(), DataLoader(RandomTokens(256, CONFIG), batch_size=1))
    record["step_s"] = [b - a for a, b in zip(clock.starts, clock.starts[1:])]
    return record


def _worker(rank: int, port: int, args: argparse.Namespace, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    result: dict = {"micro_s": _micro(args.calls), "runs": []}
    _trainer_run(False, args.steps)  # warm-up, discarded: a process's first run is slower throughout
    for repeat in range(args.repeats):
        for enabled in ((True, False) if repeat % 2 == 0 else (False, True)):  # ABBA: no order bias
            result["runs"].append({"enabled": enabled, **_trainer_run(enabled, args.steps)})
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000, help="agree() calls timed back to back")
    parser.add_argument("--steps", type=int, default=30, help="steps per Trainer run")
    parser.add_argument("--repeats", type=int, default=3, help="Trainer runs with and without preemption")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "preemption_cost.json")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as scratch:
        mp.start_processes(_worker, args=(port, args, Path(scratch)), nprocs=2, start_method="spawn")
        ranks = [json.loads(Path(scratch, f"rank{r}.json").read_text()) for r in range(2)]
    micro = ranks[0]["micro_s"]
    skip = 5
    rows = {}
    for enabled in (True, False):
        runs = [run for run in ranks[0]["runs"] if run["enabled"] == enabled]
        step = [t for run in runs for t in run["step_s"][skip:]]
        agree = [t for run in runs for t in run["agree_s"][skip:]]
        rows[enabled] = {"step_s_median": statistics.median(step), "step_s_mean": statistics.mean(step),
                         "agree_us_median": statistics.median(agree) * 1e6 if agree else None,
                         "agree_us_mean": statistics.mean(agree) * 1e6 if agree else None}
    summary = {"calls_us_mean": statistics.mean(micro) * 1e6, "calls_us_median": statistics.median(micro) * 1e6,
               "trainer": {"enabled" if k else "disabled": v for k, v in rows.items()},
               "args": {k: str(v) for k, v in vars(args).items()}}
    print(f"\nagree() alone, {args.calls} calls: mean {summary['calls_us_mean']:.0f} us, "
          f"median {summary['calls_us_median']:.0f} us per call (rank 0)")
    print("\n| preemption | s/step median | s/step mean | agree() us/step median | agree() us/step mean |")
    print("|---|---|---|---|---|")
    for enabled, row in rows.items():
        agree = (f"{row['agree_us_median']:.0f} | {row['agree_us_mean']:.0f}" if enabled else "- | -")
        print(f"| {'enabled' if enabled else 'disabled'} | {row['step_s_median']:.4f} | {row['step_s_mean']:.4f} | {agree} |")
    print("\nper run, s/step median: " + ", ".join(
        f"{'on' if run['enabled'] else 'off'} {statistics.median(run['step_s'][skip:]):.3f}" for run in ranks[0]["runs"]))
    summary["run_medians_s"] = [[run["enabled"], statistics.median(run["step_s"][skip:])] for run in ranks[0]["runs"]]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    print(f"\nresults: {args.out}")


if __name__ == "__main__":
    main()
