"""Read and write bandwidth of the NVMe swapper next to plain sequential O_DIRECT I/O of the same bytes.

ZeRO-Infinity's DeepNVMe (Rajbhandari et al., SC'21, §6.3) aims at the disk's sequential bandwidth;
this measures how close :class:`lightning_zinf.offload.NvmeSwapper` gets, in one run, on one file
of ``--size-gib`` GiB in a fresh folder under ``--dir``. Contenders, each timed ``--repeats`` times,
interleaved (the median is reported):

  raw O_DIRECT     one thread, sequential ``--block-size`` pwrite/pread of the same aligned buffer
  dd               ``dd bs=<block> oflag=direct`` from /dev/zero (zeros, not the same bytes) and
                   ``dd iflag=direct`` reading the swapper's own file to /dev/null
  swapper, 1 key   ``write(key, tensor).wait()`` / ``read(key, tensor).wait()`` of the whole buffer
  swapper, K keys  the same bytes as ``--keys`` tensors, all in flight at once (how the engine swaps)

Every write goes to a file deleted just before, so each contender allocates its blocks afresh.
GB/s = bytes / wall seconds (1 GB = 1e9 bytes). Target (from the issue): swapper >= 90% of raw.

With ``--buffered`` the swapper runs with ``AioConfig(o_direct=False)`` and the raw and dd
contenders drop their direct flags. The page cache would then make reads look like memory copies,
so every write is timed up to an ``fsync`` of its file and every read starts after the file's
cached pages were dropped (``fsync`` + ``posix_fadvise(DONTNEED)``, this file only).

    python examples/benchmarks/nvme_bandwidth.py [--dir /tmp] [--size-gib 4] [--repeats 3]
        [--block-size 1048576] [--threads 4] [--queue-depth 8] [--keys 64] [--buffered] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the checkout's lightning_zinf, when run from one

from lightning_zinf.offload import AioConfig, NvmeSwapper, aligned_empty  # noqa: E402
from lightning_zinf.offload.aligned import memory_view  # noqa: E402
from lightning_zinf.offload.files import filesystem_type  # noqa: E402

TARGET = 0.90
GB = 1e9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where the test folder goes")
    parser.add_argument("--size-gib", type=float, default=4.0, help="bytes per contender, GiB (default 4)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per contender (median reported)")
    parser.add_argument("--block-size", type=int, default=1 << 20, help="bytes per request, all contenders")
    parser.add_argument("--threads", type=int, default=4, help="swapper I/O threads")
    parser.add_argument("--queue-depth", type=int, default=8, help="swapper queue depth per thread")
    parser.add_argument("--keys", type=int, default=64, help="keys of the many-keys swapper row (0: skip it)")
    parser.add_argument("--buffered", action="store_true", help="measure the buffered fallback path instead")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "nvme_bandwidth.json", help="JSON results")
    args = parser.parse_args(argv)
    if args.size_gib <= 0 or args.repeats < 1 or args.keys < 0:
        parser.error("--size-gib and --repeats must be positive, --keys non-negative")
    return args


def drop_cached_pages(path: Path) -> None:
    """Write back and evict ``path``'s pages from the page cache (this file only)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class Raw:
    """Plain sequential I/O with one thread: the bound the swapper is compared with."""

    def __init__(self, path: Path, block: int, direct: bool) -> None:
        self.path, self.block, self.flags = path, block, os.O_DIRECT if direct else 0

    def write(self, buf: torch.Tensor) -> None:
        view, n = memory_view(buf.data_ptr(), buf.numel()), buf.numel()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | self.flags, 0o600)
        try:
            for off in range(0, n, self.block):
                os.pwritev(fd, [view[off : off + self.block]], off)
            if not self.flags:
                os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, buf: torch.Tensor) -> None:
        view, n = memory_view(buf.data_ptr(), buf.numel()), buf.numel()
        fd = os.open(self.path, os.O_RDONLY | self.flags)
        try:
            for off in range(0, n, self.block):
                if os.preadv(fd, [view[off : off + self.block]], off) != min(self.block, n - off):
                    raise RuntimeError(f"short read of {self.path} at {off}")
        finally:
            os.close(fd)


def dd(args: list[str]) -> None:
    subprocess.run(["dd", *args, "status=none"], check=True)


