"""A pool of reusable 1-D buffers for the per-unit gradient traffic of every backward.

Each unit's backward needs a flat gradient buffer (one unit of elements) and a reduce-scatter
output (one shard). Allocating and freeing them for every unit of every step costs page faults
and, with glibc, fragments the heap: measured on a 91M GPT (2 ranks, CPU), resident memory grew
from 1.3 to 2.1 GB over four steps while live tensors stayed near 1.05 GB. Reusing buffers of the
same size within a backward avoids both: the pool holds at most as many buffers of a size as were
in use at once. The engine releases the free ones at the end of every backward
(:meth:`BufferPool.release_free`), so that between backwards (forward's activations, the optimizer
step) and at the start of the next backward, where the peak is, no idle gradient buffer is held:
kept across steps they were 72 MiB of a 4-rank bf16 peak (examples/benchmarks/RESULTS.md).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional

import torch
from torch import Tensor

from lightning_zinf.engine.ledger import MemoryLedger

__all__ = ["BufferPool"]


class BufferPool:
    """Free lists of 1-D tensors keyed by ``(numel, dtype)``, on one device.

    Every buffer handed out is accounted in the ledger under the category it was taken for (see
    :data:`~lightning_zinf.engine.ledger.CATEGORIES`) until it is given back; free ones under
    ``pooled``.

    Args:
        device: Where the buffers live.
        ledger: Where the bytes are accounted (default: a ledger of its own).
    """

    def __init__(self, device: torch.device, ledger: Optional[MemoryLedger] = None) -> None:
        self.device = device
        self.ledger = ledger if ledger is not None else MemoryLedger()
        self._free: dict[tuple[int, torch.dtype], list[Tensor]] = defaultdict(list)
        self._taken_for: dict[int, str] = {}

    def take(self, numel: int, dtype: torch.dtype, category: str = "grad_buffers") -> Tensor:
        """A 1-D buffer of ``numel`` elements of ``dtype`` with undefined contents, accounted
        under ``category`` until :meth:`give` or :meth:`move`."""
        free = self._free[(numel, dtype)]
        if free:
            buffer = free.pop()
            self.ledger.add("pooled", -_nbytes(buffer))
        else:
            buffer = torch.empty(numel, dtype=dtype, device=self.device)
        self._taken_for[id(buffer)] = category
        self.ledger.add(category, _nbytes(buffer))
        return buffer

    def move(self, buffer: Tensor, category: str) -> None:
        """Account a buffer from :meth:`take` under another category (a gradient whose
        reduce-scatter started)."""
        self.ledger.add(self._taken_for[id(buffer)], -_nbytes(buffer))
        self._taken_for[id(buffer)] = category
        self.ledger.add(category, _nbytes(buffer))

    def give(self, buffer: Tensor) -> None:
        """Return a buffer from :meth:`take`; the caller must hold no view of it any more."""
        self.ledger.add(self._taken_for.pop(id(buffer)), -_nbytes(buffer))
        self.ledger.add("pooled", _nbytes(buffer))
        self._free[(buffer.numel(), buffer.dtype)].append(buffer)

    def release_free(self) -> None:
        """Drop every free buffer (the allocator gets them back once no view of them is left)."""
        for free in self._free.values():
            for buffer in free:
                self.ledger.add("pooled", -_nbytes(buffer))
        self._free.clear()

    @property
    def pooled_bytes(self) -> int:
        """Bytes held in free lists (not in use)."""
        return sum(_nbytes(t) for free in self._free.values() for t in free)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()
