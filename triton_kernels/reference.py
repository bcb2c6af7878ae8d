"""Torch references: the kernels' semantics written as plain tensor operations.

These run on any device, serve the public API for CPU tensors, and are the oracle the Triton
kernels are tested against. They share no code with the kernels, only the sizes in
:mod:`triton_kernels.layout`. Arguments are assumed valid (the public API checks them).

The rules both paths obey, per block of a row (ZeRO++ §3.1, arXiv:2306.10209):

- ``absmax`` = largest ``|x|`` over the block's finite values, in fp32.
- ``scale = absmax / qmax`` (qmax 127 or 7; IEEE fp32 division) and
  ``code = round_half_even(x * (qmax / absmax))`` clamped to ``[-qmax, qmax]``; the reciprocal is
  one fp32 division per block, so both paths multiply by the same number.
- A block whose ``absmax < qmax * 2**-126`` (zero, or so small its scale would be subnormal) has
  scale 0 and all codes 0: it dequantizes to exact zeros, never NaN.
- A block holding a NaN or an infinity has scale NaN and codes 0, so it dequantizes to NaN and the
  problem stays visible downstream (e.g. to a loss scaler).
- Dequantization is ``code * scale`` in fp32, then rounded to nearest even into the output dtype.
- Reductions accumulate ``sum_k code_k * scale_k`` operand by operand in fp32, then multiply by
  ``multiplier``.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from .layout import QMAX, QgzLayout, code_cols, num_blocks

# Below this absmax the scale absmax/qmax would be subnormal; such blocks are stored as zeros.
_TINY = 2.0**-126
if sys.byteorder != "little":
    # INT4 packing reads a pair of int8 codes as one int16 whose low byte is the first code.
    raise ImportError("triton_kernels' references assume a little-endian host (x86-64, AArch64, RISC-V)")


def quantize_rows(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``x`` ``[R, n]`` (any float dtype) on its own.

    Returns:
        ``codes`` ``[R, code_cols(n, bits)]`` (int8, or uint8 packed pairs for INT4) and
        ``scales`` fp32 ``[R, ceil(n / block)]``.
    """
    rows, n = x.shape
    nb = num_blocks(n, block)
    qmax = float(QMAX[bits])
    xf = x.float()
    if nb * block != n:
        xf = F.pad(xf, (0, nb * block - n))
    xb = xf.reshape(rows, nb, block)
    # The largest |x| per block as max(max x, -min x), without materialising |x| (two reductions
    # that vectorise; linalg.vector_norm(ord=inf) is 4-7x slower on CPU). A NaN or an infinity
    # makes it non-finite, and only then are the non-finite values masked out (the rare path).
    absmax = torch.maximum(xb.amax(dim=2), xb.amin(dim=2).neg_())
    bad = ~torch.isfinite(absmax)
    if bad.any():
        xb = torch.where(torch.isfinite(xb), xb, torch.zeros((), dtype=torch.float32, device=x.device))
        absmax = xb.abs().amax(dim=2)
    live = absmax >= qmax * _TINY
    # Tensor / tensor throughout: torch evaluates `float / tensor` (and on CUDA `tensor / float`)
    # as a multiplication by a reciprocal, which rounds differently from the kernel's division.
    qmax_t = torch.full_like(absmax, qmax)
    inv = torch.where(live & ~bad, qmax_t / torch.where(live, absmax, qmax_t), torch.zeros_like(absmax))
    scales = torch.where(live, absmax / qmax_t, torch.zeros_like(absmax))
    scales = torch.where(bad, torch.full_like(scales, float("nan")), scales)
    scaled = xb * inv.unsqueeze(2)
    codes = scaled.round_().clamp_(-qmax, qmax).to(torch.int8).view(rows, nb * block)
    if bits == 4:
        codes = pack_int4(codes)
    return codes[:, : code_cols(n, bits)].contiguous(), scales


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, numel: int, bits: int, block: int) -> torch.Tensor:
    """Inverse of :func:`quantize_rows`: ``[R, C]`` codes and ``[R, P]`` scales -> fp32 ``[R, numel]``."""
    values = unpack_int4(codes) if bits == 4 else codes
    out = values[:, :numel].to(torch.float32)
    whole = numel // block
    # Each block times its scale, in place: whole blocks as a [R, whole, block] view, then the tail.
    out[:, : whole * block].unflatten(1, (whole, block)).mul_(scales[:, :whole].unsqueeze(2))
    if whole * block < numel:
        out[:, whole * block :].mul_(scales[:, whole:])
    return out


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """``[R, 2m]`` int8 codes in [-8, 7] -> ``[R, m]`` uint8: even index in the low nibble."""
    # Each pair of codes read as one int16 (the first code in its low byte), so every operation
    # runs on contiguous elements and vectorises (on the strided halves codes[:, 0::2] and
    # codes[:, 1::2] it took 4x as long).
    pairs = codes.view(torch.int16)
    return ((pairs & 0xF) | ((pairs >> 4) & 0xF0)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """``[R, m]`` uint8 -> ``[R, 2m]`` int8 codes (two's-complement nibbles, low nibble first)."""
    signed = packed.view(torch.int8)
    out = torch.empty(packed.shape[0], packed.shape[1], 2, dtype=torch.int8, device=packed.device)
    # Shifting the nibble to the top and arithmetic-shifting back sign-extends it.
    torch.bitwise_right_shift(signed << 4, 4, out=out[:, :, 0])
    torch.bitwise_right_shift(signed, 4, out=out[:, :, 1])
    return out.view(packed.shape[0], -1)


def quantize(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise quantization of a 1-D ``[n]`` or 2-D ``[R, n]`` tensor (rows independent).

    Returns codes ``[n | R, code_cols(n, bits)]`` and fp32 scales ``[n | R, ceil(n / block)]``,
    without the leading dimension for 1-D input.
    """
    codes, scales = quantize_rows(x.reshape(-1, x.shape[-1]), bits, block)
    if x.dim() == 1:
        return codes[0], scales[0]
    return codes, scales


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, numel: int, bits: int, block: int, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of :func:`quantize`: values ``[numel]`` or ``[R, numel]`` in ``dtype``."""
    out = dequantize_rows(codes.reshape(-1, codes.shape[-1]), scales.reshape(-1, scales.shape[-1]), numel, bits, block)
    return out.to(dtype).reshape(*codes.shape[:-1], numel)


def reorder_quantize(flat: torch.Tensor, layout: QgzLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Unfused qgZ step 1: permute the partitions into slot order, then quantize each one.

    Returns codes ``[W, layout.code_cols]`` and fp32 scales ``[W, layout.blocks_per_part]``.
    """
    n, d, s = layout.nodes, layout.ranks_per_node, layout.part_numel
    padded = flat if flat.numel() == n * d * s else F.pad(flat, (0, n * d * s - flat.numel()))
    # [node][local] -> [local][node]: slot local * nodes + node holds rank node * d + local. One
    # copy (converting to fp32) into rows already padded to whole blocks.
    slots = torch.empty(n * d, layout.part_len, dtype=torch.float32, device=flat.device)
    slots[:, :s].view(d, n, s).copy_(padded.view(n, d, s).transpose(0, 1))
    slots[:, s:].zero_()
    return quantize_rows(slots, layout.bits, layout.block)


def dequantize_reduce_requantize(
    codes: torch.Tensor, scales: torch.Tensor, layout: QgzLayout, multiplier: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """qgZ step 3: ``[K, R, C]`` codes and ``[K, R, P]`` scales -> the requantized sum over ``K``,
    codes ``[R, C]`` and scales ``[R, P]``."""
    total = _reduce(codes, scales, layout, multiplier, layout.part_len)
    return quantize_rows(total, layout.bits, layout.block)


def dequantize_reduce(
    codes: torch.Tensor, scales: torch.Tensor, layout: QgzLayout, multiplier: float, dtype: torch.dtype
) -> torch.Tensor:
    """qgZ step 5: ``[K, R, C]`` codes and ``[K, R, P]`` scales -> ``multiplier * sum over K``,
    ``[R, part_numel]`` in ``dtype``."""
    return _reduce(codes, scales, layout, multiplier, layout.part_numel).to(dtype)


def _reduce(
    codes: torch.Tensor, scales: torch.Tensor, layout: QgzLayout, multiplier: float, numel: int
) -> torch.Tensor:
    k, rows = codes.shape[0], codes.shape[1]
    total = torch.zeros(rows, numel, dtype=torch.float32, device=codes.device)
    # Operand by operand, so the fp32 summation order is fixed and matches the kernel's loop.
    for i in range(k):
        total.add_(dequantize_rows(codes[i], scales[i], numel, layout.bits, layout.block))
    return total.mul_(torch.tensor(multiplier, dtype=torch.float32, device=codes.device))
