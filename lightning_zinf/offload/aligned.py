"""Page-aligned CPU tensors and raw views of tensor memory, for ``O_DIRECT`` I/O.

ZeRO-Infinity (Rajbhandari et al., SC'21, §6.3) moves shards between NVMe and CPU memory through
DeepNVMe, which reads and writes with ``O_DIRECT`` so that the page cache neither copies the data
nor holds a second copy of it in RAM. ``O_DIRECT`` requires the memory address, the file offset and
the length of every request to be multiples of the device's logical block size (512 or 4096 bytes);
4096 satisfies both, so it is the alignment used throughout :mod:`lightning_zinf.offload`.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["ALIGNMENT", "aligned_empty", "is_aligned", "round_up", "memory_view"]

ALIGNMENT = 4096
"""Bytes: address, offset and length granularity of every ``O_DIRECT`` request made here."""


def round_up(nbytes: int, multiple: int = ALIGNMENT) -> int:
    """``nbytes`` rounded up to a multiple of ``multiple`` (both in bytes, ``multiple`` > 0)."""
    return -(-nbytes // multiple) * multiple


def is_aligned(address: int, alignment: int = ALIGNMENT) -> bool:
    """Whether the integer ``address`` (e.g. ``tensor.data_ptr()``) is a multiple of ``alignment``."""
    return address % alignment == 0


def aligned_empty(numel: int, dtype: torch.dtype, *, alignment: int = ALIGNMENT, pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor whose data pointer is a multiple of ``alignment`` bytes.

    The tensor holds ``numel`` elements of ``dtype``; its storage extends at least to
    ``round_up(numel * itemsize, alignment)`` bytes past the data pointer, so a whole last block
    is addressable, and :class:`~lightning_zinf.offload.swapper.NvmeSwapper` reads and writes such
    tensors without copying them through a bounce buffer (the zero-copy path of DeepNVMe's
    pinned, aligned swap buffers). Reshape it with ``.view(shape)``.

    Args:
        numel: Number of elements, >= 0.
        dtype: Any torch dtype.
        alignment: Bytes; a power of two that is a multiple of ``dtype``'s item size.
        pin_memory: Allocate page-locked memory (needs an accelerator; copies to it are faster and
            can be asynchronous).

    Raises:
        ValueError: ``numel`` < 0, or ``alignment`` not a power of two or not a multiple of the
            item size.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
        raise ValueError(f"aligned_empty: numel={numel!r} is invalid: pass an integer >= 0.")
    if alignment <= 0 or alignment & (alignment - 1) or alignment % itemsize:
        raise ValueError(
            f"aligned_empty: alignment={alignment!r} is invalid: pass a power of two that is a "
            f"multiple of {dtype}'s item size ({itemsize} bytes), e.g. 4096."
        )
    padded = round_up(numel * itemsize, alignment)
    if pin_memory:
        # The accelerator's host allocator hands out page-aligned blocks of its own sizes:
        # over-allocating would double a power-of-two request.
        pinned = torch.empty(max(padded, alignment), dtype=torch.uint8, pin_memory=True)
        if pinned.data_ptr() % alignment == 0:
            return pinned[:padded].view(dtype)[:numel]
    # Over-allocate by one alignment unit and start at the first aligned byte: torch's CPU
    # allocator only guarantees 64-byte alignment.
    raw = torch.empty(padded + alignment, dtype=torch.uint8, pin_memory=pin_memory)
    skip = -raw.data_ptr() % alignment
    return raw[skip : skip + padded].view(dtype)[:numel]


def memory_view(address: int, nbytes: int) -> memoryview:
    """A writable byte ``memoryview`` of ``nbytes`` bytes of process memory starting at ``address``.

    Used to hand a tensor's storage (of any dtype, bfloat16 included, which numpy cannot view) to
    ``os.preadv``/``os.pwritev`` without a copy. The caller keeps the owner of the memory alive
    for as long as the view is used; ``nbytes`` must be > 0.
    """
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
