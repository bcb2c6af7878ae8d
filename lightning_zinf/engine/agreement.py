"""Rank agreement: every rank issues the same gathers and reduce-scatters, or every rank stops.

A gather's and a reduce-scatter's shape come from the unit or group they move, so two ranks that
took different branches over units of the same size reach the backend with collectives that match
in size and mean nothing (a wrong update), and units of other sizes make gloo abort the process and
NCCL hang. This part records each collective a rank issues (its code: a unit's index for a gather,
``-1 - group index`` for a reduce-scatter) and makes the ranks agree on them:

- within passes, through the :class:`~lightning_zinf.engine.negotiation.Negotiation`: ranks that
  run different modules agree on each collective before it and serve each other, and a pass that
  replays an agreed trace only checks its script;
- in user code (:meth:`RankAgreement.checked`: ``gathered()``, state dicts), each gather is checked
  with every rank before it is issued (one exchange of a hash), and ranks that differ stop;
- after the fact, at every pass boundary and before every optimizer step
  (:meth:`RankAgreement.verify`: one exchange of a CRC of the sequence since the last check; on a
  pass's script, sent with the meeting's flag there, :meth:`RankAgreement.waypoint_with`).

On a mismatch the sequences (or the next collective of each rank) are gathered as objects, only
then, and every rank raises the same error naming each rank's collective (this project's own
check: DeepSpeed and FSDP2 leave mismatched collectives to the backend). Detection of a dead or
silent rank is the watch's (:mod:`lightning_zinf.comm.watch`), which reads :attr:`waiting_in` and
:meth:`progress`.
"""

from __future__ import annotations

import zlib
from contextlib import contextmanager
from typing import Any, Callable, Hashable, Iterator, Optional, Protocol, Sequence

from lightning_zinf.comm import Collectives
from lightning_zinf.engine.flat import FlatGroup
from lightning_zinf.engine.negotiation import GENERATION, PASS, WAYPOINTS, Negotiation
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
        comm: The engine's collectives (its control-plane exchanges carry the checks).
        tracer: The engine's trace of unit gathers; while it certifies the order (a pass that
            follows the recorded one) gathers and reduce-scatters are not checked one by one.
        units: The engine's units, by index (for messages).
        groups: The engine's flat groups, unit by unit (for messages).

    Attributes:
        collectives_issued: Gathers and reduce-scatters issued over the run.
        waiting_in: The agreement check this rank is blocked in, waiting for the other ranks (a
            description), or None.
