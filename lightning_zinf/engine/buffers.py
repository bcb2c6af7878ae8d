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
from lightning_zinf.heap import advise_huge_pages

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
            if self.device.type == "cpu":  # fresh pages, faulted in at every backward (heap.py)
                advise_huge_pages(buffer.data_ptr(), need)
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


class GatherPool:
    """The memory of gather buffers, kept from one gather to the next on the CPU.

    A unit's gather buffer is a storage the parameters (and autograd's saved views of them) point
    into for the whole run: released, it keeps its storage object and loses its memory; gathered
    again, it gets memory back. On an accelerator that memory comes and goes through the storage's
    own ``resize_`` (the caching allocator keeps freed blocks). On the CPU, glibc serves blocks of a
    unit's size (tens of MiB, under its dynamic mmap threshold once one was freed) from a heap it
    cannot shrink: a GPT's gathers churned about 360 MB a step through it and left 0.9 GB of freed
    heap in the peak RSS (examples/benchmarks/RESULTS.md, issue 39). Here a released buffer's memory
    moves into a storage the pool keeps (``UntypedStorage._swap_data_ptr_``: two storages exchange
    their memory, nothing is copied), and the next gather of that many bytes takes it back the same
    way.

    Bound: the pool keeps no more than the gathers held at once (in use plus kept never exceeds the
    most bytes in use in this window or the one before; a window is a pass, :meth:`new_window`),
    the oldest kept memory freed first, and a gather that finds no kept memory of its size frees
    kept memory of other sizes before it allocates. So a spike (every unit gathered for a state
    dict) is kept for two passes at most, and :meth:`clear` frees everything (``release_all``).
    Kept bytes are accounted in the ledger under ``"gathers_kept"``.

    Args:
        device: Where the buffers live.
        ledger: Where kept bytes are accounted (default: a ledger of its own).
        reuse: Keep released memory (default: on the CPU, where torch can move memory between
            storages).
    """

    def __init__(self, device: torch.device, ledger: Optional[MemoryLedger] = None,
                 reuse: Optional[bool] = None) -> None:
        self.device = device
        # (A private torch API, which CUDA graph trees use too; a torch without it gets no reuse.)
        movable = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
        self.reuse = device.type == "cpu" and movable if reuse is None else reuse
        self.ledger = ledger if ledger is not None else MemoryLedger()
        self._kept: list[torch.UntypedStorage] = []  # storages holding released memory, oldest first
        self.in_use = 0  # bytes filled through the pool and not emptied since
        self.kept = 0
        self._high = [0, 0]  # the most bytes in use in the previous window and in this one

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give an empty ``storage`` ``nbytes`` of memory (undefined contents): kept memory of that
        size if there is some, else new."""
        held = next((s for s in self._kept if s.nbytes() == nbytes), None)
        if held is not None:
            self._kept = [s for s in self._kept if s is not held]
            self._count_kept(-nbytes)
            storage._swap_data_ptr_(held)
        else:
            self._trim(max(self._high) - self.in_use - nbytes)  # kept memory of other sizes first
            storage.resize_(nbytes)
            if self.device.type == "cpu":
                advise_huge_pages(storage.data_ptr(), nbytes)
        self.in_use += nbytes
        self._high[1] = max(self._high[1], self.in_use)

    def empty(self, storage: torch.UntypedStorage) -> None:
        """Take ``storage``'s memory away (it keeps its object, with 0 bytes): kept for a later
        :meth:`fill` within the pool's bound, else freed."""
        nbytes = storage.nbytes()
        if not nbytes:
            return
        # Buffers filled before the pool existed (a group's construction) leave it at 0.
        self.in_use = max(0, self.in_use - nbytes)
        if not self.reuse or self.in_use + nbytes > max(self._high):
            storage.resize_(0)
            return
        self._trim(max(self._high) - self.in_use - nbytes)
        held = torch.UntypedStorage(0, device=self.device)
        held._swap_data_ptr_(storage)
        self._kept.append(held)
        self._count_kept(nbytes)

    def new_window(self) -> None:
        """End a window of the bound (call at the start of each pass): the window that ends
        becomes the previous one, and kept memory above the new bound is freed."""
        self._high = [self._high[1], self.in_use]
        self._trim(max(self._high) - self.in_use)

    def clear(self) -> None:
        """Free all kept memory and forget the bound (the end of a loop: nothing is gathered again soon)."""
        self._high = [0, self.in_use]
        self._trim(0)

    def _trim(self, room: int) -> None:
        # Free the oldest kept memory until at most ``room`` bytes are kept.
        while self._kept and self.kept > room:
            oldest = self._kept.pop(0)
            self._count_kept(-oldest.nbytes())

    def _count_kept(self, nbytes: int) -> None:
        self.kept += nbytes
        self.ledger.add("gathers_kept", nbytes)
