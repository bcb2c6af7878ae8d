"""Rank agreement: every rank issues the same gathers and reduce-scatters, or every rank stops.

A gather's and a reduce-scatter's shape come from the unit or group they move, so two ranks that
took different branches over units of the same size reach the backend with collectives that match
in size and mean nothing (a wrong update), and units of other sizes make gloo abort the process and
NCCL hang. This part records each collective a rank issues (its code: a unit's index for a gather,
``-1 - group index`` for a reduce-scatter) and checks it two ways:

- after the fact, at every pass boundary and before every optimizer step
  (:meth:`RankAgreement.verify`: one all-reduce of a CRC of the sequence since the last check);
- before the collective, whenever the trace (:class:`~lightning_zinf.engine.trace.Tracer`) does not
  certify the order, i.e. in a pass that left the recorded order or in user code
  (:meth:`RankAgreement.note_gather` / :meth:`RankAgreement.note_reduce`: one all-reduce of a hash of
  what the rank is about to issue).

On a mismatch the sequences (or the next collective of each rank) are gathered as objects, only
then, and every rank raises the same error naming each rank's collective (this project's own
check: DeepSpeed and FSDP2 leave mismatched collectives to the backend). Detection of a dead or
silent rank is the watch's (:mod:`lightning_zinf.comm.watch`), which reads :attr:`waiting_in`,
:meth:`progress` and is told of departures through :attr:`on_departure`.
"""

from __future__ import annotations

import zlib
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence

from lightning_zinf.comm import Collectives
from lightning_zinf.engine.flat import FlatGroup
from lightning_zinf.engine.trace import Tracer

__all__ = ["RankAgreement", "NamedUnit"]


class NamedUnit(Protocol):
    """What the agreement reads of a unit (a :class:`~lightning_zinf.engine.units.Unit`): its
    index, a gather's code, and for messages its owner's name and its size in elements."""

    index: int
    name: str
    numel: int


