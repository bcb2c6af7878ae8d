"""Per-rank peak memory of ZeRO-3 against model depth and world size: lightning_zinf vs FSDP2 vs
DeepSpeed, and the ideal, side by side.

The GPT of examples/gpt.py (width 512, 8 heads, context 128, vocabulary 8192, tied embeddings;
3.15M parameters per block, 4.26M in the embeddings) with 4, 8, 16 and 32 blocks, trained on 1, 2
and 4 ranks (CPU, gloo, ``OMP_NUM_THREADS=1``), micro-batch 1 x 128 random tokens per rank, torch
AdamW, forward under ``torch.autocast("cpu", bfloat16)``, in two modes:

  full   bf16-mixed, every parameter trainable;
  lora   the model frozen, rank-8 adapters on each block's attention qkv and proj trainable.

Contenders (run_memory_scaling.py; each run is its own ``torchrun``, one after another):

  zinf       ``ZeroEngine(block_classes=[Block], mixed_precision=MixedPrecisionConfig(bf16, fp32),
             prefetch=PrefetchConfig(persistence_threshold=100_000, bucket_size=0,
             overlap_reduce=False))``, AdamW via ``shard_optimizer``: one unit gathered ahead and
             each reduce-scatter waited for at once, as FSDP2 runs on the CPU
  zinf_frozen_bf16  (lora only) zinf with ``MixedPrecisionConfig(frozen_dtype=bf16)``: the frozen
             base's shards stored in bf16, as DeepSpeed's bf16 mode stores its model
  fsdp2      ``fully_shard`` on each block and the root, ``MixedPrecisionPolicy(bf16, fp32)``
  deepspeed  DeepSpeed ZeRO-3, ``bf16.enabled``, AdamW as client optimizer, persistence 100,000,
             its defaults otherwise (prefetch bucket 5e7, max live parameters 1e9)
  ideal      computed, not run: (16 B x trainable + 2 B x frozen parameters) / ranks (fp32 master
             that is the parameter shard, fp32 gradient, two fp32 AdamW moments; a bf16 copy of a
             frozen parameter) + the largest unit gathered in bf16 (the tied embedding) + the
             activations. Activations are measured: the bytes of the distinct storages that a
             plain PyTorch forward of the bf16 model under autocast saves for backward
             (``saved_tensors_hooks``), parameters excluded.

Measured per run and rank: the peak RSS (``VmHWM``) over the steps after a warm-up step, reset
with ``/proc/self/clear_refs`` after it; the RSS before the model is built (imports and process
group); for zinf, its memory ledger's ``device_total`` peak (every byte the engine holds) and the
bytes its all-gathers received per step. Reported per contender, mode and world size: the largest
rank's peak RSS at each depth and its growth per block (least-squares slope over the depths,
MiB/block). Targets: zinf's growth per block <= each peer's; zinf's peak <= each peer's at every
depth; in lora mode also zinf_frozen_bf16's against DeepSpeed's, which stores the frozen base alike
(the ratio shown is the largest over depths; printed beside it, not a target, the same ratio
for the RSS added since the start, which leaves out what each library's import costs). Then zinf
alone in fp32 (``MixedPrecisionConfig()``, no autocast) on every multi-rank size: bytes gathered per step in bf16 must be at most 0.5 x
those in fp32 plus what the persistent units (gathered again after each step) receive in fp32.

    python examples/benchmarks/memory_scaling.py [--layers 4 8 16 32] [--ranks 1 2 4] [--modes full lora]
        [--only zinf,fsdp2,deepspeed] [--steps 4] [--timeout 600] [--out examples/benchmarks/results/memory_scaling.json]

The deepspeed contender needs ``pip install deepspeed`` (it runs with ``DS_ACCELERATOR=cpu``); its
first run JIT-builds DeepSpeed's shared-memory op (about a minute, cached afterwards).
"""

import argparse
import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from examples.gpt import lm_loss  # noqa: E402
from measure import run_killable  # noqa: E402
from run_memory_scaling import (  # noqa: E402
    LORA_RANK, MICRO_BATCH, PERSISTENCE_THRESHOLD, WARMUP_STEPS, batch, build_gpt, gpt_config,
)

