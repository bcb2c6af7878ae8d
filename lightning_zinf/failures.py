"""Failures that reach every rank: the strategies' watch of the other ranks (started with the
process group, stopped at teardown) and the report of an exception to them."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Callable, Optional, Sequence

from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_zinf.comm.exit import mark_failed
from lightning_zinf.comm.watch import RankWatch
from lightning_zinf.engine import ZeroEngine

__all__ = ["start_watch", "finish_run", "report_failure"]


def start_watch(rank: int, world_size: int, timeout: timedelta,
                engines: Callable[[], Sequence[ZeroEngine]]) -> Optional[RankWatch]:
    """Start this rank's :class:`~lightning_zinf.comm.watch.RankWatch` (nothing on one rank, or
    without a rendezvous store in the environment). A rank is declared dead after half the
    collectives' ``timeout`` (at most a minute), so the run ends before the backend would; two ranks
    blocked in different calls (an engine's agreement check, the strategy's :func:`barrier`) are a
    deadlock after a few seconds. ``engines()`` (the strategy's, once built) supply the progress
    quoted in messages and the agreement check this rank waits in. ``LIGHTNING_ZINF_WATCH=0`` turns it
    off (then a failing rank leaves the others to the backend's timeout, and NCCL's own timeout
    diagnostics, such as its flight recorder, run as without this package)."""
    if (world_size < 2 or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ
            or os.environ.get("LIGHTNING_ZINF_WATCH", "1") == "0"):
        return None

    def progress() -> str:
        current = engines()
        return current[-1].progress() if current else ""

    def waiting() -> Optional[str]:
        return next((e.waiting_in for e in engines() if e.waiting_in is not None), None)

    # Each watcher reads every rank's beat once per interval: W^2 store reads per interval in all.
    interval = max(1.0, world_size / 32)
    stale = max(min(timeout.total_seconds() / 2, 60.0), 10 * interval)
    try:
        watch = RankWatch(rank, world_size, interval=interval, stale=stale, progress=progress, waiting=waiting)
        watch.start()
    except Exception as error:  # the run goes on without it, as before it existed
        rank_zero_warn(f"lightning_zinf: no failure watch for this run ({error}); a failing rank may leave the "
                       "others waiting until the collectives' timeout.")
        return None
    return watch


def finish_run(engines: Sequence[ZeroEngine], watch: Optional[RankWatch]) -> None:
    """An adapter's teardown: release the engines' gathered units (collectives, skipped after a
    failure: the other ranks may be gone) and stop the watch (the normal end)."""
    failed = watch is not None and watch.first_failure() is not None
    for engine in engines if not failed else ():
        engine.release_all()
    if watch is not None:
        watch.stop()


def report_failure(watch: Optional[RankWatch], exception: BaseException) -> None:
    """Report ``exception`` to the other ranks; if the run failed first elsewhere (another rank's
    error, a divergence or a dead rank, and this rank's error is the consequence: a collective that
    broke or timed out), or this rank's collective failed and the watch knows which ranks were dead
    or elsewhere, add that message to ``exception`` (a note under its traceback, and on stderr)
    rather than raising another error, so the Trainer still tears down and finalises its loggers.
    Any exception (an interrupt too) also keeps the process groups from being released at exit
    (:func:`~lightning_zinf.comm.exit.mark_failed`: a collective may still wait for a peer)."""
    mark_failed()
    if watch is None or not isinstance(exception, Exception):
        return
    first = watch.report(exception)
    if first is None:
        return
    own = first.startswith(f"rank {watch.rank}: ")
    note = f"lightning_zinf: {'this collective failed' if own else 'the run failed first'}: {first}"
    if hasattr(exception, "add_note"):
        exception.add_note(note)
    print(f"[rank {watch.rank}] {note}", file=sys.stderr, flush=True)
