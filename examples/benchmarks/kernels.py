"""Bandwidth of the triton_kernels quantization kernels on one CUDA GPU, side by side with the
GPU's measured device-to-device copy bandwidth and with the torch references (eager and
``torch.compile``).

Each kernel is memory-bound, so its figure of merit is the effective bandwidth

    GB/s = (bytes read + bytes written, codes and fp32 scales included) / median device time

over ``--iters`` samples after ``--warmup`` untimed calls. A sample is ``--calls`` back-to-back
calls between two CUDA events, queued behind a ``torch.cuda._sleep`` long enough for the host to
launch them all while the device sleeps: the events then time the kernels alone, back to back, and
the host's own cost of a call (argument checks, allocation, Triton's launcher) is timed apart, with
the wall clock around the launches (a sample whose launches outlast the sleep is taken again behind
a longer one). Both are reported per call (``triton_ms`` on the device,
``triton_host_ms`` on the host): a kernel whose host time exceeds its device time is launch-bound
in a loop of such calls, whatever its bandwidth. The copy row is ``dst.copy_(src)`` of a tensor as
large as the quantize input (2 x its bytes moved), timed the same way. (A call that waits for the
device, like "+ check"'s finite check, stops the host running ahead: its device time then
includes the idle gaps.) Rows:

  quantize INTb            1-D tensor of --numel values (--dtype) -> codes + scales
  quantize INTb + check    the same with the default nonfinite="raise" (one isfinite pass + sync)
  dequantize INTb          codes + scales -> --dtype values
  reorder+quantize INTb    qgZ step 1 for --nodes x --ranks-per-node ranks (fused, one pass)
  permute, then quantize   the unfused baseline: a contiguous permuted copy, then quantize
  deq-reduce-requant INTb  qgZ step 3: ranks-per-node operands of `nodes` partitions -> requantized sum
  deq-reduce INTb          qgZ step 5: `nodes` operands of one partition -> --dtype mean

The reduce rows are sized so that their code input holds --numel bytes whatever the bit width.
Targets (from the issue): >= 80% of the copy bandwidth for >= 64M elements, and the fused
reorder+quantize >= 2x faster than permute-then-quantize. Every Triton result is compared with the
reference once (the mismatch count is reported; on CUDA a code may differ by one).

    python examples/benchmarks/kernels.py [--numel 268435456] [--dtype bf16] [--block 256]
        [--bits 8,4] [--nodes 2 --ranks-per-node 4] [--iters 20] [--no-compile] [--out PATH]

Needs a CUDA GPU: without one it exits with status 2 (the CPU path is the torch reference, which
tests/test_kernels.py checks against the kernels run in Triton's interpreter).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository's triton_kernels, when run from a checkout

import triton_kernels as tk  # noqa: E402
from triton_kernels import QgzLayout, reference  # noqa: E402

TRITON = "triton"  # on CUDA the same as "auto"; forces the kernels in the CPU dry run
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: Device clock cycles ``torch.cuda._sleep`` spins in the calibration of its rate.
CALIBRATION_CYCLES = 10_000_000
#: Samples taken again behind a longer sleep, at most, per timing (a call that waits for the
#: device never lets the host run ahead, however long the sleep).
RETRIES = 3
COPY_TARGET = 0.80
FUSION_TARGET = 2.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=1 << 28, help="values per quantize input (default 2**28)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="dtype of the values")
    parser.add_argument("--block", type=int, default=256, help="values per scale (power of two, 64..4096)")
    parser.add_argument("--bits", default="8,4", help="comma-separated bit widths among 8 and 4")
    parser.add_argument("--nodes", type=int, default=2, help="qgZ topology: nodes")
    parser.add_argument("--ranks-per-node", type=int, default=4, help="qgZ topology: ranks per node")
    parser.add_argument(
        "--iters", type=int, default=20, help="timed samples per row, 5 calls each (the median is reported)"
    )
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls before timing")
    parser.add_argument("--calls", type=int, default=20, help="back-to-back calls per timed sample (default 20)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile reference column")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "kernels.json", help="JSON results path")
    args = parser.parse_args(argv)
    try:
        args.bits = [int(b) for b in args.bits.split(",")]
        for b in args.bits:
            tk.layout.check_bits(b)
        tk.layout.check_block(args.block)
    except ValueError as err:
        parser.error(str(err))
    if min(args.numel, args.nodes, args.ranks_per_node, args.iters, args.calls) < 1 or args.warmup < 0:
        parser.error("--numel, --nodes, --ranks-per-node, --iters and --calls must be positive, --warmup non-negative")
    return args


def sleep_cycles_per_ms() -> float:
    """Device clock cycles ``torch.cuda._sleep`` spins per millisecond, timed by CUDA events (the
    clock it counts is the SM clock, which boosts: measured, not taken from the data sheet)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(CALIBRATION_CYCLES // 10)  # the first spin loads the kernel
    start.record()
    torch.cuda._sleep(CALIBRATION_CYCLES)
    end.record()
    end.synchronize()
    return CALIBRATION_CYCLES / start.elapsed_time(end)


#: Longest sleep queued before a sample (ms): beyond it a row's launches are reported as not ahead.
MAX_SLEEP_MS = 200.0


def time_calls(fn: Callable[[], object], iters: int, warmup: int, device: torch.device,
               calls: int = 1) -> tuple[float, float, bool]:
    """Median milliseconds per call of ``fn`` on the device and on the host, over ``iters``
    samples of ``calls`` back-to-back calls each (the module docstring says how), and whether the
    host's launches ran ahead of the device in every sample (False: the device times include idle
    gaps, as for a call that waits for the device). On the CPU (the tests' dry run) both times are
    the wall clock."""
    for _ in range(warmup):
        fn()
    device_ms, host_ms = [], []
    if device.type != "cuda":
        for _ in range(iters):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            device_ms.append((time.perf_counter() - start) * 1e3 / calls)
        return statistics.median(device_ms), statistics.median(device_ms), True
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    launch_ms = (time.perf_counter() - start) * 1e3  # an upper bound: the device may have been slower
    torch.cuda.synchronize()
    # Twice the launches' time and a margin: the host stays ahead even when a call takes longer.
    cycles_per_ms, sleep_ms = sleep_cycles_per_ms(), 2 * launch_ms + 0.5
    retries, ahead = RETRIES, True
    while len(device_ms) < iters:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(cycles_per_ms * sleep_ms))
        begin.record()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        launched_ms = (time.perf_counter() - start) * 1e3
        end.record()
        end.synchronize()
        if launched_ms > sleep_ms:  # the device may have caught up with the host and idled
            # A call that waits for the device (the "+ check" rows) waits out the sleep itself:
            # its launches can never run ahead, and a longer sleep only costs time.
            waits = launched_ms >= begin.elapsed_time(end) * 0.9
            if retries and not waits:
                retries, sleep_ms = retries - 1, min(2 * launched_ms, MAX_SLEEP_MS)
                continue
            ahead = False
            sleep_ms = min(sleep_ms, launch_ms + 0.5)
        host_ms.append(launched_ms / calls)
        device_ms.append(begin.elapsed_time(end) / calls)
    return statistics.median(device_ms), statistics.median(host_ms), ahead


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def mismatches(got: object, want: object) -> int:
    """Elements of ``got`` that differ from ``want`` (NaN equal to NaN), over tuples of tensors."""
    got_t = got if isinstance(got, tuple) else (got,)
    want_t = want if isinstance(want, tuple) else (want,)
    return sum(
        int((~((g == w) | (g.float().isnan() & w.float().isnan()))).sum()) for g, w in zip(got_t, want_t, strict=True)
    )


