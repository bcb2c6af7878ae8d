"""Host memory that setup frees goes back to the system (glibc's malloc).

Building and partitioning a model allocates and frees tens of megabytes at a time: stand-ins of
each parameter while construction is recorded (:mod:`lightning_zinf.engine.construction`), each
unit's values, its flat copy, its shards while it is partitioned. glibc serves such blocks from
``mmap`` only until the first is freed; its dynamic threshold then rises to that size (up to 32 MiB)
and later blocks come from the heap, which can only shrink from its top. Setup thus leaves most of
what it freed as heap the process keeps: measured on a 91M-parameter GPT on 2 ranks with NVMe
offload, 925 MB of free heap at the first step, the largest part of a peak RSS of 1.7-1.9 GB
(examples/benchmarks/RESULTS.md, issue 39). Trimming it afterwards (``malloc_trim``) gives the pages
back, but training then touches the whole freed range again, and a heap that shrinks at its top
after every step pays its page faults again at the next (0.2 s a step there).

So around setup (:func:`setup_phase`), blocks of 1 MiB and more are mapped, and unmapped when
freed (model code run inside :func:`~lightning_zinf.meta_parameters` included: its large blocks
then cost fresh page faults); afterwards the thresholds are fixed where glibc's dynamic ones end up
under training (blocks up to 32 MiB from the heap) and the heap keeps up to 1 GiB free at its top,
so training keeps its working set. The same run peaked at 1.34-1.40 GB instead of 1.35-1.74 at the
same step time (RESULTS.md, "Issue 39, session 21"). These are process-wide settings of glibc
(``mallopt``), kept for the rest of the process (glibc's dynamic thresholds stay off once set);
``LIGHTNING_ZINF_HEAP=off`` leaves the allocator as it is, and so do a ``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_`` or ``GLIBC_TUNABLES`` of the user's. Nothing is done where the C library
is not glibc. Setup runs on one thread (the depth counter has no lock).

Blocks above 32 MiB (a unit's flat gradient: 40 MB at the default bucket of 10M fp32 elements) are
mapped whatever the threshold (glibc refuses a larger one), so every backward faults their pages in
afresh, 4 KiB at a time: 26 ms for 40 MB on this project's CPU machine against 3 ms to zero memory
already faulted in. :func:`advise_huge_pages` asks the kernel to back such a block with transparent
huge pages (``madvise(MADV_HUGEPAGE)``, madvise(2), where the system leaves huge pages to that
advice, Linux's ``madvise`` mode): one fault per 2 MiB, 5 ms for the same 40 MB, with no memory
kept between steps. On a 48M-parameter T5 on 2 ranks, 5-8 times fewer minor faults a step, about
0.03 s less system time (RESULTS.md, "Issue 42, session 34").
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from contextlib import contextmanager
from typing import Iterator, Optional

__all__ = ["advise_huge_pages", "keep_within", "policy_active", "setup_phase"]

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: During setup: blocks of this many bytes and more are mapped (and unmapped when freed).
SETUP_MMAP_THRESHOLD = 1 << 20
#: Afterwards: glibc's largest dynamic threshold on 64-bit platforms (DEFAULT_MMAP_THRESHOLD_MAX).
TRAINING_MMAP_THRESHOLD = 32 << 20
#: Afterwards: free memory at the heap's top kept rather than returned (glibc's default is 128 KiB,
#: or twice the dynamic mmap threshold).
TRAINING_TRIM_THRESHOLD = 1 << 30

#: The transparent huge page size on x86-64 and (4 KiB base pages) arm64 Linux.
HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux's asm-generic/mman-common.h
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
_BASE_PAGE = 4096

_state = {"depth": 0, "mmap": TRAINING_MMAP_THRESHOLD, "trim": TRAINING_TRIM_THRESHOLD}


def _switched_off() -> bool:
    return os.environ.get("LIGHTNING_ZINF_HEAP", "on").lower() in ("off", "0", "false")


@functools.cache
def _glibc() -> Optional[ctypes.CDLL]:
    if _switched_off():
        return None
    if any(name in os.environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")):
        return None  # the user tunes the allocator already
    if platform.libc_ver()[0] != "glibc":
        return None
    libc = ctypes.CDLL(None)  # the process's own C library
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return libc


def policy_active() -> bool:
    """Whether :func:`setup_phase` changes anything here (glibc, and no ``LIGHTNING_ZINF_HEAP=off``
    nor allocator settings of the user's in the environment)."""
    return _glibc() is not None


@contextmanager
def setup_phase() -> Iterator[None]:
    """Inside: host blocks of 1 MiB and more are mapped on their own (freed ones go back to the
    system at once). On leaving the outermost one: training's thresholds (module docstring) and
    one ``malloc_trim(0)`` of what is left free. Nests; a no-op where :func:`policy_active` is
    False."""
    libc = _glibc()
    if libc is None:
        yield
        return
    if _state["depth"] == 0:
        libc.mallopt(_M_MMAP_THRESHOLD, SETUP_MMAP_THRESHOLD)
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1
        if _state["depth"] == 0:
            _training(libc)


def _training(libc: ctypes.CDLL) -> None:
    libc.mallopt(_M_MMAP_THRESHOLD, _state["mmap"])
    libc.mallopt(_M_TRIM_THRESHOLD, _state["trim"])
    libc.malloc_trim(0)


def keep_within(room: int) -> None:
    """Training's allocator settings for a run under ``memory_budget`` whose budget leaves ``room``
    bytes beyond what the plan predicts: blocks of 1 MiB and more mapped on their own (their
    memory goes back when freed) and at most ``room`` bytes (and at most 1 GiB) of free heap kept.
    Measured on a 50M-parameter GPT on 2 ranks at a quarter of its unplanned peak: a peak RSS
    growth of 226 MiB instead of 354 (RESULTS.md, issue 40, session 24); the price is the page
    faults of fresh mappings at every step, which a budget chooses to pay. Applied at once outside
    setup, else when the outermost :func:`setup_phase` ends; process-wide, like the rest."""
    _state["mmap"] = SETUP_MMAP_THRESHOLD
    _state["trim"] = max(0, min(TRAINING_TRIM_THRESHOLD, room))
    libc = _glibc()
    if libc is not None and _state["depth"] == 0:
        _training(libc)


@functools.cache
def _madvise() -> Optional[ctypes.CDLL]:
    # Only where the advice changes something: Linux with huge pages in ``madvise`` mode (``always``
    # gives them without advice, ``never`` ignores it).
    if _switched_off() or platform.system() != "Linux":
        return None
    try:
        with open(_THP_MODE) as f:
            if "[madvise]" not in f.read():
                return None
    except OSError:
        return None
    libc = ctypes.CDLL(None)
    libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return libc


def _mapped_above() -> int:
    # The size above which glibc maps a block on its own: the threshold set here, else its dynamic
    # threshold's ceiling.
    if _glibc() is None:
        return TRAINING_MMAP_THRESHOLD
    return SETUP_MMAP_THRESHOLD if _state["depth"] else _state["mmap"]


def advise_huge_pages(address: int, nbytes: int) -> bool:
    """Advise the kernel to back a block of host memory just allocated (``nbytes`` bytes at
    ``address``, not yet touched) with transparent huge pages, for the whole 2 MiB pages inside it.

    Only blocks that glibc maps on their own are advised (larger than the mmap threshold, and at
    least two huge pages): their pages are fresh at every allocation. A block from the heap is
    reused memory, already faulted in, and advising part of the heap would split its mapping.
    Returns whether advice was given: False for other blocks, where the system does not take
    advice (see :func:`_madvise`), with ``LIGHTNING_ZINF_HEAP=off``, or where ``madvise`` fails
    (the memory is then used as it is). Never raises."""
    libc = _madvise()
    if libc is None or nbytes < max(2 * HUGE_PAGE, _mapped_above() + 1):
        return False
    start = -(-address // _BASE_PAGE) * _BASE_PAGE  # madvise wants a page-aligned start
    length = (address + nbytes - start) // _BASE_PAGE * _BASE_PAGE
    return libc.madvise(start, length, _MADV_HUGEPAGE) == 0
