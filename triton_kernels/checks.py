"""Argument checks for the public API and the choice between the torch and Triton paths.

Every error names the argument, what was wrong, and what to pass instead.
"""

from __future__ import annotations

import math
import os
from typing import Literal

import torch

from .layout import code_dtype

Backend = Literal["auto", "torch", "triton"]
NonFinite = Literal["raise", "propagate"]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def float_tensor(x: object, name: str) -> torch.Tensor:
    """Raise ``TypeError`` unless ``x`` is an fp32, fp16 or bf16 tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {x.dtype}: pass float32, float16 or bfloat16 (e.g. {name}.float())")
    return x


def out_dtype(dtype: torch.dtype) -> torch.dtype:
    """Raise ``TypeError`` unless ``dtype`` is a supported output dtype."""
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype={dtype}: dequantized values can be torch.float32, torch.float16 or torch.bfloat16")
    return dtype


def out_tensor(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, what: str) -> None:
    """Raise ``ValueError`` unless ``out`` is a contiguous tensor of ``shape``, ``dtype`` and ``device``."""
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != dtype or out.device != device \
            or not out.is_contiguous():
        got = f"{tuple(out.shape)} {out.dtype} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"{what}: out is {got}; pass a contiguous {shape} {dtype} tensor on {device} (or no out)")


def nonfinite_mode(nonfinite: str) -> None:
    """Raise ``ValueError`` unless ``nonfinite`` is ``"raise"`` or ``"propagate"``."""
    if nonfinite not in ("raise", "propagate"):
        raise ValueError(f"nonfinite={nonfinite!r}: use 'raise' (check first) or 'propagate' (NaN scales)")


def finite(x: torch.Tensor, name: str, nonfinite: str) -> None:
    """With ``nonfinite="raise"``, raise ``ValueError`` if ``x`` holds a NaN or an infinity.

    On a GPU this check synchronizes with the device; ``nonfinite="propagate"`` skips it.
    """
    nonfinite_mode(nonfinite)
    if nonfinite == "propagate" or x.numel() == 0:
        return
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        first = int(bad.reshape(-1).nonzero()[0])
        raise ValueError(
            f"{name} holds {int(bad.sum())} non-finite values (the first, at flat index {first}, is "
            f"{x.reshape(-1)[first].item()}); quantizing them would lose them. Fix the producer (e.g. skip the "
            "step, as a loss scaler does), or pass nonfinite='propagate' to quantize such blocks with a NaN "
            "scale (they dequantize to NaN)"
        )


def multiplier_value(multiplier: float) -> float:
    """Raise ``ValueError`` unless ``multiplier`` is a finite number."""
    if not isinstance(multiplier, (int, float)) or isinstance(multiplier, bool) or not math.isfinite(multiplier):
        raise ValueError(f"multiplier={multiplier!r}: must be a finite number (e.g. 1 / world_size for the mean)")
    return float(multiplier)


def quantized(
    codes: object, scales: object, bits: int, code_shape: tuple[int, ...], scale_shape: tuple[int, ...], what: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check ``codes``/``scales`` against the shapes and dtypes the format requires; return them
    with contiguous rows (:func:`rows_contiguous`)."""
    if not isinstance(codes, torch.Tensor) or not isinstance(scales, torch.Tensor):
        raise TypeError(f"{what}: codes and scales must be torch.Tensors")
    want = code_dtype(bits)
    if codes.dtype != want:
        raise TypeError(f"{what}: codes have dtype {codes.dtype}, but {bits}-bit codes are {want}")
    if scales.dtype != torch.float32:
        raise TypeError(f"{what}: scales have dtype {scales.dtype}; scales are always torch.float32")
    if tuple(codes.shape) != code_shape or tuple(scales.shape) != scale_shape:
        raise ValueError(
            f"{what}: got codes {tuple(codes.shape)} and scales {tuple(scales.shape)}, expected codes {code_shape} "
            f"and scales {scale_shape} (check numel, bits and block against what was quantized)"
        )
    if codes.device != scales.device:
        raise ValueError(f"{what}: codes are on {codes.device} but scales on {scales.device}; move both to one device")
    return rows_contiguous(codes), rows_contiguous(scales)


def rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dimension is contiguous (rows at any stride, as in views of a
    packed buffer, which the kernels take as they are), else a contiguous copy."""
    return t if t.dim() == 0 or t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def quantized_out(
    out: object, bits: int, code_shape: tuple[int, ...], scale_shape: tuple[int, ...], device: torch.device, what: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check an ``out=(codes, scales)`` pair to be written: the format's dtypes and these shapes, on
    ``device``, with contiguous rows (at any row stride: views of a ``PackedRows`` buffer fit)."""
    if not isinstance(out, tuple) or len(out) != 2:
        raise TypeError(f"{what}: out must be a (codes, scales) pair of tensors, got {type(out).__name__}")
    codes, scales = quantized(*out, bits, code_shape, scale_shape, what)
    if codes is not out[0] or scales is not out[1]:
        raise ValueError(f"{what}: out's codes and scales must have contiguous rows (stride 1 in the last dimension)")
    if codes.device != device:
        raise ValueError(f"{what}: out is on {codes.device}; pass tensors on {device}")
    return codes, scales


def use_triton(backend: str, device: torch.device) -> bool:
    """Whether to take the Triton path: ``"auto"`` takes it for CUDA tensors only.

    Raises:
        ValueError: On an unknown ``backend``.
        RuntimeError: When ``backend="triton"`` is asked for on a CPU tensor and the kernels are not
            (or were not first) defined for Triton's interpreter.
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend={backend!r}: use 'auto' (CUDA -> Triton, else torch), 'torch' or 'triton'")
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return False
    if device.type == "cuda":
        return True
    from . import _common  # imports Triton; only reached on the Triton path

    if device.type != "cpu":
        raise RuntimeError(
            f"backend='triton' takes CUDA tensors (or CPU tensors in Triton's interpreter), not {device}"
        )
    if not _common.INTERPRETED:
        set_now = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
        raise RuntimeError(
            "backend='triton' on CPU tensors needs Triton's interpreter, "
            + (
                "but the kernels were defined before TRITON_INTERPRET=1 was set: set it before the first Triton call"
                if set_now
                else "which is off: set TRITON_INTERPRET=1 in the environment before the first Triton call"
            )
        )
    if not _common.LANGUAGE_INTERPRETED:
        raise RuntimeError(
            "backend='triton' on CPU tensors: Triton was imported before TRITON_INTERPRET=1 was set (importing "
            "lightning, for one, imports it), so its language functions are compiled and the interpreter cannot "
            "call them; set TRITON_INTERPRET=1 before anything imports triton (e.g. at the top of a pytest conftest.py)"
        )
    return True
