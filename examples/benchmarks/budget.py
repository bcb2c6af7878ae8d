"""``memory_budget`` against the best hand-written configuration at the same budget (issue 40).

A GPT (examples/gpt.py, 24 blocks of width 256, vocabulary 4096: 20.0M parameters) trains on 2
ranks (gloo, one thread each), micro-batch 2 x 128 tokens per rank, AdamW, fp32, with the swap
files in a new folder under --nvme-root. First two reference runs with everything in memory, one
keeping every block's activations and one checkpointing every block, measure the step (forward,
backward, optimizer step) and the activations (saved-tensor hooks of the script's own, by storage,
parameters left out, in the last step; with checkpointing, plus each block's input and one block's
activations for its recompute). The unplanned peak is the planner's prediction of the
state with everything in memory (held against the ledger in tests/test_memory_budget.py) plus the
activations kept.

Then, at 100%, 60%, 40% and 25% of the unplanned peak:
  planned  ZeroInfinity's options with memory_budget=B, the model's example_input_array set to one
           micro-batch: one number; the plan places the state and chooses the blocks that keep
           their activations from the example's forward (profiled with fake tensors, one block
           timed for real);
  hand     every configuration of today's options a user would write that fits B by the same
           measure (predicted state + measured activations): param/optimizer tiers none/none,
           none/nvme, nvme/nvme, activation checkpointing of every block off or on, host_bytes 0
           or as much as fits, staging_bytes 16 or 64 MiB, sub_group_size 1e6 (about a block's
           shard; the default 2.5e7 is the whole model here, which 16 MiB of staging cannot hold),
           each under the allocator settings a budget gives a planned run (lightning_zinf.heap.keep_within
           with the room the budget leaves), so that both keep the same discipline of host memory.
Each run: 6 steps, the mean of the last 4 timed on rank 0. Printed per budget: tokens/s planned
and of the best hand configuration, their ratio (goal >= 0.9), and the plan's own predicted step
time (MemoryPlan.step: compute, recompute, collectives, optimizer step, NVMe) against the measured
one (goal within 20%).

    python examples/benchmarks/budget.py [--nvme-root /tmp] [--shares 1,0.6,0.4,0.25]
        [--out examples/benchmarks/results/budget.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples.gpt import GPT, GPTConfig, lm_loss  # noqa: E402
from lightning_zinf import MixedPrecisionConfig, OffloadConfig, PrefetchConfig, meta_parameters  # noqa: E402
from lightning_zinf.engine_setup import build_engine  # noqa: E402
from lightning_zinf.heap import keep_within  # noqa: E402
from lightning_zinf.options import ZeroOptions  # noqa: E402
from lightning_zinf.planning import Inventory, Placement, predict  # noqa: E402
from lightning_zinf.planning.cost import host_costs  # noqa: E402

CFG = GPTConfig(vocab_size=4096, d_model=256, n_layers=24, n_heads=4, seq_len=128)
BATCH, STEPS, WARMUP, WORLD = 2, 6, 2, 2
BUCKET = 10_000_000
HAND_SUB_GROUP = 1_000_000


def _saved_bytes(model: torch.nn.Module, engine) -> "tuple[object, list[int]]":
    """Saved-tensor hooks counting the storage autograd keeps (parameters and gathered buffers out)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen and s.data_ptr() not in params \
                and not engine.states.holds_storage_of(t):
            seen.add(s.data_ptr())
            total[0] += s.nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), total


def _rank(rank: int, port: int, job: dict, out: str) -> None:
    try:
        _train(rank, port, job, out)
    except BaseException:  # a configuration that fails is a result: say why, on this rank
        traceback.print_exc()
        os._exit(1)  # no collective may follow: the other rank may be elsewhere