"""

    def __init__(self, comm: Collectives, tracer: Tracer, units: Sequence[NamedUnit], groups: list[FlatGroup]) -> None:
        self.comm = comm
        self.tracer = tracer
        self.units = units
        self.groups = groups
        self.collectives_issued = 0
        self.waiting_in: Optional[str] = None
        self._issued: list[int] = []  # codes of the collectives since the last verify()
        self._forced = 0  # inside checked(): user code, so its gathers are checked too
        self._lockstep = 0  # inside lockstep(): engine work every rank does in step
        self.negotiation = Negotiation(comm, self.describe)
        self.negotiation.record = self._count
        self.negotiation.elsewhere = self._elsewhere

    def begin_pass(self, kind: Hashable, check: bool, training: Optional[int] = None) -> Optional[bool]:
        """A pass of ``kind`` starts: the ranks meet at the start of a pass (a soft waypoint,
        :meth:`~lightning_zinf.engine.negotiation.Negotiation.waypoint`), then, if they are there
        together, agree that every rank issued the same collectives since the last check
        (:meth:`verify`), on the previous pass's trace recording, and on whether this pass replays
        an agreed trace of the same kind on every rank (checked against its script) or is
        negotiated: in one exchange with the meeting's flag when every rank followed its script to
        here (the pass's mode depends on the recording's validation, so both answers go), else in
        two exchanges after the meeting. ``check=False`` (the passes of a generation phase, which
        every rank runs in step): no meeting; the previous pass's recording is validated as a trace
        (a collective) and a pass replaying an agreed trace is trusted, not checked.

        Args:
            kind: The pass's kind.
            check: Meet and check (see above).
            training: For a pass that may run backward, the digest of the parameters'
                ``requires_grad`` flags and optimizer param groups
                (:meth:`Freezing.prepare <lightning_zinf.engine.freezing.Freezing.prepare>`), agreed in
                the same exchange as the mode; ``None`` for other passes.

        Returns:
            ``None``, unless every rank is at a training pass together: then whether their
            ``training`` digests agree (for :meth:`Freezing.apply <lightning_zinf.engine.freezing.Freezing.apply>`).

        Raises:
            RuntimeError: the ranks' collectives since the last check differ, or the ranks wait at
                other waypoints than a pass start.
        """
        negotiation = self.negotiation
        if not check:  # in step by construction: validated (a collective) and, once agreed, trusted
            self.tracer.begin_pass(kind)
            negotiation.begin_pass(kind, False, trusted=self.tracer.certified)
            return None
        # What the checks below compare, sent with the meeting's flag when every rank follows its
        # script (one exchange instead of three): whether this pass replays depends on whether the
        # previous pass's recording is validated, so both answers go.
        pending = self.tracer.pending()
        code = zlib.crc32(repr(kind).encode())
        payload = [_digest(self._issued), -1 if pending is None else pending,
                   code if self.tracer.certifies(kind, True) else -1, code if self.tracer.certifies(kind, False) else -1,
                   int(training is not None), training or 0]
        together, rows = self.waypoint_with(PASS, payload)
        if rows is not None:
            return self._begin_met_pass(kind, rows, pending, training)
        if negotiation.departed:  # the pass that ends left its script, or diverged: recorded anew
            self.tracer.rerecord_kind(negotiation.kind)
            negotiation.forget(negotiation.kind)
        pending = self.tracer.pending()
        if together:
            # Every rank is here: check the collectives since the last check and validate the recording.
            issued, self._issued = self._issued, []
            with self._waiting(f"the agreement check at the start of a forward pass ({kind!r})"):
                same_issued, same_pending = self.comm.all_equal_each([_digest(issued), -1 if pending is None else pending])
            if not same_issued:
                self._explain_mismatch(issued, "the start of a forward pass")
            self.tracer.finish(same_pending and pending is not None)
        else:
            self.tracer.finish(None)
        self.tracer.begin_pass(kind, finished=True)
        replaying: Optional[bool] = None
        decision: Optional[bool] = None
        if together:  # one collective on every rank, certified or not, training or not
            mine = code if self.tracer.certified else -1
            same_kind, all_training, same_flags = self.comm.all_equal_each(
                [mine, int(training is not None), training or 0])
            replaying = same_kind and mine != -1
            if all_training and training is not None:
                decision = same_flags
        negotiation.begin_pass(kind, replaying)
        return decision

    def _begin_met_pass(self, kind: Hashable, rows: list[tuple[int, ...]], pending: Optional[int],
                        training: Optional[int]) -> Optional[bool]:
        """:meth:`begin_pass` when the meeting's flag brought every rank's payload (``rows``): the
        same checks, read from it."""
        issued, self._issued = self._issued, []
        same = [len({row[i] for row in rows}) == 1 for i in range(len(rows[0]))]
        if not same[0]:
            self._explain_mismatch(issued, "the start of a forward pass")
        validated = same[1] and pending is not None
        self.tracer.finish(validated)
        self.tracer.begin_pass(kind, finished=True)
        column = 2 if validated else 3  # this pass's code if it replays, on every rank
        self.negotiation.begin_pass(kind, same[column] and rows[self.comm.rank][column] != -1)
        return same[5] if same[4] and training is not None else None

    def waypoint(self, waypoint: int) -> bool:
        """This rank reached ``waypoint`` (:mod:`~lightning_zinf.engine.negotiation`'s codes): meet
        the other ranks there, serving what they ask for meanwhile.

        Returns:
            Whether every rank is there together (always, for a hard waypoint).

        Raises:
            RuntimeError: the ranks wait at different hard waypoints.
        """
        return self.waypoint_with(waypoint, ())[0]

    def waypoint_with(self, waypoint: int, payload: Sequence[int]) -> tuple[bool, Optional[list[tuple[int, ...]]]]:
        """:meth:`waypoint`, sending ``payload`` (at most six signed 64-bit values) with the
        meeting's check when every rank follows its script
        (:meth:`Negotiation.waypoint_with <lightning_zinf.engine.negotiation.Negotiation.waypoint_with>`).

        Returns:
            Whether every rank is there together, and every rank's payload by rank, or ``None`` when
            the meeting did not bring them (the caller then checks by itself).

        Raises:
            RuntimeError: the ranks wait at different hard waypoints.
        """
        with self._waiting(f"the meeting of the ranks at {WAYPOINTS[waypoint]}"):
            return self.negotiation.waypoint_with(waypoint, payload)

    def meet_and_verify(self, waypoint: int, where: str) -> None:
        """Meet the other ranks at ``waypoint``, then :meth:`verify` (``where`` names it); when
        every rank follows its script, both in one exchange.

        Raises:
            RuntimeError: the ranks wait at different hard waypoints, or their collectives since
                the last check differ.
        """
        if self.comm.world_size == 1:
            self._issued = []  # nothing to compare with (as verify())
            return
        _, rows = self.waypoint_with(waypoint, [_digest(self._issued)])
        if rows is None:
            self.verify(where)
            return
        issued, self._issued = self._issued, []
        if len({row[0] for row in rows}) > 1:
            self._explain_mismatch(issued, where)

    def _elsewhere(self, what: str) -> None:
        """Another rank is in another control call than this rank's ``what``: every rank saw it, so
        gather each one's place (only now) and raise naming them."""
        entries = self.comm.all_gather_object(("negotiation", what, what))
        _raise_if_elsewhere(entries)
        raise RuntimeError("Ranks diverged: " + ", ".join(f"rank {r} was at {e[1]}" for r, e in enumerate(entries)))

    def _count(self, code: int) -> None:
        """Record a collective this rank took part in (issued for itself or served)."""
        self.collectives_issued += 1
        self._issued.append(code)

    @contextmanager
    def checked(self) -> Iterator[None]:
        """Within the block, every gather is checked before it is issued, trace or not (gathers
        that user code asks for: :meth:`~lightning_zinf.ZeroEngine.gathered`, state dicts)."""
        self._forced += 1
        try:
            yield
        finally:
            self._forced -= 1

    def note_gather(self, unit: NamedUnit) -> bool:
        """Before this rank gathers ``unit``: agree on it with the other ranks and record it.

        Returns:
            Whether the gather must be exact (other ranks asked for something else in the same
            round and serve it: their partitions may differ from this rank's).

        Raises:
            RuntimeError: in user code (:meth:`checked`), the ranks are about to gather different
                units (:meth:`_agree_on`).
        """
        return self._issue(unit.index)

    def note_reduce(self, group_index: int) -> None:
        """Before this rank reduce-scatters the gradients of the engine's flat group ``group_index``:
        agree on it with the other ranks and record it."""
        self._issue(-1 - group_index)

    @contextmanager
    def lockstep(self) -> Iterator[None]:
        """Within the block, collectives are recorded but neither negotiated nor checked against a
        script: engine work every rank does at the same point by construction (the persistent
        units' gathers after an optimizer step, whose pre-hook the ranks met at, and at setup)."""
        self._lockstep += 1
        try:
            yield
        finally:
            self._lockstep -= 1

    def _issue(self, code: int) -> bool:
        if self._lockstep:
            self._count(code)
            return False
        if self._forced:
            self._agree_on(code)
            divergent = False
        elif self.negotiation.certified(code):  # a trace pass on its script: nothing to wait for
            divergent = False
        else:
            with self._waiting(f"a negotiation round before its {self.describe(code)}"):
                self.negotiation.collective(code)
            divergent = self.negotiation.divergent
        self._count(code)
        return divergent

    def verify(self, where: str = "an agreement check of the engine") -> None:
        """Check that every rank issued the same gathers and reduce-scatters, unit for unit, since
        the last check (one exchange of an integer; the sequences travel only on a mismatch).
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
        with self._waiting(where):
            agreed = self.comm.all_equal(_digest(issued))
        if not agreed:
            self._explain_mismatch(issued, where)

    def _explain_mismatch(self, issued: list[int], where: str) -> None:
        """Every rank saw the ranks' collectives differ: gather the sequences (only now) and raise,
        saying where they part."""
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
        """Before a call every rank must make at the same point (entering a generation phase): a
        hard waypoint (:meth:`waypoint`), so a rank that did not make it (it went on to a gather, or
        to the end of its step) ends every rank with the divergence named instead of a hang.

        Raises:
            RuntimeError: the other ranks are at another hard waypoint (every rank raises, naming
                each one's place).
        """
        self.waypoint(GENERATION)

    def serve_with(self, serve: Callable[[int, bool], None]) -> None:
        """Take part in the collectives other ranks ask for with ``serve(code, exact)``
        (:meth:`UnitStates.serve <lightning_zinf.engine.units.UnitStates.serve>`)."""
        self.negotiation.serve = serve

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
        that it is about to issue the same one (one host-side exchange of a hash), so ranks that
        diverged (a module run on some ranks only, units of other sizes, another order) raise this
        error instead of reaching the backend with mismatched collectives, which gloo answers by
        aborting the process and NCCL by hanging.

        Raises:
            RuntimeError: the ranks are about to issue different collectives (every rank raises,
                naming each rank's); or, after this rank left the agreed trace, the others did not
                come to the check within the timeout (they follow the trace).
        """
        if self.comm.world_size == 1:
            return
        what = self.describe(code)
        with self._waiting(f"the agreement check before its {what}"):
            agreed = self.comm.all_equal(zlib.crc32(f"{code}:{self._numel_of(code)}".encode()))
        if agreed:
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


def _digest(codes: list[int]) -> int:
    """A CRC of a sequence of collectives' codes (what the ranks compare)."""
    return zlib.crc32(",".join(map(str, codes)).encode())


def _raise_if_elsewhere(entries: list[tuple[str, str, Any]]) -> None:
    """The ranks' ``(kind, where, payload)`` of a failed agreement check: when they were at
    different kinds of check (one at a pass boundary, another before a gather), the exchange
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
