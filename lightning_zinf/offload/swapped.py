"""A CPU tensor swapped between memory and an NVMe swap file, keeping its identity."""

from __future__ import annotations

from torch import Tensor

from lightning_zinf.offload.swapper import NvmeSwapper

__all__ = ["SwappedTensor"]


class SwappedTensor:
    """A CPU tensor whose bytes move between memory and one swap file (ZeRO-Infinity §5.1: a
    shard on the nvme tier).

    States: resident (storage allocated, maybe a write in flight) or out (zero bytes of storage,
    the file holds the bytes), maybe with a read in flight after :meth:`swap_in`. The tensor object
    stays the same throughout, and views of it made while it was resident see the bytes again
    after a swap in, so optimizers and parameters keep their references.

    Args:
        tensor: A contiguous CPU tensor that owns its storage (not a view).
        key: Its swap file's name in ``swapper``.
        swapper: The rank's :class:`~lightning_zinf.offload.NvmeSwapper`.
    """

    def __init__(self, tensor: Tensor, key: str, swapper: NvmeSwapper) -> None:
        self.tensor, self.key, self.swapper = tensor, key, swapper
        self.nbytes = tensor.numel() * tensor.element_size()
        self.resident = True
        self._write = None
        self._read = None

    @property
    def writing(self) -> bool:
        """A write of the bytes is in flight."""
        return self._write is not None

    def swap_out(self, write: bool = True) -> None:
        """Start writing the bytes (``write``) and free the storage once written (:meth:`settle`)."""
        if not self.resident or self._write is not None:
            return
        if write:
            self._write = self.swapper.write(self.key, self.tensor)
        else:
            self._release()

    def settle(self) -> None:
        """Complete whatever transfer is in flight (raises the swapper's error if it failed)."""
        if self._write is not None:
            self._write.wait()
            self._write = None
            self._release()
        if self._read is not None:
            self._read.wait()
            self._read = None

    def reap(self) -> bool:
        """If a write has completed, free the storage (non-blocking); True when nothing is left in flight."""
        if self._write is not None and self._write.done():
            self.settle()
        return self._write is None

    def swap_in(self, read: bool = True) -> None:
        """Make the storage exist again; ``read``: start reading the file into it (:meth:`settle`
        completes it). A tensor whose write is still in flight keeps its bytes and needs no read."""
        if self._write is not None:
            self._write.wait()  # the bytes never left memory; the file is now current too
            self._write = None
            return
        if self.resident:
            return
        self.tensor.untyped_storage().resize_(self.nbytes)
        self.resident = True
        if read:
            self._read = self.swapper.read(self.key, self.tensor)

    def _release(self) -> None:
        self.tensor.untyped_storage().resize_(0)
        self.resident = False
