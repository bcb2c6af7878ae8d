"""One node's side of the RLHF job that ``cluster.py --job rlhf`` launches in each network namespace.

The RLHF example's GRPO stage (``examples/rlhf.py``: a LoRA actor over a byte-level Llama, a frozen
reward model, one ``ZeroInfinityStrategy``) on the stdlib corpus, ``Trainer(num_nodes=2,
devices=2)`` on CPU with gloo, as ZeRO-3 (``zero3``: frozen weights in fp32, every gather and
reduce-scatter at full precision across both nodes) or ZeRO++ (``zero_pp``: frozen weights as INT8
codes, hpZ, qwZ, qgZ). The actor and reward model are built from seeds by ``cluster.py`` (their
size, not their quality, is what is measured). An observer around the strategy's ``generation()``
times each generation phase and counts the bytes the engine sent across nodes in it; the rest of
the step is the training phase. Global rank 0 writes ``--out``: per step the step's and the
generation phase's seconds, the bytes generated per rank, and node 0's inter-node bytes of each
phase; per rank the peak of the engine's ledger and the process's peak RSS.

    python rlhf_train.py {zero3,zero_pp} --sft DIR --reward DIR --steps 8 --budget 0 --out result.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import Callback

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from examples.rlhf import GRPO, StdlibLines  # noqa: E402
from lightning_zinf import PrefetchConfig, ZeroInfinityStrategy, ZeroPPConfig  # noqa: E402

CONTENDERS = {"zero3": ZeroPPConfig(), "zero_pp": ZeroPPConfig(hpz=True, qwz=True, qgz=True, frozen_bits=8)}


class TimedGeneration(ZeroInfinityStrategy):
    """The strategy, with each generation phase's seconds and inter-node bytes recorded."""

    phases: list[tuple[float, int]]

    @contextlib.contextmanager
    def generation(self) -> Iterator[None]:
        bytes_before, start = self.engine.comm.bytes.inter_node, time.perf_counter()
        with super().generation():
            yield
        self.phases.append((time.perf_counter() - start, self.engine.comm.bytes.inter_node - bytes_before))


class StepRecorder(Callback):
    """Per training step: wall seconds, inter-node bytes, and the mean response length logged."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, int, float]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.bytes_before, self.start = trainer.strategy.engine.comm.bytes.inter_node, time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.rows.append((time.perf_counter() - self.start, trainer.strategy.engine.comm.bytes.inter_node
                          - self.bytes_before, float(trainer.callback_metrics["response_len"])))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("contender", choices=list(CONTENDERS))
    parser.add_argument("--sft", required=True, help="the actor's base (a transformers folder)")
    parser.add_argument("--reward", required=True, help="the reward model (a transformers folder)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--budget", type=int, default=0, help="inference_budget, bytes")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per rank, each answered --group times")
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    L.seed_everything(0)
    strategy = TimedGeneration(zero_pp=CONTENDERS[args.contender], block_classes=["LlamaDecoderLayer"],
                               load_full_weights={"actor.base_model.model.": args.sft, "reward.": args.reward},
                               exclude_frozen_parameters=True, prefetch=PrefetchConfig(inference_budget=args.budget))
    strategy.phases = []
    recorder = StepRecorder()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", num_nodes=2, devices=2, max_steps=args.steps,
                        limit_val_batches=0, callbacks=[recorder], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    module = GRPO(args.sft, args.reward, group_size=args.group, new_tokens=args.new_tokens)
    trainer.fit(module, StdlibLines(batch_size=args.prompts))
    engine = trainer.strategy.engine
    per_step = torch.tensor([[s, float(b), n] for s, b, n in recorder.rows])
    gen = torch.tensor([[s, float(b)] for s, b in strategy.phases])
    # Node 0's ranks together: what crosses node 0's link, as the engine counts it.
    step_bytes = trainer.strategy.reduce(per_step[:, 1].contiguous(), reduce_op="sum") / trainer.num_nodes
    gen_bytes = trainer.strategy.reduce(gen[:, 1].contiguous(), reduce_op="sum") / trainer.num_nodes
    peaks = torch.tensor([float(engine.memory()["device_total"][1]),
                          resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0])
    all_peaks = trainer.strategy.all_gather(peaks)
    if trainer.is_global_zero:
        generated = per_step[:, 2] * args.prompts * args.group  # bytes generated per rank per step
        args.out.write_text(json.dumps({
            "contender": args.contender, "budget": args.budget, "step_s": per_step[:, 0].tolist(),
            "generation_s": gen[:, 0].tolist(), "generated_per_rank": generated.tolist(),
            "node_inter_bytes_step": step_bytes.tolist(), "node_inter_bytes_generation": gen_bytes.tolist(),
            "ledger_peak_bytes": all_peaks[:, 0].tolist(), "peak_rss_bytes": all_peaks[:, 1].tolist()}))


if __name__ == "__main__":
    main()
