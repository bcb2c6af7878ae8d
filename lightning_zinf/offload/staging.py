"""Host staging memory for swapped state: aligned, optionally pinned, bounded, reused.

ZeRO-Infinity's DeepNVMe (Rajbhandari et al., SC'21, §6.3) moves data between NVMe and a fixed pool
of page-locked, aligned CPU buffers, so that ``O_DIRECT`` transfers need no bounce copy and host
memory stays bounded however large the model is. :class:`StagingPool` is that pool: every record
swapped in from NVMe lives in one of its buffers, which are page-aligned, pinned when an accelerator
is used, kept for reuse by size once given back, and never exceed ``cap`` bytes in total.

On CUDA (and ROCm, whose runtime torch exposes under the same name) the pool owns its page-locked
memory: each buffer is an anonymous mapping of its own, registered with the runtime
(``cudaHostRegister``) and unregistered and unmapped when the pool frees it. Buffers from torch's
caching host allocator (``pin_memory=True``) would not leave the process when freed: that cache
keeps every freed block for reuse (rounded up to a power of two), and only emptying it, for the
whole process, gives them back, which synchronises the device and makes every other pinned user
(activation offload, the copies' staging) allocate afresh. Memory registered this way is not
tracked by that allocator either: nothing keeps a buffer alive for a copy still reading it, so the
engine waits on the host for the copies from a buffer before giving it back (the gathers of
:mod:`lightning_zinf.engine.units`).
"""

from __future__ import annotations

import mmap
import os
import warnings
import weakref
from typing import Optional

import torch
from torch import Tensor

from lightning_zinf.offload.aligned import ALIGNMENT, aligned_empty, round_up

__all__ = ["StagingPool", "registered_empty"]

#: Mappings whose finalizer ran in a forked child: MADV_DONTFORK left the child without their pages,
#: and unmapping their addresses there could remove whatever the child has mapped since.
_ORPHANED: list[mmap.mmap] = []


def _host_register(address: int, nbytes: int, device_index: int) -> None:
    """Page-lock ``nbytes`` bytes at ``address`` for CUDA device ``device_index``
    (``cudaHostRegisterDefault``).

    Raises:
        RuntimeError: the runtime refused (the message has its error code).
    """
    # The registration belongs to the current device's context: the engine's, whose copies read it.
    with torch.cuda.device(device_index):
        error = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0))
    if error:
        raise RuntimeError(
            f"page-locking {nbytes} bytes of NVMe staging memory failed (cudaError {error}); set "
            "OffloadConfig.pin_memory=False to stage in pageable memory (copies to the device are then synchronous)."
        )


def _host_unregister(address: int, device_index: int) -> None:
    """Undo :func:`_host_register` of the range starting at ``address`` (warns if the runtime refuses:
    this runs from a finalizer, where raising would only print)."""
    with torch.cuda.device(device_index):
        error = int(torch.cuda.cudart().cudaHostUnregister(address))
    if error:
        warnings.warn(f"cudaHostUnregister of an NVMe staging buffer failed (cudaError {error}); its pages "
                      "stay locked until the process ends.", RuntimeWarning, stacklevel=2)


def _unmap(mapping: mmap.mmap, address: int, device_index: int, owner: int) -> None:
    # Runs once the last tensor on the mapping is gone (their memoryview's weak-reference callback,
    # which CPython calls after the view's export is released), so nothing can reach the pages.
    if os.getpid() != owner:
        _ORPHANED.append(mapping)
        return
    _host_unregister(address, device_index)
    mapping.close()


def registered_empty(nbytes: int, device_index: int) -> Tensor:
    """An uninitialised 1-D ``torch.uint8`` CPU tensor of ``nbytes`` bytes (> 0) in page-locked
    memory of its own: a private anonymous mapping (page-aligned, so ``O_DIRECT``-aligned), which
    the tensor's storage starts at exactly (``is_pinned()`` holds and copies to the device are
    asynchronous), registered with CUDA device ``device_index``'s runtime. A forked child (a
    ``DataLoader`` worker) does not inherit the pages (``MADV_DONTFORK``, where the platform has
    it), so it can neither share them nor copy them on write under a running copy. Unregistered and
    unmapped when the last tensor viewing the memory is gone, by whatever thread drops it; a copy
    must not read it then (no allocator tracks it: wait on the host first).

    Raises:
        RuntimeError: the runtime refused to register the memory.
    """
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_DONTFORK"):
        mapping.madvise(mmap.MADV_DONTFORK)
    # The storage holds a reference to the memoryview, which holds an export of the mapping, so the
    # mapping cannot be closed under a live tensor; the view's finalizer unregisters, then unmaps.
    view = memoryview(mapping)
    buffer = torch.frombuffer(view, dtype=torch.uint8)
    address = buffer.data_ptr()
    _host_register(address, nbytes, device_index)
    # Not at exit: tensors may still view the memory then, and the process's pages go with it.
    weakref.finalize(view, _unmap, mapping, address, device_index, os.getpid()).atexit = False
    return buffer


