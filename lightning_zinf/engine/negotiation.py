"""Ranks that run different modules: they agree on each collective before it and serve each other.

A partitioned model gathers every unit collectively, so a rank that runs a module the others do not
(a head called more often, MoE experts that get no tokens, an early exit, ``generate()`` to another
length, a validation step with extra modules on rank 0) would wait in a collective the others
never issue: DeepSpeed hangs there (its issues #7998, #8262) and FSDP2's unshard is collective as
well. Here every rank keeps training, with DDP's result:

- **Negotiated passes.** Before each gather or reduce-scatter, every rank posts what it is about
  to issue, or the *waypoint* it has reached (the end of a step, of backward, an optimizer step, a
  collective of the training code), in one small all-gather of two integers (a *round*). The
  request of the lowest rank that has one is issued by every rank: the ranks that asked for it use
  it, the others *serve* it (take part in the gather and drop the result; contribute zeros to the
  reduce-scatter and keep their slice, which is exactly what DDP's mean over ranks gives a rank
  that did not use the parameter). A rank at a waypoint serves until every rank is at the same
  one. When ranks asked for different collectives in a round, the gather is exact (no qwZ, no hpZ
  secondary partition), since the ranks' partitions may no longer be alike.
- **Trace passes.** A pass that replays an agreed trace pays nothing per collective: each rank
  compares what it issues with the *script* of its kind (the collectives and waypoints of a
  pass checked round by round, recorded once). A rank that leaves the script (a collective or a
  waypoint the script does not have next) serves the rest of the script, which is what the other
  ranks are issuing, up to its next waypoint, where every rank checks one flag (one small
  exchange per waypoint, which also carries the checks made there); if any rank left, the pass
  goes on negotiated from there, and the next pass of that kind is recorded anew.

The start of a pass is a *soft* waypoint: ranks may run different numbers of passes (each decode
step of ``generate()`` under a per-forward pass), so a rank there goes on while the others wait at
another waypoint. So is the end of a step, for a rank whose others have ended the loop or wait in a
collective of the training code (a predict loop whose batches do not split evenly over the ranks:
Lightning does not pad it). The others are hard: every rank must reach the same one, or every rank
raises naming each rank's. Collectives the training code makes itself must go through the strategy's
``reduce``/``all_gather``/``barrier``/``broadcast`` (Lightning's logging does), which are
waypoints; a ``torch.distributed`` call of its own on some ranks only is still a hang, as under
DDP.
"""

from __future__ import annotations

from typing import Callable, Hashable, Optional, Sequence

from lightning_zinf.comm import Collectives

__all__ = ["Negotiation", "PASS", "STEP_END", "BACKWARD_END", "OPTIMIZER_STEP", "USER_COLLECTIVE", "GENERATION",
           "LOOP_END", "WAYPOINTS"]

#: Waypoints, by code: where ranks wait for each other.
PASS, STEP_END, BACKWARD_END, OPTIMIZER_STEP, USER_COLLECTIVE, GENERATION, LOOP_END = 1, 2, 3, 4, 5, 6, 7
WAYPOINTS = {PASS: "the start of a pass", STEP_END: "the end of a step", BACKWARD_END: "the end of backward",
             OPTIMIZER_STEP: "an optimizer step", USER_COLLECTIVE: "a collective of the training code",
             GENERATION: "a generation phase's entry or exit", LOOP_END: "the end of a loop"}
_SOFT = {PASS}
# A rank at the end of a step while the others have ended the loop or wait in a collective of the
# training code has more steps (a predict loop's batches do not split evenly): it goes on.
_BEHIND = {STEP_END}
_AHEAD = {LOOP_END, USER_COLLECTIVE}

_REQUEST, _AT = 1, 2
# Waypoints in a script, coded below every collective's code (gathers >= 0, reduce-scatters -1 - group).
_WAYPOINT_BASE = -(1 << 40)


def _scripted(waypoint: int) -> int:
    return _WAYPOINT_BASE - waypoint


def _is_waypoint(code: int) -> bool:
    return code <= _WAYPOINT_BASE - 1


