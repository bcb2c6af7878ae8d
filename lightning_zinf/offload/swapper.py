"""The asynchronous NVMe swapper: tensors to files and back, many requests in flight.

This is the NVMe tier of ZeRO-Infinity's infinity offload engine (Rajbhandari et al., SC'21, §6.3,
"DeepNVMe"): shards and optimizer-state sub-groups are *swapped out* to files on a fast local disk
and *swapped in* again before they are needed, with the transfers overlapped with computation.
Like DeepNVMe it uses ``O_DIRECT`` (no page-cache copy, no second copy of the data in RAM), splits
every transfer into ``block_size`` requests and keeps many in flight across a pool of threads
(:mod:`lightning_zinf.offload.aio`). Where the filesystem refuses ``O_DIRECT`` it says so in one log
line and uses buffered I/O.

Files live in one folder per swapper (the engine passes ``<nvme_path>/zinf-<host>-rank<r>-<unique>``),
which the swapper creates and, at :meth:`NvmeSwapper.close`, removes together with the files it
created, and nothing else: a folder that already exists is refused rather than reused. While it
is open the swapper holds a lock in the folder, so a later run can tell the folder of a killed
process from a live one (:mod:`lightning_zinf.offload.stale`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Callable, Iterator, Optional

import torch

from lightning_zinf.offload.aio import AioConfig, BlockPool, IoHandle
from lightning_zinf.offload.aligned import ALIGNMENT, aligned_empty, is_aligned, memory_view, round_up
from lightning_zinf.offload.errors import SwapError, describe_os_error
from lightning_zinf.offload.stale import LOCK_NAME, lock_folder
from lightning_zinf.offload.files import (
    filesystem_type,
    key_filename,
    preallocate,
    pread_full,
    probe_o_direct,
    pwrite_full,
)

__all__ = ["AioConfig", "IoHandle", "NvmeSwapper", "SwapError", "aligned_empty"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _FileState:
    """What this swapper last wrote to a key's file, to detect a file changed underneath."""

    nbytes: int  # logical bytes of the tensor
    size: int  # bytes on disk (padded to ALIGNMENT under O_DIRECT)
    mtime_ns: int
    ino: int


class _Request:
    """One key's read or write while it runs: the file, the tensor's memory, the blocks left."""

    def __init__(self, handle: IoHandle, path: Path, tensor: torch.Tensor) -> None:
        self.handle = handle
        self.path = path
        self.tensor = tensor  # kept alive while the pool threads use its memory
        self.nbytes = handle.nbytes
        self.ptr = tensor.data_ptr()
        self.view = memory_view(self.ptr, self.nbytes) if self.nbytes else memoryview(b"")
        self.fd: Optional[int] = None
        self.remaining = 0
        self.error: Optional[SwapError] = None
        self.lock = threading.Lock()

    def fail(self, error: SwapError) -> None:
        with self.lock:
            if self.error is None:  # the first error is the one reported
                self.error = error


