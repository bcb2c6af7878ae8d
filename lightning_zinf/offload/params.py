"""Parameter offload: each flat group's shard on the ``cpu`` or ``nvme`` tier (ZeRO-Infinity,
Rajbhandari et al. SC'21, §5.1 and §6.2).

``cpu``: the shard lives in CPU memory; a gather copies it to the device and all-gathers from there.

``nvme``: the shard lives in a swap file. It is read back just before its unit is gathered, or
earlier along the prefetch trace (``read_ahead`` units ahead of the current one), and dropped as
soon as the all-gather has completed: the file still holds the same bytes, so nothing is written.
It is written only when the shard changes: after an optimizer step, a load, or an edit made
inside ``gathered(write_back=True)``.

Under a narrower compute dtype (``MixedPrecisionConfig.param_dtype``: bf16 or fp16 gathers of fp32
parameters) a group also keeps a *compute copy* on NVMe: its shard cast to the compute dtype, in a
record of its own, rewritten whenever the shard is. Gathers for compute read only that copy, so
each forward and backward reads 2 bytes per parameter from the disk instead of 4, as ZeRO-Infinity
moves its 16-bit parameters (§4: "parameters ... in fp16"; its fp32 copy lives with the optimizer
state). The fp32 shard stays the exact value that reads, checkpoints and the optimizer use; with
the optimizer on NVMe it is the master itself (one record for both).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Optional

import torch

from lightning_zinf.engine.flat import FlatGroup, keeps_compute_copy
from lightning_zinf.offload.swapped import SwapRecord, SwapSpace, record_layout

__all__ = ["ParamOffload"]


class ParamOffload:
    """Swaps the parameter shards of flat groups, and their compute copies (``nvme`` tier); the
    ``cpu`` tier needs nothing beyond placing the shards in CPU memory, which :class:`FlatGroup`
    does.

    Args:
        space: The rank's swapper and staging pool.
        host_bytes: Bytes of shards and compute copies :meth:`add` keeps in host memory instead
            (``OffloadConfig.host_bytes`` when the optimizer is not on NVMe: the groups added
            first, until the next does not fit; :meth:`keep_in_host` moves more later).
    """

    def __init__(self, space: SwapSpace, host_bytes: int = 0) -> None:
        self.space = space
        self._host_room: Optional[int] = host_bytes  # None once a group did not fit (a prefix)
        self._shards: dict[int, SwapRecord] = {}
        self._copies: dict[int, SwapRecord] = {}  # compute copies, by group
        # Whether an optimizer step in flight will rewrite a group's shard (offload.stepping): a
        # read ahead of it would read values about to be replaced.
        self.rewrites: Callable[[FlatGroup], bool] = lambda group: False

    @staticmethod
    def planned_bytes(shards: Iterable[tuple[torch.dtype, torch.dtype, int]]) -> int:
        """Bytes the swap files of these shards take, each given as ``(dtype, compute dtype, shard
        elements)`` (as :meth:`add` writes them: one record per shard and one per compute copy,
        each padded to whole 4096-byte blocks)."""
        total = 0
        for dtype, compute_dtype, numel in shards:
            total += record_layout(_regions("shard", dtype, numel))[1]
            if keeps_compute_copy(dtype, compute_dtype):
                total += record_layout(_regions("copy", compute_dtype, numel))[1]
        return total

    def add(self, group: FlatGroup, key: str) -> None:
        """Take over ``group``'s shard, and make its compute copy where
        :func:`~lightning_zinf.engine.flat.keeps_compute_copy` says so: write them out and free
        their memory (at construction, so the model never has all of its shards in memory), or,
        while the ``host_bytes`` left hold them, keep them in host memory unwritten."""
        cost = self.planned_bytes([(group.dtype, group.compute_dtype, group.shard_numel)])
        in_host = self._host_room is not None and cost <= self._host_room
        self._host_room = self._host_room - cost if in_host else None
        record = self._shards[id(group)] = SwapRecord(self.space, key, _regions("shard", group.dtype, group.shard_numel),
                                                      in_host=in_host)
        record.bind(group.shard, "shard")
        record.adopt()
        if keeps_compute_copy(group.dtype, group.compute_dtype):
            group.compute_shard = group.shard.to(group.compute_dtype)
            copy = self._copies[id(group)] = SwapRecord(
                self.space, f"{key}.copy", _regions("copy", group.compute_dtype, group.shard_numel), in_host=in_host)
            copy.bind(group.compute_shard, "copy")
            copy.adopt()
            copy.swap_out()
        record.swap_out()

    def host_cost(self, group: FlatGroup) -> int:
        """Bytes that keeping ``group``'s shard and compute copy in host memory takes
        (:meth:`keep_in_host`); 0 for a group this offload does not swap (frozen codes)."""
        return sum(r.nbytes for r in self._records_of(group))

    def keep_in_host(self, group: FlatGroup) -> None:
        """Keep ``group``'s shard and compute copy in host memory for good, their files deleted
        (:meth:`SwapRecord.keep_in_host`; ``OffloadConfig.host_bytes``): its gathers read no
        disk, and a changed shard is not written. Nothing for a group this offload does not swap."""
        group.transfers.host_wait_h2d()  # a copy made ahead may still read the staging buffer given back
        for record in self._records_of(group):
            record.keep_in_host()

    def _records_of(self, group: FlatGroup) -> list[SwapRecord]:
        return [r for r in (self._shards.get(id(group)), self._copies.get(id(group))) if r is not None]

    def record(self, group: FlatGroup) -> SwapRecord:
        """The swap record holding ``group``'s shard (region ``"shard"``)."""
        return self._shards[id(group)]

    def _source(self, group: FlatGroup, read: bool) -> SwapRecord:
        """What a gather reads: the compute copy for compute (where there is one), else the shard."""
        copy = None if read else self._copies.get(id(group))
        return copy if copy is not None else self._shards[id(group)]

    def read_ahead(self, groups: Iterable[FlatGroup]) -> None:
        """Start reading what these groups' gathers for compute read (they are gathered soon),
        unless an optimizer step in flight rewrites it first (:attr:`rewrites`)."""
        for group in groups:
            if not self.rewrites(group):
                self._source(group, read=False).swap_in(ahead=True)

    def acquire(self, group: FlatGroup, read: bool = False) -> None:
        """What the gather reads in memory now (before it starts): the shard for a gather for
        reading (``read``: exact values), else the compute copy where there is one."""
        self.space.reap()
        record = self._source(group, read)
        record.swap_in()
        record.settle_read()  # a write behind (the step's) goes on: the gather only reads the bytes
        record.pins += 1  # until drop(): a held copy stays in memory under staging pressure

    def drop(self, group: FlatGroup, read: bool = False) -> None:
        """After the all-gather that :meth:`acquire` (same ``read``) served completed: free what
        it read; its file is still current. A compute copy held unwritten stays in memory (for
        backward's gather and the next forward's)."""
        record = self._source(group, read)
        record.settle_read()
        record.pins = max(0, record.pins - 1)
        if not record.dirty:
            record.swap_out(write=False)  # given back now, or once a write behind completes

    def will_overwrite(self, group: FlatGroup) -> None:
        """Give the shard memory (without reading: every element is about to be overwritten)."""
        record = self._shards[id(group)]
        record.swap_in(read=False)
        record.settle()

    def changed(self, group: FlatGroup) -> None:
        """The shard (in memory) was modified: refresh its compute copy, and write both out
        (behind), each freed once written."""
        self.refresh_copies([group])
        self._shards[id(group)].swap_out(write=True)

    def refresh_copies(self, groups: Iterable[FlatGroup]) -> None:
        """Rewrite the compute copies of these groups' shards (in memory, modified) from them.
        Each is held in staging memory unwritten while there is room to hold it
        (:meth:`SwapSpace.room_to_hold`), else written behind: the next forward and backward
        gather it from memory, and it is written only if staging memory is needed for something
        else first (then read back from its file), so a step costs no write and no reads of the
        16-bit copies. Groups without a copy are skipped."""
        for group in groups:
            copy = self._copies.get(id(group))
            if copy is None:
                continue
            copy.settle()  # a read ahead of the copy being replaced
            copy.swap_in(read=False)
            copy.settle()
            group.compute_shard.copy_(group.shard)
            if self.space.room_to_hold(copy):
                copy.hold()
            else:
                copy.swap_out(write=True)

    def settle_all(self) -> None:
        """Complete every transfer in flight, and free shards and copies read ahead for gathers
        that did not happen (the trace changed); their files are current. A shard that is also an
        optimizer step's master record held by a step in flight is left to that step, and compute
        copies held unwritten stay held."""
        for record in [*self._shards.values(), *self._copies.values()]:
            if record.claimed or record.dirty:
                continue
            record.settle()
            if record.resident:
                record.swap_out(write=False)

    @contextmanager
    def resident(self, groups: Iterable[FlatGroup], write_back: bool) -> Iterator[None]:
        """Every shard in memory for the block; afterwards written (``write_back``: they were
        modified; the caller refreshes their compute copies before the block ends,
        :meth:`refresh_copies`) or dropped."""
        records = [self._shards[id(group)] for group in groups]
        with self.space.uncapped():
            for record in records:
                record.swap_in()
            for record in records:
                record.settle()
            try:
                yield
            except BaseException:
                write_back = False  # a failed edit or load: the files keep the state from before
                raise
            finally:
                for record in records:
                    record.swap_out(write=write_back)
                for record in records:
                    record.settle()

    def file_bytes(self) -> int:
        """Bytes of the shards and compute copies that have swap files (all but those kept in host
        memory)."""
        return sum(r.nbytes for r in [*self._shards.values(), *self._copies.values()] if not r.in_host)

    def tier_bytes(self) -> dict[str, int]:
        """Bytes of parameter shards and compute copies in CPU memory now and in swap files."""
        records = [*self._shards.values(), *self._copies.values()]
        cpu = sum(r.nbytes for r in records if r.resident)  # staged, O_DIRECT-padded
        return {"cpu": cpu, "nvme": sum(r.nbytes for r in records) - cpu}


def _regions(name: str, dtype: torch.dtype, numel: int) -> list[tuple[str, torch.dtype, int]]:
    return [(name, dtype, numel)]
