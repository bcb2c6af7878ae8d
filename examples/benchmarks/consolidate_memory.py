"""Peak memory of consolidating a sharded checkpoint of a >1 GB model, against the model's size.

1. Two ranks (``torchrun``) build a 332M-parameter GPT (1.33 GB in fp32) on the meta device,
   partition it with the engine, and save a sharded checkpoint (no rank ever holds the model).
2. ``python -m lightning_zinf.consolidate`` streams it into one ``.safetensors`` file, then one
   ``.pt`` file, each in a fresh process whose peak RSS (its own ``ru_maxrss``) is compared with
   the model size, the largest tensor, and a process that only imports the package (the floor).

    python examples/benchmarks/consolidate_memory.py [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
D_MODEL, LAYERS, VOCAB = 1536, 10, 32000


def save_rank(workdir: Path) -> None:
    """One rank of step 1 (run under torchrun)."""
    import torch.distributed as dist

    sys.path.insert(0, str(REPO_ROOT))
    from examples.gpt import GPT, GPTConfig
    from lightning_zinf import ZeroEngine, meta_parameters
    from lightning_zinf.checkpoint import save_sharded

    dist.init_process_group("gloo")
    with meta_parameters():
        model = GPT(GPTConfig(vocab_size=VOCAB, d_model=D_MODEL, n_layers=LAYERS, n_heads=12, seq_len=128))
    engine = ZeroEngine(model, block_classes=["Block"])
    save_sharded(engine, [], workdir / "ckpt", {})
    dist.destroy_process_group()


# Runs a module as __main__ and prints its own peak RSS last (RUSAGE_CHILDREN in the parent would
# report the largest of all children, the torchrun ranks included).
_MEASURE = (
    "import resource, runpy, sys; sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__');"
    "print('PEAK_RSS_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
)


def peak_rss_mib(module: str, *args: str) -> tuple[float, float]:
    """Run ``python -m module args`` in a fresh process; return (its peak RSS in MiB, wall seconds)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _MEASURE, module, *args], check=True, cwd=REPO_ROOT,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    wall = time.perf_counter() - start
    return int(done.stdout.split("PEAK_RSS_KIB")[-1]) / 1024, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--save-rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="zinf_consolidate_"))
    if args.save_rank:
        save_rank(workdir)
        return

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    subprocess.run([*torchrun, __file__, "--save-rank", "--workdir", str(workdir)], check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    floor, _ = peak_rss_mib("lightning_zinf.checkpoint")  # imports torch and the package, nothing else
    out = workdir / "model.safetensors"
    peak, wall = peak_rss_mib("lightning_zinf.consolidate", str(workdir / "ckpt"), str(out))
    peak_pt, wall_pt = peak_rss_mib("lightning_zinf.consolidate", str(workdir / "ckpt"), str(workdir / "model.pt"))

    from safetensors import safe_open

    with safe_open(str(out), framework="pt") as f:
        sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    numel = {k: int(__import__("math").prod(s)) for k, s in sizes.items()}
    model_mib = out.stat().st_size / 2**20
    largest_mib = max(numel.values()) * 4 / 2**20
    result = {
        "parameters": sum(numel.values()) - numel.get("lm_head.weight", 0),
        "output_file_mib": round(model_mib),
        "largest_tensor_mib": round(largest_mib),
        "import_only_peak_rss_mib": round(floor),
        "consolidate_peak_rss_mib": round(peak),
        "consolidate_above_import_mib": round(peak - floor),
        "consolidate_wall_s": round(wall, 1),
        "consolidate_pt_peak_rss_mib": round(peak_pt),
        "consolidate_pt_above_import_mib": round(peak_pt - floor),
        "consolidate_pt_wall_s": round(wall_pt, 1),
    }
    print(json.dumps(result, indent=2))
    print(f"peak RSS above the import floor = {(peak - floor) / largest_mib:.2f} x the largest tensor, "
          f"{(peak - floor) / model_mib:.2f} x the model")


if __name__ == "__main__":
    main()
