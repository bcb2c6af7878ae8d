"""The prefetch trace: the order in which units are gathered in one pass, recorded and replayed.

ZeRO-Infinity §6.2 (overlap-centric design) prefetches the parameters the next operators need
while the current one computes; DeepSpeed learns that order from a recorded trace. Here a *pass* is
one forward (and its backward, when training) of one *kind* (``"train"``, ``"eval"``...). The first
pass of a kind records the order of gather requests. At the start of the next pass every rank
compares a hash of its recording with the others' (one small collective); if all agree the trace is
replayed, otherwise prefetch stays off for that kind, since prefetching differently on different
ranks would mismatch the collectives.

During replay each request is checked against the trace. A mismatch (data-dependent control flow)
stops prefetching for the rest of the pass and re-records the trace in the next pass of that kind:
the engine then gathers on demand, which is always correct.

A replayed trace also certifies the collectives: every rank agreed on it, so while a pass follows
it the ranks issue the same gathers and reduce-scatters. Outside that (recording, after a
mismatch, or a kind whose recordings disagreed) :attr:`Tracer.certified` is false and the engine
checks each collective with the other ranks before issuing it.
"""

from __future__ import annotations

import itertools
import logging
import zlib
from dataclasses import dataclass, field
from typing import Hashable, Iterator, Optional, Sequence

from lightning_zinf.comm import Collectives

__all__ = ["Tracer", "Upcoming", "reuse_costs"]

log = logging.getLogger(__name__)

_RECORD, _REPLAY, _OFF = "record", "replay", "off"


@dataclass
class _Trace:
    state: str = _RECORD
    order: list[int] = field(default_factory=list)
    recording: list[int] = field(default_factory=list)
    validated: bool = False
    costs: Optional[list[Optional[int]]] = None  # per position of ``order``: Tracer.reuse_cost


class Upcoming(Sequence[int]):
    """The units a trace says come next (from a position of it to its end), read in place: a
    request makes no copy of the rest of the trace, which is as long as the pass's requests (a
    ``generate()`` call kept in one pass requests thousands of units).

    Args:
        order: The agreed trace.
        start: The position of the first unit to come.
    """

    __slots__ = ("_order", "_start")

    def __init__(self, order: list[int], start: int) -> None:
        self._order, self._start = order, min(start, len(order))

    def __len__(self) -> int:
        return len(self._order) - self._start

    def __getitem__(self, position):  # type: ignore[override]  (positions only; a slice copies)
        if isinstance(position, slice):
            return self._order[self._start:][position]
        if not -len(self) <= position < len(self):
            raise IndexError(position)
        return self._order[self._start + position if position >= 0 else position]

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._order, self._start, None)

    def after_run(self, unit: int) -> "Upcoming":
        """The units that come after the leading requests of ``unit`` (a run of siblings grouped
        into one unit: their requests follow each other)."""
        start = self._start
        while start < len(self._order) and self._order[start] == unit:
            start += 1
        return Upcoming(self._order, start)


_NONE = Upcoming([], 0)