class Negotiation:
    """One rank's side of the agreement on collectives within passes (module docstring).

    Args:
        comm: The engine's collectives (rounds and waypoint checks run on its control group).
        describe: A collective's code -> a description, for messages.

    Attributes:
        serve: Called with the code of a collective another rank asked for, and whether it is
            exact, to take part in it (set by the engine to
            :meth:`UnitStates.serve <lightning_zinf.engine.units.UnitStates.serve>`).
        record: Called with the code of every collective this rank takes part in as a server (the
            agreement counts it as issued).
        elsewhere: Called with what this rank is doing when another rank is in another control
            call (a check of user code, a pass start's): raises on every rank, naming each one's.
        negotiating: The pass is negotiated (every collective agreed in a round), not a trace pass.
        departed: In this pass some rank left the script, or the ranks asked for different
            collectives (the kind's trace is recorded anew).
        divergent: The last round's collective was asked for by some ranks only (a gather is then exact).
        departed_passes: Passes so far in which the ranks departed (for tests and monitoring).
    """

    def __init__(self, comm: Collectives, describe: Callable[[int], str]) -> None:
        self.comm = comm
        self.describe = describe
        self.serve: Callable[[int, bool], None] = lambda code, exact: None
        self.record: Callable[[int], None] = lambda code: None
        self.elsewhere: Callable[[str], None] = lambda what: None
        self.negotiating = True
        self.departed = False
        self.divergent = False
        self.departed_passes = 0
        self._scripts: dict[Hashable, list[int]] = {}
        self._script: list[int] = []
        self._position = 0
        self._writing: Optional[list[int]] = None  # this pass's events, in a checked replay pass
        self._trusted = False
        self.kind: Hashable = None

    # --- passes -------------------------------------------------------------------------------------
    def begin_pass(self, kind: Hashable, replaying: Optional[bool], trusted: bool = False) -> None:
        """A pass of ``kind`` starts. ``replaying``: every rank replays an agreed trace of this kind
        (its script is followed, or, the first time, written in a negotiated pass); ``None``: the
        ranks are not at the same point (a soft start, :meth:`waypoint` returned ``False``), so
        the pass is negotiated and nothing is written. ``trusted``: the ranks run this pass in step
        by construction (a generation phase's decode steps under ``synced_gpus``) and replay an
        agreed trace: nothing is checked (a rank that left the trace would wait in a collective
        the others never issue, which the watch reports)."""
        self._finish()
        self.kind, self.departed, self._position = kind, False, 0
        script = self._scripts.get(kind) if replaying else None
        self.negotiating = script is None and not trusted
        self._trusted = trusted
        self._script = script or []
        self._writing = [] if replaying and script is None and not trusted else None

    def _finish(self) -> None:
        self.departed_passes += self.departed
        if self._writing is not None and not self.departed:
            self._scripts[self.kind] = self._writing
        self._writing = None

    def forget(self, kind: Hashable) -> None:
        """Drop ``kind``'s script (its trace is recorded anew)."""
        self._scripts.pop(kind, None)

    # --- events -------------------------------------------------------------------------------------
    def certified(self, code: int) -> bool:
        """The fast path of :meth:`collective`, with nothing to wait for: whether the collective
        ``code`` is certified (one rank, a trusted pass, or the script's next collective, passed).
        Otherwise call :meth:`collective`. Clears :attr:`divergent`."""
        self.divergent = False
        if self.comm.world_size == 1 or self._trusted:
            return True
        return not self.negotiating and self._follows(code)

    def collective(self, code: int) -> None:
        """Before this rank issues the collective ``code``, :meth:`certified` being false: in a
        trace pass, leave the script (it differs); in a negotiated pass, rounds until it is chosen,
        serving the others' requests meanwhile. Sets :attr:`divergent`."""
        if not self.negotiating:
            self._leave()
        self._rounds(_REQUEST, code)
        self._write(code)

    def waypoint(self, waypoint: int) -> bool:
        """This rank reached ``waypoint``: in a trace pass, one exchange of a flag (a rank that
        left the script says so) unless the script says otherwise; in a negotiated pass, rounds
        until every rank is at the same waypoint, serving their requests meanwhile.

        Returns:
            Whether every rank is at this point together (``False``: a soft waypoint this rank
            passes alone, while the others wait at another one).

        Raises:
            RuntimeError: the ranks wait at different hard waypoints (every rank raises, naming each one's).
        """
        return self.waypoint_with(waypoint, ())[0]

    def waypoint_with(self, waypoint: int, payload: Sequence[int]) -> tuple[bool, Optional[list[tuple[int, ...]]]]:
        """:meth:`waypoint`, sending ``payload`` (at most six signed 64-bit values: what the caller
        would check with the other ranks right after meeting them) with the waypoint's flag in a
        trace pass, so that one exchange does both.

        Returns:
            Whether every rank is here together, and every rank's payload, indexed by rank, when the
            flag brought them (every rank followed the script to this waypoint); ``None`` otherwise
            (a negotiated pass, or a rank left the script): the caller then checks by itself.

        Raises:
            RuntimeError: as :meth:`waypoint`.
        """
        if self.comm.world_size == 1:
            return True, [tuple(payload)]
        if self._trusted:  # every rank is here in step: meet by rounds, which name a rank elsewhere
            self._trusted, self.negotiating = False, True
        if not self.negotiating:
            if self._follows(_scripted(waypoint)):
                anyone, rows = self._flag(False, waypoint, payload)
                if not anyone:
                    return True, rows
                self._negotiate_from_here()
            else:
                self._leave()
        together = self._rounds(_AT, waypoint)
        self._write(_scripted(waypoint))
        return together, None

    def _follows(self, code: int) -> bool:
        if self._position < len(self._script) and self._script[self._position] == code:
            self._position += 1
            return True
        return False

    def _leave(self) -> None:
        """This rank left the script: serve what the others issue by it up to their next waypoint
        (the end of the script: the next pass's start), tell them there, and negotiate on."""
        while self._position < len(self._script) and not _is_waypoint(self._script[self._position]):
            code = self._script[self._position]
            self._position += 1
            self.serve(code, False)  # as the others issue it, by the script
            self.record(code)
        self._position += 1
        self._flag(True, None)
        self._negotiate_from_here()

    def _flag(self, departed: bool, waypoint: Optional[int],
              payload: Sequence[int] = ()) -> tuple[bool, list[tuple[int, ...]]]:
        """The flag every rank checks at a waypoint of the script: whether some rank left it; with
        every rank's ``payload``."""
        flagged = self.comm.flag_with(departed, payload)
        if flagged is None:
            what = f"the check at {WAYPOINTS[waypoint]}" if waypoint else "the check after leaving the script"
            self.elsewhere(what)  # raises, naming every rank's place
            raise RuntimeError(f"Ranks diverged: another rank is in another control call than {what}.")
        return flagged

    def _negotiate_from_here(self) -> None:
        self.negotiating, self.departed = True, True

    def _write(self, code: int) -> None:
        if self._writing is not None:
            self._writing.append(code)

    # --- rounds -------------------------------------------------------------------------------------
    def _rounds(self, kind: int, code: int) -> bool:
        """Rounds until this rank's request is chosen (``_REQUEST``) or every rank is at a waypoint
        that releases it (``_AT``); every other request chosen meanwhile is served."""
        while True:
            entries = self.comm.all_gather_ints([kind, code])
            if any(e is None for e in entries):
                self.elsewhere(f"a negotiation round before its {self.describe(code)}" if kind == _REQUEST
                               else f"the meeting of the ranks at {WAYPOINTS.get(code, code)}")
            requests = [c for k, c in entries if k == _REQUEST]
            if requests:
                chosen = requests[0]
                self.divergent = any(k != _REQUEST or c != chosen for k, c in entries)
                self.departed = self.departed or self.divergent
                if kind == _REQUEST and code == chosen:
                    return True
                self.serve(chosen, self.divergent)
                self.record(chosen)
                self._write(chosen)
                continue
            waypoints = [c for _, c in entries]
            if len(set(waypoints)) == 1:
                return True
            self.departed = True
            if code in _SOFT:
                return False  # the others wait at another waypoint: go on alone
            if any(w in _SOFT for w in waypoints):
                continue  # a rank passing a soft waypoint comes back with a request or another waypoint
            if set(waypoints) <= _BEHIND | _AHEAD:
                if code in _BEHIND:
                    return False  # this rank has more steps than the others: they serve them
                continue
            raise RuntimeError(
                "Ranks diverged: " + ", ".join(f"rank {r} is at {WAYPOINTS.get(w, w)}" for r, w in enumerate(waypoints))
                + ". Ranks may run different modules, but every rank must reach the same steps: the end of each "
                "training or validation step, each backward and optimizer step, and each collective of the training "
                "code (through the strategy), in the same order."
            )
