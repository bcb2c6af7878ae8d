"""Host staging memory for swapped state: aligned, optionally pinned, bounded, reused.

ZeRO-Infinity's DeepNVMe (Rajbhandari et al., SC'21, §6.3) moves data between NVMe and a fixed pool
of page-locked, aligned CPU buffers, so that ``O_DIRECT`` transfers need no bounce copy and host
memory stays bounded however large the model is. :class:`StagingPool` is that pool: every record
swapped in from NVMe lives in one of its buffers, which are page-aligned, pinned when an accelerator
is used, kept for reuse by size once given back, and never exceed ``cap`` bytes in total.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_zinf.offload.aligned import ALIGNMENT, aligned_empty, round_up

__all__ = ["StagingPool"]


class StagingPool:
    """A bounded pool of page-aligned byte buffers (``torch.uint8``, 1-D).

    Args:
        cap: Most bytes of buffers held at once (in use or kept for reuse); ``None``: no bound.
        pin_memory: Allocate page-locked buffers (an accelerator must exist).

    Attributes:
        in_use: Bytes of buffers handed out and not given back.
        held: Bytes of all buffers allocated (in use plus kept for reuse).
        peak: The largest ``in_use`` so far.
    """

    def __init__(self, cap: Optional[int], pin_memory: bool = False) -> None:
        self.cap = cap
        self.pin_memory = pin_memory
        self._free: dict[int, list[Tensor]] = {}
        self.in_use = 0
        self.held = 0
        self.peak = 0

    def take(self, nbytes: int, capped: bool = True) -> Optional[Tensor]:
        """A buffer of ``round_up(nbytes, 4096)`` bytes (uninitialised), or ``None`` when handing it
        out would exceed ``cap`` even after freeing every buffer kept for reuse (the caller then
        waits for buffers to come back, or reports that the cap is too small). ``capped=False``
        ignores the cap (whole-state operations such as a checkpoint)."""
        size = round_up(max(nbytes, 1), ALIGNMENT)
        free = self._free.get(size)
        if free:
            buffer = free.pop()
        else:
            if capped and self.cap is not None and self.held + size > self.cap:
                self._trim(self.held + size - self.cap)
                if self.held + size > self.cap:
                    return None
            buffer = aligned_empty(size, torch.uint8, pin_memory=self.pin_memory)
            self.held += size
        self.in_use += size
        self.peak = max(self.peak, self.in_use)
        return buffer

    def give(self, buffer: Tensor) -> None:
        """Return a buffer from :meth:`take`; it is kept for the next request of its size, unless
        the pool holds more than its cap (after an uncapped take), in which case it is freed."""
        size = buffer.numel()
        self.in_use -= size
        if self.cap is not None and self.held > self.cap:
            self.held -= size
            del buffer
            self._release_pinned()
            return
        self._free.setdefault(size, []).append(buffer)

    def _trim(self, need: int) -> None:
        # Free kept buffers, largest first, until ``need`` bytes are released or none is left.
        for size in sorted(self._free, reverse=True):
            kept = self._free[size]
            while kept and need > 0:
                kept.pop()
                self.held -= size
                need -= size
        self._release_pinned()

    def _release_pinned(self) -> None:
        # Pinned blocks go back to the accelerator's host cache when freed, not to the OS.
        if self.pin_memory and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()