def timed(fn: Callable[[], None], before: Callable[[], None] | None = None) -> float:
    if before is not None:
        before()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if shutil.which("dd") is None:
        print("dd not found", file=sys.stderr)
        return 2
    size = int(args.size_gib * (1 << 30)) // args.block_size * args.block_size
    blocks = size // args.block_size
    direct = not args.buffered
    work = Path(tempfile.mkdtemp(prefix="zinf-nvme-bench-", dir=args.dir))
    config = AioConfig(block_size=args.block_size, threads=args.threads, queue_depth=args.queue_depth, o_direct=direct)
    load_before = os.getloadavg()
    # Random bytes (a 64 MiB pattern repeated) so that no layer can shortcut zeros.
    src = aligned_empty(size, torch.uint8)
    pattern = torch.randint(0, 256, (min(size, 64 << 20),), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for off in range(0, size, pattern.numel()):
        src[off : off + pattern.numel()] = pattern[: size - off]
    dst = aligned_empty(size, torch.uint8)
    times: dict[str, list[float]] = {}
    raw = Raw(work / "raw.bin", args.block_size, direct)
    dd_out, dd_dir = work / "dd.bin", (["oflag=direct"], ["iflag=direct"]) if direct else (["conv=fsync"], [])
    nkeys = args.keys
    parts = [src[i * size // nkeys : (i + 1) * size // nkeys] for i in range(nkeys)] if nkeys else []
    outs = [dst[i * size // nkeys : (i + 1) * size // nkeys] for i in range(nkeys)] if nkeys else []
    try:
        with NvmeSwapper(work / "swap", config) as sw:
            if sw.direct != direct:
                print(f"warning: the swapper uses direct={sw.direct} here", file=sys.stderr)
            swap_file = sw._path("one")

            def sw_write_one() -> None:
                sw.write("one", src).wait()
                if not direct:
                    drop_cached_pages(swap_file)  # timed: the data is on disk only after the fsync

            def sw_write_many() -> None:
                for h in [sw.write(f"part{i}", p) for i, p in enumerate(parts)]:
                    h.wait()
                if not direct:
                    for i in range(nkeys):
                        drop_cached_pages(sw._path(f"part{i}"))

            def sw_read_many() -> None:
                for h in [sw.read(f"part{i}", o) for i, o in enumerate(outs)]:
                    h.wait()

            def forget(*paths: Path) -> Callable[[], None]:
                def drop() -> None:
                    for path in paths:
                        drop_cached_pages(path)
                return drop

            def fresh(*keys: str) -> Callable[[], None]:
                def remove() -> None:
                    for key in keys:
                        sw.remove(key)
                return remove

            for rep in range(args.repeats):
                print(f"repeat {rep + 1}/{args.repeats}", file=sys.stderr, flush=True)
                rows: list[tuple[str, Callable[[], None], Callable[[], None] | None]] = [
                    ("write raw", lambda: raw.write(src), lambda: raw.path.unlink(missing_ok=True)),
                    ("write swapper", sw_write_one, fresh("one")),
                    ("write dd", lambda: dd(["if=/dev/zero", f"of={dd_out}", f"bs={args.block_size}",
                                             f"count={blocks}", *dd_dir[0]]), lambda: dd_out.unlink(missing_ok=True)),
                    ("read raw", lambda: raw.read(dst), None if direct else forget(raw.path)),
                    ("read swapper", lambda: sw.read("one", dst).wait(), None if direct else forget(swap_file)),
                    ("read dd", lambda: dd([f"if={swap_file}", "of=/dev/null", f"bs={args.block_size}", *dd_dir[1]]),
                     None if direct else forget(swap_file)),
                ]
                if nkeys:
                    rows += [
                        ("write swapper many", sw_write_many, fresh(*[f"part{i}" for i in range(nkeys)])),
                        ("read swapper many", sw_read_many,
                         None if direct else forget(*[sw._path(f"part{i}") for i in range(nkeys)])),
                    ]
                for name, fn, before in rows:
                    times.setdefault(name, []).append(timed(fn, before))
                    if name.startswith("read swapper"):
                        if not torch.equal(dst, src):
                            raise RuntimeError(f"{name}: data read back differs from data written")
                        dst.zero_()
            swapper_direct = sw.direct
            bytes_written, bytes_read = sw.bytes_written, sw.bytes_read
    finally:
        for leftover in (work / "raw.bin", work / "dd.bin"):
            leftover.unlink(missing_ok=True)
        work.rmdir()
    load_after = os.getloadavg()

    gbs = {name: size / statistics.median(ts) / GB for name, ts in times.items()}
    mode = "O_DIRECT" if direct else "buffered (+fsync on writes, cache dropped before reads)"
    print(f"\n{size / (1 << 30):.2f} GiB per contender, {mode}, block {args.block_size} B, "
          f"{args.threads} threads x queue depth {args.queue_depth}, median of {args.repeats}; "
          f"{filesystem_type(args.dir.resolve())} at {args.dir}\n")
    print("| op | raw sequential GB/s | dd GB/s | swapper, 1 key GB/s | swapper / raw | swapper / dd |"
          + (f" swapper, {nkeys} keys GB/s | {nkeys} keys / raw |" if nkeys else ""))
    print("|---|---|---|---|---|---|" + ("---|---|" if nkeys else ""))
    summary = {}
    for op in ("write", "read"):
        r, d, s = gbs[f"{op} raw"], gbs[f"{op} dd"], gbs[f"{op} swapper"]
        line = f"| {op} | {r:.3f} | {d:.3f} | {s:.3f} | {s / r:.0%} | {s / d:.0%} |"
        summary[op] = {"raw_gbs": r, "dd_gbs": d, "swapper_gbs": s, "ratio_raw": s / r, "ratio_dd": s / d}
        if nkeys:
            m = gbs[f"{op} swapper many"]
            line += f" {m:.3f} | {m / r:.0%} |"
            summary[op].update(many_gbs=m, many_ratio_raw=m / r)
        print(line)
    ok = all(summary[op]["ratio_raw"] >= TARGET for op in summary)
    print(f"\ntarget: swapper >= {TARGET:.0%} of raw sequential: {'met' if ok else 'NOT met'}")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} ({os.cpu_count()} cores)")

    result = {
        "date": datetime.date.today().isoformat(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "dir": str(args.dir), "filesystem": filesystem_type(args.dir.resolve())},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "bytes": size, "swapper_direct": swapper_direct, "load_before": load_before, "load_after": load_after,
        "seconds": times, "gbs": gbs, "summary": summary, "target_met": ok,
        "swapper_counters": {"bytes_written": bytes_written, "bytes_read": bytes_read},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
