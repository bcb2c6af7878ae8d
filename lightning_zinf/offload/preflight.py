"""NVMe preflight: before the engine writes to ``nvme_path``, check that what it will write fits there.

ZeRO-Infinity's NVMe tier (Rajbhandari et al., SC'21, §5.1 and §6.3) keeps parameter shards, fp32
masters, gradient shards and optimizer states in swap files; a disk that fills hours into a run
loses those hours. Each rank counts the bytes its swap records will take, with the sizes the records
are written with (:func:`~lightning_zinf.offload.swapped.record_layout`), and the ranks compare,
filesystem by filesystem, the sum over the ranks writing to it with its free space
(``shutil.disk_usage``). Ranks that share a filesystem share its free space, so one rank's view is
not enough; if any filesystem lacks room, every rank raises the same error.
"""

from __future__ import annotations

import os
import shutil
import socket
from dataclasses import dataclass
from typing import Optional

from lightning_zinf.comm.collectives import Collectives
from lightning_zinf.offload.errors import SwapError, gigabytes

__all__ = ["ensure_space", "shortfall", "Shortfall"]


@dataclass(frozen=True)
class _Claim:
    """What one rank is about to write, and where."""

    host: str
    device: Optional[int]  # st_dev of nvme_path: ranks with the same (host, device) share one filesystem
    path: str
    need: int
    free: Optional[int]
    before: int  # bytes this rank's swap records already take there


@dataclass(frozen=True)
class Shortfall:
    """A filesystem without room for what the ranks sharing it are about to write."""

    path: str  # the first such rank's path on it
    needed: int  # bytes those ranks are about to write there
    free: int  # bytes free there (the smallest any of them saw)
    total: int  # needed plus what their earlier files already take
    ranks: str  # who writes there, in words ("2 ranks of host-a write there")


def shortfall(comm: Collectives, path: str, need: int, before: int = 0) -> tuple[Optional[Shortfall], int]:
    """Whether the bytes every rank is about to write under its ``path`` fit in the free space of
    the filesystem holding it, summed over the ranks that share that filesystem (same host and
    ``st_dev``). Collective over ``comm``'s control group; every rank gets the same answer.

    Args:
        comm: The engine's collectives (``all_gather_object`` of one small record per rank).
        path: An existing folder this rank is about to write under.
        need: Bytes this rank is about to write there.
        before: Bytes this rank's earlier files already take there (for the total in messages).

    Returns:
        The first filesystem that lacks room, or ``None`` when all have it (a path that cannot be
        inspected counts as having room: the write itself reports it); and the bytes (``need`` plus
        ``before``) of every rank writing to this rank's filesystem.
    """
    try:
        device: Optional[int] = os.stat(path).st_dev
        free: Optional[int] = shutil.disk_usage(path).free
    except OSError:
        device = free = None
    mine = _Claim(socket.gethostname(), device, os.path.abspath(path), need, free, before)
    claims: list[_Claim] = comm.all_gather_object(mine)
    shared: dict[tuple[str, Optional[int]], list[_Claim]] = {}
    for claim in claims:
        shared.setdefault((claim.host, claim.device), []).append(claim)
    for (host, device), group in shared.items():
        frees = [c.free for c in group if c.free is not None]
        needed = sum(c.need for c in group)
        if device is None or not frees or needed <= min(frees):
            continue
        ranks = f"{len(group)} ranks of {host} write there" if len(group) > 1 else f"1 rank of {host} writes there"
        return Shortfall(group[0].path, needed, min(frees), needed + sum(c.before for c in group), ranks), 0
    return None, sum(c.need + c.before for c in shared[(mine.host, mine.device)])


def ensure_space(comm: Collectives, nvme_path: str, need: int, what: str, before: int = 0) -> int:
    """Check that the bytes every rank is about to write under its ``nvme_path`` fit in the free
    space of the filesystem holding it, summed over the ranks that share that filesystem
    (:func:`shortfall`).

    Collective over ``comm``'s control group: every rank calls it at the same point, before writing.

    Args:
        comm: The engine's collectives (``all_gather_object`` of one small record per rank).
        nvme_path: This rank's ``OffloadConfig.nvme_path``.
        need: Bytes this rank is about to write there (its new swap records, padding included).
        what: What the bytes are, for the message (e.g. ``"parameter shards"``).
        before: Bytes this rank's swap files already take there (counted in the run's total only:
            they are no longer free).

    Returns:
        The run's total in bytes on this rank's filesystem: ``before + need`` summed over the ranks
        writing to it (what a later full-disk error reports).

    Raises:
        SwapError: on every rank, if any filesystem's free space is less than the sum of ``need``
            over its ranks; the message gives both numbers in GB, the path and the options to change.
            An ``nvme_path`` that cannot be inspected (missing) is left to the swapper's own error.
    """
    lack, total = shortfall(comm, nvme_path, need, before)
    if lack is not None:
        raise SwapError(
            f"NVMe offload needs {gigabytes(lack.needed)} more at nvme_path {lack.path} ({what}; {lack.ranks}; "
            f"{gigabytes(lack.total)} for the whole run), but only {gigabytes(lack.free)} are free there. Free "
            "space on that disk, point OffloadConfig(nvme_path=...) at one with room, or put less on NVMe: "
            "OffloadConfig(param='cpu') or OffloadConfig(optimizer='cpu') (that state then takes CPU "
            "memory), or run fewer ranks per machine."
        )
    return total