class Tracer:
    """Records and replays the unit order of each kind of pass.

    Args:
        comm: Used once per recorded trace to check that all ranks recorded the same order.
        enabled: ``False`` never prefetches (every gather is on demand); traces are still recorded
            and replayed, to certify the collectives.
    """

    def __init__(self, comm: Collectives, enabled: bool = True) -> None:
        self.comm = comm
        self.enabled = enabled
        self._traces: dict[Hashable, _Trace] = {}
        self._current: Optional[_Trace] = None
        self._cursor = 0
        self._diverged = False
        self.invalidations = 0
        self.expected: Optional[int] = None  # at the last mismatch: the unit the trace had there
        # False while ranks may run different numbers of passes (a generation phase that keeps the
        # whole model, so no synced_gpus): a departure then keeps the agreed trace rather than
        # recording anew, since validating a new recording is a collective that only the ranks
        # still running passes would reach.
        self.rerecord = True
        #: Elements each unit's gather brings in, by unit index (0 for persistent units and units
        #: kept gathered: :meth:`resize`): what :meth:`reuse_cost` counts. Set by the engine once
        #: its units exist.
        self.sizes: list[int] = []
        self._resized = False

    def pending(self) -> Optional[int]:
        """A digest of the recording the pass in progress made, which the next pass start
        validates (:meth:`finish`), or ``None`` if there is none to validate."""
        trace = self._current
        if trace is None or trace.state != _RECORD or not trace.recording:
            return None
        return zlib.crc32(",".join(map(str, trace.recording)).encode())

    def finish(self, agreed: Optional[bool]) -> None:
        """Finish the pass in progress without a collective: its recording becomes the kind's
        trace if ``agreed`` (every rank recorded the same, which the caller checked with
        :meth:`pending`'s digests), else prefetch stays off for that kind; ``None`` (the ranks
        were not together to compare): the recording is dropped and the next pass records again."""
        trace = self._current
        if trace is not None and trace.state == _RECORD and trace.recording:
            if agreed is None:
                trace.recording = []
            else:
                self._adopt(trace, agreed)
        self._current = None

    def certifies(self, kind: Hashable, agreed: bool) -> bool:
        """Whether a pass of ``kind`` would be :attr:`certified` at its start if the pass in
        progress were finished now with ``finish(agreed)``: what a rank sends before the ranks
        know whether they validate its recording (:meth:`RankAgreement.begin_pass
        <lightning_zinf.engine.agreement.RankAgreement.begin_pass>` checks both at once)."""
        trace = self._traces.get(kind)
        if trace is None:
            return False  # its first pass records
        if trace is self._current and trace.state == _RECORD and trace.recording:
            return agreed  # finish() adopts the recording: replayed if agreed, off otherwise
        return trace.state == _REPLAY

    def rerecord_kind(self, kind: Hashable) -> None:
        """Record ``kind``'s trace anew from its next pass (a pass of it left its script)."""
        trace = self._traces.get(kind)
        if trace is not None and trace.state == _REPLAY:
            trace.state, trace.recording = _RECORD, []

    def resize(self, unit: int, size: int) -> None:
        """``unit``'s gathers now bring in ``size`` elements (0: kept gathered between passes by a
        ``keep_gathered`` budget); the traces' reuse costs follow from the next pass on."""
        if self.sizes[unit] != size:
            self.sizes[unit] = size
            self._resized = True

    def begin_pass(self, kind: Hashable, finished: bool = False) -> None:
        """Start a pass of ``kind``; finishes the previous pass (validating a fresh recording: a
        collective) unless the caller did already (``finished``, :meth:`finish`).

        Every rank must call this at the same points (it may run a collective).
        """
        if self._resized:  # (not within a pass: a cost computed per kept unit would cost O(L log L) each)
            self._resized = False
            for trace in self._traces.values():
                trace.costs = None
        if not finished:
            self._finish()
        trace = self._traces.setdefault(kind, _Trace())
        if trace.state == _RECORD:
            trace.recording = []
        self._current, self._cursor, self._diverged = trace, 0, False

    def end_pass(self) -> None:
        """Finish the pass in progress now (validating a fresh recording: a collective, as in
        :meth:`begin_pass`), so that it is not left to the next :meth:`begin_pass`. A generation
        phase ends its last pass this way, because its ranks may have run different numbers of
        passes (decode steps after a rank's sequences ended), and the next collective must pair
        this one on every rank."""
        self._finish()

    def _finish(self) -> None:
        trace = self._current
        if trace is None or trace.state != _RECORD or not trace.recording:
            return
        digest = zlib.crc32(",".join(map(str, trace.recording)).encode())
        self._adopt(trace, self.comm.all_equal(digest))
        self._current = None

    def _adopt(self, trace: _Trace, agreed: bool) -> None:
        if not agreed:
            log.info(
                "lightning_zinf: ranks gathered units in different orders during one pass; prefetch is off for this "
                "kind of pass, whose collectives are agreed one by one (ranks that run different modules serve each "
                "other: lightning_zinf.engine.negotiation)."
            )
        trace.order, trace.recording, trace.costs = trace.recording, [], None
        trace.state = _REPLAY if agreed else _OFF  # replayed without prefetch when not enabled

    def request(self, unit: int) -> Upcoming:
        """Note a gather request for ``unit``.

        Returns:
            The units the trace says come next, in order (the caller gathers ahead along them within
            its budget); empty while recording, after a divergence, or with prefetch off.
        """
        trace = self._current
        if trace is None or self._diverged:
            return _NONE
        if trace.state == _RECORD:
            trace.recording.append(unit)
            return _NONE
        if trace.state != _REPLAY:
            return _NONE
        if self._cursor >= len(trace.order) or trace.order[self._cursor] != unit:
            self.expected = trace.order[self._cursor] if self._cursor < len(trace.order) else None
            self._diverged = True
            self.invalidations += 1
            if self.rerecord:
                trace.state, trace.recording = _RECORD, []
            return _NONE
        self._cursor += 1
        return Upcoming(trace.order, self._cursor) if self.enabled else _NONE

    def requested_next(self, unit: int) -> bool:
        """Whether the agreed trace being replayed says the next gather request is ``unit`` again
        (a unit that several sibling modules use, one after another: it stays gathered between them)."""
        trace = self._current
        return (trace is not None and not self._diverged and trace.state == _REPLAY
                and self._cursor < len(trace.order) and trace.order[self._cursor] == unit)

    def reuse_cost(self) -> Optional[int]:
        """What keeping the unit of the last request gathered until its next request in this pass
        holds of the prefetch bucket, in elements: 0 when the next request that gathers is that
        one (it is used next); else its own elements plus those of the distinct units gathered in
        between, but the first of them (in use when the unit would be gathered ahead again).
        Keeping it costs no more memory than prefetch does where this is at most the bucket: by
        the time that first unit is used, prefetch would have gathered it again. ``None``: not
        requested again in this pass, or the pass does not follow an agreed trace with prefetch
        on. O(1): a trace's costs are computed once, when first asked for."""
        trace = self._current
        if trace is None or self._diverged or trace.state != _REPLAY or not self.enabled or self._cursor == 0:
            return None
        if trace.costs is None:
            trace.costs = reuse_costs(trace.order, self.sizes)
        return trace.costs[self._cursor - 1]

    def unit_order(self) -> list[int]:
        """The units of the pass in progress (or last begun and not finished), in the order it
        first gathered or, by its agreed trace, gathers them: the order the next pass of its kind
        needs them in. Empty without one."""
        trace = self._current
        if trace is None:
            return []
        return list(dict.fromkeys(trace.order if trace.state == _REPLAY else trace.recording))

    @property
    def certified(self) -> bool:
        """The pass is replaying an agreed trace and has not left it: its collectives are the same
        on every rank without checking each one."""
        trace = self._current
        return trace is not None and trace.state == _REPLAY and not self._diverged

    @property
    def departed(self) -> bool:
        """The pass left the agreed trace it was replaying (:attr:`expected` says where)."""
        return self._diverged