class Bench:
    """Times one row's contenders and keeps the table."""

    def __init__(self, args: argparse.Namespace, copy_gbs: float, device: torch.device) -> None:
        self.args, self.copy_gbs, self.device, self.rows = args, copy_gbs, device, []

    def time(self, fn: Callable[[], object]) -> tuple[float, float, bool]:
        """Device and host milliseconds per call of ``fn``, and whether the host ran ahead (:func:`time_calls`)."""
        return time_calls(fn, self.args.iters, self.args.warmup, self.device, self.args.calls)

    def compiled(self, fn: Callable) -> Callable | None:
        return None if self.args.no_compile else torch.compile(fn, dynamic=False)

    def row(
        self,
        name: str,
        moved: int,
        triton_fn: Callable[[], object],
        eager_fn: Callable[[], object] | None,
        compiled_fn: Callable[[], object] | None,
        numel: int,
    ) -> dict:
        entry: dict = {"kernel": name, "numel": numel, "bytes": moved}
        entry["triton_ms"], entry["triton_host_ms"], entry["host_ahead"] = self.time(triton_fn)
        entry["triton_gbs"] = moved / entry["triton_ms"] / 1e6
        entry["of_copy"] = entry["triton_gbs"] / self.copy_gbs
        if eager_fn is not None:
            entry["mismatches"] = mismatches(triton_fn(), eager_fn())
            entry["eager_ms"], entry["eager_host_ms"], _ = self.time(eager_fn)
        if compiled_fn is not None:
            try:
                entry["compile_ms"], entry["compile_host_ms"], _ = self.time(compiled_fn)
            except Exception as err:  # a reference torch.compile cannot handle is reported, not fatal
                entry["compile_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
        self.rows.append(entry)
        print(f"[kernels] {name}: {entry['triton_ms']:.3f} ms on the device, {entry['triton_host_ms']:.3f} ms "
              f"on the host, {entry['triton_gbs']:.0f} GB/s", flush=True)
        return entry


def run(args: argparse.Namespace, dev: torch.device) -> dict:
    """Measure every row on ``dev`` (a CUDA device; CPU only for a dry run under the interpreter)."""
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(args.numel, generator=gen, device=dev).to(DTYPES[args.dtype])
    copy_gbs, copy_host_ms = copy_bandwidth(x, args)
    print(f"[kernels] device-to-device copy: {copy_gbs:.0f} GB/s", flush=True)
    bench = Bench(args, copy_gbs, dev)
    fusion = {}
    for bits in args.bits:
        quantize_rows(bench, x, bits)
        fusion[bits] = reorder_rows(bench, x, bits)
        reduce_rows(bench, gen, bits)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return {"copy_gbs": copy_gbs, "copy_host_ms": copy_host_ms, "rows": bench.rows, "fused_over_unfused": fusion}


def copy_bandwidth(x: torch.Tensor, args: argparse.Namespace) -> tuple[float, float]:
    """GB/s of ``dst.copy_(x)`` (bytes read + bytes written, over its device time), the bound for a
    memory-bound kernel, and the copy's host milliseconds per call."""
    dst = torch.empty_like(x)
    device_ms, host_ms, _ = time_calls(lambda: dst.copy_(x), args.iters, args.warmup, x.device, args.calls)
    return 2 * nbytes(x) / device_ms / 1e6, host_ms


def quantize_rows(bench: Bench, x: torch.Tensor, bits: int) -> None:
    """quantize (without and with the finite check) and dequantize ``x``."""
    n, block, dtype = x.numel(), bench.args.block, x.dtype
    codes, scales = tk.quantize(x, bits, block, backend=TRITON)
    moved = nbytes(x, codes, scales)

    def ref_quantize() -> tuple[torch.Tensor, torch.Tensor]:
        return reference.quantize(x, bits, block)

    def ref_dequantize() -> torch.Tensor:
        return reference.dequantize(codes, scales, n, bits, block, dtype)

    bench.row(
        f"quantize INT{bits}", moved, lambda: tk.quantize(x, bits, block, nonfinite="propagate", backend=TRITON),
        ref_quantize, bench.compiled(ref_quantize), n,
    )  # fmt: skip
    bench.row(f"quantize INT{bits} + check", moved, lambda: tk.quantize(x, bits, block, backend=TRITON), None, None, n)
    bench.row(
        f"dequantize INT{bits}", moved,
        lambda: tk.dequantize(codes, scales, n, bits, block, dtype=dtype, backend=TRITON),
        ref_dequantize, bench.compiled(ref_dequantize), n,
    )  # fmt: skip


def reorder_rows(bench: Bench, x: torch.Tensor, bits: int) -> float:
    """qgZ's fused reorder + quantize, and the unfused permute-then-quantize; returns unfused / fused time."""
    a, n = bench.args, x.numel()
    layout = QgzLayout(n, a.nodes, a.ranks_per_node, bits=bits, block=a.block)
    w, s = layout.world, layout.part_numel
    moved = nbytes(x, *tk.reorder_quantize(x, layout, backend=TRITON))

    def ref_reorder() -> tuple[torch.Tensor, torch.Tensor]:
        return reference.reorder_quantize(x, layout)

    def unfused() -> tuple[torch.Tensor, torch.Tensor]:
        padded = x if w * s == n else torch.nn.functional.pad(x, (0, w * s - n))
        permuted = padded.view(a.nodes, a.ranks_per_node, s).transpose(0, 1).reshape(w, s)
        return tk.quantize(permuted, bits, a.block, nonfinite="propagate", backend=TRITON)

    fused = bench.row(
        f"reorder+quantize INT{bits}", moved,
        lambda: tk.reorder_quantize(x, layout, nonfinite="propagate", backend=TRITON),
        ref_reorder, bench.compiled(ref_reorder), n,
    )  # fmt: skip
    plain = bench.row(f"permute, then quantize INT{bits}", moved, unfused, None, None, n)
    return plain["triton_ms"] / fused["triton_ms"]


def reduce_rows(bench: Bench, gen: torch.Generator, bits: int) -> None:
    """qgZ's two reduce steps, on operands whose codes hold --numel bytes."""
    a, dev, dtype = bench.args, bench.device, DTYPES[bench.args.dtype]
    m = a.numel * 8 // bits
    intra = QgzLayout(m, a.nodes, a.ranks_per_node, bits=bits, block=a.block)
    src = torch.randn(a.ranks_per_node * a.nodes, intra.part_len, generator=gen, device=dev)
    codes, scales = (t.view(a.ranks_per_node, a.nodes, -1) for t in tk.quantize(src, bits, a.block, backend=TRITON))
    del src

    def ref_requant() -> tuple[torch.Tensor, torch.Tensor]:
        return reference.dequantize_reduce_requantize(codes, scales, intra, 1.0)

    bench.row(
        f"deq-reduce-requant INT{bits} (K={a.ranks_per_node})",
        nbytes(codes, scales, *tk.dequantize_reduce_requantize(codes, scales, intra, backend=TRITON)),
        lambda: tk.dequantize_reduce_requantize(codes, scales, intra, backend=TRITON),
        ref_requant, bench.compiled(ref_requant), codes.shape[0] * codes.shape[1] * intra.part_len,
    )  # fmt: skip

    final = QgzLayout(m * a.ranks_per_node, a.nodes, a.ranks_per_node, bits=bits, block=a.block)
    src = torch.randn(a.nodes, final.part_len, generator=gen, device=dev)
    last_codes, last_scales = tk.quantize(src, bits, a.block, backend=TRITON)
    del src
    mean = 1 / final.world

    def ref_final() -> torch.Tensor:
        return reference.dequantize_reduce(last_codes[:, None], last_scales[:, None], final, mean, dtype)[0]

    def triton_final() -> torch.Tensor:
        return tk.dequantize_reduce(last_codes, last_scales, final, multiplier=mean, dtype=dtype, backend=TRITON)

    bench.row(
        f"deq-reduce INT{bits} (K={a.nodes})", nbytes(last_codes, last_scales, triton_final()), triton_final,
        ref_final, bench.compiled(ref_final), a.nodes * final.part_len,
    )  # fmt: skip


def format_table(result: dict) -> str:
    lines = [
        f"device-to-device copy: {result['copy_gbs']:.0f} GB/s ({1e3 * result['copy_host_ms']:.0f} µs per call on the host)",
        "",
        "| kernel | elements | MB moved | Triton ms | Triton host µs | Triton GB/s | of copy | eager ms "
        "| Triton vs eager | compile ms | Triton vs compile | mismatches |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        eager, comp, ms = r.get("eager_ms"), r.get("compile_ms"), r["triton_ms"]
        eager_cols = f"{eager:.3f} | {eager / ms:.1f}x" if eager else "- | -"
        comp_cols = f"{comp:.3f} | {comp / ms:.1f}x" if comp else f"{r.get('compile_error', '-')} | -"
        lines.append(
            f"| {r['kernel']} | {r['numel']:,} | {r['bytes'] / 1e6:.0f} | {ms:.3f} | {1e3 * r['triton_host_ms']:.0f} "
            f"| {r['triton_gbs']:.0f} "
            f"| {100 * r['of_copy']:.0f}% | {eager_cols} | {comp_cols} | {r.get('mismatches', '-')} |"
        )
    lines.append("")
    for bits, ratio in result["fused_over_unfused"].items():
        verdict = "meets" if ratio >= FUSION_TARGET else "MISSES"
        lines.append(
            f"fused reorder+quantize INT{bits}: {ratio:.2f}x the speed of permute-then-quantize"
            f" ({verdict} the {FUSION_TARGET}x target)"
        )
    slow = [
        r["kernel"]
        for r in result["rows"]
        if r["numel"] >= 1 << 26 and r["of_copy"] < COPY_TARGET and "permute" not in r["kernel"]
    ]
    lines.append(
        f"kernels below {COPY_TARGET:.0%} of copy bandwidth at >= 64M elements: {', '.join(slow) if slow else 'none'}"
    )
    bound = [r["kernel"] for r in result["rows"] if r["triton_host_ms"] > r["triton_ms"]]
    lines.append(f"launch-bound (host time per call above device time): {', '.join(bound) if bound else 'none'}")
    behind = [r["kernel"] for r in result["rows"] if not r["host_ahead"]]
    lines.append(f"device times with idle gaps (the host could not run ahead): {', '.join(behind) if behind else 'none'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "kernels.py measures GPU memory bandwidth and needs a CUDA GPU, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}). Run it on a machine with an NVIDIA GPU and a CUDA build of torch.",
            file=sys.stderr,
        )
        return 2
    import triton

    result = run(args, torch.device("cuda"))
    record = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "triton": triton.__version__},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        **result,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print()
    print(format_table(result))
    print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
