"""Bandwidth of the triton_kernels quantization kernels on one CUDA GPU, side by side with the
GPU's measured device-to-device copy bandwidth and with the torch references (eager and
``torch.compile``).

Each kernel is memory-bound, so its figure of merit is the effective bandwidth

    GB/s = (bytes read + bytes written, codes and fp32 scales included) / median time

over ``--iters`` samples (CUDA events around 5 back-to-back calls each) after ``--warmup``
untimed calls. The copy row is ``dst.copy_(src)`` of a tensor as large as the quantize input
(2 x its bytes moved). Rows:

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
from pathlib import Path
from typing import Callable, Optional

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository's triton_kernels, when run from a checkout

import triton_kernels as tk  # noqa: E402
from triton_kernels import QgzLayout, reference  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CALLS_PER_SAMPLE = 5
COPY_TARGET = 0.80
FUSION_TARGET = 2.0


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=1 << 28, help="values per quantize input (default 2**28)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="dtype of the values")
    parser.add_argument("--block", type=int, default=256, help="values per scale (power of two, 64..4096)")
    parser.add_argument("--bits", default="8,4", help="comma-separated bit widths among 8 and 4")
    parser.add_argument("--nodes", type=int, default=2, help="qgZ topology: nodes")
    parser.add_argument("--ranks-per-node", type=int, default=4, help="qgZ topology: ranks per node")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per row (the median is reported)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls before timing")
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
    if args.numel < 1 or args.nodes < 1 or args.ranks_per_node < 1 or args.iters < 1 or args.warmup < 0:
        parser.error("--numel, --nodes, --ranks-per-node and --iters must be positive, --warmup non-negative")
    return args


def median_ms(fn: Callable[[], object], iters: int, warmup: int, device: torch.device) -> float:
    """Median wall time of ``fn`` in milliseconds: CUDA events on the current stream on a GPU,
    the wall clock on CPU (used only by the dry run in the tests)."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type != "cuda":
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    for _ in range(iters):
        # Several calls per sample keep the launch queue ahead of the GPU, so the host-side cost
        # of a call (argument checks, allocation) does not show up as idle GPU time.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(CALLS_PER_SAMPLE):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / CALLS_PER_SAMPLE)
    return statistics.median(times)


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def mismatches(got: object, want: object) -> int:
    """Elements of ``got`` that differ from ``want`` (NaN equal to NaN), over tuples of tensors."""
    got_t = got if isinstance(got, tuple) else (got,)
    want_t = want if isinstance(want, tuple) else (want,)
    return sum(int((~((g == w) | (g.float().isnan() & w.float().isnan()))).sum()) for g, w in zip(got_t, want_t))


