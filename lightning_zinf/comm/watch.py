"""A side channel between ranks for failures, beside the collectives.

A collective cannot carry an error: when one rank raises (a corrupt shard file, a full disk, user
code), the others are left blocked in their next collective until the backend gives up, and what
they report is the backend's ("Connection closed by peer" from gloo, a timeout from NCCL), not the
cause; a rank that hangs in its own code is left running after the others end. Every rank
therefore runs a :class:`RankWatch`: a daemon thread that talks to the rendezvous store (the
``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` that Lightning's launcher and torchrun both create),
independently of the process groups:

- a rank that fails posts its message there (first writer wins; :meth:`RankWatch.post_failure`);
  a rank whose own error is the consequence (a collective that broke or timed out) reports that
  first message instead (:meth:`RankWatch.first_failure`);
- each watcher beats (a counter per rank, with the engine's progress); a rank whose beat stops for
  ``stale`` seconds died (killed, crashed): a survivor posts that, naming it;
- a watcher that sees a posted failure ends its own process after ``grace`` seconds if it has not
  ended by itself by then (blocked in a collective, or stuck in user code), printing the failure
  first, so no process outlives the run; one that loses the store does the same. Under
  Lightning's launcher (and wherever rank 0 creates the store, as ``init_process_group`` does
  when torchrun's agent does not host it) the store lives in rank 0's process, so a dead rank 0
  takes the channel with it: its beat said which pid it is, so a survivor on its host sees the
  pid gone before it touches the store, and any survivor sees the store's connection closed;
  either way it names rank 0 ("rank 0 (pid ...; it hosts the rendezvous store at ...) is gone")
  as the run's failure, within an interval, and ends after ``grace`` like for any failure. A
  lost store is never called again (each call on a closed client prints a C++ stack trace);
- each watcher publishes, with its beat, the blocking call its rank waits in, if it is one the
  engine or the strategy names (an agreement check of the engine, the strategy's barrier): two
  ranks waiting in different ones for ``deadlock_after`` seconds can never both return (each
  waits for the other to join its own), so the deadlock is posted as the failure, naming both
  (a model run on rank 0 alone while rank 1 waits in a barrier: LitGPT's ``generate_example``).

The normal end: :meth:`RankWatch.stop` marks the rank done and rank 0 waits (at most ``grace``)
for every rank's mark, so the store outlives every watcher.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional

import torch.distributed as dist

from lightning_zinf.comm.exit import mark_failed

__all__ = ["RankWatch"]


class RankWatch:
    """Watch the other ranks of a run through its rendezvous store (see the module docstring).

    Args:
        rank: This rank (in the world).
        world_size: The number of ranks (the world's).
        interval: Seconds between beats and checks.
        grace: Seconds a process is given to end by itself after a failure is posted, before the
            watcher ends it (exit code 1).
        stale: Seconds without a beat after which a rank counts as dead.
        progress: Returns a short description of where this rank is (the engine's last
            collective); published with each beat and quoted when a rank is found behind.
        store: The store to use (default: a client of ``MASTER_ADDR:MASTER_PORT``).
        waiting: Returns the blocking call of the engine this rank waits in, or None (published
            with each beat; see the module docstring).
        deadlock_after: Seconds two ranks must wait in different calls before it is a deadlock
            (default: three intervals, at least 3 s; published labels may lag one interval).

    Attributes:
        blocked_in: The strategy's own blocking call this rank waits in (its barrier), or None.

    Raises:
        RuntimeError: no store (``MASTER_ADDR``/``MASTER_PORT`` unset and none given).
    """

    def __init__(self, rank: int, world_size: int, *, interval: float = 1.0, grace: float = 5.0,
                 stale: float = 30.0, progress: Optional[Callable[[], str]] = None,
                 store: Optional[dist.Store] = None, waiting: Optional[Callable[[], Optional[str]]] = None,
                 deadlock_after: Optional[float] = None) -> None:
        self.rank, self.world_size = rank, world_size
        self.interval, self.grace, self.stale = interval, grace, stale
        self.progress = progress or (lambda: "")
        self.waiting = waiting or (lambda: None)
        self.deadlock_after = deadlock_after if deadlock_after is not None else max(3.0, 3 * interval)
        self.blocked_in: Optional[str] = None
        self._published = ""  # the label of the blocking call last published
        self._stalls: dict[int, tuple[tuple[str, str], float]] = {}  # rank -> ((ours, theirs), since)
        if store is None:
            if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
                raise RuntimeError("RankWatch needs MASTER_ADDR and MASTER_PORT (set by Lightning and torchrun).")
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                  is_master=False, timeout=timedelta(seconds=max(interval * 5, 10)))
            # Who hosts that store: torchrun's agent (which outlives its workers), or rank 0's process.
            self._zero_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            self._store_address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        else:
            self._zero_hosts_store, self._store_address = False, ""
        # One namespace per run (torchrun's agent keeps its store across restarts) and per watch
        # started in this process (every rank starts one per fit/validate/... call, in step).
        RankWatch._started += 1
        run = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self._pids: dict[int, tuple[str, int]] = {}  # rank -> (host, pid), from its beats
        self.store = _Store(dist.PrefixStore(f"zinf_watch/{run}/{RankWatch._started}/", store), self._zero_dead)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (last beat, monotonic time it changed)
        self._beats = 0
        self._previous_hook = None
        self._zero_done = False  # rank 0 said it ended normally (its store may go away)
        self._own: Optional[str] = None  # the failure this rank's own error posted
        self._known: Optional[str] = None  # the first failure, once read
        self._said_gone = False  # this rank printed (or reported) that the store's host is gone
        self._zero_dead_seen = False  # rank 0's pid was found dead

    _started = 0

    # --- life cycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start beating and watching (a daemon thread), and report uncaught exceptions of the main
        thread (``sys.excepthook``: a script's or Fabric loop's) to the other ranks."""
        if self._thread is not None:
            return
        self._beat()
        self.learn_pids()
        self._thread = threading.Thread(target=self._run, name=f"zinf-rank-watch-{self.rank}", daemon=True)
        self._thread.start()
        self._previous_hook = sys.excepthook
        sys.excepthook = self._excepthook
        atexit.register(self.stop)  # a script (a Fabric loop) that ends without a teardown

    def stop(self) -> None:
        """The normal end: mark this rank done and stop watching; rank 0 (which may host the store)
        first waits up to ``grace`` seconds for every rank's mark."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        atexit.unregister(self.stop)
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_hook
        try:
            self.store.set(f"done/{self.rank}", "1")
            if self.rank == 0:
                keys = [f"done/{r}" for r in range(self.world_size)]
                deadline = time.monotonic() + self.grace
                while not self.store.check(keys) and time.monotonic() < deadline:
                    time.sleep(0.05)
        except Exception:  # the store is gone already: nothing left to tell anyone
            pass

    # --- failures ---------------------------------------------------------------------------------
    def post_failure(self, message: str) -> bool:
        """Tell every rank that the run failed with ``message`` (prefix it with the rank it is about);
        True if it is the first failure posted (a later one is a consequence and is not kept)."""
        text = message[:4000]
        try:
            stored = self.store.compare_set("failed", "", text).decode()
        except Exception:
            return False
        self._known = stored
        mark_failed()
        return stored == text

    def first_failure(self) -> Optional[str]:
        """The first failure any rank posted, or None; once seen, remembered (the store may go
        away with rank 0's process)."""
        if self._known is not None:
            return self._known
        try:
            if self.store.check(["failed"]):
                self._known = self.store.get("failed").decode()
                mark_failed()
        except Exception:
            if self.store.lost is not None and not self._zero_done:
                self._known = self.store_gone()  # nobody can post anything any more: this is the failure
                mark_failed()
        return self._known

    def store_gone(self) -> str:
        """Why the rendezvous store stopped answering, naming its host: rank 0 (with its pid, and
        whether that pid is known dead) or torchrun's agent."""
        where = f" at {self._store_address}" if self._store_address else ""
        why = f" ({self.store.lost})" if self.store.lost else ""
        noticed = f"noticed by rank {self.rank}"
        if not self._zero_hosts_store:
            return f"the rendezvous store{where} stopped answering{why}: its host ended or is unreachable ({noticed})"
        host, pid = self._pids.get(0, ("", 0))
        who = f"rank 0 (pid {pid} on {host}; it hosts the rendezvous store{where})" if pid else \
            f"rank 0 (it hosts the rendezvous store{where})"
        if self._zero_done:
            return f"{who} ended before this rank was done ({noticed})"
        if self._zero_dead(settle=1.0):
            return f"{who} is gone: its process is dead, killed or crashed ({noticed})"
        return (f"{who} is gone: its store closed the connection{why}; rank 0 was killed or crashed, or its "
                f"host is unreachable ({noticed})")

    def report(self, error: BaseException) -> Optional[str]:
        """Post ``error`` as this rank's failure, unless a failure was posted first (another rank's
        error, a divergence, a dead rank): then, if ``error`` is a collective's failure (its
        consequence: a collective that broke or timed out), return that message. Also return the
        message posted when ``error`` is a collective's failure: it names the ranks that were dead
        or elsewhere. None: ``error`` is this rank's own and tells the story itself."""
        first = self.first_failure()
        collective = _looks_like_a_collective_failure(error)
        if first is not None:
            self._said_gone = self._said_gone or (collective and self.store.lost is not None)
            return first if collective else None  # an error of its own (every rank's bad file) stays its own
        message = f"rank {self.rank}: {_format_error(error)}"
        behind = self.behind() if collective else ""
        if behind:
            message += f" -- {behind}"
        if self.post_failure(message):
            self._own = message
            if self.rank == 0:  # its process may host the store: let the others read the failure first
                time.sleep(2 * self.interval)
            return message if behind else None
        first = self.first_failure() if collective else None  # another rank posted in between (or rank 0 died)
        self._said_gone = self._said_gone or (first is not None and self.store.lost is not None)
        return first

    def behind(self) -> str:
        """Which ranks look dead (no beat for ``stale`` s) or are elsewhere (their published
        progress), for an error message; empty if none is known."""
        notes = []
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            try:
                beat, host, pid, where = (self.store.get(f"beat/{rank}").decode().split(" ", 3) + [""])[:4]
            except Exception:
                notes.append(f"rank {rank} gives no sign of life")
                continue
            last = self._seen.get(rank)
            if host == socket.gethostname() and not _alive(int(pid)):
                notes.append(f"rank {rank} (pid {pid}) is dead")
            elif last is not None and int(beat) == last[0] and time.monotonic() - last[1] > self.stale:
                notes.append(f"rank {rank} stopped beating {time.monotonic() - last[1]:.0f} s ago")
            elif where != self.progress():
                notes.append(f"rank {rank} is at {where or 'its start'}")
        mine = self.progress()
        return "; ".join(notes) + (f" (this rank is at {mine})" if notes and mine else "")

    # --- the thread -------------------------------------------------------------------------------
    def _beat(self) -> None:
        self._beats += 1
        self.store.set(f"beat/{self.rank}", f"{self._beats} {socket.gethostname()} {os.getpid()} {self.progress()}")
        label = self._waiting_in() or ""
        if label != self._published or self._beats == 1:
            self.store.set(f"waiting/{self.rank}", label)
            self._published = label

    def _waiting_in(self) -> Optional[str]:
        try:
            return self.blocked_in or self.waiting()
        except Exception:  # the engine is being built or torn down
            return self.blocked_in

    def _run(self) -> None:
        posted_at: Optional[float] = None
        lost_since: Optional[float] = None
        last = started = time.monotonic()
        # In the first interval, look often for the beats of ranks that start after this one: each
        # says which pid the rank is (whether rank 0 is alive is then known without the store).
        while time.monotonic() - started < self.interval and len(self._pids) < self.world_size - 1:
            if self._stop.wait(0.05):
                return
            self.learn_pids()
        while not self._stop.wait(self.interval):
            if time.monotonic() - last > self.stale / 2:
                # This process was suspended (SIGSTOP, a paused VM): the others' beats look old
                # because we did not look; judge them afresh.
                self._seen.clear()
            last = time.monotonic()
            try:
                self._beat()
                failure = self.first_failure() or self._find_dead() or self._find_deadlock()
                self._zero_done = self.store.check(["done/0"])
                lost_since = None
            except Exception:  # the store is unreachable: its host (rank 0) is gone, or overloaded
                if self._zero_done:
                    return  # rank 0 ended normally first: nothing left to watch
                lost_since = lost_since if lost_since is not None else time.monotonic()
                if self.store.lost is None:  # slow (a timeout), not closed: wait for it a while
                    if time.monotonic() - lost_since >= max(self.grace, self.stale / 2):
                        self._end(f"{self.store_gone()}; it did not answer for {time.monotonic() - lost_since:.0f} s")
                    continue
                # Closed, or its host's process is dead: nothing can be posted any more, so this
                # rank says it now (unless its own error already did) and ends after the grace period.
                failure = self.first_failure() or self.store_gone()
                if not self._said_gone:
                    self._said_gone = True
                    print(f"[rank {self.rank}] lightning_zinf: the run failed: {failure}; this rank ends in "
                          f"{self.grace:.0f} s unless it ends by itself first", file=sys.stderr, flush=True)
                if time.monotonic() - lost_since >= self.grace:
                    self._end(failure)
                continue
            if failure is None or failure == self._own:
                continue  # none, or this rank's own error: its process is ending by itself
            posted_at = posted_at if posted_at is not None else time.monotonic()
            if time.monotonic() - posted_at >= self.grace:
                self._end(failure)

    def learn_pids(self) -> None:
        """Note the host and pid of every rank that has beaten already (to know, without the store,
        whether rank 0's process is alive). The thread looks for them; call it after a collective
        that every rank entered after :meth:`start`, so that all are known however late the
        thread runs (a loaded machine: rank 0 killed before the thread saw its beat went unnamed)."""
        try:
            for rank in range(self.world_size):
                if rank != self.rank and rank not in self._pids and self.store.check([f"beat/{rank}"]):
                    fields = self.store.get(f"beat/{rank}").decode().split(" ", 3)
                    if len(fields) >= 3 and fields[2].isdigit():
                        self._pids[rank] = (fields[1], int(fields[2]))
        except Exception:
            pass

    def _find_dead(self) -> Optional[str]:
        now = time.monotonic()
        others = [r for r in range(self.world_size) if r != self.rank]
        keys = [f"beat/{r}" for r in others]
        if self.store.check(keys):  # every rank has beaten once: one round trip for all beats
            beats = dict(zip(others, self.store.multi_get(keys)))
        else:
            beats = {r: self.store.get(k) for r, k in zip(others, keys) if self.store.check([k])}
        for rank, value in beats.items():
            fields = bytes(value).decode().split(" ", 3)
            beat = int(fields[0])
            if len(fields) >= 3 and fields[2].isdigit():
                self._pids[rank] = (fields[1], int(fields[2]))
            last = self._seen.get(rank)
            if last is None or last[0] != beat:
                self._seen[rank] = (beat, now)
            elif now - last[1] > self.stale and not self.store.check([f"done/{rank}"]):
                self.post_failure(f"rank {rank} died or froze: no sign of life for {now - last[1]:.0f} s "
                                  f"(killed, crashed, or its host is gone; noticed by rank {self.rank})")
                return self.first_failure()
        return None

    def _find_deadlock(self) -> Optional[str]:
        mine = self._waiting_in()
        others = [r for r in range(self.world_size) if r != self.rank]
        keys = [f"waiting/{r}" for r in others]
        if not mine or not self.store.check(keys):
            self._stalls.clear()
            return None
        now = time.monotonic()
        for rank, value in zip(others, self.store.multi_get(keys)):
            theirs = bytes(value).decode()
            if not theirs or theirs == mine:
                self._stalls.pop(rank, None)
                continue
            pair, since = self._stalls.get(rank, (None, now))
            if pair != (mine, theirs):
                self._stalls[rank] = ((mine, theirs), now)
            elif now - since >= self.deadlock_after:
                self.post_failure(
                    f"Ranks deadlocked: rank {self.rank} waits in {mine}, while rank {rank} waits in {theirs}; neither "
                    "can return. Every rank must make the same calls on a model lightning_zinf partitions (each unit "
                    "is gathered from all ranks): every forward pass, state_dict()/load_state_dict(), checkpoint "
                    "saves. Code that makes them on one rank alone (LitGPT's finetune scripts call generate_example "
                    "on rank 0 only; a callback that samples or saves on rank 0) must make them on every rank, "
                    "printing or writing on rank 0."
                )
                return self.first_failure()
        return None

    def _end(self, why: str) -> None:
        if self.rank == 0:  # its process may host the store: let every watcher read the failure first
            time.sleep(2 * self.interval)
        print(f"[rank {self.rank}] lightning_zinf: ending this rank because another one failed: {why}",
              file=sys.stderr, flush=True)
        os._exit(1)

    def _excepthook(self, kind: type, error: BaseException, tb) -> None:
        first = self.report(error) if isinstance(error, Exception) else None
        (self._previous_hook or sys.__excepthook__)(kind, error, tb)
        if first is not None:
            print(f"[rank {self.rank}] lightning_zinf: what the error above follows from: {first}",
                  file=sys.stderr, flush=True)

    def _zero_dead(self, settle: float = 0.0) -> bool:
        """Whether rank 0's process hosts the store and is known dead: it runs on this host (its
        beat said so) and its pid is gone. Reads no store. ``settle`` (s): how long to wait for a
        live pid to end (a store call already in flight when rank 0 was killed meets the closed
        connection before this rank reads the pid)."""
        if not self._zero_hosts_store or 0 not in self._pids or self.rank == 0:
            return False
        host, pid = self._pids[0]
        if host != socket.gethostname():
            return False
        if not self._zero_dead_seen:  # a dead pid stays dead; a live one is read before each call
            deadline = time.monotonic() + settle
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            self._zero_dead_seen = not _alive(pid)
        return self._zero_dead_seen


class StoreLost(RuntimeError):
    """The watch's rendezvous store is gone (its host's process ended or closed the connection)."""


class _Store:
    """The rendezvous store as a :class:`RankWatch` uses it: the first call that fails with a
    network error (the server closed the connection) marks it lost, as does ``host_dead()``
    returning True before a call; a lost store is not called again, every call raises
    :class:`StoreLost` at once (a call on a closed client prints a C++ warning with a stack trace,
    and a closed client never reconnects).

    Attributes:
        lost: Why the store is lost (the first line of the network error), or None.
    """

    def __init__(self, store: dist.Store, host_dead: Callable[[], bool]) -> None:
        self._store, self._host_dead = store, host_dead
        self.lost: Optional[str] = None

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._store, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.lost is None and self._host_dead():
                self.lost = "its host process is dead"
            if self.lost is not None:
                raise StoreLost(self.lost)
            try:
                return method(*args, **kwargs)
            except _NETWORK_ERRORS as error:
                self.lost = str(error).strip().split("\n", 1)[0] or type(error).__name__
                raise StoreLost(self.lost) from error

        return call


_NETWORK_ERRORS = tuple(e for e in (getattr(dist, "DistNetworkError", None), ConnectionError) if e is not None)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs: not a zombie (ended, not yet reaped by its
    parent) and not exiting (Linux's PF_EXITING flag: set when a killed process starts to end,
    before its sockets close, so a peer never meets a closed connection of a process it still
    thought alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:  # no /proc: a signal was accepted, so it exists
        return True
    return fields[0] not in ("Z", "X") and not int(fields[6]) & _PF_EXITING


_PF_EXITING = 0x4  # include/linux/sched.h; /proc/<pid>/stat's ninth field holds the flags


def _looks_like_a_collective_failure(error: BaseException) -> bool:
    """A backend error: a peer gone (gloo's "Connection closed/reset by peer") or a timeout."""
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error).lower()
    return any(s in text for s in ("connection closed", "connection reset", "timed out", "timeout", "gloo", "nccl"))


def _format_error(error: BaseException) -> str:
    """``Type: message`` and the innermost frame, short enough for the store."""
    frame = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
    where = f" (at {frame[0].filename}:{frame[0].lineno})" if frame else ""
    return f"{type(error).__name__}: {error}{where}"
