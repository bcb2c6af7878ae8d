"""The Trainer's model summary for a partitioned model.

Lightning's ``ModelSummary`` counts ``p.numel()``; outside forward a partitioned parameter is an
empty tensor, so a model of millions of parameters would show only the few its persistent units
keep gathered. Lightning fixes the same problem for DeepSpeed's ZeRO-3 with ``DeepSpeedSummary``
(it reads ``ds_numel``), chosen by the ``ModelSummary`` callback for ``DeepSpeedStrategy`` alone;
:class:`ShardedModelSummary` is its counterpart, with the sizes the engine recorded, and
:func:`use_sharded_summary` makes the Trainer's summary callbacks use it.
"""

from __future__ import annotations

import types
from typing import Any, Iterable

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelSummary
from lightning.pytorch.utilities.model_summary import ModelSummary as LightningModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import NOT_APPLICABLE, get_human_readable_count
from torch import nn
from typing_extensions import override

__all__ = ["ShardedModelSummary", "parameter_sizes", "use_sharded_summary"]


def parameter_sizes(module: nn.Module) -> dict[int, tuple[int, int]]:
    """Each parameter's element count whole and on this rank, by ``id``.

    Args:
        module: A model partitioned by a :class:`~lightning_zinf.ZeroEngine` (the engine is
            ``module._zinf_engine``), or any other.

    Returns:
        ``{id(p): (numel, numel_here)}`` for every parameter of ``module``: ``numel`` the full
        parameter's, ``numel_here`` the elements of it that this rank's shards hold (summed over
        ranks, the ``numel``). A parameter the engine does not partition counts whole for both.
    """
    sizes = {id(p): (p.numel(), p.numel()) for p in module.parameters()}
    engine = getattr(module, "_zinf_engine", None)
    if engine is not None:
        for group in engine.groups:
            for p, numel, (lo, hi) in zip(group.params, group.numels, group.owned_ranges()):
                sizes[id(p)] = (numel, hi - lo)
    return sizes


class ShardedModelSummary(LightningModelSummary):
    """Lightning's model summary (the same table, totals, model size, FLOPs) of a LightningModule
    partitioned by this package, with each parameter counted at its full size, and a column
    "Params per Device": the elements of each layer's parameters that this rank's shards hold
    (as ``DeepSpeedSummary`` shows them; the Trainer prints rank 0's).

    Use it as Lightning's: ``print(ShardedModelSummary(lit_module, max_depth=2))``. The Trainer
    uses it at fit start (:func:`use_sharded_summary`). On a module that is not partitioned it
    counts as Lightning's summary does, with "Params per Device" equal to "Params".

    Args:
        model: The LightningModule.
        max_depth: As Lightning's: the depth of nested layers shown, ``-1`` for all, ``0`` for none.

    Raises:
        ValueError: ``max_depth`` is not an int of at least -1 (Lightning's check).
    """

    def __init__(self, model: "pl.LightningModule", max_depth: int = 1) -> None:
        self._sizes = parameter_sizes(model)  # read by the counts the base constructor computes
        self._by_name = dict(model.named_modules())
        super().__init__(model, max_depth=max_depth)

    def _count(self, parameters: Iterable[nn.Parameter], here: bool = False) -> int:
        return sum(self._sizes.get(id(p), (p.numel(), p.numel()))[here] for p in parameters)

    @property
    @override
    def param_nums(self) -> list[int]:
        """Per layer shown, the elements of its parameters, whole."""
        return [self._count(self._by_name[name].parameters()) for name in self.layer_names]

    @property
    def parameters_per_device(self) -> list[int]:
        """Per layer shown, the elements of its parameters in this rank's shards."""
        return [self._count(self._by_name[name].parameters(), here=True) for name in self.layer_names]

    @property
    @override
    def total_parameters(self) -> int:
        """The model's parameter elements, whole (a tied parameter once)."""
        return self._count(self._model.parameters())

    @property
    @override
    def trainable_parameters(self) -> int:
        """The elements of the model's parameters that require gradients, whole."""
        return self._count(p for p in self._model.parameters() if p.requires_grad)

    @override
    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        """Lightning's table columns, with "Params per Device" after "Params"."""
        arrays = super()._get_summary_data()
        column = [get_human_readable_count(n) for n in self.parameters_per_device]
        column += [NOT_APPLICABLE] * (len(arrays[0][1]) - len(column))  # the "other params" row
        # After "Params": where RichModelSummary, which knows the column by name, puts it.
        at = [name for name, _ in arrays].index("Params") + 1
        return arrays[:at] + [("Params per Device", column)] + arrays[at:]


def _sharded_summary(callback: ModelSummary, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> Any:
    """``ModelSummary._summary`` for a partitioned model, at the callback's depth."""
    return ShardedModelSummary(pl_module, max_depth=callback._max_depth)


def use_sharded_summary(callbacks: Iterable[Callback]) -> None:
    """Make the Trainer's ``ModelSummary`` callbacks (``RichModelSummary`` too, and the one
    ``enable_model_summary`` adds) summarise with :class:`ShardedModelSummary`.

    Lightning's callback picks its summary class in ``ModelSummary._summary``, by strategy type,
    and knows only DeepSpeed's; this sets that method on each instance (a subclass that defines
    its own ``_summary`` is left alone). Safe to call again.

    Args:
        callbacks: The Trainer's callbacks (``trainer.callbacks``).
    """
    for callback in callbacks:
        if isinstance(callback, ModelSummary) and type(callback)._summary is ModelSummary._summary:
            callback._summary = types.MethodType(_sharded_summary, callback)  # type: ignore[method-assign]