class Bench:
    """Times one row's contenders and keeps the table."""

    def __init__(self, args: argparse.Namespace, copy_gbs: float, device: torch.device) -> None:
        self.args, self.copy_gbs, self.device, self.rows = args, copy_gbs, device, []

    def time(self, fn: Callable[[], object]) -> float:
        return median_ms(fn, self.args.iters, self.args.warmup, self.device)

    def compiled(self, fn: Callable) -> Optional[Callable]:
        return None if self.args.no_compile else torch.compile(fn, dynamic=False)

    def row(
        self,
        name: str,
        moved: int,
        triton_fn: Callable[[], object],
        eager_fn: Optional[Callable[[], object]],
        compiled_fn: Optional[Callable[[], object]],
        numel: int,
    ) -> dict:
        entry: dict = {"kernel": name, "numel": numel, "bytes": moved}
        entry["triton_ms"] = self.time(triton_fn)
        entry["triton_gbs"] = moved / entry["triton_ms"] / 1e6
        entry["of_copy"] = entry["triton_gbs"] / self.copy_gbs
        if eager_fn is not None:
            entry["mismatches"] = mismatches(triton_fn(), eager_fn())
            entry["eager_ms"] = self.time(eager_fn)
        if compiled_fn is not None:
            try:
                entry["compile_ms"] = self.time(compiled_fn)
            except Exception as err:  # a reference torch.compile cannot handle is reported, not fatal
                entry["compile_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
        self.rows.append(entry)
        print(f"[kernels] {name}: {entry['triton_ms']:.3f} ms, {entry['triton_gbs']:.0f} GB/s", flush=True)
        return entry


def run(args: argparse.Namespace, dev: torch.device) -> dict:
    """Measure every row on ``dev`` (a CUDA device; CPU only for a dry run under the interpreter)."""
    dtype, block, T = DTYPES[args.dtype], args.block, "triton"
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(args.numel, generator=gen, device=dev).to(dtype)
    dst = torch.empty_like(x)
    copy_ms = median_ms(lambda: dst.copy_(x), args.iters, args.warmup, dev)
    copy_gbs = 2 * nbytes(x) / copy_ms / 1e6
    print(f"[kernels] device-to-device copy: {copy_gbs:.0f} GB/s", flush=True)
    bench = Bench(args, copy_gbs, dev)
    fusion = {}
    del dst
    for bits in args.bits:
        n = args.numel
        codes, scales = tk.quantize(x, bits, block, backend=T)
        bench.row(
            f"quantize INT{bits}", nbytes(x, codes, scales),
            lambda: tk.quantize(x, bits, block, nonfinite="propagate", backend=T),
            lambda: reference.quantize(x, bits, block), bench.compiled(lambda: reference.quantize(x, bits, block)), n,
        )  # fmt: skip
        bench.row(f"quantize INT{bits} + check", nbytes(x, codes, scales), lambda: tk.quantize(x, bits, block, backend=T), None, None, n)
        bench.row(
            f"dequantize INT{bits}", nbytes(x, codes, scales),
            lambda: tk.dequantize(codes, scales, n, bits, block, dtype=dtype, backend=T),
            lambda: reference.dequantize(codes, scales, n, bits, block, dtype),
            bench.compiled(lambda: reference.dequantize(codes, scales, n, bits, block, dtype)), n,
        )  # fmt: skip
        del codes, scales

        layout = QgzLayout(n, args.nodes, args.ranks_per_node, bits=bits, block=block)
        w, s = layout.world, layout.part_numel
        q = tk.reorder_quantize(x, layout, backend=T)
        fused = bench.row(
            f"reorder+quantize INT{bits}", nbytes(x, *q),
            lambda: tk.reorder_quantize(x, layout, nonfinite="propagate", backend=T),
            lambda: reference.reorder_quantize(x, layout), bench.compiled(lambda: reference.reorder_quantize(x, layout)), n,
        )  # fmt: skip

        def unfused() -> object:
            padded = x if w * s == n else torch.nn.functional.pad(x, (0, w * s - n))
            permuted = padded.view(args.nodes, args.ranks_per_node, s).transpose(0, 1).reshape(w, s)
            return tk.quantize(permuted, bits, block, nonfinite="propagate", backend=T)

        plain = bench.row(f"permute, then quantize INT{bits}", nbytes(x, *q), unfused, None, None, n)
        fusion[bits] = plain["triton_ms"] / fused["triton_ms"]
        del q

        # The reduce steps, sized so their code input holds n bytes.
        m = n * 8 // bits
        big = QgzLayout(m, args.nodes, args.ranks_per_node, bits=bits, block=block)
        k_intra, rows = args.ranks_per_node, args.nodes
        src = torch.randn(k_intra * rows * big.part_len, generator=gen, device=dev)
        ops = tk.quantize(src.view(k_intra * rows, big.part_len), bits, block, backend=T)
        codes3, scales3 = ops[0].view(k_intra, rows, -1), ops[1].view(k_intra, rows, -1)
        out = tk.dequantize_reduce_requantize(codes3, scales3, big, backend=T)
        bench.row(
            f"deq-reduce-requant INT{bits} (K={k_intra})", nbytes(codes3, scales3, *out),
            lambda: tk.dequantize_reduce_requantize(codes3, scales3, big, backend=T),
            lambda: reference.dequantize_reduce_requantize(codes3, scales3, big, 1.0),
            bench.compiled(lambda: reference.dequantize_reduce_requantize(codes3, scales3, big, 1.0)),
            k_intra * rows * big.part_len,
        )  # fmt: skip
        del src, ops, codes3, scales3, out
        last = QgzLayout(m * args.ranks_per_node, args.nodes, args.ranks_per_node, bits=bits, block=block)
        src = torch.randn(args.nodes * last.part_len, generator=gen, device=dev)
        ops = tk.quantize(src.view(args.nodes, last.part_len), bits, block, backend=T)
        mean = tk.dequantize_reduce(*ops, last, multiplier=1 / last.world, dtype=dtype, backend=T)
        bench.row(
            f"deq-reduce INT{bits} (K={args.nodes})", nbytes(*ops, mean),
            lambda: tk.dequantize_reduce(*ops, last, multiplier=1 / last.world, dtype=dtype, backend=T),
            lambda: reference.dequantize_reduce(ops[0][:, None], ops[1][:, None], last, 1 / last.world, dtype)[0],
            bench.compiled(lambda: reference.dequantize_reduce(ops[0][:, None], ops[1][:, None], last, 1 / last.world, dtype)),
            args.nodes * last.part_len,
        )  # fmt: skip
        del src, ops, mean
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return {"copy_gbs": copy_gbs, "rows": bench.rows, "fused_over_unfused": fusion}


def format_table(result: dict) -> str:
    lines = [
        f"device-to-device copy: {result['copy_gbs']:.0f} GB/s",
        "",
        "| kernel | elements | MB moved | Triton ms | Triton GB/s | of copy | eager ms | Triton vs eager "
        "| compile ms | Triton vs compile | mismatches |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        eager, comp, ms = r.get("eager_ms"), r.get("compile_ms"), r["triton_ms"]
        eager_cols = f"{eager:.3f} | {eager / ms:.1f}x" if eager else "- | -"
        comp_cols = f"{comp:.3f} | {comp / ms:.1f}x" if comp else f"{r.get('compile_error', '-')} | -"
        lines.append(
            f"| {r['kernel']} | {r['numel']:,} | {r['bytes'] / 1e6:.0f} | {ms:.3f} | {r['triton_gbs']:.0f} "
            f"| {100 * r['of_copy']:.0f}% | {eager_cols} | {comp_cols} | {r.get('mismatches', '-')} |"
        )
    lines.append("")
    for bits, ratio in result["fused_over_unfused"].items():
        verdict = "meets" if ratio >= FUSION_TARGET else "MISSES"
        lines.append(f"fused reorder+quantize INT{bits}: {ratio:.2f}x the unfused permute-then-quantize ({verdict} {FUSION_TARGET}x)")
    slow = [r["kernel"] for r in result["rows"] if r["numel"] >= 1 << 26 and r["of_copy"] < COPY_TARGET and "permute" not in r["kernel"]]
    lines.append(
        f"kernels below {COPY_TARGET:.0%} of copy bandwidth at >= 64M elements: {', '.join(slow) if slow else 'none'}"
    )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
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
