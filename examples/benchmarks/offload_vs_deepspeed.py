"""ZeRO-Infinity with NVMe offload: lightning_zinf against DeepSpeed, side by side.

Trains the same ~91M-parameter GPT (examples/gpt.py) as throughput.py (same random tokens, AdamW
lr 1e-4, micro-batch 1 x 128 tokens per rank, 2 ranks on CPU with gloo, OMP_NUM_THREADS=1), with
parameters and optimizer state (fp32 masters, gradients, Adam moments) on NVMe, under:

  zinf_nvme       Lightning + ZeroInfinityStrategy(block_classes=["Block"],
                  offload=OffloadConfig(param="nvme", optimizer="nvme", nvme_path=...)),
                  every other option at its default, torch.optim.AdamW(fused=True): the step
                  runs on the CPU, as DeepSpeed's runs its vectorised CPU Adam (run_lightning.py),
                  in the background while the next forward runs (OffloadConfig.overlap_step)
  zinf_nvme+sync  the same with OffloadConfig(overlap_step=False): the step completes inside
                  optimizer.step() (what the overlapped step is measured against)
  deepspeed_nvme  a raw DeepSpeed ZeRO-3 engine with offload_param and offload_optimizer on
                  device "nvme" through its libaio op, in the configuration that works on this
                  machine (run_deepspeed.py's nvme_config: prefetch and reuse distance 0 against
                  deepspeedai/DeepSpeed#3062, sub_group_size 1e7)

--host-bytes B keeps up to B bytes per rank of zinf's NVMe-tier state in host memory (OffloadConfig.host_bytes:
the first blocks' shards, compute copies, masters and moments; default 0, everything on NVMe), the trade of
host memory for disk traffic that DeepSpeed makes only between the device and the CPU.

--precision picks what both run in (default 32-true):
  32-true     fp32 throughout. zinf's fp32 parameter shard is also its master (one swap record).
  bf16-mixed  zinf_nvme: Trainer(precision="bf16-mixed"): forward under bf16 autocast, shards
              gathered in bf16 from a bf16 compute copy of each shard (rewritten by each step and
              held in staging memory while it has room, else on NVMe), fp32 masters, fp32 gradient
              shards (held likewise) and AdamW state on NVMe.
              deepspeed_nvme: DeepSpeed's "bf16": {"enabled": true}: the module's parameters in
              bf16 (swapped to NVMe as bf16), fp32 masters, gradients and Adam moments in its
              NVMe-offloaded optimizer, forward and loss under the same bf16 autocast.

Each contender runs as its own ``torchrun --nproc_per_node 2`` job (throughput.py's driver), with its
swap files in its own new folder under --nvme-root, removed afterwards. Measured per contender:
  - s/step, tokens/s: as in throughput.py (rank 0, mean over the steps after the first 2);
  - peak RSS: ru_maxrss of each rank, MiB;
  - exposed step: the step time not hidden by compute, rank 0's mean s/step minus the mean
    forward and backward time of zinf_nvme+sync (on_train_batch_start to on_before_backward to
    on_after_backward: compute and the gathers, without a step to wait for); for zinf_nvme+sync
    that is the time from the end of backward to the end of the step;
  - bytes read / written per step: from /proc/self/io (read_bytes, write_bytes) of each rank,
    which counts what the process (all its threads, O_DIRECT and kernel AIO included) made the
    block layer read or write; the same measure for both contenders. Summed over the ranks, mean
    over the timed steps (from the end of the last warm-up step to the end of the last step).
    For zinf_nvme the swapper's own byte counters are reported as well, as a cross-check.
The ratios compare zinf_nvme with DeepSpeed: tokens/s (above 1: zinf faster; target >= 1.5) and
the largest per-rank peak RSS (below 1: zinf leaner; target <= 1).

    python examples/benchmarks/offload_vs_deepspeed.py [--steps 7] [--only zinf_nvme,deepspeed_nvme]
        [--precision {32-true,bf16-mixed}] [--host-bytes B] [--nvme-root /tmp]
        [--out examples/benchmarks/results/offload_vs_deepspeed.json (_bf16-mixed.json under bf16-mixed)]

Each contender's rank 0 also prints, at the end of training, the bytes of the swap files by kind
(``swap files:`` in its log): where each keeps what.

--nvme-root must be on the disk to measure, not a tmpfs (check with ``df``; on the project's machine
/tmp is on the virtio disk). DeepSpeed runs with the interpreter of a separate venv
(--python-deepspeed, default $ZINF_DEEPSPEED_PYTHON, else this interpreter) and needs libaio for its NVMe op:

    apt-get install libaio-dev

It JIT-compiles its ops the first time they are used: async_io takes about 4 minutes and cpu_adam
about 1 (cached afterwards in ~/.cache/torch_extensions). Step times exclude the build, but run the
deepspeed_nvme contender once beforehand (e.g. ``--only deepspeed_nvme --steps 3``) to keep wall
time short.
"""

