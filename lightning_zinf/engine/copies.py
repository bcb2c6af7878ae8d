"""Device copies of host-tier shards: copied ahead of their gathers, and accounted until waited for.

A gather of a shard that lives in host memory (the ``cpu`` parameter tier, or frozen codes kept
there) first copies it to the device on the copy stream, then all-gathers from that copy; the copy
is alive from its issue until the gather is waited for (:class:`~lightning_zinf.engine.transfer.HeldUntilWait`
keeps it). ZeRO-Infinity's overlap-centric design (Rajbhandari et al., SC'21, §6.2) has the link
move shards further ahead than the gathers themselves: a shard is 1/W of its unit, so copying the
next units' shards ahead (:meth:`DeviceCopies.copy_ahead`, within a byte budget) costs little
device memory, while gathering them ahead would cost whole units. The gather then reads the
copy (:meth:`~lightning_zinf.engine.flat.FlatGroup.start_gather`'s ``staged``) instead of
waiting for the link. Shards' copies, made ahead or by the gather, run on a copy stream of
their own (:meth:`~lightning_zinf.engine.transfer.Transfers.copy_ahead`), in the order of use: a
gather, and the compute that waits for it, wait for the copy they read, not for the later units'
copies queued before the gather was issued.

Every such device copy is accounted in the ledger under ``"staged"``: copied ahead and not yet
gathered, and held by a gather in flight.
"""

from __future__ import annotations

from typing import Iterable

from torch import Tensor

from lightning_zinf.comm import Handle
from lightning_zinf.engine.flat import FlatGroup
from lightning_zinf.engine.ledger import MemoryLedger
from lightning_zinf.engine.transfer import CopiedAhead, HeldUntilWait

__all__ = ["DeviceCopies", "copies_nbytes"]


def copies_nbytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors`` (a tensor and its cast to its own dtype, the
    same tensor, count once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


class DeviceCopies:
    """The device copies of host-tier shards that are alive: copied ahead of their gathers, and
    held by gathers in flight; their bytes in ``ledger`` under ``"staged"``.

    Args:
        ledger: The engine's ledger.

    Attributes:
        ahead_bytes: Bytes copied ahead and not yet taken by a gather.
    """

    def __init__(self, ledger: MemoryLedger) -> None:
        self.ledger = ledger
        self.ahead_bytes = 0
        self._ahead: dict[int, CopiedAhead] = {}  # by id of the group
        self._held: dict[int, int] = {}  # bytes held, by id of the gather's handle

    @staticmethod
    def nbytes_to_copy(groups: Iterable[FlatGroup]) -> int:
        """Bytes :meth:`copy_ahead` would copy for ``groups`` (0: their gathers read no host memory)."""
        return sum(copies_nbytes(g.stage_source()) for g in groups)

    def copied(self, groups: Iterable[FlatGroup]) -> bool:
        """Whether some of ``groups`` has a copy made ahead and not yet taken."""
        return any(id(g) in self._ahead for g in groups)

    def copy_ahead(self, groups: Iterable[FlatGroup]) -> None:
        """Start copying the host-side sources of ``groups`` (released groups of a unit the trace
        says comes soon) to the device (:meth:`FlatGroup.stage <lightning_zinf.engine.flat.FlatGroup.stage>`)."""
        for group in groups:
            if id(group) in self._ahead:
                continue
            copied = group.stage()
            if copied is not None:
                self._ahead[id(group)] = copied
                self._add(copies_nbytes(copied.tensors))

    def start_gather(self, group: FlatGroup, quantized: bool = False, from_secondary: bool = True,
                     read: bool = False) -> Handle:
        """``group.start_gather`` reading the copy made ahead of it, if any; what the gather then
        holds on the device until it is waited for is accounted until :meth:`waited`."""
        staged = self._ahead.pop(id(group), None)
        if staged is not None:
            self._add(-copies_nbytes(staged.tensors))
        handle = group.start_gather(quantized, from_secondary=from_secondary, read=read, staged=staged)
        if isinstance(handle, HeldUntilWait):
            # A kept qwZ row is the group's, counted under "secondary".
            held = copies_nbytes(t for t in handle.tensors if t is not group.qwz_row)
            if held:
                self._held[id(handle)] = held
                self.ledger.add("staged", held)
        return handle

    def waited(self, handle: Handle) -> None:
        """Call before waiting for a handle :meth:`start_gather` returned: the device copies it
        holds are freed by the wait."""
        self.ledger.add("staged", -self._held.pop(id(handle), 0))

    def drop_ahead(self) -> None:
        """Forget every copy made ahead and not taken (a pass ended, or the shards are about to
        change: the copies would hold old values). Only the ahead stream used them, so their memory
        is free for its next work at once."""
        self._ahead.clear()
        self._add(-self.ahead_bytes)

    def _add(self, nbytes: int) -> None:
        self.ahead_bytes += nbytes
        self.ledger.add("staged", nbytes)
