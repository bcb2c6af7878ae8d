"""The interactive (notebook) launcher for ``zero_infinity``: Lightning's fork launcher, with the
end-of-``fit`` hand-back adapted to a partitioned model.

Lightning's fork launcher returns the trained weights to the notebook's process by saving rank 0's
``state_dict()`` to a temporary file that the parent loads. Under ``zero_infinity`` rank 0 holds
only its shards, and a model built in ``configure_model`` does not exist in the parent at all. So
here every rank takes part in gathering the full parameters (a collective), rank 0 saves them, and
the parent builds the model with ``configure_model()`` before loading them.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

__all__ = ["NotebookLauncher"]


class NotebookLauncher(_MultiProcessingLauncher):
    """Fork one process per device from the current (interactive) process; when ``fit`` ends, the
    trained weights, the Trainer's state and its ``callback_metrics`` come back to the parent.

    The weights come back whole, through a file in the system's temporary folder: the parent (the
    notebook) ends up holding the full model in CPU memory, as with Lightning's own notebook
    strategies. For a model that does not fit there, save a checkpoint instead (it stays sharded)
    and consolidate it (``zinf-consolidate``).
    """

    def __init__(self, strategy: "pl.strategies.Strategy") -> None:
        super().__init__(strategy, start_method="fork")

    @override
    def _collect_rank_zero_results(self, trainer: "pl.Trainer", results: Any) -> Optional[_WorkerOutput]:
        """Gather the full parameters on every rank (collective), save them from rank 0 only."""
        state: dict[str, Any] = {}
        if trainer.state.fn == TrainerFn.FITTING:
            module = trainer.lightning_module
            with trainer.strategy.gathered_parameters():  # type: ignore[attr-defined]
                if trainer.strategy.local_rank == 0:
                    # Cloned: the gathered storage is freed when the block exits.
                    state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
        if trainer.strategy.local_rank != 0:
            return None
        callback = trainer.checkpoint_callback
        best_model_path = getattr(callback, "best_model_path", None) if callback else None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), "zinf-weights.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state, weights_path)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))

    @override
    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: "pl.Trainer") -> None:
        """Build the parent's model first if it was only ever built in the workers (``configure_model``)."""
        if worker_output.weights_path is not None:
            module = trainer.lightning_module
            saved = self._strategy.checkpoint_io.load_checkpoint(worker_output.weights_path)
            if set(saved) - set(module.state_dict()):
                module.configure_model()
            missing = set(saved) - set(module.state_dict())
            if missing:
                raise RuntimeError(
                    f"The trained weights have entries the notebook's model lacks even after configure_model(): "
                    f"{sorted(missing)[:5]}. Build every layer in configure_model() (or __init__) so the notebook "
                    f"process can rebuild the model; the weights are kept at {worker_output.weights_path}."
                )
        super()._recover_results_in_main_process(worker_output, trainer)
        if worker_output.weights_path is not None:
            os.rmdir(os.path.dirname(worker_output.weights_path))
