"""Parameter offload: each flat group's compute-dtype shard on the ``cpu`` or ``nvme`` tier
(ZeRO-Infinity, Rajbhandari et al. SC'21, §5.1 and §6.2).

``cpu``: the shard lives in CPU memory; a gather copies it to the device and all-gathers from there.

``nvme``: the shard lives in a swap file. It is read back just before its unit is gathered, or
earlier along the prefetch trace (``read_ahead`` units ahead of the current one), and dropped as
soon as the all-gather has completed: the file still holds the same bytes, so nothing is written.
It is written only when the shard changes: after an optimizer step, a load, or an edit made
inside ``gathered(write_back=True)``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

import torch

from lightning_zinf.engine.flat import FlatGroup
from lightning_zinf.offload.swapped import SwapRecord, SwapSpace, record_layout

__all__ = ["ParamOffload"]


class ParamOffload:
    """Swaps the parameter shards of flat groups (``nvme`` tier); the ``cpu`` tier needs nothing
    beyond placing the shards in CPU memory, which :class:`FlatGroup` does.

    Args:
        space: The rank's swapper and staging pool.
    """

    def __init__(self, space: SwapSpace) -> None:
        self.space = space
        self._shards: dict[int, SwapRecord] = {}

    @staticmethod
    def planned_bytes(shards: Iterable[tuple[torch.dtype, int]]) -> int:
        """Bytes the swap files of these shards take, each given as ``(dtype, shard elements)``
        (as :meth:`add` writes them: one record per shard, padded to whole 4096-byte blocks)."""
        return sum(record_layout(_shard_regions(dtype, numel))[1] for dtype, numel in shards)

    def add(self, group: FlatGroup, key: str) -> None:
        """Take over ``group``'s shard: write it out and free its memory (at construction, so the
        model never has all of its shards in memory)."""
        record = self._shards[id(group)] = SwapRecord(self.space, key, _shard_regions(group.dtype, group.shard_numel))
        record.bind(group.shard, "shard")
        record.adopt()
        record.swap_out()

    def record(self, group: FlatGroup) -> SwapRecord:
        """The swap record holding ``group``'s shard (region ``"shard"``)."""
        return self._shards[id(group)]

    def read_ahead(self, groups: Iterable[FlatGroup]) -> None:
        """Start reading these groups' shards (they are gathered soon)."""
        for group in groups:
            self._shards[id(group)].swap_in(ahead=True)

    def acquire(self, group: FlatGroup) -> None:
        """The shard in memory now (before its all-gather starts)."""
        self.space.reap()
        record = self._shards[id(group)]
        record.swap_in()
        record.settle()

    def drop(self, group: FlatGroup) -> None:
        """After the all-gather completed: free the shard; its file is still current."""
        record = self._shards[id(group)]
        record.settle()
        record.swap_out(write=False)

    def will_overwrite(self, group: FlatGroup) -> None:
        """Give the shard memory (without reading: every element is about to be overwritten)."""
        record = self._shards[id(group)]
        record.swap_in(read=False)
        record.settle()

    def changed(self, group: FlatGroup) -> None:
        """The shard was modified: write it out (behind) and free it once written."""
        self._shards[id(group)].swap_out(write=True)

    def settle_all(self) -> None:
        """Complete every transfer in flight, and free shards read ahead for gathers that did not
        happen (the trace changed); their files are current."""
        for record in self._shards.values():
            record.settle()
            if record.resident:
                record.swap_out(write=False)

    @contextmanager
    def resident(self, groups: Iterable[FlatGroup], write_back: bool) -> Iterator[None]:
        """Every shard in memory for the block; afterwards written (``write_back``) or dropped."""
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

    def tier_bytes(self) -> dict[str, int]:
        """Bytes of parameter shards in CPU memory now and in swap files."""
        cpu = sum(s.nbytes for s in self._shards.values() if s.resident)  # staged, O_DIRECT-padded
        return {"cpu": cpu, "nvme": sum(s.nbytes for s in self._shards.values()) - cpu}


def _shard_regions(dtype: torch.dtype, numel: int) -> list[tuple[str, torch.dtype, int]]:
    return [("shard", dtype, numel)]
