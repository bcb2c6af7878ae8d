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
     "global_ops": {"ld.global.v4.b32": 2, ...}}

``local``/``stack`` are bytes per thread of local memory (register spills); ``global_ops``
counts the PTX global loads and stores by width. Run it without ``TRITON_INTERPRET`` set:

    python tests/compile_kernels.py [--arch 90 --arch 80]

Relies on two Triton internals (``create_function_from_signature`` and
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


def launches() -> Iterator[tuple[str, object]]:
    """``(name, KernelLaunch)`` for each configuration the public API can launch: every element
    kind and bit width at block 256, the smallest and largest blocks, qgZ's reorder and both
    reduce steps, and ragged sizes."""
    from triton_kernels import QgzLayout, code_cols, code_dtype, num_blocks
    from triton_kernels.quant_kernel import quantize_launch
    from triton_kernels.reduce_kernel import reduce_launch

    def quantize(n: int, dtype: str, bits: int, block: int):
        x = torch.zeros(n, dtype=DTYPES[dtype])
        codes = torch.empty(1, code_cols(n, bits), dtype=code_dtype(bits))
        scales = torch.empty(1, num_blocks(n, block))
        return quantize_launch(
            x, codes, scales, in_row_len=n, out_row_len=n, nodes=1, ranks_per_node=1, bits=bits, block=block
        )

    def reorder(n: int, dtype: str, bits: int, block: int):
        layout = QgzLayout(n, nodes=2, ranks_per_node=4, bits=bits, block=block)
        codes = torch.empty(layout.world, layout.code_cols, dtype=code_dtype(bits))
        scales = torch.empty(layout.world, layout.blocks_per_part)
        return quantize_launch(
            torch.zeros(n, dtype=DTYPES[dtype]), codes, scales, in_row_len=layout.part_numel,
            out_row_len=layout.part_len, nodes=2, ranks_per_node=4, bits=bits, block=block,
        )  # fmt: skip

    def reduce(n: int, dtype: str | None, bits: int, block: int, operands: int, rows: int):
        codes = torch.empty(operands, rows, code_cols(n, bits), dtype=code_dtype(bits))
        scales = torch.empty(operands, rows, num_blocks(n, block))
        if dtype is None:  # requantize
            out, out_scales = torch.empty(rows, codes.shape[-1], dtype=codes.dtype), torch.empty(scales.shape[1:])
        else:
            out, out_scales = torch.empty(rows, n, dtype=DTYPES[dtype]), None
        return reduce_launch(
            codes, scales, out, out_scales, row_len=n, out_row_len=n, bits=bits, block=block, multiplier=0.25
        )

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


def compile_launch(launch, arch: int):
    """Compile ``launch`` for ``sm_<arch>`` down to a cubin; returns Triton's ``CompiledKernel``.

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
    kernel = launch.kernel
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, action="append", help="compute capability x10 (default: 90 and 80)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    for name, launch in launches():
        for arch in args.arch or (90, 80):
            compiled = compile_launch(launch, arch)
            ops = collections.Counter(re.findall(r"\b(?:ld|st)\.global[.\w]*", compiled.asm["ptx"]))
            record = {"name": name, "arch": arch, **resource_usage(compiled.asm["cubin"]), "global_ops": dict(ops)}
            print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
