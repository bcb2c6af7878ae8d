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

import torch
import torch.nn.functional as F

from .layout import QMAX, QgzLayout, code_cols, num_blocks

# Below this absmax the scale absmax/qmax would be subnormal; such blocks are stored as zeros.
_TINY = 2.0**-126


def quantize_rows(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``x`` ``[R, n]`` (any float dtype) on its own.

    Returns:
        ``codes`` ``[R, code_cols(n, bits)]`` (int8, or uint8 packed pairs for INT4) and
        ``scales`` fp32 ``[R, ceil(n / block)]``.
    """
    rows, n = x.shape
    nb = num_blocks(n, block)
    qmax = float(QMAX[bits])
    xb = F.pad(x.float(), (0, nb * block - n)).view(rows, nb, block)
    finite = torch.isfinite(xb)
    xf = torch.where(finite, xb, torch.zeros((), dtype=torch.float32, device=x.device))
    absmax = xf.abs().amax(dim=2)
    live = absmax >= qmax * _TINY
    bad = ~finite.all(dim=2)
    # Tensor / tensor throughout: torch evaluates `float / tensor` (and on CUDA `tensor / float`)
    # as a multiplication by a reciprocal, which rounds differently from the kernel's division.
    qmax_t = torch.full_like(absmax, qmax)
    inv = torch.where(live & ~bad, qmax_t / torch.where(live, absmax, qmax_t), torch.zeros_like(absmax))
    scales = torch.where(live, absmax / qmax_t, torch.zeros_like(absmax))
    scales = torch.where(bad, torch.full_like(scales, float("nan")), scales)
    codes = torch.round(xf * inv.unsqueeze(2)).clamp_(-qmax, qmax).to(torch.int8).view(rows, nb * block)
    if bits == 4:
        codes = pack_int4(codes)
    return codes[:, : code_cols(n, bits)].contiguous(), scales


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, numel: int, bits: int, block: int) -> torch.Tensor:
    """Inverse of :func:`quantize_rows`: ``[R, C]`` codes and ``[R, P]`` scales -> fp32 ``[R, numel]``."""
    rows = codes.shape[0]
    values = unpack_int4(codes) if bits == 4 else codes
    values = values[:, :numel].to(torch.float32)
    per_value = scales.repeat_interleave(block, dim=1)[:, :numel]
    return (values * per_value).reshape(rows, numel)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """``[R, 2m]`` int8 codes in [-8, 7] -> ``[R, m]`` uint8: even index in the low nibble."""
    nibbles = codes.to(torch.int16) & 0xF
    return (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """``[R, m]`` uint8 -> ``[R, 2m]`` int8 codes (two's-complement nibbles, low nibble first)."""
    wide = packed.to(torch.int16)
    pair = torch.stack((wide & 0xF, wide >> 4), dim=2)
    pair = torch.where(pair >= 8, pair - 16, pair)
    return pair.reshape(packed.shape[0], -1).to(torch.int8)


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
    padded = F.pad(flat, (0, n * d * s - flat.numel()))
    # [node][local] -> [local][node]: slot local * nodes + node holds rank node * d + local.
    slots = padded.view(n, d, s).transpose(0, 1).reshape(n * d, s)
    slots = F.pad(slots, (0, layout.part_len - s))
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
        total = total + dequantize_rows(codes[i], scales[i], numel, layout.bits, layout.block)
    return total * torch.tensor(multiplier, dtype=torch.float32, device=codes.device)