class NvmeSwapper:
    """Asynchronous swap out/in of CPU tensors to/from files in a folder of its own.

    Each *key* (any non-empty string) names one file. :meth:`write` and :meth:`read` return at
    once with an :class:`IoHandle`; the transfer is split into ``config.block_size`` blocks that
    run on ``config.threads`` threads. Requests on one key run in the order they were issued (a
    read issued after a write of the same key sees that write); requests on different keys run
    concurrently. Use it as a context manager or call :meth:`close`.

    Args:
        folder: The folder to create for the files; it must not exist yet, and its parent (the
            user's ``nvme_path``) must exist and be writable.
        config: Block size, queue depth, threads, ``O_DIRECT``.

    Attributes:
        folder: The swapper's folder (absolute).
        direct: Whether ``O_DIRECT`` is in use (probed with a real aligned write and read).
        bytes_read: Logical bytes of the read requests completed successfully.
        bytes_written: Logical bytes of the write requests completed successfully.
        read_seconds: Wall time during which at least one read ran; ``bytes_read`` divided by it
            is the achieved read bandwidth.
        write_seconds: Wall time during which at least one write ran; ``bytes_written`` divided by
            it is the achieved write bandwidth.
        planned_bytes: What the whole run writes under the folder's parent, over every rank sharing
            its filesystem (set by the NVMe preflight, :func:`~lightning_zinf.offload.preflight.ensure_space`;
            0: unknown): a full disk is reported with this total, not one request's size.

    Raises:
        SwapError: ``folder`` exists, its parent is missing, not a directory or not writable, or
            the disk is full; the message names the path and the fix.
    """

    def __init__(self, folder: str | os.PathLike, config: AioConfig = AioConfig()) -> None:
        self.folder = Path(folder).absolute()
        self.config = config
        self._nvme_path = self.folder.parent
        self._make_folder()
        self._closed = False
        self.direct = False
        try:
            self._lock_fd = lock_folder(self.folder)
        except OSError as err:
            os.rmdir(self.folder)
            raise SwapError(
                describe_os_error(err, op="create the lock file in", path=self.folder, nvme_path=self._nvme_path)
            ) from err
        if config.o_direct:
            try:
                refused = probe_o_direct(self.folder, self._nvme_path)
            except BaseException:
                self._remove_folder()
                raise
            self.direct = refused is None
            if refused is not None:
                self._log_fallback(refused)
        self._pool = BlockPool(config)
        self._lock = threading.Lock()
        self._tail: dict[str, IoHandle] = {}  # the last request issued per key
        self._expected: dict[str, int] = {}  # bytes of the last write issued per key
        self._state: dict[str, Optional[_FileState]] = {}  # None: the last write failed
        self._created: dict[str, int] = {}  # key -> inode of the file this swapper created
        self._outstanding: dict[int, IoHandle] = {}  # not yet settled (running, or failed unreported)
        self._tls = threading.local()
        self.bytes_read = 0
        self.bytes_written = 0
        self.read_seconds = 0.0
        self.write_seconds = 0.0
        self.planned_bytes = 0
        self._active = {"read": 0, "write": 0}
        self._active_since = {"read": 0.0, "write": 0.0}

    # ----------------------------------------------------------------- folder and O_DIRECT probe
    def _make_folder(self) -> None:
        folder, parent = self.folder, self._nvme_path
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError as err:
            raise SwapError(
                f"swap folder {folder} already exists; the swapper never reuses or deletes a folder "
                f"it did not create: pass a fresh path (the engine uses "
                f"<nvme_path>/zinf-<host>-rank<r>-<unique>) or remove {folder} yourself if it is a leftover."
            ) from err
        except FileNotFoundError as err:
            raise SwapError(
                f"nvme_path {parent} does not exist (creating the swap folder {folder}); create it "
                f"or point nvme_path at an existing directory on a local disk."
            ) from err
        except NotADirectoryError as err:
            raise SwapError(
                f"nvme_path {parent} is not a directory (creating the swap folder {folder}); point "
                f"nvme_path at a directory on a local disk."
            ) from err
        except OSError as err:
            raise SwapError(
                describe_os_error(err, op="create the swap folder", path=folder, nvme_path=parent)
            ) from err

    def _log_fallback(self, reason: str) -> None:
        log.warning(
            "NVMe swap folder %s (%s): %s; using buffered I/O through the page cache, which is "
            "slower and keeps a copy of the swapped data in RAM.",
            self.folder,
            filesystem_type(self.folder),
            reason,
        )

    # ------------------------------------------------------------------------------ public API
    def write(self, key: str, tensor: torch.Tensor) -> IoHandle:
        """Swap out: write ``tensor``'s bytes to the file for ``key`` (created or overwritten), asynchronously.

        Args:
            key: Non-empty string naming the file.
            tensor: Contiguous CPU tensor, any dtype and size (in bytes: ``numel * element_size``,
                not necessarily a multiple of the block size). Keep it alive and unchanged until
                the handle's ``wait()`` returns. Tensors from :func:`aligned_empty` are written
                without a copy; others go through a per-thread aligned bounce buffer.

        Returns:
            The request's handle; its ``wait()`` raises :class:`SwapError` if the write failed
            (full disk, I/O error...).

        Raises:
            ValueError / TypeError: ``key`` empty, ``tensor`` not a contiguous CPU tensor.
            SwapError: the swapper is closed.
        """
        self._check_open()
        path = self._path(key)
        _check_tensor(tensor, "write")
        handle = IoHandle(key, "write", tensor.numel() * tensor.element_size())
        req = _Request(handle, path, tensor)
        with self._lock:
            self._expected[key] = handle.nbytes
        self._issue(req, lambda: self._pool.submit(lambda: self._begin_write(req), read=False))
        return handle

    def read(self, key: str, out: torch.Tensor) -> IoHandle:
        """Swap in: read the file for ``key`` into ``out``, asynchronously.

        The read waits for every earlier request on ``key`` (so it sees the last write issued).
        Before reading, the file's size, modification time and inode are compared with what this
        swapper wrote; a difference, or fewer bytes than expected, fails the request.

        Args:
            key: A key written by this swapper.
            out: Contiguous CPU tensor (any dtype) whose byte size equals the last write's. Do not
                use it until the handle's ``wait()`` returns.

        Returns:
            The request's handle; its ``wait()`` raises :class:`SwapError` on a short read, a
            file changed or deleted underneath, a failed earlier write of ``key``, or an I/O error.

        Raises:
            SwapError: ``key`` was never written (or was removed), ``out``'s byte size differs from
                the last write's, or the swapper is closed.
            ValueError / TypeError: ``out`` not a contiguous CPU tensor.
        """
        self._check_open()
        path = self._path(key)
        _check_tensor(out, "read into")
        nbytes = out.numel() * out.element_size()
        with self._lock:
            expected = self._expected.get(key)
        if expected is None:
            raise SwapError(f"cannot read key {key!r} from {self.folder}: it was never written (or was removed).")
        if nbytes != expected:
            raise SwapError(
                f"cannot read key {key!r} ({path}) into a tensor of {nbytes} bytes "
                f"({tuple(out.shape)}, {out.dtype}): it was written with {expected} bytes; pass a "
                f"tensor of exactly that byte size."
            )
        req = _Request(IoHandle(key, "read", nbytes), path, out)
        self._issue(req, lambda: self._pool.submit(lambda: self._begin_read(req), read=True))
        return req.handle

    def wait_all(self) -> None:
        """Wait for every outstanding request.

        Raises:
            SwapError: the first failed request (in issue order) whose error no ``wait()`` has
                raised yet; the message counts any further failures.
        """
        with self._lock:
            handles = list(self._outstanding.values())
        for handle in handles:
            handle._event.wait()
        failed = [h for h in handles if h.error is not None and not h._reported]
        with self._lock:
            for h in handles:
                self._outstanding.pop(id(h), None)
        for h in failed[1:]:
            h._reported = True
        if failed:
            first = failed[0]
            more = f" ({len(failed) - 1} more requests failed)" if len(failed) > 1 else ""
            first._reported = True
            raise SwapError(str(first.error) + more) from first.error.__cause__

    def remove(self, key: str) -> None:
        """Delete ``key``'s file once earlier requests on it have finished; unknown keys are ignored.

        A file that someone else put in its place (another inode) is left alone.
        """
        self._check_open()
        path = self._path(key)
        with self._lock:
            last = self._tail.pop(key, None)
        if last is not None:
            last._event.wait()  # its error, if any, stays for wait()/wait_all()
        with self._lock:
            self._expected.pop(key, None)
            self._state.pop(key, None)
            ino = self._created.pop(key, None)
        if ino is not None:
            self._unlink_own(path, ino)

    def close(self) -> None:
        """Wait for all requests, then delete the files this swapper created and its folder; idempotent.

        Files it did not create are left, and so is the folder if any remain (with a log line).

        Raises:
            SwapError: a request failed and no ``wait()``/``wait_all()`` has raised its error (the
                files are removed all the same).
        """
        if self._closed:
            return
        self._closed = True
        error: Optional[SwapError] = None
        try:
            self.wait_all()
        except SwapError as err:
            error = err
        self._pool.shutdown()
        with self._lock:
            created = dict(self._created)
            self._created.clear()
        for key, ino in created.items():
            self._unlink_own(self._path(key), ino)
        self._remove_folder()
        if error is not None:
            raise error

    def _remove_folder(self) -> None:
        """Remove the lock file and the (now empty) folder, then release the lock."""
        (self.folder / LOCK_NAME).unlink(missing_ok=True)
        try:
            os.rmdir(self.folder)
        except FileNotFoundError:
            pass
        except OSError as err:
            left = sorted(p.name for p in self.folder.iterdir()) if self.folder.is_dir() else []
            log.warning("NVMe swap folder %s left in place (%s); it holds files the swapper did not create: %s",
                        self.folder, err.strerror, left[:10])
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> "NvmeSwapper":
        return self

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        try:
            self.close()
        except SwapError as err:
            if exc is None:
                raise
            log.error("while handling another error, closing the NVMe swapper failed: %s", err)

    def __repr__(self) -> str:
        return f"NvmeSwapper({str(self.folder)!r}, direct={self.direct}, closed={self._closed})"

    # ------------------------------------------------------------------- request orchestration
    def _check_open(self) -> None:
        if self._closed:
            raise SwapError(f"the NVMe swapper for {self.folder} is closed; create a new one.")

    def _path(self, key: str) -> Path:
        return self.folder / key_filename(key)

    def _issue(self, req: _Request, start: Callable[[], None]) -> None:
        """Register ``req``; ``start`` it after the last request on its key finishes."""
        handle, key = req.handle, req.handle.key
        with self._lock:
            previous = self._tail.get(key)
            self._tail[key] = handle
            self._outstanding[id(handle)] = handle
        handle.add_done_callback(lambda: self._settle(handle))
        if previous is None:
            start()
        else:
            previous.add_done_callback(start)

    def _settle(self, handle: IoHandle) -> None:
        with self._lock:
            if handle.error is None:
                self._outstanding.pop(id(handle), None)
            if self._tail.get(handle.key) is handle:
                del self._tail[handle.key]

    def _busy(self, op: str, start: bool) -> None:
        with self._lock:
            now = time.perf_counter()
            if start:
                if self._active[op] == 0:
                    self._active_since[op] = now
                self._active[op] += 1
                return
            self._active[op] -= 1
            if self._active[op] == 0:
                elapsed = now - self._active_since[op]
                if op == "read":
                    self.read_seconds += elapsed
                else:
                    self.write_seconds += elapsed

    def _begin_write(self, req: _Request) -> None:
        """Open (and size) the file, then queue the blocks. Runs on a pool thread."""
        self._busy("write", True)
        key = req.handle.key
        with self._failures(req, f"open and size (to {req.nbytes} bytes)", needed=req.nbytes):
            with self._lock:
                first = key not in self._created
            flags = os.O_RDWR | os.O_CREAT | (os.O_EXCL if first else 0) | (os.O_DIRECT if self.direct else 0)
            try:
                req.fd = os.open(req.path, flags, 0o600)
            except FileExistsError as err:
                raise SwapError(
                    f"cannot create {req.path} for key {key!r}: a file this swapper did not create is "
                    f"already there; nothing but the swapper may write in {self.folder}."
                ) from err
            st = os.fstat(req.fd)
            with self._lock:
                self._created[key] = st.st_ino
            size = round_up(req.nbytes) if self.direct else req.nbytes
            if st.st_size > size:
                os.ftruncate(req.fd, size)
            elif st.st_size < size:
                preallocate(req.fd, st.st_size, size)
        self._queue_blocks(req, write=True)

    def _begin_read(self, req: _Request) -> None:
        """Check the file against what was written, then queue the blocks. Runs on a pool thread."""
        self._busy("read", True)
        key = req.handle.key
        with self._lock:
            state = self._state.get(key)
        with self._failures(req, "open for reading"):
            if state is None:
                raise SwapError(
                    f"cannot read key {key!r} ({req.path}): its last write failed (see that write's "
                    f"error), so the file holds no valid data."
                )
            req.fd = os.open(req.path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
            self._check_unchanged(req, state, os.fstat(req.fd), "before reading")
        self._queue_blocks(req, write=False)

    def _check_unchanged(self, req: _Request, state: _FileState, st: os.stat_result, when: str) -> None:
        found = _FileState(state.nbytes, st.st_size, st.st_mtime_ns, st.st_ino)
        if found != state:
            raise SwapError(
                f"swap file {req.path} of key {req.handle.key!r} changed underneath the swapper "
                f"({when}): it wrote {state.size} bytes, mtime_ns {state.mtime_ns}, inode "
                f"{state.ino}; found {st.st_size} bytes, mtime_ns {st.st_mtime_ns}, inode {st.st_ino}. "
                f"Something else wrote to {self.folder}; the swapped data cannot be trusted. Make "
                f"sure no other process (or a second run with the same folder) uses it."
            )

    def _queue_blocks(self, req: _Request, *, write: bool) -> None:
        """Split ``req`` into blocks and queue them; with nothing to transfer, finish at once.

        Under ``O_DIRECT`` the body (the bytes up to the last multiple of 4096) moves straight
        between the file and the tensor when the tensor is aligned, through a bounce buffer when it
        is not; the tail (the last ``nbytes % 4096`` bytes) always goes through a zero-padded
        4096-byte bounce, since the file's last block is padded and the tensor's memory past its
        end belongs to someone else.
        """
        tasks: list[Callable[[], None]] = []
        if req.error is None and req.nbytes:
            run = self._write_block if write else self._read_block
            body = req.nbytes - req.nbytes % ALIGNMENT if self.direct else req.nbytes
            bounce = self.direct and not is_aligned(req.ptr)
            block = self.config.block_size
            for offset in range(0, body, block):
                length = min(block, body - offset)
                tasks.append(_bind(run, req, offset, length, length, bounce))
            if body < req.nbytes:
                tasks.append(_bind(run, req, body, req.nbytes - body, ALIGNMENT, True))
        if not tasks:
            self._finish(req, write=write)
            return
        req.remaining = len(tasks)
        for task in tasks:
            self._pool.submit(task, read=not write)

    def _write_block(self, req: _Request, offset: int, length: int, span: int, bounce: bool) -> None:
        with self._failures(req, f"write {span} bytes at offset {offset} to", needed=span):
            if req.error is None:
                if bounce:
                    ptr, view = self._bounce()
                    ctypes.memmove(ptr, req.ptr + offset, length)
                    if span > length:
                        ctypes.memset(ptr + length, 0, span - length)
                    data = view[:span]
                else:
                    data = req.view[offset : offset + length]
                pwrite_full(req.fd, data, offset)
        self._block_done(req, write=True)

    def _read_block(self, req: _Request, offset: int, length: int, span: int, bounce: bool) -> None:
        with self._failures(req, f"read {span} bytes at offset {offset} from"):
            if req.error is None:
                if bounce:
                    ptr, view = self._bounce()
                    got = pread_full(req.fd, view[:span], offset)
                else:
                    got = pread_full(req.fd, req.view[offset : offset + length], offset)
                if got != span:
                    raise SwapError(
                        f"short read of {req.path} (key {req.handle.key!r}): got {got} of {span} "
                        f"bytes at offset {offset}; the file was truncated by something else while "
                        f"being read. The swapped data is lost."
                    )
                if bounce:
                    ctypes.memmove(req.ptr + offset, ptr, length)
        self._block_done(req, write=False)

    def _block_done(self, req: _Request, *, write: bool) -> None:
        with req.lock:
            req.remaining -= 1
            last = req.remaining == 0
        if last:
            self._finish(req, write=write)

    def _finish(self, req: _Request, *, write: bool) -> None:
        """Record what was written (or check nothing changed during the read), close, complete."""
        key = req.handle.key
        state: Optional[_FileState] = None
        with self._failures(req, "finish"):
            if req.fd is not None:
                try:
                    st = os.fstat(req.fd)
                    if req.error is None and write:
                        state = _FileState(req.nbytes, st.st_size, st.st_mtime_ns, st.st_ino)
                    elif req.error is None:
                        with self._lock:
                            expected = self._state.get(key)
                        if expected is not None:
                            self._check_unchanged(req, expected, st, "while reading")
                finally:
                    os.close(req.fd)
                    req.fd = None
        ok = req.error is None
        with self._lock:
            if write:
                self._state[key] = state if ok else None
                self.bytes_written += req.nbytes if ok else 0
            else:
                self.bytes_read += req.nbytes if ok else 0
        self._busy("write" if write else "read", False)
        req.tensor = None
        req.handle.set_done(req.error)

    def _bounce(self) -> tuple[int, memoryview]:
        """This pool thread's aligned ``block_size`` bounce buffer (address, byte view)."""
        buf = getattr(self._tls, "buf", None)
        if buf is None:
            tensor = aligned_empty(self.config.block_size, torch.uint8)
            buf = self._tls.buf = (tensor, tensor.data_ptr(), memory_view(tensor.data_ptr(), tensor.numel()))
        return buf[1], buf[2]

    @contextlib.contextmanager
    def _failures(self, req: _Request, op: str, needed: int = 0) -> Iterator[None]:
        """Record any exception raised inside on ``req`` (the first one wins) instead of raising it.

        ``op`` says what was being done ("write 4096 bytes at offset 0 to"), ``needed`` how many
        bytes it had to allocate. Unexpected exceptions are caught too: a bug must fail the
        request, never leave its waiters hanging.
        """
        try:
            yield
        except SwapError as err:
            req.fail(err)
        except OSError as err:
            message = describe_os_error(err, op=f"swap {req.handle.op} of key {req.handle.key!r}: {op}",
                                        path=req.path, nvme_path=self._nvme_path, needed=needed,
                                        planned=self.planned_bytes)
            error = SwapError(message)
            error.__cause__ = err
            req.fail(error)
        except Exception as err:
            req.fail(SwapError(f"swap {req.handle.op} of {req.path} ({op}) failed unexpectedly: {err!r}"))

    def _unlink_own(self, path: Path, ino: int) -> None:
        """Delete ``path`` if it is still the file this swapper created (same inode)."""
        try:
            if os.stat(path).st_ino != ino:
                log.warning("NVMe swapper: %s was replaced by a file it did not create; leaving it.", path)
                return
            os.unlink(path)
        except FileNotFoundError:
            pass


def _bind(fn: Callable[..., None], *args: object) -> Callable[[], None]:
    return lambda: fn(*args)


def _check_tensor(tensor: torch.Tensor, op: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"NVMe swapper: cannot {op} a {type(tensor).__name__}; pass a torch.Tensor.")
    if tensor.device.type != "cpu" or tensor.layout != torch.strided:
        raise ValueError(
            f"NVMe swapper: cannot {op} a tensor on {tensor.device} ({tensor.layout}); pass a dense "
            f"CPU tensor (copy accelerator tensors to CPU first)."
        )
    if not tensor.is_contiguous():
        raise ValueError(f"NVMe swapper: cannot {op} a non-contiguous tensor; pass tensor.contiguous().")
