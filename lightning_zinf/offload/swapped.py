"""Swap records: named tensors laid out in one swap file, staged in one aligned buffer when in memory.

ZeRO-Infinity (Rajbhandari et al., SC'21, §5.1 and §6.3) keeps shards and optimizer states on NVMe
and brings them into CPU memory only around their use. Here the unit of swapping is a *record*: a
few regions (e.g. one group's fp32 master, or its Adam moments) stored back to back in one file, so
one swap is one large sequential transfer instead of many small files, and staged in one buffer of
the rank's :class:`~lightning_zinf.offload.staging.StagingPool`, page-aligned so that ``O_DIRECT``
moves it without a bounce copy.

The tensors that user code and the optimizer hold (a master shard, its per-parameter fragments,
optimizer states) are *bound* to places in a record: while the record is in memory their ``.data``
points into the staging buffer, while it is out they are empty tensors. They keep their identity
throughout, so optimizers and parameter lists keep their references.
"""

from __future__ import annotations

import collections
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor

from lightning_zinf.engine.ranges import phase, phased
from lightning_zinf.offload.aligned import round_up
from lightning_zinf.offload.errors import SwapError
from lightning_zinf.offload.staging import StagingPool
from lightning_zinf.offload.swapper import NvmeSwapper

__all__ = ["SwapRecord", "SwapSpace", "record_layout"]

_REGION_ALIGN = 64  # bytes: every region starts on a cache line (vectorised CPU kernels)


def record_layout(regions: list[tuple[str, torch.dtype, int]]) -> tuple[dict[str, int], int]:
    """Where each region of a swap record starts and the record's size on disk, in bytes.

    Args:
        regions: ``(name, dtype, numel)`` per region, in file order.

    Returns:
        The byte offset of each region (each on a 64-byte boundary) and the file's size: the
        regions back to back, rounded up to whole 4096-byte ``O_DIRECT`` blocks (at least one).
        What :class:`SwapRecord` writes, and what the NVMe preflight counts.
    """
    offsets: dict[str, int] = {}
    end = 0
    for name, dtype, numel in regions:
        offsets[name] = end
        end = round_up(end + numel * dtype.itemsize, _REGION_ALIGN)
    return offsets, round_up(max(end, 1))


