"""Optimizers built before the model was partitioned: which parameters replaced the ones they hold.

Partitioning may replace a model's parameter objects: a meta-device parameter by a real one as its
unit is initialised, and an ``nn.Linear``'s ``weight`` and ``bias`` by the tiles of the
:class:`~lightning_zinf.TiledLinear` that the ``tiling`` option puts in its place. An optimizer
built over the model before that (``fabric.setup(model, optimizer)``; an optimizer a LightningModule
builds before ``configure_optimizers`` returns it) still holds the old objects. :class:`Successors`
records, around the partitioning, what replaced each of them, by the name the model registers it
under, so the optimizer can be pointed at the new parameters before the engine shards it. An
elementwise optimizer over a layer's tiles steps exactly what it would over the whole layer.
"""

from __future__ import annotations

import weakref
from typing import Optional

from torch import nn
from torch.optim import Optimizer

from lightning_zinf.tiling import tile_views

__all__ = ["Successors"]


class Successors:
    """What replaced each parameter of the models set up so far (collected over several models).

    Usage: ``names = Successors.names_of(model)`` before the model is partitioned, then
    ``successors.record(model, names)`` after, and ``successors.repoint(optimizer)`` for each
    optimizer built before. Only weak references to the old parameters are kept: a replaced
    parameter no optimizer holds is freed as it would be otherwise, and its entry is dropped at the
    next :meth:`record`.
    """

    def __init__(self) -> None:
        # id(old parameter) -> (a weak reference to it, the parameters now in its place, in order)
        self._moved: dict[int, tuple[weakref.ref, list[nn.Parameter]]] = {}

    @staticmethod
    def names_of(module: nn.Module) -> dict[int, tuple[weakref.ref, str]]:
        """``id(parameter)`` -> (a weak reference to it, a name ``module`` registers it under), for
        every parameter of ``module`` (tied ones included once, under their first name)."""
        names: dict[int, tuple[weakref.ref, str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), (weakref.ref(p), name))
        return names

    def record(self, module: nn.Module, before: dict[int, tuple[weakref.ref, str]]) -> None:
        """Note, for each parameter named in ``before`` (:meth:`names_of` of ``module`` before it was
        partitioned) that ``module`` no longer holds, what holds its place now: the parameter
        registered under the same name, or, for a tiled layer's ``weight`` (``bias``), its tiles'
        weights in order (its :class:`~lightning_zinf.tiling.TileBias`'s bias)."""
        self._moved = {k: v for k, v in self._moved.items() if v[0]() is not None}  # forget the freed
        after = dict(module.named_parameters(remove_duplicate=False))
        current = {id(p) for p in after.values()}
        views = tile_views(module)
        tiles: dict[str, list[nn.Parameter]] = {}  # the untiled tensor's name -> its pieces, in order
        for p in module.parameters():
            if id(p) in views:
                tiles.setdefault(views[id(p)].name, []).append(p)
        for key, (ref, name) in before.items():
            old = ref()
            if old is None or key in current:
                continue
            new = [after[name]] if name in after else tiles.get(name)
            if new:
                self._moved[key] = (ref, new)

    def successors(self, p: nn.Parameter) -> Optional[list[nn.Parameter]]:
        """The parameters that replaced ``p``, or ``None`` if nothing recorded replaced it."""
        entry = self._moved.get(id(p))
        return entry[1] if entry is not None and entry[0]() is p else None

    def repoint(self, optimizer: Optimizer) -> None:
        """Replace, in place, every parameter ``optimizer``'s param groups hold that was replaced by
        its successors (a tiled layer's weight by all its tiles, in the same param group, with that
        group's hyper-parameters). The optimizer must have no state yet (the engine refuses one that
        has: it is about to be pointed at fp32 master shards)."""
        for group in optimizer.param_groups:
            params: list[nn.Parameter] = []
            for p in group["params"]:
                params.extend(self.successors(p) or [p])
            group["params"] = params
