"""Callbacks the examples use: a validation pass before the first step, and a PNG of the run.

Neither is specific to ``zero_infinity``; :class:`TrainingPlot` reads the memory-per-tier metrics
that :class:`lightning_zinf.callbacks.ZeroMonitor` logs when it is present.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

__all__ = ["TrainingPlot", "ValidateBeforeTraining"]

_TIERS = ("device", "cpu", "nvme")


class ValidateBeforeTraining(Callback):
    """Run (and log, at step 0) the validation loop once before the first training step, so the
    logs hold the untrained model's validation metrics next to the trained one's.

    Skipped when the run resumes from a checkpoint (the start was logged by the first run).
    """

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if trainer.global_step != 0:
            return
        # The same sequence the training loop uses for its own validation runs.
        trainer.validating = True
        trainer.fit_loop.epoch_loop.val_loop.run()
        trainer.training = True


class TrainingPlot(Callback):
    """Write ``training.png`` next to the logs at the end of ``fit`` (rank 0): train and validation
    loss over steps, and the bytes of training state resident per tier (device/cpu/nvme, from
    :class:`~lightning_zinf.callbacks.ZeroMonitor`'s ``zinf/resident_bytes_*`` metrics) over steps.

    Args:
        train_metric, val_metric: The logged names of the train and validation loss.
        filename: Name of the image inside the Trainer's ``log_dir``.

    Raises:
        ModuleNotFoundError: matplotlib is not installed (``pip install -e ".[examples]"``).
    """

    def __init__(self, train_metric: str = "train_loss", val_metric: str = "val_loss", filename: str = "training.png") -> None:
        self.train_metric, self.val_metric, self.filename = train_metric, val_metric, filename
        self.train: list[tuple[int, float]] = []
        self.val: list[tuple[int, float]] = []
        self.resident: dict[str, list[tuple[int, float]]] = {tier: [] for tier in _TIERS}
        self.path: Optional[Path] = None

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        # Fail at the start, not after the whole run, when matplotlib is missing.
        import matplotlib  # noqa: F401

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        metrics = trainer.callback_metrics
        step = trainer.global_step
        if self.train_metric in metrics:
            self.train.append((step, float(metrics[self.train_metric])))
        for tier in _TIERS:
            name = f"zinf/resident_bytes_{tier}"
            if name in metrics:
                self.resident[tier].append((step, float(metrics[name])))

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not trainer.sanity_checking and self.val_metric in trainer.callback_metrics:
            self.val.append((trainer.global_step, float(trainer.callback_metrics[self.val_metric])))

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        log_dir = trainer.log_dir  # collective (a broadcast from rank 0): every rank asks
        if not trainer.is_global_zero:
            return
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on a training machine
        import matplotlib.pyplot as plt

        fig, (loss_ax, mem_ax) = plt.subplots(1, 2, figsize=(11, 4))
        for series, label in ((self.train, self.train_metric), (self.val, self.val_metric)):
            if series:
                loss_ax.plot(*zip(*series), label=label, marker="o" if series is self.val else None)
        loss_ax.set(xlabel="step", ylabel="loss", title="loss")
        loss_ax.legend()
        for tier, series in self.resident.items():
            if series:
                steps, values = zip(*series)
                mem_ax.plot(steps, [v / 2**20 for v in values], label=tier)
        mem_ax.set(xlabel="step", ylabel="MiB (rank 0)", title="training state resident per tier")
        if any(self.resident.values()):
            mem_ax.legend()
        fig.tight_layout()
        self.path = Path(log_dir or trainer.default_root_dir) / self.filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(self.path, dpi=100)
        plt.close(fig)
        rank_zero_info(f"Wrote {self.path}")