CONTENDERS = ("zinf", "zinf_frozen_bf16", "fsdp2", "deepspeed")
PEERS = ("fsdp2", "deepspeed")
# (ours, peer) pairs held to the targets: zinf against both; with the frozen base stored in bf16,
# against DeepSpeed, which stores it so.
PAIRS = (("zinf", "fsdp2"), ("zinf", "deepspeed"), ("zinf_frozen_bf16", "deepspeed"))
MIB = 1 << 20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16, 32], help="depths (blocks)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="world sizes")
    parser.add_argument("--modes", nargs="+", choices=["full", "lora"], default=["full", "lora"])
    parser.add_argument("--only", default=",".join(CONTENDERS), help="comma-separated contenders to run")
    parser.add_argument("--steps", type=int, default=4, help=f"steps per run, the first {WARMUP_STEPS} a warm-up")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before a run is killed")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "memory_scaling.json")
    parser.add_argument("--mmap-threshold", type=int, default=None,
                        help="set glibc's MALLOC_MMAP_THRESHOLD_ (bytes) for every contender alike, so that "
                             "freed tensors go back to the OS and RSS follows live bytes (default: glibc's own, "
                             "which keeps much of what a step frees)")
    args = parser.parse_args()
    args.only = [name.strip() for name in args.only.split(",") if name.strip()]
    if not args.only or set(args.only) - set(CONTENDERS):
        parser.error(f"--only must name some of {CONTENDERS}")
    if args.steps <= WARMUP_STEPS or len(args.layers) < 2:
        parser.error(f"need more than {WARMUP_STEPS} steps and at least two depths")
    return args


def launch(contender: str, ranks: int, layers: int, mode: str, args: argparse.Namespace, log_dir: Path,
           fp32: bool = False) -> dict:
    """One torchrun of run_memory_scaling.py; its per-rank results, or why it failed."""
    name = f"{contender}{'_fp32' if fp32 else ''}_{mode}_w{ranks}_l{layers}"
    log = log_dir / f"{name}.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore::FutureWarning")
    if args.mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    with tempfile.TemporaryDirectory(prefix="zinf_memscale_") as result_dir:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               str(HERE / "run_memory_scaling.py"), contender, "--layers", str(layers), "--mode", mode,
               "--steps", str(args.steps), "--result-dir", result_dir, *(["--fp32"] if fp32 else [])]
        start = time.perf_counter()
        returncode = run_killable(cmd, env, log, args.timeout)
        files = [Path(result_dir, f"rank{r}.json") for r in range(ranks)]
        per_rank = [json.loads(f.read_text()) for f in files if f.exists()]
    run = {"returncode": returncode, "wall_s": round(time.perf_counter() - start, 1), "log": str(log)}
    # Judged by what every rank wrote, not by torchrun's exit code (DeepSpeed may abort at exit).
    if len(per_rank) != ranks:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line and "ChildFailedError" not in line]
        return {**run, "status": "failed", "error": (errors or lines or ["(no output)"])[-1].strip()[:200]}
    measured = slice(WARMUP_STEPS, None)
    summary = {
        **run, "status": "ok",
        "peak_rss_mib": [r["peak_rss_mib"] for r in per_rank],
        "rss_at_start_mib": [r["rss_at_start_mib"] for r in per_rank],
        "rss_at_reset_mib": [r["rss_at_reset_mib"] for r in per_rank],
        "step_times_s": per_rank[0]["step_times_s"],
        "losses": per_rank[0]["losses"],
    }
    if contender.startswith("zinf"):
        ledger_peaks = [max(r["ledger_device_total_peak"][measured]) for r in per_rank]
        summary["ledger_device_total_peak_mib"] = max(ledger_peaks) / MIB
        summary["ledger_peaks_mib_rank0"] = {
            c: max(p[c] for p in per_rank[0]["ledger_peaks"][measured]) / MIB for c in per_rank[0]["ledger_peaks"][0]}
        gathered = per_rank[0]["gathered_bytes"][measured]
        summary["gathered_bytes_per_step"] = sum(gathered) / len(gathered)
        summary["persistent_numel"] = per_rank[0]["persistent_numel"]
    return summary