def _train(rank: int, port: int, job: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD), RANK=str(rank),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    with meta_parameters():
        model = GPT(CFG)
    if job.get("budget"):  # the micro-batch the plan profiles (Lightning's example_input_array)
        model.example_input_array = torch.zeros(BATCH, CFG.seq_len, dtype=torch.long)
    options = ZeroOptions(block_classes=["Block"], offload=OffloadConfig(**job["offload"]),
                          prefetch=PrefetchConfig(bucket_size=job.get("bucket", BUCKET)),
                          activation_checkpointing=["Block"] if job.get("ckpt") else (),
                          memory_budget=job.get("budget"))
    engine = build_engine(model, options, device=torch.device("cpu"), ranks_per_node=WORLD,
                          precision=MixedPrecisionConfig(), loss_scaling=False, timeout=None, auto_pass=True)
    if job.get("room") is not None:  # a hand configuration under the budget's allocator settings
        keep_within(job["room"])
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(rank)
    times, saved = [], 0
    for step in range(STEPS):
        x = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len + 1), generator=g)
        observe = step == STEPS - 1
        hooks, count = _saved_bytes(model, engine) if observe else (None, [0])
        t0 = time.perf_counter()
        if hooks is not None:
            with hooks:
                loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        else:
            loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        saved = count[0] if observe else saved
        if step >= WARMUP:
            times.append((t3 - t0, t1 - t0, t2 - t1, t3 - t2))
    engine.release_all()
    if rank == 0:
        mean = [sum(t[i] for t in times) / len(times) for i in range(4)]
        plan, acts = engine.memory_plan, engine.activation_plan
        result = {"s_step": mean[0], "forward": mean[1], "backward": mean[2], "step": mean[3], "saved": saved,
                  "ledger_device_peak": engine.memory()["device_total"][1]}
        if plan is not None:
            result.update(placement=plan.placement.describe(), predicted=plan.prediction.total(False),
                          predicted_s_step=plan.step.total, terms=dataclasses.asdict(plan.step),
                          checkpointed=len(acts.checkpointed) if acts is not None else None, plan=plan.describe())
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def run(job: dict, nvme_root: Path) -> dict:
    """One 2-rank training run of ``job``; rank 0's measurements."""
    folder = Path(tempfile.mkdtemp(prefix="zinf-budget-", dir=nvme_root))
    job = {**job, "offload": {**job.get("offload", {}), "nvme_path": str(folder)}}
    out = folder / "result.json"
    try:
        context = mp.start_processes(_rank, args=(29500 + os.getpid() % 500, job, str(out)), nprocs=WORLD,
                                     join=False, start_method="spawn")
        for process in context.processes:
            process.join()
        failed = [p.exitcode for p in context.processes if p.exitcode]
        if failed or not out.exists():
            return {"failed": f"exit codes {failed}"}
        return json.loads(out.read_text())
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def hand_configs(inventory: Inventory, room: int) -> list[tuple[dict, int]]:
    """Today's options a user would write, sized to ``room`` bytes of state, each with its state's
    predicted peak in bytes (the planner's prediction)."""
    configs = []
    for param, optimizer in (("none", "none"), ("none", "nvme"), ("nvme", "nvme")):
        if optimizer == "none":
            candidates = [Placement()]
        else:
            candidates = []
            for staging in (16 << 20, 64 << 20):
                base = Placement(param=param, optimizer=optimizer, staging_bytes=staging)
                costs, best = host_costs(inventory, base, 8), 0
                for k in range(len(costs) + 1):
                    trial = Placement(param=param, optimizer=optimizer, staging_bytes=staging, host_bytes=sum(costs[:k]))
                    if predict(inventory, trial, bucket_size=BUCKET).total(False) <= room:
                        best = sum(costs[:k])
                candidates += [base, Placement(param=param, optimizer=optimizer, staging_bytes=staging, host_bytes=best)]
        for placement in dict.fromkeys(candidates):
            state = predict(inventory, placement, bucket_size=BUCKET).total(False)
            if state <= room:
                offload = {"param": placement.param, "optimizer": placement.optimizer}
                if placement.nvme:  # sub-groups of about one block's shard, as a DeepSpeed user tunes them
                    offload.update(staging_bytes=placement.staging_bytes, host_bytes=placement.host_bytes,
                                   sub_group_size=HAND_SUB_GROUP)
                configs.append((offload, state))
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme-root", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--shares", default="1,0.6,0.4,0.25")
    parser.add_argument("--out", type=Path, default=ROOT / "examples/benchmarks/results/budget.json")
    args = parser.parse_args()
    with meta_parameters():
        inventory = Inventory.of(GPT(CFG), world=WORLD, block_classes=["Block"])
    state = predict(inventory, Placement(), bucket_size=BUCKET).total(False)
    kept = run({}, args.nvme_root)
    checkpointed = run({"ckpt": True}, args.nvme_root)
    # Under checkpointing the script's hooks see what is saved outside the blocks; each block also
    # keeps its input, and backward recomputes one block at a time.
    block = (kept["saved"] - checkpointed["saved"]) / CFG.n_layers
    checkpointed["saved"] += int(CFG.n_layers * BATCH * CFG.seq_len * CFG.d_model * 4 + block)
    unplanned = state + kept["saved"]
    tokens = WORLD * BATCH * CFG.seq_len
    print(f"{inventory.parameters / 1e6:.1f}M parameters; state {state / 2**20:.1f} MiB per rank, activations "
          f"{kept['saved'] / 2**20:.1f} MiB kept, {checkpointed['saved'] / 2**20:.1f} MiB checkpointed; "
          f"unplanned peak {unplanned / 2**20:.1f} MiB; reference step {kept['s_step']:.2f} s "
          f"(forward {kept['forward']:.2f}, backward {kept['backward']:.2f}, step {kept['step']:.2f})", flush=True)
    results = {"reference": kept, "reference_checkpointed": checkpointed, "unplanned": unplanned, "cells": []}
    for share in (float(s) for s in args.shares.split(",")):
        budget = int(share * unplanned)
        planned = run({"budget": budget}, args.nvme_root)
        hand = []
        for ckpt, acts in ((False, kept["saved"]), (True, checkpointed["saved"])):
            for offload, state in hand_configs(inventory, budget - acts):
                measured = run({"offload": offload, "ckpt": ckpt, "room": budget - state - acts}, args.nvme_root)
                hand.append({"offload": offload, "ckpt": ckpt, **measured})
                print(f"  {share:.0%} hand {offload} ckpt={ckpt}: "
                      f"{measured['s_step']:.2f} s/step" if "s_step" in measured else f"failed ({measured})", flush=True)
        ok = [h for h in hand if "s_step" in h]
        best = min(ok, key=lambda h: h["s_step"]) if ok else None
        cell = {"share": share, "budget": budget, "planned": planned, "hand": hand, "best": best}
        if "s_step" in planned:
            predicted = planned["predicted_s_step"]
            ratio = (best["s_step"] / planned["s_step"]) if best else float("nan")
            cell["ratio"] = ratio
            print(f"{share:.0%} ({budget / 2**20:.1f} MiB): planned {planned['placement']}, "
                  f"{planned['checkpointed']} blocks checkpointed: {tokens / planned['s_step']:.0f} tokens/s; best hand "
                  f"{best['offload'] if best else None} ckpt={best['ckpt'] if best else None}: "
                  f"{tokens / best['s_step'] if best else float('nan'):.0f} tokens/s; planned/best {ratio:.2f}; "
                  f"predicted {predicted:.2f} s/step, measured {planned['s_step']:.2f} "
                  f"({predicted / planned['s_step'] - 1:+.0%})", flush=True)
        else:
            print(f"{share:.0%}: planned run failed: {planned}", flush=True)
        results["cells"].append(cell)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
