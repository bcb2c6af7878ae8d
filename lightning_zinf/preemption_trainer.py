"""The Trainer side of preemption (:mod:`lightning_zinf.preemption`): when the agreed save happens
in the fit loop, where it is written, and how Lightning's own signal handling is kept out.

Lightning installs its SIGTERM handler in ``Trainer._run`` after the strategy's ``setup``
(``_SignalConnector.register_signal_handlers``). That handler forwards the signal to the launcher's
other processes and ``dist.broadcast``-s a flag from inside the handler, a collective issued in the
middle of whatever collective the interrupted rank was in, which aborts a multi-process run (gloo
reports a mismatched or closed connection); under SLURM with auto-requeue, its SIGUSR1 handler
saves a checkpoint from inside the handler. Neither can work for a sharded run. The strategy
replaces the Trainer's signal connector with :class:`PreemptionSignalConnector`, which lets
Lightning register its handlers (and restore them at teardown) but then puts back what SIGTERM and
the requeue signal had before, and installs the strategy's flag-only handler while fitting.
"""

from __future__ import annotations

import signal
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, Checkpoint, ModelCheckpoint
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_zinf.preemption_exit import preemption_exit_status, wait_for_launched
from lightning_zinf.preemption import Preemption

__all__ = ["PreemptionCheckpoint", "PreemptionSignalConnector", "preemption_checkpoint_path", "take_over_signals"]


def preemption_checkpoint_path(trainer: "pl.Trainer", checkpoint: str) -> str:
    """Where the preemption checkpoint of ``trainer`` goes, for ``PreemptionConfig.checkpoint``:

    - ``"last"``: the last checkpoint of the Trainer's (first) ``ModelCheckpoint`` (the one it
      saved last, else ``<dirpath>/last.ckpt``, or its ``CHECKPOINT_NAME_LAST`` formatted with the
      current metrics),
      which ``trainer.fit(..., ckpt_path="last")`` finds; without a ModelCheckpoint, as ``"hpc"``;
    - ``"hpc"``: ``<default_root_dir>/hpc_ckpt_<n>.ckpt``, ``n`` one more than the highest there
      (Lightning's SLURM checkpoint, which ``ckpt_path="hpc"`` loads);
    - anything else: that path.
    """
    callback = trainer.checkpoint_callback
    if checkpoint == "last" and isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
        if callback.last_model_path:  # the run's own last checkpoint (its name may carry a version)
            return callback.last_model_path
        metrics = dict(trainer.callback_metrics)
        metrics.update(epoch=torch.tensor(trainer.current_epoch), step=torch.tensor(trainer.global_step))
        return callback.format_checkpoint_name(metrics, filename=callback.CHECKPOINT_NAME_LAST)
    if checkpoint in ("last", "hpc"):
        return _CheckpointConnector.hpc_save_path(trainer.default_root_dir)
    return checkpoint


class PreemptionCheckpoint(Callback):
    """At the end of each training batch that stepped the optimizer (not between the micro-batches
    of gradient accumulation, whose pending gradients a checkpoint does not hold), every rank
    agrees whether one of them received a preemption signal (:meth:`Preemption.agree`, one
    all-reduce); if so, all of them save the checkpoint (:func:`preemption_checkpoint_path`) with
    ``trainer.save_checkpoint`` and raise Lightning's ``SIGTERMException`` (a ``SystemExit``)
    with the exit status, which ends ``trainer.fit`` after the Trainer's teardown.

    The checkpoint is the one a ``ModelCheckpoint`` writes at that point of the step
    (``on_train_batch_end``): resuming runs the rest of the step (a validation due there) and goes
    on exactly. The strategy adds this callback when fitting, before the checkpoint callbacks (so
    they do not save the same step again); the LightningModule's own ``on_train_batch_end`` does
    not run for the step the run stops at.

    Args:
        preemption: The strategy's :class:`~lightning_zinf.preemption.Preemption`.
    """

    def __init__(self, preemption: Preemption) -> None:
        self.preemption = preemption
        self._last_step: Optional[int] = None

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._last_step = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._last_step:  # accumulating: no optimizer step in this batch
            return
        self._last_step = trainer.global_step
        if self.preemption.agree() is None:
            return
        self.preemption.ignore_signals()  # this process is stopping: a second signal must not kill it
        path = trainer.strategy.broadcast(preemption_checkpoint_path(trainer, self.preemption.config.checkpoint))
        rank_zero_info(f"lightning_zinf: preempted ({self.preemption.describe()}): every rank stops after global "
                       f"step {trainer.global_step} and saves {path}")
        callback = trainer.checkpoint_callback
        if self.preemption.config.checkpoint == "last" and isinstance(callback, ModelCheckpoint):
            # Before saving, as ModelCheckpoint's own last save does: the path is part of the saved
            # state, so the resumed run's callback takes last.ckpt as its own (else its version
            # counter writes last-v1.ckpt beside it, and both stay).
            callback.last_model_path = path
        trainer.save_checkpoint(path, weights_only=False)
        rank_zero_info(f"lightning_zinf: saved {path}; resume with trainer.fit(..., ckpt_path="
                       f"{_resume_hint(trainer, self.preemption.config.checkpoint, path)})")
        raise SIGTERMException(preemption_exit_status(self.preemption))


