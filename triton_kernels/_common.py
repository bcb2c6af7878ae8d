"""What the quantize and reduce kernels share: device helpers for one tile of blocks, value loads
and stores, and the host-side launch shape.

A tile is ``[ROWS, BLOCK]``: ``ROWS`` consecutive quantization blocks, one per tile row, so a
block's absmax is one row reduction. Importing this module imports Triton, so the public API
imports it only when a Triton path is taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

#: Whether the kernels below are being defined for Triton's CPU interpreter. Triton decides this
#: when ``@triton.jit`` runs (at import of the kernel modules), from ``TRITON_INTERPRET``.
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)
#: Whether Triton's own language functions (``tl.max``, ...) are interpreted too: they were
#: decided when ``triton.language`` was first imported, which may have been earlier (importing
#: lightning imports Triton), and interpreted kernels cannot call compiled ones.
LANGUAGE_INTERPRETED: bool = type(tl.max).__name__ == "InterpretedFunction"

# Element kinds as the kernels see them. bf16 travels as its int16 bit pattern: the interpreter
# converts fp32 -> bf16 by truncation, so the kernels round with integer operations instead.
FP32, FP16, BF16_BITS = 0, 1, 2
_KIND = {torch.float32: FP32, torch.float16: FP16, torch.bfloat16: BF16_BITS}

_FP32_MAX = tl.constexpr(3.4028234663852886e38)
_FP32_MIN_NORMAL = tl.constexpr(1.1754943508222875e-38)
# A NaN as its fp32 bit pattern: Triton re-checks a kernel's globals at each launch by equality,
# which a NaN constant never passes ("Global variable has changed"); an int compares equal.
_NAN_BITS = tl.constexpr(0x7FC00000)
# Adding then subtracting 1.5 * 2**23 leaves x rounded to an integer, ties to even, for
# |x| < 2**22: the sum's unit in the last place is 1. Exact in IEEE fp32 on every backend, and
# available in the interpreter (libdevice's rint is not).
_ROUNDER = tl.constexpr(12582912.0)

# Under the interpreter every program instance costs milliseconds, so tiles grow until a launch
# has about this many programs; on a GPU a tile holds about _GPU_TILE elements.
_INTERPRETER_PROGRAMS = 16
_GPU_TILE = 4096


@dataclass(frozen=True)
class KernelLaunch:
    """One launch of a ``@triton.jit`` kernel: the kernel, its 1-D grid (program instances), its
    positional arguments (tensors and ints) and its keyword arguments (constexprs and compiler
    options such as ``num_warps``).

    Kept as data so the same launch can be run on the tensors' device, or compiled ahead of time
    for a GPU target on a machine without one (``tests/compile_kernels.py``).
    """

    kernel: Any
    grid: int
    args: tuple
    options: dict

    def run(self) -> None:
        """Launch the kernel on its tensors' device, on that device's current stream (nothing to do
        for an empty grid). Triton launches on the current device: a kernel whose tensors are on
        ``cuda:1`` while ``cuda:0`` is current would read and write another GPU's addresses, so the
        tensors' device is made current for the launch.

        Raises:
            ValueError: the tensor arguments are on different devices.
        """
        if not self.grid:
            return
        devices = {a.device for a in self.args if isinstance(a, torch.Tensor)}
        if len(devices) > 1:
            raise ValueError(f"A Triton launch got tensors on different devices ({sorted(map(str, devices))}); "
                             "move them to one device first.")
        index = next(iter(devices)).index if devices else None
        with torch.accelerator.device_index(index):
            self.kernel[(self.grid,)](*self.args, **self.options)


def kind(dtype: torch.dtype) -> int:
    """The kernels' element kind for a float ``dtype``."""
    return _KIND[dtype]


def kernel_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the kernels address it (bf16 as int16 bits)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def rows_contiguous(t: torch.Tensor, name: str) -> None:
    """Raise ``ValueError`` unless the last dimension of ``t`` is contiguous (the kernels take one
    stride per leading dimension and step through a row element by element)."""
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} has strides {t.stride()}: its rows must be contiguous (stride 1 in the last "
                         "dimension)")


def tile_rows(total_blocks: int, block: int) -> int:
    """Blocks per program instance (a power of two) for a launch over ``total_blocks`` blocks."""
    if INTERPRETED:
        want = max(1, -(-total_blocks // _INTERPRETER_PROGRAMS))
        return min(triton.next_power_of_2(want), max(1, (1 << 20) // block))
    return max(1, _GPU_TILE // block)


@triton.jit
def load_f32(ptr, offs, mask, KIND: tl.constexpr):
    """Load values of element kind ``KIND`` and widen them to fp32 (exactly)."""
    if KIND == 2:
        bits = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_f32_as(ptr, offs, value, mask, KIND: tl.constexpr):
    """Store fp32 ``value`` as element kind ``KIND``, rounding to nearest even."""
    if KIND == 2:
        u = value.to(tl.uint32, bitcast=True)
        rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.int32)
        # A NaN whose payload sits in the low half would round into an infinity; keep it a NaN.
        bits = tl.where(value != value, 0x7FC0, rounded)
        tl.store(ptr + offs, bits.to(tl.int16), mask=mask)
    elif KIND == 1:
        tl.store(ptr + offs, value.to(tl.float16), mask=mask)
    else:
        tl.store(ptr + offs, value, mask=mask)


@triton.jit
def quantize_tile(x, QMAX: tl.constexpr):
    """Quantize fp32 ``x`` ``[ROWS, BLOCK]``, one block per row (rules in ``reference.py``).

    Returns int32 codes ``[ROWS, BLOCK]`` in ``[-QMAX, QMAX]`` and fp32 scales ``[ROWS]``.
    """
    finite = tl.abs(x) <= _FP32_MAX
    xf = tl.where(finite, x, 0.0)
    absmax = tl.max(tl.abs(xf), axis=1)
    bad = tl.max(tl.where(finite, 0, 1), axis=1) > 0
    live = absmax >= QMAX * _FP32_MIN_NORMAL
    qmax = tl.zeros_like(absmax) + QMAX
    inv = tl.where(live & (bad == 0), tl.math.div_rn(qmax, tl.where(live, absmax, qmax)), 0.0)
    scale = tl.where(live, tl.math.div_rn(absmax, qmax), 0.0)
    nan = (tl.zeros_like(scale).to(tl.int32, bitcast=True) + _NAN_BITS).to(tl.float32, bitcast=True)
    scale = tl.where(bad, nan, scale)
    r = (xf * inv[:, None] + _ROUNDER) - _ROUNDER
    r = tl.minimum(tl.maximum(r, -QMAX), QMAX)
    return r.to(tl.int32), scale


@triton.jit
def pack_int4(codes, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """int32 codes ``[ROWS, BLOCK]`` -> uint8 ``[ROWS, BLOCK // 2]``, even column in the low nibble."""
    lo, hi = tl.split(tl.reshape(codes, [ROWS, BLOCK // 2, 2]))
    return ((lo & 0xF) | ((hi & 0xF) << 4)).to(tl.uint8)


@triton.jit
def unpack_int4(packed, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """uint8 ``[ROWS, BLOCK // 2]`` -> int32 codes ``[ROWS, BLOCK]`` (inverse of :func:`pack_int4`)."""
    b = packed.to(tl.int32)
    lo = b & 0xF
    hi = (b >> 4) & 0xF
    lo = tl.where(lo >= 8, lo - 16, lo)
    hi = tl.where(hi >= 8, hi - 16, hi)
    return tl.reshape(tl.join(lo, hi), [ROWS, BLOCK])
