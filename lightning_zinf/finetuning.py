"""Lightning's fine-tuning callbacks (``BaseFinetuning``, ``BackboneFinetuning``) on sharded optimizers.

``BaseFinetuning`` reads the optimizers' param groups as the model's parameters: at every epoch
start it maps each tensor in them to its parameter's name (``_store``, which raises ``KeyError``
for a tensor that is not one), ``unfreeze_and_add_param_group`` drops the parameters already in a
group by comparing values (``torch.equal``), and a restored run assigns whole param groups of the
model's parameters. A sharded optimizer holds this rank's fp32 master fragments instead
(:class:`~lightning_zinf.engine.sharded.ShardedOptimizers`). While such a callback's ``on_fit_start``
and ``on_train_epoch_start`` run, the param groups hold the model's parameters
(:meth:`ShardedOptimizers.presenting <lightning_zinf.engine.sharded.ShardedOptimizers.presenting>`);
afterwards what the callback added is re-pointed at fragments, and the parameters it unfroze train
from the next pass on (:class:`~lightning_zinf.engine.freezing.Freezing`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BaseFinetuning, Callback

from lightning_zinf.engine import ZeroEngine

__all__ = ["present_parameters_to_finetuning"]

#: The hooks of ``BaseFinetuning`` that read or change the optimizers' param groups.
_HOOKS = ("on_fit_start", "on_train_epoch_start")


def present_parameters_to_finetuning(callbacks: Iterable[Callback], engine: ZeroEngine) -> None:
    """Make each ``BaseFinetuning`` callback among ``callbacks`` see the model's parameters in the
    param groups of ``engine``'s sharded optimizers while its ``on_fit_start`` and
    ``on_train_epoch_start`` run (set on each instance, wrapping its own methods, a subclass's
    overrides included). Safe to call again: a callback already wrapped for ``engine`` is left alone.

    Args:
        callbacks: The Trainer's callbacks (``trainer.callbacks``).
        engine: The engine that sharded the Trainer's optimizers.
    """
    for callback in callbacks:
        if isinstance(callback, BaseFinetuning) and getattr(callback, "_zinf_presented", None) is not engine:
            for hook in _HOOKS:
                own = getattr(type(callback), hook).__get__(callback)
                setattr(callback, hook, _presenting(own, engine))
            callback._zinf_presented = engine  # type: ignore[attr-defined]


def _presenting(hook: Callable[..., Any], engine: ZeroEngine) -> Callable[..., Any]:
    @functools.wraps(hook)
    def run(trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any) -> Any:
        with engine.sharded.presenting(trainer.optimizers):
            return hook(trainer, pl_module, *args, **kwargs)

    return run
