"""Swap folders of runs that died: naming, the liveness lock, and reclaiming them.

A run that ends normally deletes its swap folder (:meth:`NvmeSwapper.close`). One that is
killed (SIGKILL, the kernel's OOM killer, a lost node) cannot, and its folder can hold tens of GB,
enough to make the next run fail with a full disk. So every live swapper holds an exclusive
``flock`` on a ``.lock`` file in its folder; the kernel drops it when the process dies, however it
dies. Before a new swapper starts, :func:`reclaim_stale_folders` deletes the folders of this host
whose lock nobody holds.

Only folders named by :func:`swap_folder_name` for this host are looked at (never through a
symbolic link), and in them only the swapper's own kinds of file (``k-*``/``h-*`` swap files, the
``O_DIRECT`` probe, the lock, all regular files); a folder holding anything else is left in place
with a warning. ``nvme_path`` is meant to be a local disk; on a filesystem shared by hosts of the
same name whose locks do not work across hosts, a live folder of another host could be taken for
stale.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import socket
import time
import uuid
from pathlib import Path
from typing import Optional

__all__ = ["LOCK_NAME", "swap_folder_name", "lock_folder", "reclaim_stale_folders"]

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
_OWN_FILE = re.compile(r"^(k-.*|h-.*|\.o_direct-probe|\.lock)$")
# Between creating a folder and locking it, a swapper's folder is briefly unlocked; a folder is
# only treated as stale once it is older than this.
_MIN_AGE_S = 5.0


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "host"


def swap_folder_name(rank: int) -> str:
    """A fresh swap folder name for ``rank`` on this host: ``zinf-<host>-rank<r:05d>-<pid>-<hex8>``."""
    return f"zinf-{_host()}-rank{rank:05d}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def lock_folder(folder: Path) -> Optional[int]:
    """Create ``folder/.lock`` and hold an exclusive ``flock`` on it for as long as the returned
    file descriptor stays open (the caller closes it after removing the folder).

    Returns ``None`` (nothing held) where the filesystem has no locks (``ENOLCK``, ``EOPNOTSUPP``,
    ``EINVAL``); :func:`reclaim_stale_folders` cannot lock such folders either, so it never
    takes them for stale.

    Raises:
        OSError: the lock file cannot be created (e.g. a full disk).
    """
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        os.unlink(folder / LOCK_NAME)
        if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
            return None
        raise
    return fd


def reclaim_stale_folders(nvme_path: str | os.PathLike) -> list[tuple[Path, int]]:
    """Delete this host's swap folders in ``nvme_path`` that no live process holds.

    A folder is stale when it is named by :func:`swap_folder_name` for this host, is older than a
    few seconds, and its ``.lock`` can be locked (its swapper's process has died). Its swap files,
    probe and lock are deleted, then the folder; a folder with other files keeps them and is left
    (one warning). Each reclaimed folder is logged with its size. Errors (a folder another rank
    reclaims at the same time, no permission) skip the folder and never raise.

    Returns:
        ``(folder, bytes freed)`` for each folder removed.
    """
    root = Path(nvme_path)
    pattern = re.compile(rf"^zinf-{re.escape(_host())}-rank\d{{5}}-\d+-[0-9a-f]{{8}}$")
    try:
        candidates = [p for p in root.iterdir() if pattern.match(p.name) and not p.is_symlink()]
    except OSError:
        return []
    reclaimed = []
    for folder in candidates:
        freed = _reclaim(folder)
        if freed is not None:
            reclaimed.append((folder, freed))
            log.warning(
                "Removed stale NVMe swap folder %s (%.2f GB) left by a run that ended without cleaning up "
                "(killed, or out of memory).", folder, freed / 1e9,
            )  # fmt: skip
    return reclaimed


def _reclaim(folder: Path) -> Optional[int]:
    """Remove one stale folder; ``None`` if it is live, too young, foreign or vanished."""
    try:
        if time.time() - folder.stat().st_mtime < _MIN_AGE_S:
            return None
        fd = os.open(folder / LOCK_NAME, os.O_RDWR)
    except OSError:
        return None  # no lock file: being created, from an older version, or already gone
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None  # held: a live run
    try:
        entries = list(folder.iterdir())
        foreign = [p.name for p in entries if not _OWN_FILE.match(p.name) or p.is_symlink() or not p.is_file()]
        if foreign:
            log.warning("Stale NVMe swap folder %s left in place: it holds files lightning_zinf did not write: %s",
                        folder, foreign[:10])
            return None
        freed = 0
        for path in entries:
            if path.name != LOCK_NAME:
                freed += path.stat().st_blocks * 512
                path.unlink()
        (folder / LOCK_NAME).unlink()
        folder.rmdir()
        return freed
    except OSError:
        return None
    finally:
        os.close(fd)