import json
import shutil
import tempfile
from pathlib import Path

from throughput import HERE, benchmark_parser, check_args, format_table, run_all, setup_record

CONTENDERS = ("zinf_nvme", "zinf_nvme+sync", "deepspeed_nvme")
MIB = 1 << 20


def total_mib(counter: str):
    """A table cell: MiB per step of ``counter``, summed over the ranks."""

    def cell(res: dict) -> str:
        per_rank = res["bytes_per_step"].get(counter)
        return f"{sum(per_rank) / MIB:.0f}" if per_rank else "-"

    return cell


def exposed_step(results: dict, name: str) -> float | None:
    """Seconds per step of ``name`` not hidden by compute: its mean step minus the synchronous
    zinf run's mean forward and backward (see the docstring), where both were measured."""
    sync, res = results.get("zinf_nvme+sync", {}), results.get(name, {})
    if res.get("status") != "ok" or "mean_forward_s" not in sync:
        return None
    return res["mean_step_s"] - sync["mean_forward_s"] - sync["mean_backward_s"]


COLUMNS = [
    ("read MiB/step", total_mib("read_bytes")),
    ("written MiB/step", total_mib("write_bytes")),
    ("swapper read", total_mib("swapper_read_bytes")),
    ("swapper written", total_mib("swapper_written_bytes")),
]


def main() -> None:
    default_out = HERE / "results" / "offload_vs_deepspeed.json"
    parser = benchmark_parser(__doc__, CONTENDERS, default_out)
    parser.add_argument("--nvme-root", default="/tmp", help="folder on the disk to swap to (a new folder is made in it)")
    parser.add_argument("--precision", choices=["32-true", "bf16-mixed"], default="32-true",
                        help="what both contenders train in (see above; default: %(default)s)")
    parser.add_argument("--host-bytes", type=int, default=0,
                        help="zinf_nvme and zinf_nvme+sync: OffloadConfig.host_bytes, bytes per rank of NVMe-tier state "
                             "kept in host memory (see above; default: %(default)s, everything on NVMe)")
    args = parser.parse_args()
    check_args(parser, args, CONTENDERS)
    if args.out == default_out and args.precision != "32-true":
        args.out = default_out.with_name(f"offload_vs_deepspeed_{args.precision}.json")

    swap_root = tempfile.mkdtemp(prefix="zinf_offload_bench_", dir=args.nvme_root)
    try:
        swap_dirs = {name: Path(swap_root, name) for name in args.only}
        for path in swap_dirs.values():
            path.mkdir()
        record = {**setup_record(args), "nvme_root": args.nvme_root, "precision": args.precision,
                  "host_bytes": args.host_bytes}
        script_args = {name: ["--nvme", str(path), "--precision", args.precision] for name, path in swap_dirs.items()}
        for name in ("zinf_nvme", "zinf_nvme+sync"):
            if name in script_args:
                script_args[name] += ["--host-bytes", str(args.host_bytes)]
        script_args["zinf_nvme+sync"] = [*script_args.get("zinf_nvme+sync", []), "--overlap-step", "off"]
        results, ratios = run_all(args, record, "offload_vs_deepspeed", ours="zinf_nvme", script_args=script_args)
    finally:
        shutil.rmtree(swap_root, ignore_errors=True)
    print()
    print(format_table(results, ratios, COLUMNS))
    exposed = {name: exposed_step(results, name) for name in ("zinf_nvme+sync", "zinf_nvme")}
    if all(value is not None for value in exposed.values()):
        ratio = exposed["zinf_nvme"] / exposed["zinf_nvme+sync"] if exposed["zinf_nvme+sync"] > 0 else float("nan")
        print(f"exposed step (s/step not hidden by compute): synchronous {exposed['zinf_nvme+sync']:.2f}, "
              f"overlapped {exposed['zinf_nvme']:.2f}, ratio {ratio:.2f} (goal <= 0.30)")
        record_path = args.out
        data = json.loads(record_path.read_text())
        data["exposed_step_s"] = {**exposed, "ratio": ratio}
        record_path.write_text(json.dumps(data, indent=2))
    print("(read/written: /proc/self/io, all ranks; swapper: lightning_zinf's own counters, all ranks)")
    print(f"\nresults: {args.out}")


if __name__ == "__main__":
    main()
