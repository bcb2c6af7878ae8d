"""Speed of the quantization kernels' torch references on the CPU, next to the CPU's copy
bandwidth and, optionally, a previous revision of the references, in one run.

On CPU tensors the public ``triton_kernels`` API runs these references (Triton needs a GPU), so
they set the cost of qwZ and qgZ for CPU training. Each row reports nanoseconds per input element
and effective GB/s ((bytes in + bytes out) / median time) as a share of ``dst.copy_(src)``'s.
With ``--baseline REV`` the same rows run on ``triton_kernels/reference.py`` as it was at git
revision ``REV``, and the speed-up is printed.

    python examples/benchmarks/reference_cpu.py [--numel 4194304] [--baseline 95ecc94] [--iters 7]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))

from triton_kernels import QgzLayout, reference  # noqa: E402


def load_revision(rev: str) -> ModuleType:
    """``triton_kernels/reference.py`` at git revision ``rev``, as a module of the package."""
    shown = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:triton_kernels/reference.py"],
                           capture_output=True, text=True)
    if shown.returncode != 0:
        raise SystemExit(f"--baseline {rev}: git cannot show triton_kernels/reference.py at that revision "
                         f"({shown.stderr.strip()}); give a commit of this repository that has it.")
    source = shown.stdout
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "reference.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(f"triton_kernels.reference_{rev}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def median_s(fn: Callable[[], object], iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def rows(ref: ModuleType, n: int) -> list[tuple[str, int, Callable[[], object]]]:
    """``(name, bytes moved, call)`` per row, for reference module ``ref``."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen)
    xb = x.bfloat16()
    out = []
    for bits in (8, 4):
        codes, scales = reference.quantize(x, bits, 256)
        layout = QgzLayout(n, nodes=2, ranks_per_node=2, bits=bits, block=256)
        rc, rs = reference.reorder_quantize(x, layout)
        k, ks = rc.view(2, 2, -1), rs.view(2, 2, -1)
        out += [
            (f"quantize fp32 INT{bits}", nbytes(x, codes, scales), lambda b=bits: ref.quantize(x, b, 256)),
            (f"quantize bf16 INT{bits}", nbytes(xb, codes, scales), lambda b=bits: ref.quantize(xb, b, 256)),
            (f"dequantize INT{bits} -> bf16", nbytes(codes, scales, xb),
             lambda c=codes, s=scales, b=bits: ref.dequantize(c, s, n, b, 256, torch.bfloat16)),
            (f"reorder+quantize fp32 INT{bits} (2x2)", nbytes(x, rc, rs), lambda l=layout: ref.reorder_quantize(x, l)),
            (f"deq-reduce-requant INT{bits} (K=2)", nbytes(k, ks, k[0], ks[0]),
             lambda k=k, ks=ks, l=layout: ref.dequantize_reduce_requantize(k, ks, l, 1.0)),
            (f"deq-reduce INT{bits} -> fp32 (K=2)", nbytes(k, ks) + 4 * k.shape[1] * layout.part_numel,
             lambda k=k, ks=ks, l=layout: ref.dequantize_reduce(k, ks, l, 0.25, torch.float32)),
        ]  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=1 << 22, help="input elements per row (default 2**22)")
    parser.add_argument("--baseline", help="git revision whose references run side by side")
    parser.add_argument("--iters", type=int, default=7, help="timed calls per row (median reported)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "reference_cpu.json")
    args = parser.parse_args(argv)
    n = args.numel
    src = torch.randn(n)
    dst = torch.empty_like(src)
    copy_gbs = 2 * nbytes(src) / median_s(lambda: dst.copy_(src), args.iters) / 1e9
    print(f"CPU copy: {copy_gbs:.1f} GB/s ({torch.get_num_threads()} threads), {n:,} elements per row\n")
    baseline = rows(load_revision(args.baseline), n) if args.baseline else None
    header = "| row | ns/element | GB/s | of copy |" + (f" {args.baseline} ns/element | speed-up |" if baseline else "")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    results = []
    for i, (name, moved, call) in enumerate(rows(reference, n)):
        t = median_s(call, args.iters)
        entry = {"row": name, "ns_per_element": t / n * 1e9, "gbs": moved / t / 1e9, "of_copy": moved / t / 1e9 / copy_gbs}
        line = f"| {name} | {entry['ns_per_element']:.2f} | {entry['gbs']:.2f} | {100 * entry['of_copy']:.0f}% |"
        if baseline:
            tb = median_s(baseline[i][2], args.iters)
            entry["baseline_ns_per_element"] = tb / n * 1e9
            entry["speedup"] = tb / t
            line += f" {entry['baseline_ns_per_element']:.2f} | {entry['speedup']:.2f}x |"
        print(line, flush=True)
        results.append(entry)
    record = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "threads": torch.get_num_threads(), "torch": torch.__version__},
        "copy_gbs": copy_gbs, "baseline": args.baseline, "rows": results,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