def reuse_costs(order: list[int], sizes: Sequence[int]) -> list[Optional[int]]:
    """:meth:`Tracer.reuse_cost` for each position of a trace (the prefetch bucket's share that
    keeping a unit gathered until its next request holds; DeepSpeed's ``stage3_max_reuse_distance``
    measured in elements). O(L log L) in the trace's length L.

    Args:
        order: The trace: unit indices in the order of their gather requests.
        sizes: Elements each unit's gather brings in, by unit index (0: persistent or kept
            gathered, gathering nothing).

    Returns:
        Per position of ``order``, in elements: 0 when the next request that gathers is the same
        unit's; else the unit's elements plus those of the distinct units gathered before its next
        request, but the first of them; ``None`` where the unit is not requested again or
        gathers nothing.
    """
    gaps = _gaps(order, sizes)
    costs: list[Optional[int]] = [None] * len(order)
    following: Optional[int] = None  # the first position after this one whose unit gathers
    for position in range(len(order) - 1, -1, -1):
        gap, unit = gaps[position], order[position]
        if gap is not None and sizes[unit]:  # (a persistent unit stays gathered anyway)
            first = order[following]  # type: ignore[index]  (the next request of ``unit`` is one)
            costs[position] = 0 if first == unit else gap - sizes[first] + sizes[unit]
        if sizes[unit]:
            following = position
    return costs


def _gaps(order: list[int], sizes: Sequence[int]) -> list[Optional[int]]:
    """For each position of ``order``: the sum of ``sizes`` over the distinct units requested
    strictly between it and the next request of the same unit (what prefetch gathers in between),
    ``None`` where there is none. O(L log L) in the trace's length L: distinct sums over ranges,
    offline, with a Fenwick tree that holds each unit's size at its latest request so far."""
    length = len(order)
    following: dict[int, int] = {}
    ends: list[list[int]] = [[] for _ in range(length)]  # by the range's last position, its first
    gaps: list[Optional[int]] = [None] * length
    for position in range(length - 1, -1, -1):
        after = following.get(order[position])
        if after == position + 1:
            gaps[position] = 0
        elif after is not None:
            ends[after - 1].append(position)
        following[order[position]] = position
    tree = [0] * (length + 1)

    def add(position: int, value: int) -> None:
        position += 1
        while position <= length:
            tree[position] += value
            position += position & -position

    def total(position: int) -> int:  # over positions 0..position-1
        result = 0
        while position > 0:
            result += tree[position]
            position -= position & -position
        return result

    latest: dict[int, int] = {}
    for position, unit in enumerate(order):
        if unit in latest:
            add(latest[unit], -sizes[unit])
        add(position, sizes[unit])
        latest[unit] = position
        if ends[position]:
            through = total(position + 1)
            for start in ends[position]:
                gaps[start] = through - total(start + 1)
    return gaps
