"""One node's side of the multi-node job that ``cluster.py`` launches in each network namespace.

The main job's byte-level GPT (examples/pretrain.py, d_model 256, 4 layers) on the stdlib corpus,
``Trainer(num_nodes=2, devices=2)`` on CPU with gloo, as one of:

  zero3       ZeroInfinityStrategy(): ZeRO-3 over all four ranks
  zero_pp     ZeRO++: hpZ, qwZ and qgZ on top of ZeRO-3
  grad_op     sharding="grad_op" (ZeRO-2: gathered once a step, kept from forward to backward)
  hybrid      sharding="hybrid" (ZeRO-3 within each node, replicated across the two; gradient
              shards all-reduced across nodes)
  hybrid_qgz  the same with qgZ: the all-reduce across nodes moves INT4 codes (qgz_bits=4)
  hybrid_qgz8 the same with INT8 codes
  fsdp2       Lightning's ModelParallelStrategy with torch's fully_shard on each block and the
              root over the 4 ranks (FSDP2's ZeRO-3)
  fsdp2_hsdp  the same over a 2-D mesh (replicate across nodes, shard within each): FSDP2's HSDP
  auto        sharding="auto": the mode and ZeRO++'s switches chosen at setup from the measured
              links, the step's compute from one micro-batch as example_input_array; the choice
              is written to --out
  compute     the testbed's bound: each node's process starts 2 workers that train the same
              module, batch and optimizer alone (Lightning's single-device strategy, no process
              group), so the 4 processes share the 2 cores as the ranks do but nothing is
              communicated; no sharding mode's step can be shorter

Lightning's own environment reads ``MASTER_ADDR``, ``MASTER_PORT`` and ``NODE_RANK``; gloo binds to
``GLOO_SOCKET_IFNAME``. Global rank 0 writes ``--out``: the wall time of every training step, and
per step the bytes the engine counted across nodes (summed over the ranks of node 0, from
``ZeroMonitor``-style counters read around each step; 0 for FSDP2, which has no such count: the
veth's counters in cluster.py are the observer common to all).

    python train.py {zero3,zero_pp,grad_op,hybrid,hybrid_qgz,hybrid_qgz8,fsdp2,fsdp2_hsdp,auto,compute} --steps 30 --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
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

CONTENDERS: dict[str, dict[str, Any]] = {
    "zero3": {}, "zero_pp": {"zero_pp": ZeroPPConfig(hpz=True, qwz=True, qgz=True)},
    "grad_op": {"sharding": "grad_op"}, "hybrid": {"sharding": "hybrid"}, "auto": {"sharding": "auto"},
    "hybrid_qgz": {"sharding": "hybrid", "zero_pp": ZeroPPConfig(qgz=True)},
    "hybrid_qgz8": {"sharding": "hybrid", "zero_pp": ZeroPPConfig(qgz=True, qgz_bits=8)},
}
MICRO_BATCH = 8
FSDP2 = ("fsdp2", "fsdp2_hsdp")
NODES, RANKS_PER_NODE = 2, 2


class AutoPretrain(GPTPretrain):
    """The same module with a forward and one micro-batch as ``example_input_array``, from which
    ``sharding="auto"`` predicts the step's compute."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.example_input_array = torch.zeros(MICRO_BATCH, self.cfg.seq_len, dtype=torch.long)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)


class FSDP2Pretrain(GPTPretrain):
    """The same module, its GPT sharded by ``fully_shard`` on each block and the root once built,
    over the 4 ranks or (``hsdp``) a 2-D mesh of nodes x ranks per node."""

    def __init__(self, hsdp: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hsdp = hsdp

    def configure_model(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if self.model is not None:
            return
        super().configure_model()
        mesh = (init_device_mesh("cpu", (NODES, RANKS_PER_NODE), mesh_dim_names=("replicate", "shard")) if self.hsdp
                else self.device_mesh["data_parallel"])
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class StepRecorder(Callback):
    """Per training step: wall seconds, and this rank's inter-node bytes (engine count)."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, int]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            engine.comm.bytes.reset()
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        self.rows.append((time.perf_counter() - self.start, engine.comm.bytes.inter_node if engine is not None else 0))


def compute_worker(local_rank: int, steps: int, out: Path, node_rank: int) -> None:
    """One of the ``compute`` bound's workers: the module trained alone on one device, no
    collectives; node 0's first worker writes ``out``."""
    L.seed_everything(local_rank)
    recorder = StepRecorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, limit_val_batches=0, callbacks=[recorder],
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    trainer.fit(GPTPretrain(sample_bytes=0), StdlibBytes(batch_size=MICRO_BATCH))
    if node_rank == 0 and local_rank == 0:
        out.write_text(json.dumps({"contender": "compute", "step_s": [r[0] for r in recorder.rows],
                                   "node_inter_bytes": [0.0 for _ in recorder.rows], "choice": None}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("contender", choices=[*CONTENDERS, *FSDP2, "compute"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.contender == "compute":
        # Lightning would see NODE_RANK and MASTER_ADDR and wait for the other node; the workers
        # are single-device runs, so neither is theirs.
        node_rank = int(os.environ.pop("NODE_RANK", "0"))
        os.environ.pop("MASTER_ADDR", None)
        torch.multiprocessing.spawn(compute_worker, args=(args.steps, args.out, node_rank), nprocs=RANKS_PER_NODE)
        return
    L.seed_everything(0)
    recorder = StepRecorder()
    if args.contender in FSDP2:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy: Any = ModelParallelStrategy(data_parallel_size=NODES * RANKS_PER_NODE, tensor_parallel_size=1)
        module: GPTPretrain = FSDP2Pretrain(args.contender == "fsdp2_hsdp", sample_bytes=0)
    else:
        strategy = ZeroInfinityStrategy(**CONTENDERS[args.contender])
        module = AutoPretrain(sample_bytes=0) if args.contender == "auto" else GPTPretrain(sample_bytes=0)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        num_nodes=NODES,
        devices=RANKS_PER_NODE,
        max_steps=args.steps,
        limit_val_batches=0,
        callbacks=[recorder],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, StdlibBytes(batch_size=MICRO_BATCH))
    seconds = torch.tensor([r[0] for r in recorder.rows])
    inter = torch.tensor([float(r[1]) for r in recorder.rows])
    # Node 0's ranks together: what crosses node 0's link, as the engine counts it.
    node_inter = trainer.strategy.reduce(inter, reduce_op="sum") / trainer.num_nodes
    if trainer.is_global_zero:
        choice = getattr(getattr(trainer.strategy, "engine", None), "sharding_choice", None)
        args.out.write_text(json.dumps({"contender": args.contender, "step_s": seconds.tolist(),
                                        "node_inter_bytes": node_inter.tolist(),
                                        "choice": choice.describe() if choice is not None else None}))


if __name__ == "__main__":
    main()
