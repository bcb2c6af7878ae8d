"""The swapper's error type and the messages that turn an ``OSError`` into a cause and a fix.

DESIGN.md: "a failed write, a full disk, a bad path or a killed rank ends with an error that names
the cause". Every message built here names the file, the operation, the cause and what to do.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

__all__ = ["SwapError", "describe_os_error", "free_bytes", "gigabytes"]


class SwapError(RuntimeError):
    """An NVMe swap operation failed: the message names the file, the operation, the cause and the fix.

    Raised by :class:`~lightning_zinf.offload.swapper.NvmeSwapper` (folder creation, arguments that
    do not match what was written) and by :meth:`~lightning_zinf.offload.swapper.IoHandle.wait`
    for a request that failed (full disk, I/O error, short read, a file changed underneath). When an
    ``OSError`` caused it, that error is chained as ``__cause__``.
    """


def gigabytes(nbytes: int) -> str:
    """``nbytes`` as messages give it: GB (10^9 bytes) and the exact count, ``"4.20 GB (4,200,000,000 bytes)"``."""
    return f"{nbytes / 1e9:,.2f} GB ({nbytes:,} bytes)"


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes available to this process on the filesystem holding ``path``; ``None`` if unknown."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def describe_os_error(err: OSError, *, op: str, path: Path, nvme_path: Path, needed: int = 0, planned: int = 0) -> str:
    """One-paragraph message for ``err``, raised while doing ``op`` ("write", "read"...) on ``path``.

    Args:
        err: The ``OSError`` from the system call.
        op: The operation, in words, e.g. ``"write 8388608 bytes to"``.
        path: The file (or folder) operated on.
        nvme_path: The user's ``nvme_path`` (the parent of the swapper's folder), named in the fix.
        needed: Bytes the operation still had to allocate, for the full-disk message.
        planned: Bytes the whole run writes under ``nvme_path`` (every rank sharing its filesystem,
            as the NVMe preflight counted them; 0 if unknown): what a full disk must have room for.
    """
    code = err.errno
    what = f"{op} {path} failed: {err.strerror or err}"
    if code in (errno.ENOSPC, errno.EDQUOT):
        free = free_bytes(nvme_path)
        free_txt = "an unknown number of bytes" if free is None else f"{free} bytes"
        quota = " (disk quota exceeded)" if code == errno.EDQUOT else ""
        if planned:
            free_gb = "an unknown amount" if free is None else gigabytes(free)
            return (
                f"nvme_path {nvme_path} is full{quota}: this run needs {gigabytes(planned)} there in all "
                f"(every rank's swap files; {free_gb} free now: something else took the room the check at "
                f"setup found) ({what}). Free space, point OffloadConfig(nvme_path=...) at a disk with "
                "that much room, or put less on NVMe (OffloadConfig(param='cpu') or optimizer='cpu')."
            )
        return (
            f"nvme_path {nvme_path} is full{quota}: {free_txt} free, {needed} more needed "
            f"({what}); free space or point nvme_path elsewhere."
        )
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{what}; make nvme_path {nvme_path} writable by this process or point nvme_path elsewhere."
    if code == errno.ENOENT:
        return (
            f"{what}: the file or folder was deleted by something outside the swapper; nothing but "
            f"the swapper may touch its folder under nvme_path {nvme_path}. The swapped data is lost."
        )
    if code == errno.EIO:
        return f"{what}: the device reported an I/O error; check the disk (dmesg, smartctl) or point nvme_path elsewhere."
    if code == errno.EINVAL:
        return (
            f"{what}: the filesystem rejected the request (EINVAL; with O_DIRECT this means its "
            f"alignment rules are stricter than 4096 bytes); point nvme_path at a local ext4/xfs disk."
        )
    return f"{what} (errno {code}); check nvme_path {nvme_path} or point it elsewhere."
