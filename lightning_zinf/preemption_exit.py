"""How a process ends after the agreed preemption save: the exit status of each rank, told apart
by who started it (Lightning's script launcher, whose processes are marked, or torchrun, SLURM...),
and the launching process's wait for the ones it started."""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_zinf.preemption import Preemption

__all__ = ["mark_script_launcher", "preemption_exit_status", "wait_for_launched"]

_LAUNCHER_PID = "LIGHTNING_ZINF_LAUNCHER_PID"


def mark_script_launcher(launcher: Any) -> None:
    """Make the processes Lightning's ``_SubprocessScriptLauncher`` starts from this one know it
    (:func:`preemption_exit_status` tells them apart from ranks that torchrun or SLURM started):
    while it starts them, and only then, the environment they inherit names this process. Nothing
    for a launcher without Lightning 2's ``_call_children_scripts``."""
    spawn = getattr(launcher, "_call_children_scripts", None)
    if spawn is None:
        return

    def spawn_marked() -> None:
        os.environ[_LAUNCHER_PID] = str(os.getpid())
        try:
            spawn()
        finally:
            os.environ.pop(_LAUNCHER_PID, None)

    launcher._call_children_scripts = spawn_marked


def preemption_exit_status(preemption: Preemption) -> int:
    """The exit status of this process after a preemption stop: 0 for a process that Lightning's
    script launcher started (rank > 0 of ``python train.py``), else ``preemption.exit_code()``.

    The launching process watches the processes it started and kills every process (SIGKILL)
    when one of them ends with a non-zero status, taking it for a crash; its own status is the one
    a scheduler sees, and it exits with ``exit_code()`` once they have ended
    (:func:`wait_for_launched`). Ranks started by torchrun, SLURM or a cluster's launcher all exit
    with ``exit_code()``.

    Raises:
        RuntimeError: the ranks have not agreed to stop (:meth:`Preemption.agree`).
    """
    if os.environ.get(_LAUNCHER_PID) == str(os.getppid()):
        return 0
    return preemption.exit_code()


def wait_for_launched(launcher: Any, timeout: float) -> None:
    """In the process that launched the others (Lightning's script launcher), wait up to
    ``timeout`` seconds in all for them to end, so that it ends last, with the status the
    scheduler reads, and leaves no process behind. Nothing for other launchers."""
    deadline = time.monotonic() + timeout
    for proc in getattr(launcher, "procs", None) or ():
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rank_zero_warn(f"lightning_zinf: the process {proc.pid} this one launched has not ended {timeout:.0f} s "
                           "after the preemption checkpoint was saved; exiting without it.")
