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

from ._common import KernelLaunch, kernel_view, kind, pack_int4, quantize_tile, store_f32_as, tile_rows, unpack_int4
from .layout import QMAX, code_cols, num_blocks


# As in quant_kernel: the block counts are left unspecialised, so a new shard size compiles
# nothing; so is the scales' stride between operands (a block count: it offsets only the one fp32
# scale each block loads, a scalar load either way). The sizes that bound or offset the code and
# value accesses keep their divisibility by 16 (the 16-byte vectors), and ``n_operands`` its value 1
# (plain dequantization, no loop).
@triton.jit(do_not_specialize=["operand_scales", "blocks_per_row", "total_blocks"])
def _reduce_kernel(
    codes_ptr, scales_ptr, out_ptr, out_scales_ptr,
    n_operands, operand_codes, operand_scales, row_len, code_row_stride, out_row_len, blocks_per_row,
    total_blocks, multiplier,
    OUT_KIND: tl.constexpr, BITS: tl.constexpr, QMAX: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    REQUANT: tl.constexpr,
):  # fmt: skip
    blk = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    blk_ok = blk < total_blocks
    row = blk // blocks_per_row
    start = (blk % blocks_per_row) * BLOCK
    pos = start[:, None] + tl.arange(0, BLOCK)[None, :]
    row_base = row.to(tl.int64)[:, None] * code_row_stride
    if BITS == 8:
        code_offs = row_base + pos
        code_mask = blk_ok[:, None] & (pos < row_len)
    else:
        byte = start[:, None] // 2 + tl.arange(0, BLOCK // 2)[None, :]
        code_offs = row_base + byte
        # Rows are contiguous (stride = bytes per row); a bound on the contiguous ``byte`` keeps
        # the loads and stores 16-byte vectors.
        code_mask = blk_ok[:, None] & (byte < code_row_stride)
    code_ptrs = codes_ptr + code_offs
    scale_ptrs = scales_ptr + blk
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
        tl.store(out_scales_ptr + blk, scale, mask=blk_ok)
        if BITS == 8:
            tl.store(out_ptr + code_offs, codes.to(tl.int8), mask=code_mask)
        else:
            tl.store(out_ptr + code_offs, pack_int4(codes, ROWS, BLOCK), mask=code_mask)
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
    """The launch that reduces contiguous ``codes`` ``[K, R, C]`` and ``scales`` ``[K, R, P]`` (rows of ``row_len``
    values, ``P = ceil(row_len / block)``) into ``out``.

    With ``out_scales`` given, ``out`` is codes ``[R, C]`` and ``out_scales`` fp32 ``[R, P]`` (the
    requantized ``multiplier * sum``); otherwise ``out`` is values ``[R, out_row_len]`` (fp32, fp16
    or bf16), the first ``out_row_len <= row_len`` values of each row. Call ``.run()`` on the
    result to launch it (ZeRO++ §3.3).

    Raises:
        ValueError: ``C`` is not ``code_cols(row_len, bits)`` (the kernel's masks assume it is).
    """
    operands, rows, cols = codes.shape
    if cols != code_cols(row_len, bits):  # the kernel's masks take the stride for the row's bytes
        raise ValueError(f"codes rows hold {cols} bytes; {row_len} values need {code_cols(row_len, bits)}")
    blocks_per_row = num_blocks(row_len, block)
    total_blocks = rows * blocks_per_row
    tile = tile_rows(total_blocks, block)
    requant = out_scales is not None
    return KernelLaunch(
        _reduce_kernel,
        triton.cdiv(total_blocks, tile),
        (
            codes, scales, out if requant else kernel_view(out), out_scales if requant else scales,
            operands, rows * cols, rows * blocks_per_row, row_len, cols, out_row_len, blocks_per_row,
            total_blocks, float(multiplier),
        ),
        dict(
            OUT_KIND=0 if requant else kind(out.dtype), BITS=bits, QMAX=QMAX[bits], BLOCK=block, ROWS=tile,
            REQUANT=requant, num_warps=4, enable_fp_fusion=False,
        ),
    )  # fmt: skip
