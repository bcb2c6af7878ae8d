"""Asynchronous block I/O on a thread pool: the configuration, completion handles and the pool.

DeepNVMe (ZeRO-Infinity, Rajbhandari et al., SC'21, §6.3) reaches NVMe bandwidth by splitting each
transfer into ``block_size`` requests and keeping many of them in flight (libaio, ``queue_depth``
per thread, a pool of threads). Here the requests are blocking ``os.preadv``/``os.pwritev`` calls,
which release the GIL, spread over a pool of Python threads: each thread has one request inside the
kernel at a time, and the pool hands the threads at most ``threads * queue_depth`` blocks at once.
Blocks not yet handed over wait in the pool's own queues, where reads (swap in, on the critical
path of the next computation) go before writes (swap out, written behind).
"""

from __future__ import annotations

import collections
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

from lightning_zinf.offload.aligned import ALIGNMENT
from lightning_zinf.offload.errors import SwapError

__all__ = ["AioConfig", "IoHandle", "BlockPool"]

_MAX_BLOCK = 1 << 30  # Linux moves at most 0x7ffff000 bytes per read/write call.


@dataclass(frozen=True, kw_only=True)
class AioConfig:
    """How the NVMe swapper issues I/O (DeepSpeed's ``aio`` section, DeepNVMe).

    Attributes:
        block_size: Bytes per I/O request; larger transfers are split into blocks of this size
            spread over the threads. A multiple of 4096 (``O_DIRECT`` alignment), at most 1 GiB.
            Default 1 MiB, as in DeepSpeed.
        queue_depth: Most requests in flight per thread. With blocking system calls each thread has
            one request inside the kernel at a time; the pool hands out at most
            ``threads * queue_depth`` blocks at once and keeps the rest in its own queues, where
            reads overtake writes. Default 8, as in DeepSpeed.
        threads: I/O threads (the GIL is released during ``os.preadv``/``os.pwritev``).
        o_direct: Use ``O_DIRECT`` where the filesystem supports it (the page cache is bypassed:
            no second copy in RAM). ``False`` always uses buffered I/O.

    Raises:
        ValueError: a field that is not a positive integer, or a ``block_size`` that is not a
            multiple of 4096; the message names the field and the fix.
    """

    block_size: int = 1 << 20
    queue_depth: int = 8
    threads: int = 4
    o_direct: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "queue_depth", "threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"AioConfig.{name}={value!r} is invalid: pass a positive integer.")
        if self.block_size % ALIGNMENT or self.block_size > _MAX_BLOCK:
            raise ValueError(
                f"AioConfig.block_size={self.block_size!r} is invalid: O_DIRECT needs a multiple of "
                f"{ALIGNMENT} bytes, at most {_MAX_BLOCK}; use e.g. {1 << 20} (1 MiB)."
            )
        if not isinstance(self.o_direct, bool):
            raise ValueError(f"AioConfig.o_direct={self.o_direct!r} is invalid: pass True or False.")


class IoHandle:
    """Completion handle of one asynchronous swap request (one key's read or write).

    As with DeepNVMe's ``async_pread``/``async_pwrite`` followed by ``wait``, the request is
    issued at once and its completion (or failure) collected later, so swaps overlap compute.

    Attributes:
        key: The swap key.
        op: ``"read"`` or ``"write"``.
        nbytes: Logical bytes transferred by the request.
    """

    def __init__(self, key: str, op: str, nbytes: int) -> None:
        self.key = key
        self.op = op
        self.nbytes = nbytes
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._error: Optional[SwapError] = None
        self._callbacks: list[Callable[[], None]] = []
        self._reported = False  # its error reached the caller through wait()

    def done(self) -> bool:
        """Whether the request has finished, successfully or not (never blocks)."""
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until the request is complete; idempotent.

        Args:
            timeout: Seconds to wait at most; ``None`` waits for as long as it takes.

        Raises:
            SwapError: the request failed (the same error on every call).
            TimeoutError: ``timeout`` passed before the request finished (it goes on).
        """
        if not self._event.wait(timeout):
            raise TimeoutError(f"swap {self.op} of key {self.key!r} not finished after {timeout} s")
        if self._error is not None:
            self._reported = True
            # A fresh exception per call: re-raising one object would pile up tracebacks.
            raise SwapError(*self._error.args) from self._error.__cause__

    @property
    def error(self) -> Optional[SwapError]:
        """The failure of a finished request, or ``None``."""
        return self._error

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once the request finishes (at once, in this thread, if it already has)."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def set_done(self, error: Optional[SwapError] = None) -> None:
        """Mark the request finished (with ``error`` if it failed) and run the callbacks."""
        with self._lock:
            self._error = error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn()
            except Exception:  # one broken callback must not strand the others' waiters
                logging.getLogger(__name__).exception("callback of %r failed", self)

    def __repr__(self) -> str:
        state = "failed" if self._error else ("done" if self.done() else "pending")
        return f"IoHandle({self.op} {self.key!r}, {self.nbytes} bytes, {state})"


class BlockPool:
    """A pool of ``config.threads`` threads running I/O tasks, at most ``threads * queue_depth`` at once.

    Tasks are plain callables that never raise (they record failures on their request). Reads and
    writes wait in separate FIFO queues; a free slot takes the oldest read first.
    """

    def __init__(self, config: AioConfig) -> None:
        self._executor = ThreadPoolExecutor(max_workers=config.threads, thread_name_prefix="zinf-nvme")
        self._window = config.threads * config.queue_depth
        self._lock = threading.Lock()
        self._reads: collections.deque[Callable[[], None]] = collections.deque()
        self._writes: collections.deque[Callable[[], None]] = collections.deque()
        self._in_flight = 0

    def submit(self, task: Callable[[], None], *, read: bool) -> None:
        """Queue ``task``; it runs on a pool thread when a slot is free (reads first)."""
        with self._lock:
            (self._reads if read else self._writes).append(task)
            refused = self._pump()
        self._run_here(refused)

    def _pump(self) -> list[Callable[[], None]]:
        """Start queued tasks while slots are free (called with ``self._lock`` held); the tasks
        the executor refused, for the caller to run in its own thread once it lets the lock go."""
        refused = []
        while self._in_flight < self._window and (self._reads or self._writes):
            task = (self._reads or self._writes).popleft()
            self._in_flight += 1
            try:
                self._executor.submit(self._run, task)
            except RuntimeError:
                # The interpreter is exiting: concurrent.futures takes no new work then, but a
                # request chained behind one that just finished (a write after a failed one, at a
                # script's end) must still finish, or close() would wait for it forever.
                refused.append(task)
        return refused

    def _run(self, task: Callable[[], None]) -> None:
        try:
            task()
        finally:
            with self._lock:
                self._in_flight -= 1
                refused = self._pump()
            self._run_here(refused)

    def _run_here(self, tasks: list[Callable[[], None]]) -> None:
        for task in tasks:
            self._run(task)

    def shutdown(self) -> None:
        """Stop the threads once queued tasks have run (the caller has waited for its requests)."""
        self._executor.shutdown(wait=True)
