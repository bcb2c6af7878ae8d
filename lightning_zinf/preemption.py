"""Stop training cleanly when the scheduler signals the end of a job: every rank at the same step.

SLURM and Kubernetes send SIGTERM to a job's processes some seconds before they kill it (SLURM's
``GraceTime``/``KillWait``, Kubernetes' ``terminationGracePeriodSeconds``, 30 s by default; torchrun
forwards it to its workers and waits ``--shutdown-timeout``, 30 s), and SLURM sends the signal of
``--signal=USR1@<seconds>`` ahead of a time limit. Often only some of the processes receive it (one
container's PID 1, a worker a user signalled). A sharded run can only save collectively, so:

1. the handler only records the signal (a Python attribute; no I/O and no collective, which could
   interleave with a collective the interrupted code was issuing: what aborts Lightning's own
   SIGTERM handling of a multi-process run with a gloo error);
2. at a step boundary every rank calls :meth:`Preemption.agree`, one all-reduce (max) of one
   integer on a gloo group, so all ranks learn at the same step whether any rank was signalled;
3. then they ignore the signals (:meth:`Preemption.ignore_signals`), save together and exit with
   :meth:`Preemption.exit_code`.

This module needs only ``torch.distributed``: any training loop can drive it (the Trainer strategy
does so at the end of each optimizer step, a Fabric loop through
``fabric.strategy.preempted()``).
"""

from __future__ import annotations

import signal
import threading
import warnings
from types import FrameType
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_zinf.comm.exit import hold_groups
from lightning_zinf.config import PreemptionConfig

__all__ = ["Preemption"]


