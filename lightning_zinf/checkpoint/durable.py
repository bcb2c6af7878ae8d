"""Crash-safe placement of checkpoints on disk: a checkpoint's name always holds a complete
checkpoint (the new one or the previous one), whatever instant a process is killed or the power fails.

Three rules, the same as a database's commit record:

1. Everything is written under names nobody loads (a staging folder, a fresh data folder), and
   flushed to the disk with ``fsync`` (the files, then the folders that list them) before anything
   refers to it.
2. One atomic step makes it the checkpoint: ``os.replace`` of one file over another (a sharded
   checkpoint's ``meta.pt``, a full checkpoint's file), or the ``rename`` of a complete staging
   folder to a name that does not exist yet. POSIX makes both atomic on every local and network
   filesystem; the folder holding them is ``fsync``'ed after, so the step itself survives a power loss.
3. Only then is the previous copy removed. A crash while removing it leaves debris under names
   nobody loads, which the next save in the same folder removes (:func:`clean_stale`).

One case needs two steps: a name that changes kind (a sharded folder replaced by a full file, or
the reverse), since no ``rename`` puts a folder over a file. On Linux filesystems that have it
(ext4, XFS, btrfs, tmpfs) the two are exchanged atomically (``renameat2(RENAME_EXCHANGE)``);
elsewhere the old copy is renamed to ``.<name>.zinf-old`` first, and a crash between the two
renames leaves it there, restored by the next save in the folder (:func:`clean_stale`).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import shutil
import zipfile
from pathlib import Path
from typing import Any, Optional

from lightning_zinf.offload.errors import free_bytes, gigabytes

__all__ = ["fsync_file", "fsync_folder", "replace_file", "put_new", "replace_kind", "remove_checkpoint",
           "clean_stale", "remove_path", "is_torch_file", "describe_write_failure", "space_message",
           "CheckpointWriteError", "STAGING_SUFFIX", "REMOVING_SUFFIX"]

#: Suffix of a save's staging folder or file: ``.<name>.zinf-partial`` beside ``<name>``.
STAGING_SUFFIX = ".zinf-partial"
#: Suffix of a checkpoint being removed: ``.<name>.zinf-removing``.
REMOVING_SUFFIX = ".zinf-removing"
#: Suffix of the previous copy while a name changes kind without an atomic exchange.
OLD_SUFFIX = ".zinf-old"


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (full disk, quota, permissions, I/O error). The message
    names the path, the bytes needed and free where space is the cause, and says that the previous
    checkpoint at that name is untouched; ``errno`` is the system's."""

    def __str__(self) -> str:
        return str(self.strerror)  # the message alone, without "[Errno 28]" before it


def fsync_file(path: os.PathLike | str) -> None:
    """Flush the file ``path``'s data and metadata to the disk (``fsync``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_folder(path: os.PathLike | str) -> None:
    """Flush the folder ``path``'s entries (files created, renamed or removed in it) to the disk.
    A folder that cannot be opened for this (some network filesystems) is left to the filesystem."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.EBADF):  # folders that cannot be fsync'ed
            raise
    finally:
        os.close(fd)


def replace_file(staging: Path, path: Path) -> None:
    """Make the complete, fsync'ed file ``staging`` the file ``path`` in one atomic step
    (``os.replace``), and flush the rename to the disk."""
    os.replace(staging, path)
    fsync_folder(path.parent)


def put_new(staging: Path, path: Path) -> None:
    """Give the complete, fsync'ed folder ``staging`` the name ``path``, which does not exist (one
    atomic ``rename``), and flush the rename to the disk."""
    os.rename(staging, path)
    fsync_folder(path.parent)


@functools.cache
def _renameat2() -> Optional[Any]:
    """libc's ``renameat2`` (glibc >= 2.28), from the symbols already loaded; None elsewhere."""
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    except OSError:
        return None
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        function.restype = ctypes.c_int
    return function


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap the entries ``a`` and ``b`` atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False if
    this system or filesystem cannot, in which case nothing changed."""
    function = _renameat2()
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(code, f"exchanging {a} and {b}: {os.strerror(code)}")


def remove_path(path: Path) -> None:
    """Remove ``path``: a folder with everything in it, or a file or link; nothing if absent."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def replace_kind(staging: Path, path: Path) -> None:
    """Put the complete, fsync'ed ``staging`` (a folder or a file) at ``path``, which holds a
    checkpoint of the other kind (a file or a folder), then remove the old one.

    Atomic where the filesystem exchanges entries (Linux ``renameat2``); otherwise the old copy is
    renamed to ``.<name>.zinf-old`` first, and restored by :func:`clean_stale` if a crash comes
    before the new copy is in place.
    """
    if _exchange(staging, path):
        fsync_folder(path.parent)
        remove_path(staging)  # now the old copy, under the staging name: debris if a crash stops this
        return
    old = path.parent / f".{path.name}{OLD_SUFFIX}"
    remove_path(old)
    os.rename(path, old)
    fsync_folder(path.parent)
    os.rename(staging, path)
    fsync_folder(path.parent)
    remove_path(old)