def _resume_hint(trainer: "pl.Trainer", checkpoint: str, path: str) -> str:
    """What to pass as ``ckpt_path`` to resume from ``path``."""
    if checkpoint not in ("last", "hpc"):
        return repr(path)
    callback = trainer.checkpoint_callback
    if checkpoint == "last" and isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
        return '"last"'
    return '"hpc"'


class PreemptionSignalConnector(_SignalConnector):
    """The Trainer's signal connector under ``zero_infinity``: Lightning's, except that

    - SIGTERM and Lightning's requeue signal (SIGUSR1, or the ``SLURMEnvironment``'s) keep the
      handling they had before Lightning registered its handlers (none of its in-handler
      collectives, launcher kills or saves);
    - while fitting, the strategy's flag-only handler (:meth:`Preemption.install`) handles the
      configured signals; in ``validate``/``test``/``predict`` the process's previous handlers do;
    - at teardown the handlers from before the run are restored, unless the run stopped for a
      preemption: the process is about to exit, and the signals stay ignored until it has
      (:meth:`Preemption.ignore_signals`: torchrun sends SIGTERM to the ranks still running when
      one has exited, which must not kill a rank that is still exiting). The launching process
      then waits for the processes it launched (:func:`~lightning_zinf.preemption_exit.wait_for_launched`).

    ``trainer.received_sigterm`` stays ``False``: Lightning's loops would act on it on one rank alone.

    Args:
        trainer: The Trainer.
        preemption: The strategy's :class:`~lightning_zinf.preemption.Preemption`.
        timeout: Seconds the launching process waits for the others after a preemption stop.
    """

    def __init__(self, trainer: "pl.Trainer", preemption: Preemption, timeout: float) -> None:
        super().__init__(trainer)
        self.preemption = preemption
        self.timeout = timeout

    @override
    def _get_current_signal_handlers(self) -> dict:
        """The handlers Lightning restores at teardown: for the signals the strategy's handler holds
        (installed at ``setup_environment``), those it replaced."""
        handlers = super()._get_current_signal_handlers()
        handlers.update(self.preemption.previous_handlers())
        return handlers

    @override
    def register_signal_handlers(self) -> None:
        fitting = self.trainer.state.fn == TrainerFn.FITTING
        lightning_signals = {signal.SIGTERM, signal.SIGUSR1}
        requeue = getattr(self.trainer._accelerator_connector.cluster_environment, "requeue_signal", None)
        if requeue is not None:
            lightning_signals.add(requeue)
        before = {signum: signal.getsignal(signum) for signum in lightning_signals}
        super().register_signal_handlers()
        for signum, handler in before.items():
            self._register_signal(signum, signal.SIG_DFL if handler is None else handler)
        if fitting:
            self.preemption.install()
        else:
            self.preemption.uninstall()

    @override
    def teardown(self) -> None:
        super().teardown()
        if self.preemption.stopping is None:
            self.preemption.uninstall()
            return
        self.preemption.ignore_signals()  # until the process exits (see the class docstring)
        wait_for_launched(self.trainer.strategy.launcher, self.timeout)


def take_over_signals(trainer: "pl.Trainer", preemption: Preemption, timeout: float) -> None:
    """Give ``trainer`` a :class:`PreemptionSignalConnector` (called from the strategy's ``setup``,
    before ``Trainer._run`` registers the signal handlers) and, when fitting with preemption
    enabled, a :class:`PreemptionCheckpoint` placed before the checkpoint callbacks."""
    connector = getattr(trainer, "_signal_connector", None)
    if isinstance(connector, _SignalConnector) and not isinstance(connector, PreemptionSignalConnector):
        trainer._signal_connector = PreemptionSignalConnector(trainer, preemption, timeout)
    elif isinstance(connector, PreemptionSignalConnector):
        connector.preemption, connector.timeout = preemption, timeout
    if trainer.state.fn != TrainerFn.FITTING or not preemption.config.enabled:
        return
    callbacks = trainer.callbacks
    for callback in callbacks:
        if isinstance(callback, PreemptionCheckpoint):
            callback.preemption = preemption
            return
    first_checkpoint = next((i for i, c in enumerate(callbacks) if isinstance(c, Checkpoint)), len(callbacks))
    callbacks.insert(first_checkpoint, PreemptionCheckpoint(preemption))
