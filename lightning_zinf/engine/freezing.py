"""Freezing and unfreezing during training: ``requires_grad`` may change between passes.

A unit's parameters are split into flat groups by ``requires_grad`` when the model is partitioned
(:func:`~lightning_zinf.engine.build.split_by_kind`), and a frozen group gets no fp32 master, no
gradient shard and no gradient hooks. Fine-tuning recipes change ``requires_grad`` later: gradual
unfreezing (Lightning's ``BackboneFinetuning``), switching PEFT adapters (``set_adapter``),
DeepSpeed's unbalanced-gradients test, which toggles half the parameters at every step. At each
pass boundary that may run backward, :class:`Freezing` reads every parameter's flag and, where one
changed, brings the engine to what plain torch does with the new flags:

- a parameter turned off gets no gradient: backward no longer waits for it, its ``.grad`` stays
  ``None`` and the optimizer skips it (its fragment gets no gradient), keeping its state, as torch
  keeps a frozen parameter's; its group's gradient shard is freed once consumed;
- a parameter turned on, in a group that was frozen since partitioning, gets what trainable groups
  have from this pass on: the fp32 master where the precision and offload policy put it (once an
  optimizer is sharded), the gradient hooks, the reduce-scatter. Sharded optimizers that were
  given the parameter while frozen (a placeholder stands for it) step it from now on; one added
  later with ``add_param_group`` is re-pointed as it is added
  (:class:`~lightning_zinf.engine.sharded.ShardedOptimizers`).

Every rank must make the same changes: the flags (and the sharded optimizers' param groups) are
agreed by their digest in the pass boundary's control exchange; on a mismatch every rank raises
an error naming the first parameter that differs, before any collective depends on them. Cases not
supported yet are refused, on every rank, before anything changes: unfreezing a group stored as
``frozen_bits`` codes or in ``frozen_dtype`` (its exact values are gone), and unfreezing a group
that was frozen at partitioning under NVMe optimizer offload (its swap files were never planned).
"""

from __future__ import annotations

import zlib
from typing import Optional

import torch

from lightning_zinf.comm import Collectives
from lightning_zinf.engine.flat import FlatGroup
from lightning_zinf.engine.sharded import ShardedOptimizers
from lightning_zinf.engine.schedule import Schedule
from lightning_zinf.engine.units import Unit

__all__ = ["Freezing"]