def remove_checkpoint(path: os.PathLike | str) -> None:
    """Remove the checkpoint ``path`` (a folder or a file) so that no instant shows a half-removed
    checkpoint under its name: it is renamed to ``.<name>.zinf-removing`` first (one atomic step),
    then deleted; a crash during the deletion leaves debris that :func:`clean_stale` removes."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return
    if path.is_dir() and not path.is_symlink():
        doomed = path.parent / f".{path.name}{REMOVING_SUFFIX}"
        remove_path(doomed)
        os.rename(path, doomed)
        fsync_folder(path.parent)
        shutil.rmtree(doomed)
    else:
        path.unlink()
        fsync_folder(path.parent)


def clean_stale(folder: Path) -> list[str]:
    """Remove what crashed saves and removals left in ``folder``: staging folders and files
    (``.<name>.zinf-partial``), checkpoints half-removed (``.<name>.zinf-removing``); a previous copy
    left by a kind change (``.<name>.zinf-old``) goes back to ``<name>`` if that name is empty, else
    it is removed. Call it from one process, before a save into ``folder``.

    Returns:
        The names removed or restored, for the log.
    """
    done: list[str] = []
    if not folder.is_dir():
        return done
    for entry in sorted(folder.iterdir()):
        name = entry.name
        if not name.startswith("."):
            continue
        if name.endswith(STAGING_SUFFIX) or name.endswith(REMOVING_SUFFIX):
            remove_path(entry)
            done.append(name)
        elif name.endswith(OLD_SUFFIX):
            original = folder / name[1:-len(OLD_SUFFIX)]
            if original.exists():
                remove_path(entry)
            else:
                os.rename(entry, original)
            done.append(name)
    if done:
        fsync_folder(folder)
    return done


def is_torch_file(path: Path) -> bool:
    """True if ``path`` is a file ``torch.save`` wrote (a zip archive): a full checkpoint that a
    save of the other kind may replace. Any other file at a checkpoint's name is the user's."""
    return path.is_file() and zipfile.is_zipfile(path)


def describe_write_failure(error: OSError, checkpoint: Path, file: Path, need: Optional[int] = None) -> str:
    """The message for ``error``, raised while writing ``file`` of the checkpoint ``checkpoint``:
    the file, the cause, for a full disk the bytes needed (when known) and free, and that the
    previous checkpoint at that name is untouched."""
    cause = error.strerror or str(error)
    text = f"Saving the checkpoint {checkpoint} failed: writing {file} raised '{cause}'"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        free = free_bytes(file.parent if file.parent.exists() else checkpoint.parent)
        free_text = "an unknown amount" if free is None else gigabytes(free)
        need_text = "" if need is None else f"; the save needs {gigabytes(need)}"
        text += f" (the disk is full{need_text}; {free_text} free there now)"
    return (text + f". The partial save was removed; the previous checkpoint at {checkpoint}, if any, is "
            "untouched. Free space there or save elsewhere (ModelCheckpoint(dirpath=...)), then resume from it.")


def space_message(checkpoint: Path, where: str, needed: int, free: int, ranks: str = "") -> str:
    """The message for a checkpoint save refused before writing: the bytes it needs at ``where``
    and the bytes free there."""
    who = f" ({ranks})" if ranks else ""
    return (f"Saving the checkpoint {checkpoint} needs {gigabytes(needed)} at {where}{who}, but only "
            f"{gigabytes(free)} are free there. Nothing was written; the previous checkpoint at {checkpoint}, "
            "if any, stays until a new one is complete, so the save needs the room for a whole checkpoint. "
            "Free space there, save elsewhere (ModelCheckpoint(dirpath=...)), or save less "
            "(ZeroInfinityStrategy(exclude_frozen_parameters=True) for a frozen base model, "
            "ModelCheckpoint(save_weights_only=True)).")
