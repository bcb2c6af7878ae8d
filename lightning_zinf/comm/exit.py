"""Process groups released at a normal exit, while the interpreter is still whole.

Gloo runs each process group's collectives on threads of its own. A script that ends without
destroying its process groups (a Fabric loop; a Trainer script: Lightning destroys them at exit
only under NCCL) leaves those threads to the interpreter's shutdown, and a thread that then lets go
of a tensor Python once held must take the GIL of an interpreter being torn down: the process
aborts after the run succeeded ("terminate called without an active exception", SIGABRT, exit code
-6; PyTorch issue #190489, where the fix in ``init_process_group`` was abandoned). CI saw it once in
rank 1 of a Fabric loop that had ended its four steps (tests/test_failures.py).

So at a normal exit (``atexit``, registered when the strategy joins the process group, so it runs
after the rank watch's own handler, which keeps rank 0's rendezvous store up until every rank is
done) every object registered here drops its process groups, ``torch.distributed``'s are destroyed,
and the garbage collector lets the groups' destructors join their threads while Python is alive.
Not after a failure (an uncaught exception, or one the rank watch saw posted): a collective left
waiting for a peer would hold the exit until its timeout, where today the process ends at once.
"""

from __future__ import annotations

import atexit
import gc
import sys
import weakref
from typing import Protocol

import torch.distributed as dist

__all__ = ["GroupHolder", "hold_groups", "install", "mark_failed", "release_groups"]


class GroupHolder(Protocol):
    """An object that keeps process groups and can let go of them for good."""

    def drop_groups(self) -> None: ...


_holders: "weakref.WeakSet[GroupHolder]" = weakref.WeakSet()
_state = {"installed": False, "failed": False}


def hold_groups(holder: GroupHolder) -> None:
    """Register ``holder``: its :meth:`~GroupHolder.drop_groups` is called at a normal exit (it
    must not use its groups afterwards). Held weakly."""
    _holders.add(holder)


def mark_failed() -> None:
    """The run failed on some rank (a failure was posted or seen): leave the groups to the
    interpreter's shutdown at exit."""
    _state["failed"] = True


def install() -> None:
    """Register :func:`release_groups` with ``atexit`` (once per process). Call it right after the
    default process group is created, before anything that must run earlier at exit registers."""
    if not _state["installed"]:
        _state["installed"] = True
        atexit.register(release_groups)


def release_groups() -> bool:
    """Drop every registered holder's groups, destroy ``torch.distributed``'s process groups and
    collect them, unless the run failed (:func:`mark_failed`, or an uncaught exception is ending
    the interpreter). Returns whether it released them."""
    if _state["failed"] or getattr(sys, "last_value", None) is not None:
        return False
    for holder in list(_holders):
        holder.drop_groups()
    _holders.clear()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    return True
