"""Memory-centric tiling (ZeRO-Infinity §5.1.3): one huge Linear layer under NVMe offload, with and
without tiling, side by side.

For each hidden size H of the grid, one process builds an ``nn.Linear(H, H, bias=False)`` on the
meta device inside an ``nn.Sequential``, partitions it with :class:`~lightning_zinf.ZeroEngine`
with parameters and optimizer state on NVMe (``OffloadConfig(param="nvme", optimizer="nvme")``), and
takes ``--steps`` AdamW steps (``fused=True``) on 8 x H random inputs, loss = mean squared output:

  - ``untiled``: the layer is one unit. Gathering it needs the whole weight in memory, and its
    optimizer state is one flat group, stepped (and swapped in) whole;
  - ``tiled``: ``ZeroEngine(tiling=TilingConfig(tile_numel=T))`` makes it a ``TiledLinear`` whose
    tiles (at most T elements) are units gathered one after another, and separate optimizer groups.

Each run is its own process (so ``ru_maxrss`` is that run's peak RSS) with the staging cap raised to
the machine's RAM, so that what each way needs, not the cap, sets its memory. Reported per run:
the peak bytes of gathered parameters (``engine.peak_gathered_bytes``) against the layer's and one
tile's bytes, the peak RSS, and the mean step time and swap bytes read and written after the first
step (the first creates the Adam moments). Then, for the memory budget ``--budget-gib``: the largest H of the grid that trained with
a peak RSS within it, untiled and tiled, and their ratio (the paper reports 8x larger hidden sizes).
A run the kernel kills for memory, or that fails, counts as not trained.

    python examples/benchmarks/tiling.py [--hidden 4096 8192 16384 32768] [--tile-numel 16777216]
                                         [--budget-gib 4] [--steps 3] [--nvme-root /tmp]

--nvme-root needs room for 16 bytes per parameter of the largest layer (17 GB at H = 32768).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from lightning_zinf import OffloadConfig, PrefetchConfig, TilingConfig, ZeroEngine, meta_parameters  # noqa: E402

GIB = 1 << 30
BATCH = 8


def ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def run_one(hidden: int, tile_numel: int, tiled: bool, steps: int, nvme_root: Path) -> dict:
    """Train the layer in this process; return the measurements (see the module docstring)."""
    folder = Path(tempfile.mkdtemp(prefix="zinf-tiling-", dir=nvme_root))
    try:
        torch.manual_seed(0)
        start = time.perf_counter()
        with meta_parameters():
            model = nn.Sequential(nn.Linear(hidden, hidden, bias=False))
        engine = ZeroEngine(
            model,
            prefetch=PrefetchConfig(persistence_threshold=0),
            offload=OffloadConfig(param="nvme", optimizer="nvme", nvme_path=str(folder), staging_bytes=ram_bytes()),
            tiling=TilingConfig(tile_numel=tile_numel) if tiled else None,
        )
        opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
        setup = time.perf_counter() - start
        units = [sum(g.numel for g in u.groups) for u in engine.units]
        seconds, losses, moved = [], [], []
        swapper = engine.swapper
        for step in range(steps):
            x = torch.randn(BATCH, hidden, generator=torch.Generator().manual_seed(step))
            read, written = swapper.bytes_read, swapper.bytes_written
            began = time.perf_counter()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            engine.release_all()
            seconds.append(time.perf_counter() - began)
            losses.append(loss.item())
            moved.append((swapper.bytes_read - read, swapper.bytes_written - written))
        engine.swapper.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "hidden": hidden,
        "tiled": tiled,
        "tiles": len(units),
        "layer_bytes": 4 * hidden * hidden,
        "tile_bytes": 4 * max(units),
        "peak_gathered_bytes": engine.peak_gathered_bytes,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "setup_s": setup,
        "step_s": sum(seconds[1:]) / max(len(seconds) - 1, 1),
        "read_per_step": sum(r for r, _ in moved[1:]) / max(len(moved) - 1, 1),
        "written_per_step": sum(w for _, w in moved[1:]) / max(len(moved) - 1, 1),
        "losses": losses,
    }


def run_in_child(hidden: int, tile_numel: int, tiled: bool, steps: int, nvme_root: Path) -> dict:
    """:func:`run_one` in a fresh process; a run that fails or is killed returns its reason."""
    cmd = [sys.executable, __file__, "--child", str(hidden), "--tile-numel", str(tile_numel), "--steps", str(steps),
           "--nvme-root", str(nvme_root)] + (["--tiled"] if tiled else [])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        reason = f"killed by signal {-done.returncode}" if done.returncode < 0 else done.stderr.strip().splitlines()[-1]
        return {"hidden": hidden, "tiled": tiled, "failed": reason}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--tile-numel", type=int, default=16 << 20, help="most weight elements per tile")
    parser.add_argument("--budget-gib", type=float, default=4.0, help="the memory budget (peak RSS), GiB")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nvme-root", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--out", type=Path, default=HERE / "results" / "tiling.json", help="JSON results")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tiled", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(run_one(args.child, args.tile_numel, args.tiled, args.steps, args.nvme_root)))
        return 0

    rows = []
    print(f"{'H':>6} {'mode':>8} {'tiles':>5} {'layer':>9} {'1 tile':>9} {'gathered':>9} {'peak RSS':>9} "
          f"{'s/step':>7} {'read':>7} {'written':>7}  (GiB; read/written per step, from the swapper)", flush=True)
    for hidden in args.hidden:
        for tiled in (False, True):
            row = run_in_child(hidden, args.tile_numel, tiled, args.steps, args.nvme_root)
            rows.append(row)
            mode = "tiled" if tiled else "untiled"
            if "failed" in row:
                print(f"{hidden:>6} {mode:>8}  failed: {row['failed']}", flush=True)
                continue
            print(f"{hidden:>6} {mode:>8} {row['tiles']:>5} {row['layer_bytes'] / GIB:>9.3f} {row['tile_bytes'] / GIB:>9.3f} "
                  f"{row['peak_gathered_bytes'] / GIB:>9.3f} {row['peak_rss'] / GIB:>9.2f} {row['step_s']:>7.1f} "
                  f"{row['read_per_step'] / GIB:>7.2f} {row['written_per_step'] / GIB:>7.2f}", flush=True)
    by = {(r["hidden"], r["tiled"]): r for r in rows}
    for hidden in args.hidden:
        a, b = by[(hidden, False)], by[(hidden, True)]
        if "failed" not in a and "failed" not in b:
            print(f"H {hidden}: gathered tiled/untiled {b['peak_gathered_bytes'] / a['peak_gathered_bytes']:.3f} "
                  f"(one tile / layer {b['tile_bytes'] / a['layer_bytes']:.3f}), peak RSS tiled/untiled "
                  f"{b['peak_rss'] / a['peak_rss']:.2f}, step time tiled/untiled {b['step_s'] / a['step_s']:.2f}, "
                  f"losses equal to {max(abs(x - y) / abs(y) for x, y in zip(a['losses'], b['losses'])):.1e} (relative)")
    budget = args.budget_gib * GIB
    largest = {}
    for tiled in (False, True):
        fits = [r["hidden"] for r in rows if r["tiled"] == tiled and "failed" not in r and r["peak_rss"] <= budget]
        largest[tiled] = max(fits, default=None)
    print(f"budget {args.budget_gib:g} GiB peak RSS: largest H untiled {largest[False]}, tiled {largest[True]}", end="")
    if largest[False] and largest[True]:
        print(f", ratio {largest[True] / largest[False]:.1f}x (ZeRO-Infinity reports 8x)")
    else:
        print()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "budget_gib": args.budget_gib, "tile_numel": args.tile_numel,
                                    "largest_in_budget": {"untiled": largest[False], "tiled": largest[True]}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
