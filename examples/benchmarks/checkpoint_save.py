"""Saving a sharded checkpoint: time, peak disk use and bytes written, next to one sequential
write of the same bytes (the disk's bound), and optionally next to an earlier revision of the code.

One process (world size 1) partitions a stack of fp32 ``nn.Linear`` layers of ``--params``
parameters with AdamW, takes one step (so the optimizer state exists), and times
``save_sharded`` (parameters + exp_avg + exp_avg_sq: 12 bytes per parameter). While it runs, a
thread samples the disk space held under the checkpoint's folder every 10 ms, and
``/proc/self/io`` gives the bytes passed to ``write()``. The bound writes the checkpoint's size to
one file on the same disk in 8 MiB ``write()`` calls. With ``--baseline REV`` the same measurement
runs on a ``git worktree`` of revision ``REV``.

    python examples/benchmarks/checkpoint_save.py [--params 100000000] [--dir /tmp/ckpt_bench] [--baseline REV]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def disk_bytes(folder: Path) -> int:
    """Bytes of disk allocated to the files under ``folder`` (0 for files that vanish meanwhile)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def measure(params: int, folder: Path) -> dict:
    """Time one ``save_sharded`` of a ``params``-parameter model in ``folder`` (this process, this
    checkout of lightning_zinf)."""
    import torch

    from lightning_zinf import ZeroEngine
    from lightning_zinf.checkpoint import save_sharded
    from measure import proc_io

    width = min(4096, int(params**0.5))
    layers = max(1, params // (width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    engine = ZeroEngine(model)
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    folder.mkdir(parents=True, exist_ok=True)
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], disk_bytes(folder))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    before, start = proc_io()["wchar"], time.perf_counter()
    save_sharded(engine, [opt], folder / "ckpt", {})
    seconds, wrote = time.perf_counter() - start, proc_io()["wchar"] - before
    stop.set()
    sampler.join()
    size = disk_bytes(folder / "ckpt")
    shutil.rmtree(folder / "ckpt")
    return {"params": layers * width * width, "save_s": seconds, "checkpoint_bytes": size, "peak_disk_bytes": peak[0],
            "wchar": wrote}  # fmt: skip


def sequential_write(nbytes: int, folder: Path, durable: bool = False) -> float:
    """Seconds to write ``nbytes`` to one new file in ``folder`` in 8 MiB ``write()`` calls (and,
    ``durable``, to ``fsync`` it: the bound for a save that flushes its files to the disk)."""
    block = b"\0" * (8 << 20)
    path = folder / "bound.bin"
    os.sync()  # the writeback of earlier measurements' dirty pages is not this one's
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // len(block)):
            f.write(block)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def run_in(tree: Path, params: int, folder: Path) -> dict:
    """:func:`measure` in a fresh process importing lightning_zinf from ``tree``."""
    os.sync()  # the writeback of earlier measurements' dirty pages is not this one's
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2]);"
        "from checkpoint_save import measure; from pathlib import Path;"
        "print(json.dumps(measure(int(sys.argv[3]), Path(sys.argv[4]))))"
    )
    done = subprocess.run([sys.executable, "-c", code, str(HERE), str(tree), str(params), str(folder)],
                          check=True, capture_output=True, text=True, cwd=tree)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=100_000_000)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "ckpt_bench")
    parser.add_argument("--baseline", help="git revision to measure side by side")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "checkpoint_save.json")
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    trees = {"current": REPO}
    if args.baseline:
        worktree = Path(tempfile.mkdtemp()) / "baseline"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(worktree), args.baseline],
                       check=True, capture_output=True)  # fmt: skip
        trees[args.baseline] = worktree
    try:
        results = {name: run_in(tree, args.params, args.dir) for name, tree in trees.items()}
    finally:
        if args.baseline:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(trees[args.baseline])],
                           check=True, capture_output=True)  # fmt: skip
    size = results["current"]["checkpoint_bytes"]
    bound_s = sequential_write(size, args.dir)
    durable_s = sequential_write(size, args.dir, durable=True)
    print(f"checkpoint: {size / 1e9:.2f} GB; one sequential write of it: {bound_s:.2f} s ({size / bound_s / 1e9:.2f} GB/s), "
          f"with fsync: {durable_s:.2f} s ({size / durable_s / 1e9:.2f} GB/s)\n")
    print("| code | save s | vs sequential write | vs write + fsync | peak disk / checkpoint | write() bytes / checkpoint |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['save_s']:.2f} | {r['save_s'] / bound_s:.2f}x | {r['save_s'] / durable_s:.2f}x "
              f"| {r['peak_disk_bytes'] / size:.2f} | {r['wchar'] / size:.2f} |")  # fmt: skip
    record = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(), "sequential_write_s": bound_s, "sequential_write_fsync_s": durable_s,
        "results": results,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
