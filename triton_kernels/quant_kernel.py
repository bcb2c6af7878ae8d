"""Triton kernel: blockwise quantization, optionally reading its rows in qgZ's slot order.

One kernel serves plain quantization (rows in order) and the fused reorder + quantize of qgZ
(ZeRO++ §3.3): output row ``j`` is quantized from input row ``rank_of_slot(j)``, so the permuted
copy of the gradient is never written; every input element is read once and every code and scale
written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import KernelLaunch, kernel_view, kind, load_f32, pack_int4, quantize_tile, rows_contiguous, tile_rows
from .layout import QMAX, code_cols, num_blocks


# Block counts change with every shard size and no access depends on their divisibility: left
# unspecialised, so one compiled kernel serves every size (Triton would otherwise compile again
# whenever a count is 1 or a multiple of 16 or neither); so is the scales' row stride (a block
# count, or a packed row's length in fp32 words: it offsets only the one scale each block stores).
# The sizes that bound or offset the code accesses stay specialised: their divisibility by 16 is
# what proves the 16-byte vector loads and stores in bounds (``do_not_specialize_on_alignment``
# would drop just that); a packed row (``PackedRows``) is a multiple of 16 bytes for that reason.
# ``nodes`` and ``ranks_per_node`` are fixed by the topology, and 1 spares the plain path the slot
# arithmetic.
@triton.jit(do_not_specialize=["scale_row_stride", "blocks_per_row", "total_blocks"])
def _quantize_kernel(
    x_ptr, codes_ptr, scales_ptr,
    n_valid, in_row_len, out_row_len, code_row_bytes, code_row_stride, scale_row_stride, blocks_per_row,
    total_blocks, nodes, ranks_per_node,
    IN_KIND: tl.constexpr, BITS: tl.constexpr, QMAX: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    blk = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    blk_ok = blk < total_blocks
    slot = blk // blocks_per_row
    in_row = blk % blocks_per_row
    start = in_row * BLOCK
    src_row = (slot % nodes) * ranks_per_node + slot // nodes
    pos = start[:, None] + tl.arange(0, BLOCK)[None, :]
    src = src_row.to(tl.int64)[:, None] * in_row_len + pos
    # Positions past the source row or past the tensor read as zeros: the padding of a partition
    # to whole blocks, and the tail block of a plain row.
    x = load_f32(x_ptr, src, blk_ok[:, None] & (pos < in_row_len) & (src < n_valid), IN_KIND)
    codes, scale = quantize_tile(x, QMAX)
    tl.store(scales_ptr + slot.to(tl.int64) * scale_row_stride + in_row, scale, mask=blk_ok)
    row_base = slot.to(tl.int64)[:, None] * code_row_stride
    if BITS == 8:
        tl.store(codes_ptr + row_base + pos, codes.to(tl.int8), mask=blk_ok[:, None] & (pos < out_row_len))
    else:
        # Bounding the contiguous ``byte`` (not ``2 * byte``) lets the compiler prove whole
        # 16-byte runs in bounds and store them as vectors.
        byte = start[:, None] // 2 + tl.arange(0, BLOCK // 2)[None, :]
        tl.store(
            codes_ptr + row_base + byte, pack_int4(codes, ROWS, BLOCK), mask=blk_ok[:, None] & (byte < code_row_bytes)
        )


def quantize_launch(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    in_row_len: int,
    out_row_len: int,
    nodes: int,
    ranks_per_node: int,
    bits: int,
    block: int,
) -> KernelLaunch:
    """The launch that quantizes ``x`` (contiguous, fp32/fp16/bf16) into preallocated ``codes`` ``[R, C]`` and
    ``scales`` ``[R, ceil(out_row_len / block)]``, ``R = nodes * ranks_per_node``, each with
    contiguous rows and any row stride (views of a packed buffer, ``PackedRows``, included).

    Output row ``j`` holds input elements ``[r * in_row_len, (r + 1) * in_row_len)`` with
    ``r = (j % nodes) * ranks_per_node + j // nodes`` (identity when ``nodes == 1``), zero-padded
    to ``out_row_len`` values. ``C`` is ``out_row_len`` (INT8) or ``ceil(out_row_len / 2)`` (INT4).
    Call ``.run()`` on the result to launch it (ZeRO++ §3.1; with ``nodes > 1`` the fused reorder
    of §3.3).

    Raises:
        ValueError: ``codes`` rows are not ``C`` bytes, or rows of ``codes`` or ``scales`` are not
            contiguous.
    """
    rows = nodes * ranks_per_node
    if codes.shape[-1] != code_cols(out_row_len, bits):
        raise ValueError(f"codes rows hold {codes.shape[-1]} bytes; {out_row_len} values need {code_cols(out_row_len, bits)}")
    rows_contiguous(codes, "codes")
    rows_contiguous(scales, "scales")
    blocks_per_row = num_blocks(out_row_len, block)
    total_blocks = rows * blocks_per_row
    tile = tile_rows(total_blocks, block)
    return KernelLaunch(
        _quantize_kernel,
        triton.cdiv(total_blocks, tile),
        (
            kernel_view(x), codes, scales,
            x.numel(), in_row_len, out_row_len, codes.shape[-1], codes.stride(0), scales.stride(0), blocks_per_row,
            total_blocks, nodes, ranks_per_node,
        ),
        dict(
            IN_KIND=kind(x.dtype), BITS=bits, QMAX=QMAX[bits], BLOCK=block, ROWS=tile,
            num_warps=4, enable_fp_fusion=False,
        ),
    )  # fmt: skip
