"""File-level helpers of the NVMe swapper: key names, the ``O_DIRECT`` probe, full reads and writes.

DeepNVMe (ZeRO-Infinity, Rajbhandari et al., SC'21, §6.3) opens its swap files with ``O_DIRECT``.
Whether a filesystem honours it is only known by trying: ext4 and xfs do, tmpfs does since Linux
6.6, ramfs and some network and FUSE filesystems refuse it with ``EINVAL``. The probe below tries
a real aligned write and read in the swapper's own folder.
"""

from __future__ import annotations

import errno
import hashlib
import os
import urllib.parse
from pathlib import Path
from typing import Optional

import torch

from lightning_zinf.offload.aligned import ALIGNMENT, aligned_empty, memory_view
from lightning_zinf.offload.errors import SwapError, describe_os_error

__all__ = ["key_filename", "probe_o_direct", "preallocate", "pwrite_full", "pread_full", "filesystem_type"]

PROBE_NAME = ".o_direct-probe"


def key_filename(key: str) -> str:
    """The file name (no folder) that holds swap key ``key``, a non-empty string.

    Keys are percent-quoted, so none can leave the folder ('/' and '..' are quoted); keys whose
    quoted form is long are hashed (SHA-256) to stay under the 255-byte name limit. The ``k-`` and
    ``h-`` prefixes keep the two schemes apart, and no name starts with a dot like the probe's.

    Raises:
        ValueError: ``key`` is not a non-empty string.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"swap key {key!r} is invalid: pass a non-empty string.")
    name = "k-" + urllib.parse.quote(key, safe="-_.")
    if len(name) > 200:
        name = "h-" + hashlib.sha256(key.encode()).hexdigest()
    return name + ".swp"


def probe_o_direct(folder: Path, nvme_path: Path) -> Optional[str]:
    """Write and read back one aligned 4096-byte block with ``O_DIRECT`` in ``folder``.

    Returns:
        ``None`` if ``O_DIRECT`` works there, else the reason it does not (for the log line).

    Raises:
        SwapError: any other failure (full disk, no permission), naming the fix.
    """
    path = folder / PROBE_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise SwapError(describe_os_error(err, op="create", path=path, nvme_path=nvme_path)) from err
        # Linux creates the file before it checks O_DIRECT (seen on ramfs); it is ours, in our folder.
        path.unlink(missing_ok=True)
        return "opening a file with O_DIRECT fails with EINVAL"
    try:
        out, back = aligned_empty(ALIGNMENT, torch.uint8), aligned_empty(ALIGNMENT, torch.uint8)
        out.copy_(torch.arange(ALIGNMENT, dtype=torch.int32).remainder_(251).to(torch.uint8))
        back.zero_()
        os.pwritev(fd, [memory_view(out.data_ptr(), ALIGNMENT)], 0)
        got = os.preadv(fd, [memory_view(back.data_ptr(), ALIGNMENT)], 0)
        if got != ALIGNMENT or not torch.equal(out, back):
            return "an aligned O_DIRECT write did not read back"
        return None
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise SwapError(
                describe_os_error(err, op="write a probe block to", path=path, nvme_path=nvme_path, needed=ALIGNMENT)
            ) from err
        return "an aligned O_DIRECT write fails with EINVAL"
    finally:
        os.close(fd)
        os.unlink(path)


def preallocate(fd: int, current: int, size: int) -> None:
    """Reserve bytes ``[current, size)`` of the file, so a full disk fails before any block is written.

    Raises:
        OSError: ``ENOSPC``/``EDQUOT``/``EFBIG``. Other failures (a filesystem without
            ``fallocate``) are ignored: the writes then allocate, and report a full disk themselves.
    """
    try:
        os.posix_fallocate(fd, current, size - current)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise


def pwrite_full(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at byte ``offset`` (a regular file may take fewer bytes per call).

    Raises:
        OSError: from ``os.pwritev``, or ``EIO`` if a call writes nothing.
    """
    while len(data):
        written = os.pwritev(fd, [data], offset)
        if written <= 0:
            raise OSError(errno.EIO, f"the write returned {written} bytes")
        data, offset = data[written:], offset + written


def pread_full(fd: int, buf: memoryview, offset: int) -> int:
    """Read into ``buf`` from byte ``offset`` until it is full or the file ends; returns the bytes read.

    Raises:
        OSError: from ``os.preadv``.
    """
    total = 0
    while total < len(buf):
        got = os.preadv(fd, [buf[total:]], offset + total)
        if got == 0:
            break
        total += got
    return total


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding ``path`` (from /proc/mounts), or ``"unknown filesystem"``."""
    best, kind = "", "unknown filesystem"
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) > 2:
                    point = fields[1].replace("\\040", " ")
                    inside = str(path) == point or str(path).startswith(point.rstrip("/") + "/")
                    if inside and len(point) >= len(best):
                        best, kind = point, fields[2]
    except OSError:
        pass
    return kind
