"""A pool of reusable 1-D buffers for the per-unit gradient traffic of every backward.

Each unit's backward needs a reduce-scatter input (a flat gradient of one unit of elements: the
buffer autograd accumulates into, or under mixed precision the cast of autograd's own gradients)
and a reduce-scatter output (one shard). Allocating and freeing them for every unit of every step
costs page faults and, with glibc, fragments the heap: measured on a 91M GPT (2 ranks, CPU),
resident memory grew from 1.3 to 2.1 GB over four steps while live tensors stayed near 1.05 GB.
Reusing buffers within a backward avoids both: a free buffer serves any request of 1/``SLACK`` of
its bytes up to all of them (units of nearly equal size share buffers), so the pool holds about as
many buffers as were in use at once. Two rules keep idle buffers out of the peak (kept across
steps, they were 72 MiB of a 4-rank bf16 peak; examples/benchmarks/RESULTS.md):

- a request that no free buffer serves first drops the free buffers too small for it (a larger
  unit's turn: what it allocates replaces them, and they would only be served by their own size);
- the engine releases every free buffer at the end of each backward (:meth:`BufferPool.release_free`),
  so forward's activations and the optimizer step run without them.

On an accelerator the pool does not reuse (``reuse=False``): the caching allocator already keeps
freed blocks per stream, and a buffer is given back only after ``wait()`` on the collective that
used it, issued on its allocation (compute) stream, so the allocator's own reuse is safe. The pool
then only accounts the buffers in the ledger.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_zinf.engine.ledger import MemoryLedger

__all__ = ["BufferPool"]

#: A free buffer serves requests of 1/SLACK of its bytes and more.
SLACK = 1.25


class BufferPool:
    """Free byte buffers on one device, handed out as 1-D tensors of any dtype.

    Every buffer handed out is accounted in the ledger under the category it was taken for (see
    :data:`~lightning_zinf.engine.ledger.CATEGORIES`) until it is given back; free ones under
    ``pooled``. A request of ``n`` bytes is served by the smallest free buffer of ``n`` to
    ``SLACK * n`` bytes, else by a new one (``uint8`` storage, viewed as the requested dtype).

    Args:
        device: Where the buffers live.
        ledger: Where the bytes are accounted (default: a ledger of its own).
        reuse: Keep given-back buffers for later requests (default: on the CPU only); ``False``
            lets the allocator have them back at once.
    """

    def __init__(self, device: torch.device, ledger: Optional[MemoryLedger] = None,
                 reuse: Optional[bool] = None) -> None:
        self.device = device
        self.reuse = device.type == "cpu" if reuse is None else reuse
        self.ledger = ledger if ledger is not None else MemoryLedger()
        self._free: list[Tensor] = []  # uint8 buffers
        self._handed: dict[int, tuple[Tensor, str]] = {}  # id(tensor handed out) -> (its buffer, category)

    def take(self, numel: int, dtype: torch.dtype, category: str = "grad_buffers") -> Tensor:
        """A 1-D tensor of ``numel`` elements of ``dtype`` with undefined contents, accounted
        under ``category`` until :meth:`give` or :meth:`move`."""
        need = numel * dtype.itemsize
        fits = [b for b in self._free if need <= b.numel() <= SLACK * need]
        if fits:
            buffer = min(fits, key=Tensor.numel)
            self._free = [b for b in self._free if b is not buffer]
            self.ledger.add("pooled", -buffer.numel())
        else:
            for small in (b for b in self._free if b.numel() < need):
                self.ledger.add("pooled", -small.numel())
            self._free = [b for b in self._free if b.numel() >= need]
            buffer = torch.empty(need, dtype=torch.uint8, device=self.device)
        tensor = buffer[:need].view(dtype)
        self._handed[id(tensor)] = (buffer, category)
        self.ledger.add(category, buffer.numel())
        return tensor

    def move(self, tensor: Tensor, category: str) -> None:
        """Account a tensor from :meth:`take` under another category (a gradient whose
        reduce-scatter started)."""
        buffer, old = self._handed[id(tensor)]
        self.ledger.add(old, -buffer.numel())
        self._handed[id(tensor)] = (buffer, category)
        self.ledger.add(category, buffer.numel())

    def give(self, tensor: Tensor) -> None:
        """Return a tensor from :meth:`take`; the caller must hold no view of it any more."""
        buffer, category = self._handed.pop(id(tensor))
        self.ledger.add(category, -buffer.numel())
        if self.reuse:
            self.ledger.add("pooled", buffer.numel())
            self._free.append(buffer)

    def forget(self, tensor: Tensor) -> None:
        """Hand a tensor from :meth:`take` over to its user for good (a reduce-scatter output kept
        as a gradient shard): no longer accounted here, freed when its user drops it."""
        buffer, category = self._handed.pop(id(tensor))
        self.ledger.add(category, -buffer.numel())

    def release_free(self) -> None:
        """Drop every free buffer (the allocator gets them back once no view of them is left)."""
        self.ledger.add("pooled", -self.pooled_bytes)
        self._free = []

    @property
    def pooled_bytes(self) -> int:
        """Bytes held in free buffers (not in use)."""
        return sum(b.numel() for b in self._free)
