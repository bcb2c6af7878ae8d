"""``bf16-mixed`` on the main job: zero_infinity against Lightning DDP and a single device, and the
reduce dtype chosen from the same runs.

The main job (examples/configs/gpt_stdlib.yaml: the byte-level GPT, d 256, 4 layers, on the stdlib
corpus; global batch 32 sequences of 128 bytes, AdamW with the one-cycle schedule, seed 0) trained
``--steps`` steps under ``precision="bf16-mixed"``, one contender after the other:

  - ``single``: one process, batch 32, fed the same global batches as the 2-rank runs (the two
    ranks' ``DistributedSampler`` slices of each step, concatenated), so it differs from DDP only
    in arithmetic (one bf16 forward over 32 sequences against two over 16, and the gradient sum);
  - ``ddp``: Lightning's DDP on 2 ranks (autocast over fp32 weights);
  - ``zinf_fp32``: ``zero_infinity`` on 2 ranks with the policy Trainer(precision="bf16-mixed")
    derives: bf16 gathers and compute, fp32 reduce-scatters (``reduce_dtype=float32``);
  - ``zinf_bf16``: the same with bf16 reduce-scatters (``reduce_dtype=bfloat16``).

Parity target (issue 15): |zinf - DDP| <= |DDP - single| on the validation losses. Reported: the
validation losses (before training, every ``--steps // 2`` steps), the final train loss averaged
over the last 20 logged steps, the pairwise differences and each run's wall time. JSON in
``results/precision_parity.json``; runs' metrics under ``--root``.

    python examples/benchmarks/precision_parity.py [--steps 200] [--root /tmp/precision_parity]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from zero_pp_quality import read_metrics  # noqa: E402  (the CSV reader of the other main-job benchmark)

CONTENDERS = ("single", "ddp", "zinf_fp32", "zinf_bf16")
WORLD, PER_RANK = 2, 16


def train(name: str, steps: int, root: Path) -> None:
    """One contender's run (this process is rank 0; Lightning starts the other rank)."""
    import lightning.pytorch as L
    import torch
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, DistributedSampler, Sampler

    from examples.callbacks import ValidateBeforeTraining
    from examples.pretrain import GPTPretrain, StdlibBytes
    from lightning_zinf import MixedPrecisionConfig, ZeroInfinityStrategy

    class SameGlobalBatches(Sampler):
        """The indices the 2 ranks' DistributedSamplers (Lightning's seed) give each step, rank 0's
        slice then rank 1's: one process sees the global batches the 2-rank runs see."""

        def __init__(self, dataset) -> None:
            self.parts = [list(DistributedSampler(dataset, WORLD, r, shuffle=True, seed=0)) for r in range(WORLD)]

        def __len__(self) -> int:
            return sum(len(p) for p in self.parts)

        def __iter__(self):
            for start in range(0, len(self.parts[0]) - PER_RANK + 1, PER_RANK):
                for part in self.parts:
                    yield from part[start : start + PER_RANK]

    class SingleData(StdlibBytes):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(self.train_set, batch_size=WORLD * PER_RANK, sampler=SameGlobalBatches(self.train_set),
                              drop_last=True)

    L.seed_everything(0)
    if name == "single":
        strategy, devices, data = "auto", 1, SingleData(batch_size=WORLD * PER_RANK)
    else:
        data = StdlibBytes(batch_size=PER_RANK)
        devices = WORLD
        strategy = "ddp" if name == "ddp" else ZeroInfinityStrategy(mixed_precision=MixedPrecisionConfig(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32 if name == "zinf_fp32" else torch.bfloat16))
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, precision="bf16-mixed", max_steps=steps,
        val_check_interval=steps // 2, limit_val_batches=20, log_every_n_steps=1,
        callbacks=[ValidateBeforeTraining()], logger=CSVLogger(str(root), name=name, version=0),
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        use_distributed_sampler=name != "single",
    )
    trainer.fit(GPTPretrain(sample_bytes=0), data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--root", type=Path, default=Path("/tmp/precision_parity"))
    parser.add_argument("--out", type=Path, default=HERE / "results" / "precision_parity.json")
    parser.add_argument("--only", nargs="*", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument("--run", choices=CONTENDERS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run:
        train(args.run, args.steps, args.root)
        return 0

    results = {}
    for name in CONTENDERS:
        metrics_path = args.root / name / "version_0" / "metrics.csv"
        wall_path = args.root / name / "wall_s.txt"  # a contender left out of --only keeps its earlier run
        if name in args.only or not metrics_path.exists():
            began = time.perf_counter()
            cmd = [sys.executable, __file__, "--run", name, "--steps", str(args.steps), "--root", str(args.root)]
            subprocess.run(cmd, check=True, cwd=HERE.parents[1])
            wall_path.write_text(str(time.perf_counter() - began))
        seconds = float(wall_path.read_text())
        metrics = read_metrics(metrics_path)
        train_losses = [v for _, v in metrics["train_loss"]] if "train_loss" in metrics else []
        results[name] = {"val_loss": metrics["val_loss"], "final_train_loss": sum(train_losses[-20:]) / 20, "wall_s": seconds}
        print(f"{name:10s} validation loss {[round(v, 4) for _, v in metrics['val_loss']]}, "
              f"train (last 20) {results[name]['final_train_loss']:.4f}, {seconds:.0f} s", flush=True)
    final = {name: r["val_loss"][-1][1] for name, r in results.items()}
    gap = lambda a, b: abs(final[a] - final[b])  # noqa: E731
    print(f"|DDP - single| {gap('ddp', 'single'):.4f}   |zinf(fp32 reduce) - DDP| {gap('zinf_fp32', 'ddp'):.4f}   "
          f"|zinf(bf16 reduce) - DDP| {gap('zinf_bf16', 'ddp'):.4f}   |zinf fp32 - bf16 reduce| "
          f"{gap('zinf_fp32', 'zinf_bf16'):.4f}")
    print(f"parity (|zinf - DDP| <= |DDP - single|): fp32 reduce {gap('zinf_fp32', 'ddp') <= gap('ddp', 'single')}, "
          f"bf16 reduce {gap('zinf_bf16', 'ddp') <= gap('ddp', 'single')}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"steps": args.steps, **results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