class SwapSpace:
    """A rank's swapper plus its staging pool, and the records whose writes are in flight.

    When the pool is at its cap, taking a buffer first completes the oldest writes in flight (their
    buffers come back), then starts writing the records held unwritten (:meth:`SwapRecord.hold`),
    oldest first, then gives up reads made ahead of need, newest first (their files are current):
    the back-pressure that bounds staging memory.

    Args:
        swapper: The rank's NVMe swapper.
        pool: The rank's staging pool.
    """

    def __init__(self, swapper: NvmeSwapper, pool: StagingPool) -> None:
        self.swapper = swapper
        self.pool = pool
        self._writing: collections.deque[SwapRecord] = collections.deque()
        self._ahead: list[SwapRecord] = []
        # Records held unwritten (SwapRecord.hold), oldest first, and their bytes: kept by the
        # records' own dirty transitions, so that neither backward nor the cap scans them.
        self._held: dict[int, SwapRecord] = {}
        self._held_bytes = 0
        self._uncapped = 0
        # Called when the cap is reached and nothing else gives a buffer back: completes an
        # optimizer step in flight (offload.stepping), whose records then leave memory; True if
        # it did anything.
        self.relieve: Optional[Callable[[], bool]] = None

    def take(self, nbytes: int, key: str, optional: bool = False) -> Optional[Tensor]:
        """A staging buffer of at least ``nbytes`` bytes for record ``key``; ``optional`` (a read
        ahead, which may be skipped): ``None`` instead of an error when none can be had.

        Raises:
            SwapError: the pool's cap is reached and neither a write in flight nor a read ahead
                can give a buffer back; the message names ``OffloadConfig.staging_bytes`` and what
                else lowers the need.
        """
        self.reap()  # buffers of completed writes first, so that they are reused, not added
        while True:
            buffer = self.pool.take(nbytes, capped=not self._uncapped)
            if buffer is not None:
                return buffer
            while self._writing and not self._writing[0].writing:
                self._writing.popleft()
            if self._writing:
                self._writing.popleft().settle()
                continue
            # (claimed: a step's; pinned: a gather's, which reads it now)
            unclaimed = next((r for r in self._held.values() if not r.claimed and not r.pins), None)
            if unclaimed is not None and not optional:
                unclaimed.swap_out()  # a write in flight now, completed next round
                continue
            self._ahead = [r for r in self._ahead if r.ahead]
            if self._ahead and not optional:
                self._ahead.pop().give_up()
                continue
            if optional:
                return None
            if self.relieve is not None and self.relieve():
                continue
            raise SwapError(
                f"NVMe staging memory exhausted: swapping in {key!r} needs {nbytes} bytes while "
                f"{self.pool.in_use} of the cap of {self.pool.cap} bytes are in use by records "
                "needed at the same time. Raise OffloadConfig.staging_bytes, or lower "
                "OffloadConfig.sub_group_size (optimizer records stepped at once)."
            )

    @contextmanager
    def uncapped(self) -> Iterator[None]:
        """Let staging exceed the cap inside the block (whole-state operations: checkpoints)."""
        self._uncapped += 1
        try:
            yield
        finally:
            self._uncapped -= 1

    def room_to_hold(self, record: "SwapRecord") -> bool:
        """Whether ``record`` may be held unwritten (:meth:`SwapRecord.hold`): the records held stay
        within half the cap with it (the rest is for what the step and the next forward read)."""
        held = self._held_bytes - (record.nbytes if record.dirty else 0)
        return self.pool.cap is None or held + record.nbytes <= self.pool.cap // 2

    def _mark_held(self, record: "SwapRecord", held: bool) -> None:
        # (SwapRecord.dirty's transitions.) Held records are written under pressure, unless a step
        # claims them: then they are given up as reads ahead, or consumed.
        if held:
            self._held[id(record)] = record
            self._held_bytes += record.nbytes
        else:
            del self._held[id(record)]
            self._held_bytes -= record.nbytes

    def read_ahead(self, record: "SwapRecord") -> None:
        """``record`` was swapped in ahead of need: its buffer may be taken back under pressure."""
        self._ahead = [r for r in self._ahead if r.ahead]  # used or released since: forgotten
        self._ahead.append(record)

    def wrote(self, record: "SwapRecord") -> None:
        """``record`` has a write in flight; its buffer comes back once the write completes. Writes
        behind are bounded to a quarter of the cap: a producer faster than the disk (partitioning
        a model, the step) waits for the oldest instead of filling staging memory with them."""
        self._writing.append(record)
        if self.pool.cap is not None and not self._uncapped:
            while sum(r.nbytes for r in self._writing if r.writing) > self.pool.cap // 4 and len(self._writing) > 1:
                self._writing.popleft().settle()

    def reap(self) -> None:
        """Give back the buffers of completed writes, without waiting for the others."""
        self._writing = collections.deque(r for r in self._writing if not r.reap())


