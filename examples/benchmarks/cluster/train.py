"""One node's side of the multi-node job that ``cluster.py`` launches in each network namespace.

The main job's byte-level GPT (examples/pretrain.py, d_model 256, 4 layers) on the stdlib corpus,
``Trainer(num_nodes=2, devices=2)`` on CPU with gloo, as ZeRO-3 (``zero3``) or ZeRO++ with hpZ, qwZ
and qgZ (``zero_pp``). Lightning's own environment reads ``MASTER_ADDR``, ``MASTER_PORT`` and
``NODE_RANK``; gloo binds to ``GLOO_SOCKET_IFNAME``. Global rank 0 writes ``--out``: the wall time of
every training step, and per step the bytes the engine counted across nodes (summed over the ranks
of node 0, from ``ZeroMonitor``-style counters read around each step).

    python train.py {zero3,zero_pp} --steps 30 --out result.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import Callback

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from examples.pretrain import GPTPretrain, StdlibBytes  # noqa: E402
from lightning_zinf import ZeroInfinityStrategy, ZeroPPConfig  # noqa: E402

CONTENDERS = {"zero3": ZeroPPConfig(), "zero_pp": ZeroPPConfig(hpz=True, qwz=True, qgz=True)}


class StepRecorder(Callback):
    """Per training step: wall seconds, and this rank's inter-node bytes (engine count)."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, int]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        trainer.strategy.engine.comm.bytes.reset()
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.rows.append((time.perf_counter() - self.start, trainer.strategy.engine.comm.bytes.inter_node))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("contender", choices=list(CONTENDERS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    L.seed_everything(0)
    recorder = StepRecorder()
    trainer = L.Trainer(
        strategy=ZeroInfinityStrategy(zero_pp=CONTENDERS[args.contender]),
        accelerator="cpu",
        num_nodes=2,
        devices=2,
        max_steps=args.steps,
        limit_val_batches=0,
        callbacks=[recorder],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(GPTPretrain(sample_bytes=0), StdlibBytes(batch_size=8))
    seconds = torch.tensor([r[0] for r in recorder.rows])
    inter = torch.tensor([float(r[1]) for r in recorder.rows])
    # Node 0's ranks together: what crosses node 0's link, as the engine counts it.
    node_inter = trainer.strategy.reduce(inter, reduce_op="sum") / trainer.num_nodes
    if trainer.is_global_zero:
        args.out.write_text(json.dumps({"contender": args.contender, "step_s": seconds.tolist(),
                                        "node_inter_bytes": node_inter.tolist()}))


if __name__ == "__main__":
    main()