class Freezing:
    """Follows ``requires_grad`` changes of the partitioned model's parameters between passes.

    Args:
        units: The engine's units.
        comm: The engine's collectives (the agreement on the flags).
        schedule: The engine's schedule (gradient hooks of parameters unfrozen).
        sharded: The engine's sharded optimizers (masters of groups unfrozen, their layouts).
        frozen_dtype: :attr:`MixedPrecisionConfig.frozen_dtype`: frozen groups stored in it lost
            their exact values, so they cannot be unfrozen.
        nvme_optimizer: The optimizer is offloaded to NVMe (groups frozen at partitioning cannot
            be unfrozen).
    """

    def __init__(self, units: list[Unit], comm: Collectives, *, schedule: Schedule, sharded: ShardedOptimizers,
                 frozen_dtype: Optional[torch.dtype], nvme_optimizer: bool) -> None:
        self.units = units
        self.groups = [g for u in units for g in u.groups]
        self.comm = comm
        self.schedule = schedule
        self.sharded = sharded
        self.frozen_dtype = frozen_dtype
        self.nvme_optimizer = nvme_optimizer
        self._flags = self._read()
        self._read_flags, self._layouts = self._flags, 0  # what prepare() read, for apply()

    def _read(self) -> list[bool]:
        return [p.requires_grad for g in self.groups for p in g.params]

    def sync(self) -> None:
        """At a pass boundary (before a pass that may run backward): agree with the other ranks on
        every parameter's ``requires_grad`` and the sharded optimizers' param groups, and apply
        what changed since the last call. One control exchange; costs nothing else when
        nothing changed.

        Param groups that reached a sharded optimizer without its intercepted ``add_param_group``
        (through Fabric's optimizer wrapper) are re-pointed first
        (:meth:`~lightning_zinf.engine.sharded.ShardedOptimizers.re_point_added`).

        Raises:
            RuntimeError: the ranks' flags or param groups differ (every rank raises, naming the
                first parameter that differs); or a parameter is unfrozen whose group cannot be
                (every rank raises, naming it and the fix). Nothing is changed then.
            ValueError: a param group added holds a tensor that is not the model's
                (:meth:`~lightning_zinf.engine.sharded.ShardedOptimizers.re_point_added`).
        """
        digest = self.prepare()
        self.apply(self.comm.all_equal(digest))

    def prepare(self) -> int:
        """The local half of :meth:`sync`: re-point added param groups, read the flags, and return
        the digest every rank must agree on (the caller compares it, possibly in a collective of
        its own, and passes the outcome to :meth:`apply`)."""
        self.sharded.re_point_added()
        self._read_flags = self._read()
        self._layouts = self.sharded.layout_digest()
        return zlib.crc32(bytes(self._read_flags), self._layouts)

    def apply(self, agreed: bool) -> None:
        """The rest of :meth:`sync`, after :meth:`prepare`: raise if the ranks' digests differ
        (``agreed`` false; collective), else apply what changed.

        Raises:
            RuntimeError: as :meth:`sync`.
        """
        flags = self._read_flags
        if not agreed:
            self._raise_divergence(flags, self._layouts)
        if flags == self._flags:
            return
        changed: list[tuple[FlatGroup, list[bool]]] = []
        start = 0
        for group in self.groups:
            wanted = flags[start : start + len(group.params)]
            start += len(group.params)
            if wanted != group.wants_grad:
                changed.append((group, wanted))
        for group, wanted in changed:
            if any(wanted) and group.master is None:
                self._refuse_unfreezing(group, wanted)
        for group, wanted in changed:
            group.set_wanted(wanted)
        self.sharded.give_masters()
        touched = {id(g) for g, _ in changed}
        for unit in self.units:
            if any(id(g) in touched for g in unit.groups):
                unit.count_kinds()
                self.schedule.watch_gradients(unit)
        self._flags = flags

    def _refuse_unfreezing(self, group: FlatGroup, wanted: list[bool]) -> None:
        name = next(n for n, w in zip(group.names, wanted) if w)
        if group.codes is not None:
            why = (f"its group is stored as INT{group.code_format[0]} codes (ZeroPPConfig.frozen_bits), which "
                   "do not hold its exact values", "leave ZeroPPConfig.frozen_bits unset")
        elif self.frozen_dtype is not None and group.dtype == self.frozen_dtype:
            why = (f"its group is stored in {self.frozen_dtype} (MixedPrecisionConfig.frozen_dtype), which does "
                   "not hold its exact values", "leave MixedPrecisionConfig.frozen_dtype unset")
        elif self.nvme_optimizer:
            why = ("the NVMe optimizer offload planned its swap files for the parameters trainable then (not "
                   "supported yet)", "offload the optimizer to 'cpu' instead of 'nvme'")
        else:
            return
        raise RuntimeError(
            f"Parameter '{name}' was frozen when the model was partitioned and cannot be unfrozen: {why[0]}. "
            f"To unfreeze parameters during training, {why[1]}, or make them trainable before the strategy sets "
            "up (in `__init__` or `configure_model`)."
        )

    def _raise_divergence(self, flags: list[bool], layouts: int) -> None:
        """Every rank saw the mismatch: gather the flags (only now) and name the first difference."""
        everyone = self.comm.all_gather_object((flags, layouts))
        names = [n for g in self.groups for n in g.names]
        for k, name in enumerate(names):
            on = [r for r, (theirs, _) in enumerate(everyone) if theirs[k]]
            if 0 < len(on) < len(everyone):
                off = [r for r in range(len(everyone)) if r not in on]
                raise RuntimeError(
                    f"Ranks diverged: parameter '{name}' requires a gradient on rank(s) {on} but not on rank(s) "
                    f"{off}. Every rank must freeze and unfreeze the same parameters at the same point of training "
                    "(decide on rank 0 and broadcast where the decision depends on rank-local data)."
                )
        raise RuntimeError(
            "Ranks diverged: their sharded optimizers hold different param groups (layout digests "
            f"{[d for _, d in everyone]}). Every rank must build the same optimizers and add the same param "
            "groups (add_param_group) at the same point of training."
        )
