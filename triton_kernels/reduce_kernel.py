"""Triton kernel: dequantize ``K`` operands of one blockwise layout, sum them in fp32, multiply,
then either write values (dequantize-reduce) or requantize (dequantize-reduce-requantize).

With ``K = 1`` and multiplier 1 it is plain dequantization. For qgZ (ZeRO++ §3.3) it is the step
between the two all-to-alls (``K`` = ranks per node, requantized) and the last step (``K`` = nodes,
values). Each code and scale is read once; the sum never leaves registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (KernelLaunch, kernel_view, kind, pack_int4, quantize_tile, rows_contiguous, store_f32_as,
                      tile_rows, unpack_int4)
from .layout import QMAX, code_cols, num_blocks


# As in quant_kernel: the block counts are left unspecialised, so a new shard size compiles
# nothing; so are the scales' strides between operands and rows (block counts or packed rows'
# lengths in fp32 words: they offset only the one fp32 scale each block loads or stores, a scalar
# access either way). The sizes that bound or offset the code and value accesses keep their
# divisibility by 16 (the 16-byte vectors), and ``n_operands`` its value 1 (plain dequantization,
# no loop).
@triton.jit(do_not_specialize=["operand_scales", "scale_row_stride", "out_scale_row_stride", "blocks_per_row",
                               "total_blocks"])
def _reduce_kernel(
    codes_ptr, scales_ptr, out_ptr, out_scales_ptr,
    n_operands, operand_codes, operand_scales, row_len, code_row_bytes, code_row_stride, scale_row_stride,
    out_row_len, out_code_row_stride, out_scale_row_stride, blocks_per_row, total_blocks, multiplier,
    OUT_KIND: tl.constexpr, BITS: tl.constexpr, QMAX: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    REQUANT: tl.constexpr,
):  # fmt: skip
    blk = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    blk_ok = blk < total_blocks
    row = blk // blocks_per_row
    in_row = blk % blocks_per_row
    start = in_row * BLOCK
    pos = start[:, None] + tl.arange(0, BLOCK)[None, :]
    row64 = row.to(tl.int64)
    if BITS == 8:
        in_row_offs = pos
        code_mask = blk_ok[:, None] & (pos < row_len)
    else:
        in_row_offs = start[:, None] // 2 + tl.arange(0, BLOCK // 2)[None, :]
        # A bound on the contiguous byte index keeps the loads and stores 16-byte vectors.
        code_mask = blk_ok[:, None] & (in_row_offs < code_row_bytes)
    code_ptrs = codes_ptr + row64[:, None] * code_row_stride + in_row_offs
    scale_ptrs = scales_ptr + row64 * scale_row_stride + in_row
    acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for _ in range(0, n_operands):
        s = tl.load(scale_ptrs, mask=blk_ok, other=0.0)
        raw = tl.load(code_ptrs, mask=code_mask, other=0)
        if BITS == 8:
            c = raw.to(tl.int32)
        else:
            c = unpack_int4(raw, ROWS, BLOCK)
        acc += c.to(tl.float32) * s[:, None]
        code_ptrs += operand_codes
        scale_ptrs += operand_scales
    acc = acc * multiplier
    if REQUANT:
        codes, scale = quantize_tile(acc, QMAX)
        tl.store(out_scales_ptr + row64 * out_scale_row_stride + in_row, scale, mask=blk_ok)
        out_code_ptrs = out_ptr + row64[:, None] * out_code_row_stride + in_row_offs
        if BITS == 8:
            tl.store(out_code_ptrs, codes.to(tl.int8), mask=code_mask)
        else:
            tl.store(out_code_ptrs, pack_int4(codes, ROWS, BLOCK), mask=code_mask)
    else:
        out_offs = row.to(tl.int64)[:, None] * out_row_len + pos
        store_f32_as(out_ptr, out_offs, acc, blk_ok[:, None] & (pos < out_row_len), OUT_KIND)


def reduce_launch(
    codes: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
    out_scales: torch.Tensor | None,
    *,
    row_len: int,
    out_row_len: int,
    bits: int,
    block: int,
    multiplier: float,
) -> KernelLaunch:
    """The launch that reduces ``codes`` ``[K, R, C]`` and ``scales`` ``[K, R, P]`` (rows of ``row_len``
    values, ``P = ceil(row_len / block)``) into ``out``. Rows are contiguous; the operands and rows
    may lie at any strides (views of a packed buffer, ``PackedRows``, included).

    With ``out_scales`` given, ``out`` is codes ``[R, C]`` and ``out_scales`` fp32 ``[R, P]`` (the
    requantized ``multiplier * sum``; contiguous rows at any stride); otherwise ``out`` is values
    ``[R, out_row_len]`` (fp32, fp16 or bf16, contiguous), the first ``out_row_len <= row_len``
    values of each row. Call ``.run()`` on the result to launch it (ZeRO++ §3.3).

    Raises:
        ValueError: ``C`` is not ``code_cols(row_len, bits)``, or a tensor's rows are not contiguous.
    """
    operands, rows, cols = codes.shape
    if cols != code_cols(row_len, bits):  # the kernel's masks take the row's bytes
        raise ValueError(f"codes rows hold {cols} bytes; {row_len} values need {code_cols(row_len, bits)}")
    for tensor, name in ((codes, "codes"), (scales, "scales"), (out, "out"), (out_scales, "out_scales")):
        if tensor is not None:
            rows_contiguous(tensor, name)
    out_strides = (out.stride(0), out_scales.stride(0)) if out_scales is not None else (out_row_len, 0)
    blocks_per_row = num_blocks(row_len, block)
    total_blocks = rows * blocks_per_row
    tile = tile_rows(total_blocks, block)
    requant = out_scales is not None
    return KernelLaunch(
        _reduce_kernel,
        triton.cdiv(total_blocks, tile),
        (
            codes, scales, out if requant else kernel_view(out), out_scales if requant else scales,
            operands, codes.stride(0), scales.stride(0), row_len, cols, codes.stride(1), scales.stride(1),
            out_row_len, *out_strides, blocks_per_row, total_blocks, float(multiplier),
        ),
        dict(
            OUT_KIND=0 if requant else kind(out.dtype), BITS=bits, QMAX=QMAX[bits], BLOCK=block, ROWS=tile,
            REQUANT=requant, num_warps=4, enable_fp_fusion=False,
        ),
    )  # fmt: skip
