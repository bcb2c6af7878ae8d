"""A pool of reusable 1-D buffers for the per-unit gradient traffic of every backward.

Each unit's backward needs a flat gradient buffer (one unit of elements) and a reduce-scatter
output (one shard). Allocating and freeing them for every unit of every step costs page faults
and, with glibc, fragments the heap: measured on a 91M GPT (2 ranks, CPU), resident memory grew
from 1.3 to 2.1 GB over four steps while live tensors stayed near 1.05 GB. Reusing buffers of the
same size avoids both. The pool holds at most as many buffers of a size as were in use at once.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor

__all__ = ["BufferPool"]


class BufferPool:
    """Free lists of 1-D tensors keyed by ``(numel, dtype)``, on one device.

    Args:
        device: Where the buffers live.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._free: dict[tuple[int, torch.dtype], list[Tensor]] = defaultdict(list)

    def take(self, numel: int, dtype: torch.dtype) -> Tensor:
        """A 1-D buffer of ``numel`` elements of ``dtype`` with undefined contents."""
        free = self._free[(numel, dtype)]
        return free.pop() if free else torch.empty(numel, dtype=dtype, device=self.device)

    def give(self, buffer: Tensor) -> None:
        """Return a buffer from :meth:`take`; the caller must hold no view of it any more."""
        self._free[(buffer.numel(), buffer.dtype)].append(buffer)

    @property
    def pooled_bytes(self) -> int:
        """Bytes held in free lists (not in use)."""
        return sum(t.numel() * t.element_size() for free in self._free.values() for t in free)