def activation_bytes(layers: int, mode: str) -> int:
    """Bytes saved for backward by one plain PyTorch forward (one rank's micro-batch) of the model
    with bf16 parameters under bf16 autocast: distinct storages, the parameters' own excluded."""
    torch.manual_seed(0)
    model = build_gpt(layers, mode).to(torch.bfloat16)
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    inputs, targets = batch(0, 0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = lm_loss(model(inputs), targets)
    del loss
    return sum(saved.values())


def ideal_mib(layers: int, mode: str, ranks: int, activations: int) -> float:
    """The ideal per-rank bytes (see the module docstring), in MiB."""
    with torch.device("meta"):
        model = build_gpt(layers, mode)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    largest_unit = max(model.wte.weight.numel(), sum(p.numel() for p in model.blocks[0].parameters()))
    return ((16 * trainable + 2 * frozen) / ranks + 2 * largest_unit + activations) / MIB


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def curves(runs: dict, args: argparse.Namespace, activations: dict) -> dict:
    """Per mode and world size: for each contender (and zinf's ledger, and the ideal), the peak MiB
    at each depth (the largest rank's) and the growth per block, or None where a run failed."""
    out: dict = {}
    for mode in args.modes:
        for ranks in args.ranks:
            rows = {}
            for contender in args.only:
                if contender == "zinf_frozen_bf16" and mode != "lora":
                    continue
                got = [runs.get(f"{contender}/{mode}/w{ranks}/l{layers}", {}) for layers in args.layers]
                ok = all(run.get("status") == "ok" for run in got)
                done = [r for r in got if r.get("status") == "ok"]
                rows[contender] = {
                    "peak_mib": [max(r["peak_rss_mib"]) if r.get("status") == "ok" else None for r in got],
                    "rss_at_start_mib": [max(r["rss_at_start_mib"]) for r in done],
                    "above_start_mib": [max(p - s for p, s in zip(r["peak_rss_mib"], r["rss_at_start_mib"])) for r in done],
                    "errors": [r["error"] for r in got if r.get("status") == "failed"],
                }
                rows[contender]["mib_per_block"] = slope(args.layers, rows[contender]["peak_mib"]) if ok else None
                if contender == "zinf" and ok:
                    ledger = [r["ledger_device_total_peak_mib"] for r in got]
                    rows["zinf ledger"] = {"peak_mib": ledger, "mib_per_block": slope(args.layers, ledger)}
            ideal = [ideal_mib(layers, mode, ranks, activations[mode][layers]) for layers in args.layers]
            rows["ideal"] = {"peak_mib": ideal, "mib_per_block": slope(args.layers, ideal)}
            out[f"{mode}/w{ranks}"] = rows
    return out


def targets(table: dict) -> list[dict]:
    """zinf against each peer that finished: growth per block and peak (largest ratio over depths)."""
    found = []
    for key, rows in table.items():
        for ours, peer in PAIRS:
            zinf, theirs = rows.get(ours, {}), rows.get(peer, {})
            if zinf.get("mib_per_block") is None or theirs.get("mib_per_block") is None:
                continue
            slope_ours, peer_slope = zinf["mib_per_block"], theirs["mib_per_block"]
            found.append({"where": key, "ours": ours, "peer": peer, "what": "growth per block", "zinf": slope_ours,
                          "peer_value": peer_slope, "ratio": slope_ours / peer_slope if peer_slope > 0 else None,
                          "pass": slope_ours <= peer_slope})
            ratios = [a / b for a, b in zip(zinf["peak_mib"], theirs["peak_mib"])]
            # Not a target: the same ratio for the RSS added since the start (imports excluded).
            above = [a / b for a, b in zip(zinf["above_start_mib"], theirs["above_start_mib"])]
            found.append({"where": key, "ours": ours, "peer": peer, "what": "peak RSS (worst depth)", "ratio": max(ratios),
                          "pass": max(ratios) <= 1.0, "ratio_above_start": max(above)})
    return found


def gathered_checks(runs: dict) -> list[dict]:
    """bf16 vs fp32 bytes gathered per step by zinf, at every multi-rank size, mode and depth."""
    found = []
    for key, fp32 in runs.items():
        if not key.startswith("zinf_fp32/") or fp32.get("status") != "ok":
            continue
        bf16 = runs.get(key.replace("zinf_fp32/", "zinf/"), {})
        if bf16.get("status") != "ok":
            continue
        ranks = int(key.split("/")[2][1:])
        # The persistent units, gathered in fp32 after each step: what this rank receives of them.
        persistent = fp32["persistent_numel"] * 4 * (ranks - 1) / ranks
        limit = 0.5 + persistent / fp32["gathered_bytes_per_step"]
        ratio = bf16["gathered_bytes_per_step"] / fp32["gathered_bytes_per_step"]
        found.append({"where": key.removeprefix("zinf_fp32/"), "bf16_mib": bf16["gathered_bytes_per_step"] / MIB,
                      "fp32_mib": fp32["gathered_bytes_per_step"] / MIB, "ratio": ratio, "limit": limit,
                      "pass": ratio <= limit})
    return found


def fmt(value, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def format_tables(table: dict, layers: list[int]) -> str:
    header = ("mode", "ranks", "contender", *(f"L={n} MiB" for n in layers), "MiB/block", "start MiB",
              "zinf/peer peak", "zinf/peer MiB/block")
    lines = [header]
    for key, rows in table.items():
        mode, ranks = key.split("/")
        zinf = rows.get("zinf", {})
        for name, row in rows.items():
            peak_ratio = slope_ratio = None
            if name in PEERS and zinf.get("mib_per_block") is not None and row["mib_per_block"] is not None:
                peak_ratio = max(a / b for a, b in zip(zinf["peak_mib"], row["peak_mib"]))
                slope_ratio = zinf["mib_per_block"] / row["mib_per_block"] if row["mib_per_block"] > 0 else None
            start = max(row["rss_at_start_mib"]) if row.get("rss_at_start_mib") else None
            cells = [fmt(v) if v is not None else "FAILED" for v in row["peak_mib"]]
            lines.append((mode, ranks[1:], name, *cells, fmt(row["mib_per_block"], ".2f"), fmt(start),
                          fmt(peak_ratio, ".2f"), fmt(slope_ratio, ".2f")))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(" | ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def format_checks(checks: list[dict], gathered: list[dict]) -> str:
    lines = []
    for c in checks:
        lines.append(f"{'PASS' if c['pass'] else 'FAIL'}  {c['where']:8} {c['ours']:16} vs {c['peer']:9} {c['what']:22} "
                     f"ratio {fmt(c['ratio'], '.2f')}"
                     + (f"  ({c['zinf']:.2f} vs {c['peer_value']:.2f} MiB/block)" if "zinf" in c else "")
                     + (f"  (above start RSS: {c['ratio_above_start']:.2f})" if "ratio_above_start" in c else ""))
    for g in gathered:
        lines.append(f"{'PASS' if g['pass'] else 'FAIL'}  {g['where']:16} gathered/step bf16 {g['bf16_mib']:.1f} MiB vs "
                     f"fp32 {g['fp32_mib']:.1f} MiB: ratio {g['ratio']:.3f} <= {g['limit']:.3f}")
    return "\n".join(lines)


def code_state() -> dict:
    """The commit, whether the tree had changes, and a digest of lightning_zinf's sources as run."""
    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=HERE, capture_output=True, text=True).stdout.strip()
        except OSError:
            return ""
    digest = hashlib.sha256()
    for path in sorted((HERE.parents[1] / "lightning_zinf").rglob("*.py")):
        digest.update(path.read_bytes())
    commit = git("rev-parse", "--short", "HEAD") or None  # None outside a git checkout
    return {"commit": commit, "uncommitted_changes": bool(git("status", "--porcelain")) if commit else None,
            "lightning_zinf_sha256": digest.hexdigest()[:16]}


def main() -> None:
    args = parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="zinf_memscale_logs_"))
    began = time.perf_counter()
    activations = {mode: {n: activation_bytes(n, mode) for n in args.layers} for mode in args.modes}
    record = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "code": code_state(),
        "model": {**gpt_config(0).__dict__, "n_layers": args.layers, "lora_rank": LORA_RANK},
        "micro_batch": MICRO_BATCH, "steps": args.steps, "warmup_steps": WARMUP_STEPS,
        "persistence_threshold": PERSISTENCE_THRESHOLD,
        "activation_bytes": activations,
    }
    # The grid, depth-major inside each world size and mode so that drift hits every contender alike;
    # then zinf in fp32 for the gathered-bytes check.
    grid = [(c, w, n, m, False) for w in args.ranks for m in args.modes for n in args.layers for c in args.only
            if c != "zinf_frozen_bf16" or m == "lora"]
    if "zinf" in args.only:
        grid += [("zinf", w, n, m, True) for w in args.ranks if w > 1 for m in args.modes for n in args.layers]
    runs: dict = {}
    for i, (contender, ranks, layers, mode, fp32) in enumerate(grid, 1):
        key = f"{contender}{'_fp32' if fp32 else ''}/{mode}/w{ranks}/l{layers}"
        runs[key] = launch(contender, ranks, layers, mode, args, log_dir, fp32)
        run = runs[key]
        detail = f"peak RSS {max(run['peak_rss_mib']):.0f} MiB" if run["status"] == "ok" else run["error"]
        print(f"[{i}/{len(grid)}] {key}: {run['status']} in {run['wall_s']:.0f} s, {detail}", flush=True)
        # Written after every run, so that an interrupted run keeps what it measured.
        args.out.write_text(json.dumps({**record, "runs": runs}, indent=1))
    table = curves(runs, args, activations)
    checks, gathered = targets(table), gathered_checks(runs)
    record["wall_s"] = round(time.perf_counter() - began)
    record.update(table=table, targets=checks, gathered=gathered)
    args.out.write_text(json.dumps({**record, "runs": runs}, indent=1))
    print()
    print(format_tables(table, args.layers))
    print()
    print(format_checks(checks, gathered))
    print(f"\nwall time {record['wall_s']} s; logs in {log_dir}; results: {args.out}")


if __name__ == "__main__":
    main()