class SwapRecord:
    """Regions of tensors stored back to back in one swap file, staged in one buffer when in memory.

    States: in memory (a staging buffer, maybe a write in flight, or held unwritten with bytes the
    file lacks: :meth:`hold`) or out (no buffer; the file holds the bytes), maybe with a read in
    flight after :meth:`swap_in`; or kept in host memory for good (:attr:`in_host`): a buffer of
    its own outside the staging cap, no file, every swap a no-op.

    Args:
        space: The rank's :class:`SwapSpace`.
        key: The swap file's key.
        regions: ``(name, dtype, numel)`` per region, in file order.
        in_host: Create the record kept in host memory (:meth:`keep_in_host`).
    """

    def __init__(self, space: SwapSpace, key: str, regions: list[tuple[str, torch.dtype, int]],
                 in_host: bool = False) -> None:
        self.space, self.key = space, key
        self._in_host = in_host
        offsets, self.nbytes = record_layout(regions)  # whole O_DIRECT blocks: no bounced tail
        self._regions = {name: (offsets[name], dtype, numel) for name, dtype, numel in regions}
        self._bindings: list[tuple[Tensor, str, int, torch.Size]] = []
        self._buffer: Optional[Tensor] = None
        self._write = None
        self._read = None
        self.ahead = False  # swapped in ahead of need and not used since
        self._kept = False  # swapped in while its write was in flight: the buffer stays after the write
        self._dirty = False  # in memory with bytes the file does not have, and no write started (hold)
        self._on_disk = False  # a write was issued: the file exists (held records dropped unwritten may have none)
        # Held for an optimizer step in flight (offload.stepping): another thread may be reading or
        # writing its memory, so settling the parameter offload must leave it alone.
        self.claimed = False
        # Gathers reading the record's memory now (ParamOffload.acquire .. drop): staging pressure
        # must not write a held record out from under them and give its buffer away.
        self.pins = 0

    @property
    def in_host(self) -> bool:
        """Kept in host memory for good (:meth:`keep_in_host`): never written, read or given back."""
        return self._in_host

    def keep_in_host(self) -> None:
        """Move the record to host memory for good: its current bytes (read back if out, a write
        in flight completed) into a buffer of its own outside the staging cap
        (:meth:`StagingPool.outside`), its staging buffer given back and its file deleted. From
        then on swaps do nothing: the bound tensors stay views of that buffer, which is the only
        copy of the values (``OffloadConfig.host_bytes``: state placed on the host tier instead of
        NVMe). Idempotent.

        Raises:
            SwapError: reading the bytes back failed.
        """
        if self._in_host:
            return
        self.swap_in()
        self.settle()
        buffer = self.space.pool.outside(self.nbytes)
        staged, self._buffer = self._buffer, buffer
        buffer.copy_(staged[: buffer.numel()])
        self.dirty = False  # the bytes are where they stay now: nothing to write
        self.ahead = self._kept = False
        self._in_host = True
        self._point()
        self.space.pool.give(staged)
        self.space.swapper.remove(self.key)
        self._on_disk = False

    @property
    def resident(self) -> bool:
        """A staging buffer holds the record (possibly still being read or written)."""
        return self._buffer is not None

    @property
    def read_complete(self) -> bool:
        """No read of the record is in flight, or it has completed (:meth:`settle` then does not wait)."""
        return self._read is None or self._read.done()

    @property
    def writing(self) -> bool:
        """A write of the record is in flight."""
        return self._write is not None

    def bind(self, tensor: Tensor, region: str, offset: int = 0) -> None:
        """While in memory, ``tensor`` (its current shape, the region's dtype) is elements
        ``[offset, offset + tensor.numel())`` of ``region``; while out it is an empty tensor. Bind
        every tensor before :meth:`adopt`, which takes their values."""
        start, dtype, numel = self._regions[region]
        if tensor.dtype != dtype or offset + tensor.numel() > numel:
            raise ValueError(f"cannot bind a {tensor.dtype} tensor of {tensor.numel()} elements at {offset} of "
                             f"region {region!r} ({dtype}, {numel} elements) of swap record {self.key!r}.")
        self._bindings.append((tensor, region, offset, tensor.shape))

    def attach(self, tensor: Tensor, region: str, offset: int = 0) -> None:
        """Bind ``tensor`` to a record already in use (see :meth:`bind`); it takes the record's
        values at once if the record is in memory (its own are dropped)."""
        self.bind(tensor, region, offset)
        if self._buffer is not None:
            with torch.no_grad():
                tensor.data = self.view(region)[offset : offset + tensor.numel()].view(tensor.shape)

    def view(self, region: str) -> Tensor:
        """The region as a 1-D tensor of its dtype (the record must be in memory)."""
        assert self._buffer is not None, f"swap record {self.key!r} is not in memory"
        start, dtype, numel = self._regions[region]
        return self._buffer[start : start + numel * dtype.itemsize].view(dtype)

    def adopt(self) -> None:
        """Move the bound tensors' current values into a staging buffer and point them there (the
        record is in memory and unwritten afterwards; their old memory is freed once unreferenced)."""
        assert self._buffer is None, f"swap record {self.key!r} adopted twice"
        self._buffer = self.space.pool.outside(self.nbytes) if self._in_host else self.space.take(self.nbytes, self.key)
        for tensor, region, offset, _ in self._bindings:
            self.view(region)[offset : offset + tensor.numel()].copy_(tensor.detach().reshape(-1))
        self._point()

    def swap_out(self, write: bool = True) -> None:
        """Start writing the record (``write``) and give its buffer back once written (:meth:`settle`);
        without ``write`` the buffer is given back at once (the file is current), or once a write
        still in flight completes. A record held unwritten (:meth:`hold`) is written either way;
        one kept in host memory (:attr:`in_host`) stays as it is."""
        self._kept = False
        if self._buffer is None or self._write is not None or self._in_host:
            return
        if self._read is not None:
            self.settle()
        if write or self.dirty:
            self.dirty = False
            self._on_disk = True
            with phase("zinf.swap_out"):
                self._write = self.space.swapper.write(self.key, self._buffer[: self.nbytes])
            self.space.wrote(self)
        else:
            self._release()

    def settle(self) -> None:
        """Complete whatever transfer is in flight (raises the swapper's error if it failed). A
        completed write gives the buffer back, unless the record was swapped in meanwhile
        (:meth:`swap_in` during the write: its bytes are in use)."""
        if self._write is not None:
            write, self._write = self._write, None
            try:
                write.wait()
            finally:
                if not self._kept:
                    self._release()
        self.settle_read()

    def settle_read(self) -> None:
        """Complete a read in flight, if any (a write in flight goes on: the bytes in memory are
        valid while it runs, for readers)."""
        if self._read is not None:
            read, self._read = self._read, None
            try:
                read.wait()
            except BaseException:
                self._release()  # the buffer holds no valid bytes: nothing may use or save them
                raise

    def reap(self) -> bool:
        """If a write has completed, give the buffer back (non-blocking); True when no write is in flight."""
        if self._write is not None and self._write.done():
            self.settle()
        return self._write is None

    @phased("zinf.swap_in")
    def swap_in(self, read: bool = True, ahead: bool = False) -> None:
        """Give the record a staging buffer and point the bound tensors at it; ``read``: start reading
        the file into it (:meth:`settle` completes it). A record whose write is still in flight
        keeps its buffer and needs no read. ``ahead``: a read ahead of need, skipped when the
        staging cap leaves no room (a later swap in does it)."""
        if self._write is not None:
            # The bytes never left memory: readers use them while the write goes on (settle_read);
            # the buffer stays when the write completes, and a writer settles the write first.
            self._kept = True
            self.ahead = self.ahead and ahead
            return
        if self._buffer is not None:
            self.ahead = self.ahead and ahead  # used now: no longer given up under pressure
            return
        buffer = self.space.take(self.nbytes, self.key, optional=ahead)
        if buffer is None:
            return
        self._buffer = buffer
        self._point()
        if ahead:
            self.ahead = True
            self.space.read_ahead(self)
        if read and self._on_disk:
            self._read = self.space.swapper.read(self.key, self._buffer[: self.nbytes])
        elif read:  # only ever held and dropped (a consumed gradient): nothing to read, no stale bytes
            self._buffer[: self.nbytes].zero_()

    @property
    def dirty(self) -> bool:
        """Held unwritten (:meth:`hold`): in memory with bytes the file lacks, no write started."""
        return self._dirty

    @dirty.setter
    def dirty(self, value: bool) -> None:
        if value != self._dirty:
            self._dirty = value
            self.space._mark_held(self, value)

    def hold(self) -> None:
        """Keep the record in memory, modified, instead of writing it now: it is written when
        staging memory is needed (:class:`SwapSpace`'s back-pressure) or when it is swapped out,
        and never if :meth:`drop` comes first (a gradient shard the next step consumes in memory:
        no write, no read back). The record must be in memory with no transfer in flight. A record
        kept in host memory (:attr:`in_host`) is not held: it stays anyway."""
        assert self._buffer is not None and self._write is None and self._read is None, self.key
        self.dirty = not self._in_host

    def drop(self) -> None:
        """Give the buffer back without writing, whatever the bytes in memory are (they are no longer
        needed: a consumed gradient shard, a step that failed); the file keeps what it had."""
        self.dirty = False
        self.swap_out(write=False)

    def keep_ahead(self) -> None:
        """Keep a record that is in memory (or being written) there, as if read ahead of need: a
        write in flight goes on (the buffer stays after it), and the record is given up first under
        staging pressure. (Not one kept in host memory: it is never given up.)"""
        if self._buffer is None or self._in_host:
            return
        if self._write is not None:
            self._kept = True
        self.ahead = True
        self.space.read_ahead(self)

    def give_up(self) -> None:
        """Undo a swap in made ahead of need (staging memory is needed elsewhere); the file is current,
        or is made so (a record held unwritten starts its write, which gives the buffer back)."""
        if self.dirty:
            self.ahead = False
            self.swap_out()
            return
        self.settle()
        self._release()

    def discard(self) -> None:
        """Retire the record (another one replaces it): delete its file and give its buffer back.
        Bound tensors that another record has adopted since keep their new memory; the others
        become empty."""
        if self._write is not None:
            self._write.wait()
            self._write = None
        if self._read is not None:
            self._read.wait()
            self._read = None
        self.ahead = self.dirty = False
        if self._buffer is not None:
            lo = self._buffer.data_ptr()
            with torch.no_grad():
                for tensor, region, _, _ in self._bindings:
                    if tensor.numel() and lo <= tensor.data_ptr() < lo + self.nbytes:
                        tensor.data = torch.empty(0, dtype=self._regions[region][1])
            if not self._in_host:  # (a buffer of its own is freed with its last view)
                self.space.pool.give(self._buffer)
            self._buffer = None
        self.space.swapper.remove(self.key)

    def _point(self) -> None:
        with torch.no_grad():
            for tensor, region, offset, shape in self._bindings:
                tensor.data = self.view(region)[offset : offset + shape.numel()].view(shape)

    def _release(self) -> None:
        self._kept = False
        with torch.no_grad():
            for tensor, region, _, _ in self._bindings:
                tensor.data = torch.empty(0, dtype=self._regions[region][1])
        buffer, self._buffer = self._buffer, None
        self.ahead = False
        if buffer is not None:
            self.space.pool.give(buffer)
