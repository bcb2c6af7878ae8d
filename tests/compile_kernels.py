"""Compile every launch configuration of the Triton kernels for NVIDIA GPU targets, on a machine
with or without a GPU, and report what the compiler made of each.

The CPU tests run the kernels in Triton's interpreter, which accepts some programs the GPU
compiler rejects and says nothing about registers or memory access width. This script builds
the same :class:`triton_kernels._common.KernelLaunch` the public API launches, specializes its
arguments exactly as a launch would (Triton's own binder: 16-byte-aligned pointers and sizes that
are multiples of 16 get ``tt.divisibility``), and runs Triton's full pipeline down to a cubin
with the ``ptxas`` that ships in the Triton wheel. For each (configuration, sm_XX) it prints one
JSON line:

    {"name": ..., "arch": 90, "regs": 40, "local": 0, "stack": 0, "shared": 1024,
     "global_ops": {"ld.global.v4.b32": 2, ...}, "global_ops_specialized": {...}, "cache_hit": false}

``local``/``stack`` are bytes per thread of local memory (register spills); ``global_ops``
counts the PTX global loads and stores by width; ``global_ops_specialized`` counts them in the
same kernel compiled with every integer argument specialised (the kernels leave the sizes that
change with every shard unspecialised, ``do_not_specialize``, so one compiled kernel serves them
all: the two must move data alike); ``cache_hit`` says whether Triton found the kernel in its
on-disk cache (``TRITON_CACHE_DIR``) instead of compiling it. ``--keys`` prints instead, for each
kernel and format at several sizes, the key under which a launch caches its compiled kernel.
Run it without ``TRITON_INTERPRET`` set:

    python tests/compile_kernels.py [--arch 90 --arch 80] [--only NAME] [--keys]

Relies on Triton internals (``create_function_from_signature``, ``compute_cache_key`` and
``JITFunction._pack_args``) so the specialization is the launch's, not a copy of its rules.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ALIGNED = 1 << 16  # a multiple of every block size: whole blocks, 16-divisible sizes
RAGGED = 3 * 4096 + 1001  # odd: a tail block and a half-filled INT4 byte


def quantize(n: int, dtype: str, bits: int, block: int):
    """The launch of ``triton_kernels.quantize`` on ``n`` values of ``dtype``."""
    from triton_kernels import code_cols, code_dtype, num_blocks
    from triton_kernels.quant_kernel import quantize_launch

    x = torch.zeros(n, dtype=DTYPES[dtype])
    codes = torch.empty(1, code_cols(n, bits), dtype=code_dtype(bits))
    scales = torch.empty(1, num_blocks(n, block))
    return quantize_launch(
        x, codes, scales, in_row_len=n, out_row_len=n, nodes=1, ranks_per_node=1, bits=bits, block=block
    )


def reorder(n: int, dtype: str, bits: int, block: int):
    """The launch of ``triton_kernels.reorder_quantize`` of an ``n``-value gradient, 2 nodes of 4 ranks."""
    from triton_kernels import QgzLayout, code_dtype
    from triton_kernels.quant_kernel import quantize_launch

    layout = QgzLayout(n, nodes=2, ranks_per_node=4, bits=bits, block=block)
    codes = torch.empty(layout.world, layout.code_cols, dtype=code_dtype(bits))
    scales = torch.empty(layout.world, layout.blocks_per_part)
    return quantize_launch(
        torch.zeros(n, dtype=DTYPES[dtype]), codes, scales, in_row_len=layout.part_numel,
        out_row_len=layout.part_len, nodes=2, ranks_per_node=4, bits=bits, block=block,
    )  # fmt: skip


def reduce(n: int, dtype: str | None, bits: int, block: int, operands: int, rows: int):
    """The launch that reduces ``operands`` x ``rows`` rows of ``n`` values into values of ``dtype``
    (``None``: requantized codes)."""
    from triton_kernels import code_cols, code_dtype, num_blocks
    from triton_kernels.reduce_kernel import reduce_launch

    codes = torch.empty(operands, rows, code_cols(n, bits), dtype=code_dtype(bits))
    scales = torch.empty(operands, rows, num_blocks(n, block))
    if dtype is None:  # requantize
        out, out_scales = torch.empty(rows, codes.shape[-1], dtype=codes.dtype), torch.empty(scales.shape[1:])
    else:
        out, out_scales = torch.empty(rows, n, dtype=DTYPES[dtype]), None
    return reduce_launch(
        codes, scales, out, out_scales, row_len=n, out_row_len=n, bits=bits, block=block, multiplier=0.25
    )


def packed_quantize(n: int, dtype: str, bits: int, block: int):
    """The launch of ``triton_kernels.quantize`` of ``n`` values into a packed row (qwZ's gather)."""
    from triton_kernels import PackedRows
    from triton_kernels.quant_kernel import quantize_launch

    rows = PackedRows.of(n, bits, block)
    codes, scales = rows.views(rows.empty(1))
    return quantize_launch(
        torch.zeros(n, dtype=DTYPES[dtype]), codes, scales, in_row_len=n, out_row_len=n, nodes=1, ranks_per_node=1,
        bits=bits, block=block,
    )  # fmt: skip


def packed_reduce(n: int, dtype: str | None, bits: int, block: int, operands: int, rows: int):
    """As :func:`reduce`, reading (and, requantizing, writing) packed rows: qwZ's gathered rows
    (1 operand) and qgZ's legs."""
    from triton_kernels import PackedRows
    from triton_kernels.reduce_kernel import reduce_launch

    packed = PackedRows.of(n, bits, block)
    codes, scales = packed.views(packed.empty(operands * rows).view(operands, rows, -1))
    if dtype is None:
        out, out_scales = packed.views(packed.empty(rows))
    else:
        out, out_scales = torch.empty(rows, n, dtype=DTYPES[dtype]), None
    return reduce_launch(
        codes, scales, out, out_scales, row_len=n, out_row_len=n, bits=bits, block=block, multiplier=0.25
    )


def launches() -> Iterator[tuple[str, object]]:
    """``(name, KernelLaunch)`` for each configuration the public API can launch: every element
    kind and bit width at block 256, the smallest and largest blocks, qgZ's reorder and both
    reduce steps, ragged sizes, and the launches that read and write packed rows."""
    for bits in (8, 4):
        for dtype in DTYPES:
            yield f"quantize {dtype} INT{bits}", quantize(ALIGNED, dtype, bits, 256)
            yield f"dequantize {dtype} INT{bits}", reduce(ALIGNED, dtype, bits, 256, 1, 1)
        for block in (64, 4096):
            yield f"quantize fp32 INT{bits} block {block}", quantize(ALIGNED, "fp32", bits, block)
        yield f"reorder+quantize bf16 INT{bits}", reorder(8 * ALIGNED, "bf16", bits, 256)
        yield f"deq-reduce-requant INT{bits}", reduce(ALIGNED, None, bits, 256, 4, 2)
        yield f"deq-reduce bf16 INT{bits}", reduce(ALIGNED, "bf16", bits, 256, 2, 1)
        yield f"quantize bf16 INT{bits} ragged", quantize(RAGGED, "bf16", bits, 256)
        yield f"reorder+quantize fp32 INT{bits} ragged", reorder(8 * RAGGED + 5, "fp32", bits, 256)
        yield f"packed: quantize INT{bits} bf16", packed_quantize(ALIGNED, "bf16", bits, 256)
        yield f"packed: dequantize INT{bits} bf16", packed_reduce(ALIGNED, "bf16", bits, 256, 1, 8)
        yield f"packed: deq-reduce-requant INT{bits}", packed_reduce(ALIGNED, None, bits, 256, 4, 2)
        yield f"packed: deq-reduce INT{bits} bf16", packed_reduce(ALIGNED, "bf16", bits, 256, 2, 1)


#: Sizes (values per row or per shard) whose launches should share one compiled kernel: whole
#: 16-value runs (every shard the engine makes, ``SHARD_ALIGN``), with 1, 16, 32, 52 and 4096 blocks
#: of 256 per row (a block count that is 1 or a multiple of 16 is what Triton would specialise on).
WHOLE_RUNS = (256, 4096, 8192, 13312, 1 << 20)
#: Sizes that are not whole 16-value runs, nor are their INT4 byte counts (``n = 1 mod 32``), with 1,
#: 16, 17 and 49 blocks per row: they share the other kernel (narrower accesses).
ODD = (33, 4065, 4097, 12289)


def size_families() -> Iterator[tuple[str, int, object]]:
    """``(family, n, KernelLaunch)``: each launch kind of the public API at every size of
    :data:`WHOLE_RUNS` and :data:`ODD`, one family per kernel and format."""
    for n in WHOLE_RUNS + ODD:
        for bits in (8, 4):
            yield f"quantize fp32 INT{bits}", n, quantize(n, "fp32", bits, 256)
            yield f"quantize bf16 INT{bits}", n, quantize(n, "bf16", bits, 256)
            yield f"dequantize bf16 INT{bits}", n, reduce(n, "bf16", bits, 256, 1, 8)
            yield f"reorder+quantize bf16 INT{bits}", n, reorder(8 * n, "bf16", bits, 256)
            yield f"deq-reduce-requant INT{bits}", n, reduce(n, None, bits, 256, 4, 2)
            yield f"deq-reduce fp32 INT{bits}", n, reduce(n, "fp32", bits, 256, 2, 1)
            yield f"packed: quantize INT{bits} bf16", n, packed_quantize(n, "bf16", bits, 256)
            yield f"packed: dequantize INT{bits} bf16", n, packed_reduce(n, "bf16", bits, 256, 1, 8)
            yield f"packed: deq-reduce-requant INT{bits}", n, packed_reduce(n, None, bits, 256, 4, 2)


def _bind(kernel, launch, backend):
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    return binder(*launch.args, **launch.options)


def specialization_key(launch, arch: int) -> str:
    """The key under which Triton's launcher caches the kernel compiled for ``launch`` on
    ``sm_<arch>`` (what it compiles once per process, and finds on disk in later ones): launches
    with equal keys run one compiled kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import compute_cache_key

    _, specialization, options = _bind(launch.kernel, launch, make_backend(GPUTarget("cuda", arch, 32)))
    return compute_cache_key({}, specialization, options)


def compile_launch(launch, arch: int, specialize_all: bool = False):
    """Compile ``launch`` for ``sm_<arch>`` down to a cubin; returns Triton's ``CompiledKernel``.
    ``specialize_all``: as if the kernel specialised every integer argument (no
    ``do_not_specialize``), the reference its accesses are compared with.

    Raises whatever Triton's compiler raises for a program it cannot compile.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    try:
        from triton.runtime.jit import create_function_from_signature
    except ImportError as err:
        raise RuntimeError(
            f"triton {triton.__version__} lacks triton.runtime.jit.create_function_from_signature, the launch "
            "binder this script specializes arguments with (written against triton 3.9): adapt compile_launch()"
        ) from err

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kernel = triton.runtime.jit.JITFunction(launch.kernel.fn) if specialize_all else launch.kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.options)
    options, signature, constexprs, attrs = kernel._pack_args(backend, launch.options, bound, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers, local, stack and shared bytes of the cubin's one function, from ``cuobjdump``."""
    import triton.backends.nvidia

    tool = Path(triton.backends.nvidia.__file__).parent / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        text = subprocess.run(
            [str(tool), "--dump-resource-usage", str(path)], check=True, capture_output=True, text=True
        ).stdout
    fields = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {"regs": int(fields["REG"]), "stack": int(fields["STACK"]), "shared": int(fields["SHARED"]),
            "local": int(fields["LOCAL"])}  # fmt: skip


def global_ops(compiled) -> dict[str, int]:
    """The PTX global loads and stores of a compiled kernel, counted by width."""
    return dict(collections.Counter(re.findall(r"\b(?:ld|st)\.global[.\w]*", compiled.asm["ptx"])))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, action="append", help="compute capability x10 (default: 90 and 80)")
    parser.add_argument("--keys", action="store_true",
                        help="print the specialization key of each launch of size_families() instead of compiling")
    parser.add_argument("--only", help="compile only the configurations whose name contains this")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    import triton

    if args.keys:
        for family, n, launch in size_families():
            for arch in args.arch or (90, 80):
                print(json.dumps({"family": family, "n": n, "arch": arch, "key": specialization_key(launch, arch)}))
        return 0
    hits: list[bool] = []
    triton.knobs.compilation.listener = lambda *, cache_hit, **_: hits.append(cache_hit)
    for name, launch in launches():
        if args.only and args.only not in name:
            continue
        for arch in args.arch or (90, 80):
            hits.clear()
            compiled = compile_launch(launch, arch)
            cache_hit = all(hits)  # found on disk (TRITON_CACHE_DIR), as a launch would
            reference = compile_launch(launch, arch, specialize_all=True)
            record = {"name": name, "arch": arch, **resource_usage(compiled.asm["cubin"]),
                      "global_ops": global_ops(compiled), "global_ops_specialized": global_ops(reference),
                      "cache_hit": cache_hit}
            print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