class Preemption:
    """One process's preemption state: the handler that records a signal, and the agreement.

    Args:
        config: Which signals, and the exit status (:class:`~lightning_zinf.PreemptionConfig`).

    Use: :meth:`install` once the process exists (main thread), :meth:`connect` once the default
    process group exists (collective), :meth:`agree` at each step boundary (collective); when it
    returns a signal, :meth:`ignore_signals`, save and exit with :meth:`exit_code`; otherwise
    :meth:`uninstall` at the end. Without ``torch.distributed`` (one process) :meth:`agree` just
    reads this process's flag.
    """

    def __init__(self, config: PreemptionConfig) -> None:
        self.config = config
        self._received: Optional[int] = None
        self._previous: dict[signal.Signals, Any] = {}
        self._group: Optional[Any] = None
        self._connected = False
        #: The signal every rank agreed to stop for (set by :meth:`agree`), or ``None``.
        self.stopping: Optional[signal.Signals] = None
        #: The ranks that had received a signal when the ranks agreed to stop.
        self.signalled_ranks: list[int] = []

    # --- the handler -------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        # Only an assignment: the interrupted code may be in a collective, an allocation or I/O.
        if self._received is None:
            self._received = signum

    @property
    def received(self) -> Optional[signal.Signals]:
        """The first configured signal this process received, or ``None`` (local: no collective)."""
        return None if self._received is None else signal.Signals(self._received)

    @property
    def installed(self) -> bool:
        """Whether this object's handler is installed for at least one signal."""
        return bool(self._previous)

    def install(self) -> bool:
        """Install the handler for each of ``config.signals``, replacing (not calling) the handlers
        the process had, which :meth:`uninstall` puts back. Idempotent.

        Returns:
            ``True`` if installed; ``False`` when ``config.enabled`` is false, or off the main thread
            (Python accepts signal handlers only there; a warning says so).
        """
        if not self.config.enabled:
            return False
        if threading.current_thread() is not threading.main_thread():
            warnings.warn("lightning_zinf: preemption signals are not handled: the strategy was set up outside the "
                          "main thread, where Python cannot install signal handlers.", stacklevel=2)
            return False
        for name in self.config.signals:
            signum = signal.Signals[name]
            if signum in self._previous:
                if signal.getsignal(signum) != self._on_signal:  # someone replaced it since: take it back
                    signal.signal(signum, self._on_signal)
                continue
            previous = signal.signal(signum, self._on_signal)
            self._previous[signum] = signal.SIG_DFL if previous is None else previous
        return True

    def previous_handlers(self) -> dict[signal.Signals, Any]:
        """The handlers :meth:`install` replaced (what :meth:`uninstall` puts back), by signal."""
        return dict(self._previous)

    def uninstall(self) -> None:
        """Put back the handlers :meth:`install` replaced, where this object's handler is still the
        one installed (a handler installed over it since is left alone). Idempotent."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, previous)
        self._previous.clear()

    def ignore_signals(self) -> None:
        """Ignore the configured signals (``SIG_IGN``) from now until the process exits: for a
        process that stops after :meth:`agree` said so. A launcher reacts to the first process that
        exits by signalling the others (torchrun sends SIGTERM to the workers still running), which
        must not kill a rank still saving or exiting; and Python's shutdown resets a Python handler
        to the default action, but leaves an ignored signal ignored. Main thread only (elsewhere,
        nothing)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for name in self.config.signals:
            signal.signal(signal.Signals[name], signal.SIG_IGN)

    # --- the agreement -----------------------------------------------------------------------------
    def connect(self) -> None:
        """Create the process group the agreement runs on: a gloo group over every rank, so the
        flag stays in CPU memory whatever the default backend (no device synchronisation under
        NCCL). Collective: every rank calls it once, at the same point of the set-up. Nothing
        without an initialised default group, or with one rank."""
        if self._connected:
            return
        self._connected = True
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo")
            hold_groups(self)

    def drop_groups(self) -> None:
        """Let go of the agreement's process group, for good (at a normal exit:
        :mod:`lightning_zinf.comm.exit`)."""
        self._group = None

    def agree(self) -> Optional[signal.Signals]:
        """Whether any rank received a configured signal: collective, every rank must call it at the
        same step boundary. Costs one all-reduce of one integer (the largest signal number received).

        Returns:
            The signal to stop for (the same on every rank), also kept in :attr:`stopping`; ``None``
            to go on. Once a stop was agreed, returns it again without a collective.

        Raises:
            RuntimeError: ``torch.distributed`` is initialised with several ranks but
                :meth:`connect` was not called.
        """
        if self.stopping is not None:
            return self.stopping
        local = 0 if self._received is None else int(self._received)
        if self._group is None:
            if self._connected or not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
                agreed, ranks = local, [0] if local else []
            else:
                raise RuntimeError("Preemption.agree() needs connect() first (once, on every rank).")
        else:
            flag = torch.tensor([local], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
            agreed = int(flag.item())
            ranks = []
            if agreed:  # once, on the way out: which ranks were signalled, for the message
                every = [torch.zeros(1, dtype=torch.int32) for _ in range(dist.get_world_size())]
                dist.all_gather(every, flag.fill_(local), group=self._group)
                ranks = [rank for rank, value in enumerate(every) if value.item()]
        if not agreed:
            return None
        self.stopping = signal.Signals(agreed)
        self.signalled_ranks = ranks
        return self.stopping

    def exit_code(self) -> int:
        """The exit status after a stop: ``config.exit_code``, or 128 + the agreed signal's number.

        Raises:
            RuntimeError: no stop was agreed.
        """
        if self.stopping is None:
            raise RuntimeError("No preemption signal was agreed on: there is no preemption exit code.")
        return self.config.exit_code if self.config.exit_code is not None else 128 + int(self.stopping)

    def describe(self) -> str:
        """One line for the log: the agreed signal, the ranks that received it, the exit status."""
        assert self.stopping is not None
        ranks = ", ".join(map(str, self.signalled_ranks)) or "?"
        return f"{self.stopping.name} received by rank(s) {ranks}; exit status {self.exit_code()}"