class StagingPool:
    """A bounded pool of page-aligned byte buffers (``torch.uint8``, 1-D).

    Page-locked buffers (``pin_memory``) depend on ``device``'s type: ``cuda`` (ROCm included):
    :func:`registered_empty`, page-locked bytes equal to :attr:`held`, returned to the system as
    soon as the pool frees a buffer. Other accelerators, which torch offers no registration API
    for: blocks of torch's caching host allocator; a buffer freed to stay under the cap goes back
    to that cache, not to the system (the process's page-locked memory may stay above the cap;
    later pinned allocations of the process reuse it), and the pool never empties that cache.

    Args:
        cap: Most bytes of buffers held at once (in use or kept for reuse); ``None``: no bound.
        pin_memory: Allocate page-locked buffers.
        device: The accelerator whose copies read the buffers (with ``pin_memory``); a ``cuda``
            device without an index means the current one.

    Raises:
        ValueError: ``pin_memory`` without an accelerator ``device``.

    Attributes:
        in_use: Bytes of buffers handed out and not given back.
        held: Bytes of all buffers allocated (in use plus kept for reuse).
        peak: The largest ``in_use`` so far.
    """

    def __init__(self, cap: Optional[int], pin_memory: bool = False, device: Optional[torch.device] = None) -> None:
        if pin_memory and (device is None or torch.device(device).type == "cpu"):
            raise ValueError(f"StagingPool(pin_memory=True) needs the accelerator device its copies go to, got {device!r}.")
        self.cap = cap
        self.pin_memory = pin_memory
        device = torch.device(device) if pin_memory else None
        self._registered = device is not None and device.type == "cuda"
        self._device_index = (device.index if device.index is not None else torch.cuda.current_device()) if self._registered else None
        self._free: dict[int, list[Tensor]] = {}
        self.in_use = 0
        self.held = 0
        self.peak = 0

    def take(self, nbytes: int, capped: bool = True) -> Optional[Tensor]:
        """A buffer of ``round_up(nbytes, 4096)`` bytes (uninitialised), or ``None`` when handing it
        out would exceed ``cap`` even after freeing every buffer kept for reuse (the caller then
        waits for buffers to come back, or reports that the cap is too small). ``capped=False``
        ignores the cap (whole-state operations such as a checkpoint).

        Raises:
            RuntimeError: page-locking a new buffer failed (:func:`registered_empty`).
        """
        size = round_up(max(nbytes, 1), ALIGNMENT)
        free = self._free.get(size)
        if free:
            buffer = free.pop()
        else:
            if capped and self.cap is not None and self.held + size > self.cap:
                self._trim(self.held + size - self.cap)
                if self.held + size > self.cap:
                    return None
            buffer = self._new(size)
            self.held += size
        self.in_use += size
        self.peak = max(self.peak, self.in_use)
        return buffer

    def outside(self, nbytes: int) -> Tensor:
        """A buffer like :meth:`take`'s (aligned, page-locked with ``pin_memory``) that is neither
        counted against the cap nor given back: for records kept in host memory for good
        (:meth:`SwapRecord.keep_in_host <lightning_zinf.offload.swapped.SwapRecord.keep_in_host>`);
        freed when its last view is dropped.

        Raises:
            RuntimeError: page-locking it failed (:func:`registered_empty`).
        """
        return self._new(round_up(max(nbytes, 1), ALIGNMENT))

    def _new(self, size: int) -> Tensor:
        if self._registered:
            return registered_empty(size, self._device_index)
        return aligned_empty(size, torch.uint8, pin_memory=self.pin_memory)

    def give(self, buffer: Tensor) -> None:
        """Return a buffer from :meth:`take`, no longer read or written by any transfer (the caller
        has waited on the host for them); it is kept for the next request of its size, unless the
        pool holds more than its cap (after an uncapped take), in which case it is freed (a
        registered buffer is unregistered and unmapped once the caller drops it too)."""
        size = buffer.numel()
        self.in_use -= size
        if self.cap is not None and self.held > self.cap:
            self.held -= size
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