class RankAgreement:
    """Records the collectives this rank issues and checks with the other ranks that they match.

    Args:
        comm: The engine's collectives (its control-plane all-reduces carry the checks).
        tracer: The engine's trace of unit gathers; while it certifies the order (a pass that
            follows the recorded one) gathers and reduce-scatters are not checked one by one.
        units: The engine's units, by index (for messages).
        groups: The engine's flat groups, unit by unit (for messages).

    Attributes:
        collectives_issued: Gathers and reduce-scatters issued over the run.
        waiting_in: The agreement check this rank is blocked in, waiting for the other ranks (a
            description), or None.
        on_departure: Called with a description of the next collective when this rank leaves the
            agreed trace (before it checks with the other ranks), and with ``None`` once they
            agreed; the strategies point it at their :class:`~lightning_zinf.comm.watch.RankWatch`.
    """

    def __init__(self, comm: Collectives, tracer: Tracer, units: Sequence[NamedUnit], groups: list[FlatGroup]) -> None:
        self.comm = comm
        self.tracer = tracer
        self.units = units
        self.groups = groups
        self.collectives_issued = 0
        self.waiting_in: Optional[str] = None
        self.on_departure: Optional[Callable[[Optional[str]], Any]] = None
        self._issued: list[int] = []  # codes of the collectives since the last verify()
        self._forced = 0  # inside checked(): user code, so its gathers are checked too
        self._departure_agreed = False  # this pass left its trace and every rank agreed on the branch

    def begin_pass(self) -> None:
        """A new pass starts: a departure from its trace is announced again."""
        self._departure_agreed = False

    @contextmanager
    def checked(self) -> Iterator[None]:
        """Within the block, every gather is checked before it is issued, trace or not (gathers
        that user code asks for: :meth:`~lightning_zinf.ZeroEngine.gathered`, state dicts)."""
        self._forced += 1
        try:
            yield
        finally:
            self._forced -= 1

    def note_gather(self, unit: NamedUnit) -> None:
        """Before this rank gathers ``unit``: check (unless certified) and record it.

        Raises:
            RuntimeError: see :meth:`_agree_on`.
        """
        self._issue(unit.index)

    def note_reduce(self, group_index: int) -> None:
        """Before this rank reduce-scatters the gradients of the engine's flat group ``group_index``:
        check (unless certified) and record it.

        Raises:
            RuntimeError: see :meth:`_agree_on`.
        """
        self._issue(-1 - group_index)

    def _issue(self, code: int) -> None:
        self._agree_on(code)
        self.collectives_issued += 1
        self._issued.append(code)

    def verify(self, where: str = "an agreement check of the engine") -> None:
        """Check that every rank issued the same gathers and reduce-scatters, unit for unit, since
        the last check (one all-reduce of two integers; the sequences travel only on a mismatch).
        Run at every pass boundary and before every optimizer step, so a rank whose control flow
        diverged (a different branch over units of the same size, which the collectives
        themselves cannot notice) stops training before a wrong update is applied.

        Args:
            where: What this check is, for :attr:`waiting_in` while it waits for the other ranks.

        Raises:
            RuntimeError: the ranks' sequences differ; the message gives the first difference.
        """
        issued, self._issued = self._issued, []
        if self.comm.world_size == 1:
            return
        digest = zlib.crc32(",".join(map(str, issued)).encode())
        with self._waiting(where):
            agreed = self.comm.all_equal(digest)
        if agreed:
            return
        # Every rank saw the mismatch: gather the sequences (only now) to say where they part.
        entries = self.comm.all_gather_object(("sequence", where, issued[:4096]))
        _raise_if_elsewhere(entries)
        sequences = [entry[2] for entry in entries]
        first = next(i for i in range(max(map(len, sequences))) if len({tuple(q[i:i + 1]) for q in sequences}) > 1)
        seen = ", ".join(f"rank {r}: {self.describe(q[first]) if first < len(q) else 'end'}"
                         for r, q in enumerate(sequences))
        raise RuntimeError(
            f"Ranks diverged: collective #{first} since the last check was {seen}. Every rank must run "
            "the same modules in the same order (control flow that depends on rank-local data must "
            "agree across ranks, e.g. by deciding on rank 0 and broadcasting)."
        )

    def check_entry(self, what: str) -> None:
        """Before a call every rank must make at the same point (entering a generation phase):
        check that every rank made it, as a departure from the agreed order is checked (a notice
        to the watch, then one all-reduce), so a rank that did not (it went on to a gather of the
        agreed trace) ends every rank with the divergence instead of a hang until the timeout.

        Raises:
            RuntimeError: the other ranks made another call (every rank raises, naming each one's
                place), or did not come within the watch's ``stale`` seconds.
        """
        if self.comm.world_size == 1:
            return
        if self.on_departure is not None:
            self.on_departure(what)
        with self._waiting(f"the agreement check at {what}"):
            agreed = self.comm.all_equal(zlib.crc32(f"entry:{what}".encode()))
        if self.on_departure is not None:
            self.on_departure(None)
        if agreed:
            return
        entries = self.comm.all_gather_object(("entry", what, what))
        _raise_if_elsewhere(entries)
        raise RuntimeError("Ranks diverged: " + ", ".join(f"rank {r} was at {e[1]}" for r, e in enumerate(entries))
                           + ". Every rank must make the same calls on a partitioned model, in the same order.")

    def describe(self, code: int) -> str:
        """A collective by its code: a unit's index (a gather), or ``-1 - group index`` (a reduce-scatter)."""
        if code >= 0:
            unit = self.units[code]
            return f"gather of unit '{unit.name}' ({unit.numel:,} elements)"
        group = self.groups[-1 - code]
        return f"reduce-scatter of '{group.names[0]}'{'...' if len(group.names) > 1 else ''} ({group.numel:,} elements)"

    def progress(self) -> str:
        """Where this rank is: how many gathers and reduce-scatters it has issued and the last one
        (for messages about ranks that fell behind or went elsewhere). Read from the watch's thread."""
        issued = self._issued  # swapped, not cleared, by the main thread: this list stays whole
        last = f": {self.describe(issued[-1])}" if issued else ""
        return f"collective #{self.collectives_issued}{last}"

    def _agree_on(self, code: int) -> None:
        """Before issuing a collective the agreed trace does not certify: check with every rank
        that it is about to issue the same one (one host-side all-reduce of a hash), so ranks that
        diverged (a module run on some ranks only, units of other sizes, another order) raise this
        error instead of reaching the backend with mismatched collectives, which gloo answers by
        aborting the process and NCCL by hanging.

        Raises:
            RuntimeError: the ranks are about to issue different collectives (every rank raises,
                naming each rank's); or, after this rank left the agreed trace, the others did not
                come to the check within the timeout (they follow the trace).
        """
        if self.comm.world_size == 1 or (self.tracer.certified and not self._forced):
            return
        what = self.describe(code)
        departed = self.tracer.departed and not self._departure_agreed
        if departed and self.on_departure is not None:
            self.on_departure(f"collective #{self.collectives_issued}: {what}")
        try:
            with self._waiting(f"the agreement check before its {what}"):
                agreed = self.comm.all_equal(zlib.crc32(f"{code}:{self._numel_of(code)}".encode()))
        except Exception as error:
            if not departed:
                raise
            expected = self.tracer.expected
            raise RuntimeError(
                f"Ranks diverged: rank {self.comm.rank} left the order of collectives every rank agreed on: its "
                f"collective #{self.collectives_issued} is a {what}, where the agreed order has "
                f"{'the end of the pass' if expected is None else self.describe(expected)}; the other ranks did "
                "not take the same branch (they waited in that collective). Every rank must run the same modules "
                "in the same order (decide data-dependent branches on rank 0 and broadcast the decision)."
            ) from error
        if agreed:
            if departed:
                self._departure_agreed = True  # every rank took the branch: no more notices this pass
                if self.on_departure is not None:
                    self.on_departure(None)
            return
        entries = self.comm.all_gather_object(("next", f"about to issue a {what}", what))
        _raise_if_elsewhere(entries)
        seen = [entry[2] for entry in entries]
        raise RuntimeError(
            f"Ranks diverged: at collective #{self.collectives_issued} "
            + ", ".join(f"rank {r} was about to issue a {w}" for r, w in enumerate(seen))
            + ". Every rank must run the same modules in the same order (a module run on some ranks only, or "
            "control flow that depends on rank-local data, must be decided on rank 0 and broadcast)."
        )

    @contextmanager
    def _waiting(self, what: str) -> Iterator[None]:
        self.waiting_in = what
        try:
            yield
        finally:
            self.waiting_in = None

    def _numel_of(self, code: int) -> int:
        return self.units[code].numel if code >= 0 else self.groups[-1 - code].numel


def _raise_if_elsewhere(entries: list[tuple[str, str, Any]]) -> None:
    """The ranks' ``(kind, where, payload)`` of a failed agreement check: when they were at
    different kinds of check (one at a pass boundary, another before a gather), the all-reduce
    paired calls that do not correspond, so say where each rank was.

    Raises:
        RuntimeError: the kinds differ; names each rank's place.
    """
    if len({entry[0] for entry in entries}) > 1:
        raise RuntimeError(
            "Ranks diverged: " + ", ".join(f"rank {r} was at {entry[1]}" for r, entry in enumerate(entries))
            + ". Every rank must make the same calls on a partitioned model, in the same order: every forward "
            "pass, state_dict()/load_state_dict(), optimizer steps (code that runs them on one rank only must "
            "run them on every rank)."
        )
