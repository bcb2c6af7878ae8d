"""Blockwise INT8/INT4 quantization kernels for ZeRO++'s quantized communication.

ZeRO++ (Wang et al. 2023, arXiv:2306.10209) quantizes what crosses the network: weights in INT8
for the all-gather (qwZ, §3.1) and gradients in INT4 for a hierarchical all-to-all that replaces
the reduce-scatter (qgZ, §3.3). This package provides the kernels both need:

- :func:`quantize` / :func:`dequantize`: blockwise symmetric quantization (§3.1);
- :func:`reorder_quantize`: qgZ's fused reorder + quantize of a flat gradient (§3.3);
- :func:`dequantize_reduce_requantize`: the fused step between qgZ's two all-to-alls;
- :func:`dequantize_reduce`: qgZ's last step, giving this rank's (mean) partition.

Every function has a Triton kernel and a torch reference of the same semantics
(:mod:`triton_kernels.reference`). ``backend="auto"`` sends CUDA tensors to Triton and everything
else to the reference; ``backend="triton"`` forces the kernel, which on CPU tensors needs
``TRITON_INTERPRET=1`` in the environment before the first Triton call (Triton's interpreter,
used by the tests); ``backend="torch"`` forces the reference.

Format (details in :mod:`triton_kernels.layout` and :mod:`triton_kernels.reference`):

- A row of ``n`` values is cut into ``ceil(n / block)`` blocks; the last may be shorter (the
  *tail*) and is quantized over its own values. ``block`` is a power of two in [64, 4096].
- Symmetric, one fp32 scale per block: ``scale = absmax / qmax`` with ``qmax = 127`` (INT8) or
  ``7`` (INT4); ``code = round_half_even(x * (qmax / absmax))`` in ``[-qmax, qmax]``;
  ``value = code * scale``. The largest value of a block is therefore represented exactly
  (DeepSpeed instead divides by 128 or 8 and clips it, trading that for a finer step).
- INT8 codes are int8 ``[n]``; INT4 codes are uint8 ``[ceil(n / 2)]``, value ``2i`` in the low
  nibble and ``2i + 1`` in the high nibble (two's complement), an odd count padded with code 0.
- All-zero blocks (and blocks with ``absmax < qmax * 2**-126``) get scale 0 and codes 0.
- Packed: :class:`PackedRows` puts each row's codes and scales in one uint8 row, so one
  collective moves both; every function reads such views in place, and the quantizing ones write
  into them (``out=``).
- NaN/Inf: ``nonfinite="raise"`` (default) raises ``ValueError`` before quantizing (on a GPU this
  costs one synchronization); ``nonfinite="propagate"`` gives such a block scale NaN and codes 0,
  so it dequantizes to NaN and stays visible downstream. NaN scales propagate through the reduce
  functions the same way.
- On CPU (reference vs interpreter) the two paths agree bit for bit (tested). On CUDA the kernels
  are compiled without FMA contraction, divide with IEEE rounding and round with exact integer
  tricks so that they should agree as well; the CUDA tests allow a code to differ by one.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import checks, reference
from .checks import Backend, NonFinite
from .layout import (MAX_BLOCK, MIN_BLOCK, PACK_ALIGN, QMAX, PackedRows, QgzLayout, check_bits, check_block, code_cols,
                     code_dtype, num_blocks)

__all__ = [
    "MAX_BLOCK",
    "MIN_BLOCK",
    "PACK_ALIGN",
    "QMAX",
    "PackedRows",
    "QgzLayout",
    "code_cols",
    "code_dtype",
    "dequantize",
    "dequantize_reduce",
    "dequantize_reduce_requantize",
    "num_blocks",
    "quantize",
    "reorder_quantize",
]


def quantize(
    x: torch.Tensor,
    bits: int = 8,
    block: int = 256,
    *,
    nonfinite: NonFinite = "raise",
    backend: Backend = "auto",
    out: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise symmetric quantization (ZeRO++ §3.1, qwZ).

    Args:
        x: fp32, fp16 or bf16, 1-D ``[n]``, or 2-D ``[R, n]`` whose rows are quantized independently
            (e.g. several shards at once). Flatten other shapes first.
        bits: 8 (int8 codes) or 4 (two codes per uint8 byte).
        block: Elements per scale, a power of two in [64, 4096].
        nonfinite: ``"raise"`` or ``"propagate"`` (see the package docstring).
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        out: Optional ``(codes, scales)`` of the result's shapes and dtypes on ``x``'s device, rows
            contiguous at any row stride (e.g. :meth:`PackedRows.views` of a packed buffer), to
            write into (directly, on the Triton path).

    Returns:
        ``(codes, scales)``: codes ``[(R,) code_cols(n, bits)]`` of ``code_dtype(bits)``, scales
        fp32 ``[(R,) ceil(n / block)]``, on ``x``'s device (``out`` when given).

    Raises:
        TypeError: ``x`` is not an fp32/fp16/bf16 tensor, or ``out`` is not a pair of the format's dtypes.
        ValueError: Unsupported ``bits``/``block``/shape, non-finite values with ``nonfinite="raise"``,
            or an ``out`` of other shapes, device or non-contiguous rows.
    """
    checks.float_tensor(x, "x")
    check_bits(bits)
    check_block(block)
    if x.dim() not in (1, 2):
        raise ValueError(f"x has shape {tuple(x.shape)}: pass a 1-D tensor or 2-D rows (e.g. x.reshape(-1))")
    lead, n = tuple(x.shape[:-1]), x.shape[-1]
    if out is not None:
        out = checks.quantized_out(out, bits, (*lead, code_cols(n, bits)), (*lead, num_blocks(n, block)), x.device,
                                   "quantize")
    checks.finite(x, "x", nonfinite)
    if not checks.use_triton(backend, x.device):
        return _into(reference.quantize(x, bits, block), out)
    from .quant_kernel import quantize_launch

    rows = lead[0] if lead else 1
    if out is None:
        out = (torch.empty(*lead, code_cols(n, bits), dtype=code_dtype(bits), device=x.device),
               torch.empty(*lead, num_blocks(n, block), dtype=torch.float32, device=x.device))
    codes, scales = out
    quantize_launch(
        x.contiguous(), codes.view(rows, -1), scales.view(rows, -1), in_row_len=n, out_row_len=n, nodes=1,
        ranks_per_node=rows, bits=bits, block=block,
    ).run()  # fmt: skip
    return out


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    bits: int = 8,
    block: int = 256,
    *,
    dtype: torch.dtype = torch.float32,
    backend: Backend = "auto",
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``code * scale`` per block, rounded to ``dtype`` (ZeRO++ §3.1).

    Args:
        codes: ``[code_cols(numel, bits)]`` or ``[R, code_cols(numel, bits)]``, as :func:`quantize` made them.
        scales: fp32 ``[ceil(numel / block)]`` or ``[R, ceil(numel / block)]``.
        numel: Values per row (needed because INT4 codes of ``n`` and ``n + 1`` values have one size).
        bits: As given to :func:`quantize`.
        block: As given to :func:`quantize`.
        dtype: fp32, fp16 or bf16 output.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        out: Optional contiguous ``[numel]`` / ``[R, numel]`` tensor of ``dtype`` on the codes'
            device to write the values into (the Triton kernel writes there directly, saving an
            allocation and a copy, e.g. of a whole gather buffer).

    Returns:
        ``[numel]`` or ``[R, numel]`` values of ``dtype`` (``out`` when given).

    Raises:
        TypeError: Wrong code/scale dtype or output ``dtype``.
        ValueError: Shapes that do not match ``numel``, ``bits`` and ``block``, or an ``out`` of
            another shape, dtype or device.
    """
    check_bits(bits)
    check_block(block)
    checks.out_dtype(dtype)
    lead = tuple(codes.shape[:-1]) if isinstance(codes, torch.Tensor) and codes.dim() == 2 else ()
    codes, scales = checks.quantized(
        codes, scales, bits, (*lead, code_cols(numel, bits)), (*lead, num_blocks(numel, block)), "dequantize"
    )
    if out is not None:
        checks.out_tensor(out, (*lead, numel), dtype, codes.device, "dequantize")
    if not checks.use_triton(backend, codes.device):
        values = reference.dequantize(codes, scales, numel, bits, block, dtype)
        return values if out is None else out.copy_(values)
    from .reduce_kernel import reduce_launch

    if out is None:
        out = torch.empty((*lead, numel), dtype=dtype, device=codes.device)
    rows = lead[0] if lead else 1
    reduce_launch(
        codes.view(1, rows, -1), scales.view(1, rows, -1), out.view(rows, numel), None,
        row_len=numel, out_row_len=numel, bits=bits, block=block, multiplier=1.0,
    ).run()  # fmt: skip
    return out


def reorder_quantize(
    flat: torch.Tensor,
    layout: QgzLayout,
    *,
    nonfinite: NonFinite = "raise",
    backend: Backend = "auto",
    out: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """qgZ step 1, fused: cut ``flat`` into one partition per rank, put the partitions in slot
    order and quantize them, reading ``flat`` once (ZeRO++ §3.3).

    Args:
        flat: 1-D fp32/fp16/bf16 gradient of ``layout.numel`` elements.
        layout: The topology and format (:class:`QgzLayout`).
        nonfinite: As in :func:`quantize`.
        backend: As in :func:`quantize`.
        out: As in :func:`quantize` (e.g. the views of a ``[W]`` :meth:`QgzLayout.packed` buffer,
            which the intra-node all-to-all sends as it is).

    Returns:
        codes ``[W, layout.code_cols]`` of ``code_dtype(layout.bits)`` and fp32 scales
        ``[W, layout.blocks_per_part]`` (``out`` when given); row ``j`` is rank
        ``layout.rank_of_slot(j)``'s partition, zero-padded to ``layout.part_len`` values. Rows
        ``[k * nodes, (k + 1) * nodes)`` go to local peer ``k`` in the intra-node all-to-all.

    Raises:
        TypeError, ValueError: As in :func:`quantize`; ``ValueError`` if ``flat`` does not have
            ``layout.numel`` elements.
    """
    checks.float_tensor(flat, "flat")
    if flat.dim() != 1 or flat.numel() != layout.numel:
        raise ValueError(
            f"flat has shape {tuple(flat.shape)} but the layout is for a 1-D gradient of {layout.numel} elements:"
            " pass the flat gradient, or build QgzLayout(numel=flat.numel(), ...)"
        )
    if out is not None:
        out = checks.quantized_out(out, layout.bits, (layout.world, layout.code_cols),
                                   (layout.world, layout.blocks_per_part), flat.device, "reorder_quantize")
    checks.finite(flat, "flat", nonfinite)
    if not checks.use_triton(backend, flat.device):
        return _into(reference.reorder_quantize(flat, layout), out)
    from .quant_kernel import quantize_launch

    codes, scales = out if out is not None else (
        torch.empty(layout.world, layout.code_cols, dtype=code_dtype(layout.bits), device=flat.device),
        torch.empty(layout.world, layout.blocks_per_part, dtype=torch.float32, device=flat.device))
    quantize_launch(
        flat.contiguous(), codes, scales, in_row_len=layout.part_numel, out_row_len=layout.part_len,
        nodes=layout.nodes, ranks_per_node=layout.ranks_per_node, bits=layout.bits, block=layout.block,
    ).run()  # fmt: skip
    return codes, scales


def dequantize_reduce_requantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    layout: QgzLayout,
    *,
    multiplier: float = 1.0,
    backend: Backend = "auto",
    out: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """qgZ step 3, fused: dequantize ``K`` received operands, sum them in fp32, multiply by
    ``multiplier`` and requantize with the same bits and block (ZeRO++ §3.3).

    After the intra-node all-to-all a rank holds ``K = ranks_per_node`` operands of ``R = nodes``
    partitions each; the result has ``R`` partitions, row ``m`` for global rank
    ``m * ranks_per_node + local``.

    Args:
        codes: ``[K, R, layout.code_cols]`` (or ``[K, layout.code_cols]`` for ``R = 1``).
        scales: fp32 ``[K, R, layout.blocks_per_part]`` (or ``[K, layout.blocks_per_part]``).
        layout: The :class:`QgzLayout` the operands were made with.
        multiplier: Applied to the fp32 sum before requantizing (e.g. ``1 / ranks_per_node``);
            keep the default 1 and average at the last step with ``1 / W``.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        out: As in :func:`quantize`, of the result's shapes (e.g. the views of an ``[R]``
            :meth:`QgzLayout.packed` buffer, which the inter-node all-to-all sends as it is).

    Returns:
        codes ``[R, layout.code_cols]`` (``[layout.code_cols]`` for 2-D input) and fp32 scales
        ``[R, layout.blocks_per_part]`` (likewise); ``out`` when given.

    Raises:
        TypeError, ValueError: On dtypes or shapes that do not fit ``layout``, a non-finite
            ``multiplier``, or an ``out`` that does not fit the result.
    """
    codes3, scales3, squeeze = _operands(codes, scales, layout, "dequantize_reduce_requantize")
    multiplier = checks.multiplier_value(multiplier)
    rows = codes3.shape[1]
    if out is not None:
        lead = () if squeeze else (rows,)
        out = checks.quantized_out(out, layout.bits, (*lead, layout.code_cols), (*lead, layout.blocks_per_part),
                                   codes3.device, "dequantize_reduce_requantize")
    if not checks.use_triton(backend, codes3.device):
        result = reference.dequantize_reduce_requantize(codes3, scales3, layout, multiplier)
        return _into((result[0][0], result[1][0]) if squeeze else result, out)
    from .reduce_kernel import reduce_launch

    if out is None:
        shape = (rows,) if not squeeze else ()
        out = (torch.empty(*shape, layout.code_cols, dtype=codes3.dtype, device=codes3.device),
               torch.empty(*shape, layout.blocks_per_part, dtype=torch.float32, device=codes3.device))
    out_codes, out_scales = out
    reduce_launch(
        codes3, scales3, out_codes.view(rows, -1), out_scales.view(rows, -1), row_len=layout.part_len,
        out_row_len=layout.part_len, bits=layout.bits, block=layout.block, multiplier=multiplier,
    ).run()  # fmt: skip
    return out


def dequantize_reduce(
    codes: torch.Tensor,
    scales: torch.Tensor,
    layout: QgzLayout,
    *,
    multiplier: float = 1.0,
    dtype: torch.dtype = torch.float32,
    backend: Backend = "auto",
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """qgZ step 5, fused: dequantize ``K`` received operands, sum them in fp32, multiply by
    ``multiplier`` and round to ``dtype`` (ZeRO++ §3.3).

    After the inter-node all-to-all a rank holds ``K = nodes`` operands of its own partition;
    with ``multiplier=1 / layout.world`` the result is this rank's slice of the mean gradient, what a
    mean reduce-scatter returns.

    Args:
        codes: ``[K, layout.code_cols]`` (or ``[K, R, layout.code_cols]`` for ``R`` partitions).
        scales: fp32 ``[K, layout.blocks_per_part]`` (or ``[K, R, layout.blocks_per_part]``).
        layout: The :class:`QgzLayout` the operands were made with.
        multiplier: Applied to the fp32 sum before rounding (``1 / W`` for the mean).
        dtype: fp32, fp16 or bf16 output.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        out: Optional contiguous tensor of the result's shape and ``dtype`` on the codes' device
            to write into (directly, on the Triton path).

    Returns:
        ``[layout.part_numel]`` (or ``[R, layout.part_numel]``) values of ``dtype``; the padding of
        the partition to whole blocks is dropped. ``out`` when given.

    Raises:
        TypeError, ValueError: On dtypes or shapes that do not fit ``layout``, a non-finite
            ``multiplier``, or an ``out`` of another shape, dtype or device.
    """
    codes3, scales3, squeeze = _operands(codes, scales, layout, "dequantize_reduce")
    multiplier = checks.multiplier_value(multiplier)
    checks.out_dtype(dtype)
    rows = codes3.shape[1]
    shape = (layout.part_numel,) if squeeze else (rows, layout.part_numel)
    if out is not None:
        checks.out_tensor(out, shape, dtype, codes3.device, "dequantize_reduce")
    if not checks.use_triton(backend, codes3.device):
        values = reference.dequantize_reduce(codes3, scales3, layout, multiplier, dtype).view(shape)
        return values if out is None else out.copy_(values)
    from .reduce_kernel import reduce_launch

    if out is None:
        out = torch.empty(shape, dtype=dtype, device=codes3.device)

    reduce_launch(
        codes3, scales3, out.view(rows, layout.part_numel), None, row_len=layout.part_len,
        out_row_len=layout.part_numel, bits=layout.bits, block=layout.block, multiplier=multiplier,
    ).run()  # fmt: skip
    return out


def _into(
    result: tuple[torch.Tensor, torch.Tensor], out: Optional[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path's ``(codes, scales)``, copied into ``out`` when one was given."""
    if out is None:
        return result
    out[0].copy_(result[0])
    out[1].copy_(result[1])
    return out


def _operands(
    codes: torch.Tensor, scales: torch.Tensor, layout: QgzLayout, what: str
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Check ``[K, (R,) C]`` codes and ``[K, (R,) P]`` scales against ``layout``; return them as
    contiguous ``[K, R, ...]`` and whether ``R`` was left out."""
    if not isinstance(codes, torch.Tensor) or codes.dim() not in (2, 3) or codes.shape[0] < 1:
        shape = tuple(codes.shape) if isinstance(codes, torch.Tensor) else type(codes).__name__
        raise ValueError(f"{what}: codes {shape} must be [K, C] or [K, R, C] with K >= 1 received operands")
    lead = tuple(codes.shape[:-1])
    codes, scales = checks.quantized(
        codes, scales, layout.bits, (*lead, layout.code_cols), (*lead, layout.blocks_per_part), what
    )
    squeeze = codes.dim() == 2
    if squeeze:
        codes, scales = codes.unsqueeze(1), scales.unsqueeze(1)
    return codes, scales, squeeze
