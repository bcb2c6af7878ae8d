"""Run a function on W real processes joined by a gloo process group, and collect what each returns.

Processes come from a ``forkserver`` that has already imported torch and Lightning, so each rank
starts in well under a second and inherits no OpenMP state from the pytest process. A rank that
raises, dies or outlives the timeout fails the test with that rank's traceback; the other ranks
are killed rather than left hanging.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed", "lightning.pytorch", "lightning_zinf"])


class RankDied(RuntimeError):
    """A rank's process ended without reporting a result (killed, crashed)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn: Callable[..., Any], rank: int, world: int, port: int, init_pg: bool, backend: str, args: tuple,
            out: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    try:
        if init_pg:
            torch.distributed.init_process_group(backend, rank=rank, world_size=world)
        result = fn(rank, world, *args)
        buffer = io.BytesIO()
        torch.save(result, buffer)
        out.put((rank, True, buffer.getvalue()))
    except BaseException:  # report everything, including SystemExit from a library
        out.put((rank, False, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any], world: int, *args: Any, init_pg: bool = True, backend: str = "gloo", timeout: float = 300.0,
    grace: float = 10.0,
) -> list[Any]:
    """Call ``fn(rank, world, *args)`` on ``world`` processes and return the results by rank.

    Args:
        fn: A module-level (picklable) function. Its return value must be ``torch.save``-able.
        world: Number of ranks.
        init_pg: Initialise a process group before calling ``fn`` (``False`` for Lightning
            runs, which initialise their own from the same environment variables).
        backend: Its backend (``"nccl"`` for the GPU suite).
        timeout: Seconds all ranks together may take.
        grace: Seconds the other ranks get to end by themselves once the run is over (a rank died
            or failed) before they are killed.

    Raises:
        RankDied: a rank's process ended without a result (the others are killed).
        RuntimeError: a rank raised (its traceback is in the message) or the ranks timed out.
    """
    out = _CTX.Queue()
    port = _free_port()
    procs = [
        _CTX.Process(target=_worker, args=(fn, rank, world, port, init_pg, backend, args, out), daemon=True)
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            try:
                rank, ok, payload = out.get(timeout=1.0)
            except queue.Empty:
                dead = {r: p.exitcode for r, p in enumerate(procs) if not p.is_alive() and r not in results}
                if dead:  # a rank that died without reporting (killed, segfault) ends the run now
                    raise RankDied(f"rank(s) died without a result, exit codes {dead}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no result from every rank within {timeout:.0f} s") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} of {world} failed:\n{payload}")
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=grace)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


def fill_disk(folder: str) -> None:
    """Another writer takes every free byte of ``folder``'s filesystem (a file ``filler`` in it)."""
    fd = os.open(os.path.join(folder, "filler"), os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"x" * 4096):
            pass
    except OSError:  # ENOSPC: the disk is full
        pass
    os.close(fd)


@contextmanager
def buffers_made(made: list[int]) -> Iterator[None]:
    """Record the bytes of every buffer the collectives make for themselves, on any thread: packed
    rows of codes (``PackedRows.empty``), their copies (``torch.empty_like``) and a dequantized
    shard (``Tensor.new_empty``). (The CPU references' own temporaries, ``torch.empty``, are the
    kernels' scratch, which Triton's kernels do not have.)"""
    from triton_kernels import PackedRows

    saved = PackedRows.empty, torch.empty_like, torch.Tensor.new_empty

    def recorded(make):
        def wrapper(*args, **kwargs):
            out = make(*args, **kwargs)
            made.append(out.numel() * out.element_size())
            return out
        return wrapper

    PackedRows.empty, torch.empty_like, torch.Tensor.new_empty = map(recorded, saved)
    try:
        yield
    finally:
        PackedRows.empty, torch.empty_like, torch.Tensor.new_empty = saved
