"""What a model will hold once partitioned, from its parameters alone: the facts the memory
planner costs placements with (:mod:`lightning_zinf.planning.cost`).

The flat groups are the engine's (:func:`~lightning_zinf.engine.partition.plan_units`, one group per
unit and kind of parameter, :func:`~lightning_zinf.engine.build.split_by_kind`), with each rank's
shard padded as the engine pads it (:func:`~lightning_zinf.engine.flat.shard_numel`). The model
may be on the meta device: only shapes, dtypes and ``requires_grad`` are read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from torch import nn

from lightning_zinf.config import MixedPrecisionConfig, PrefetchConfig
from lightning_zinf.engine.build import split_by_kind
from lightning_zinf.engine.flat import shard_numel
from lightning_zinf.engine.grouping import auto_blocks
from lightning_zinf.engine.partition import persistent_units, plan_units

__all__ = ["GroupFacts", "Inventory"]


@dataclass(frozen=True)
class GroupFacts:
    """One flat group as the engine will build it.

    Attributes:
        unit: Index of its unit (the engine's plan order, the forward's for most models).
        unit_name: The unit's module name.
        numel: Elements of the whole group (all ranks).
        shard_numel: Elements of each rank's shard (padded).
        storage_bytes: Bytes per element of the shard (the parameters' dtype, or ``frozen_dtype``).
        compute_bytes: Bytes per element gathered (``param_dtype``, else the parameters' dtype).
        trainable: ``requires_grad``: has gradient shards, an fp32 master and optimizer state.
        persistent: Its unit stays gathered for the whole run (``persistence_threshold``, ``persistence_limit``).
        tensors: Parameters in the group.
        tied: Its unit is used by several modules (tied weights: an embedding that is also the
            output layer), so its gathered values and full gradient may live from one use to the other.
    """

    unit: int
    unit_name: str
    numel: int
    shard_numel: int
    storage_bytes: int
    compute_bytes: int
    trainable: bool
    persistent: bool
    tensors: int
    tied: bool = False

    @property
    def keeps_copy(self) -> bool:
        """An offloaded shard gets a compute copy (a narrower ``param_dtype``:
        :func:`~lightning_zinf.engine.flat.keeps_compute_copy`)."""
        return self.compute_bytes < self.storage_bytes


@dataclass(frozen=True)
class Inventory:
    """The flat groups of a model partitioned over ``world`` ranks.

    Attributes:
        groups: Every flat group, unit by unit.
        world: Ranks the model is sharded over.
        reduce_bytes: Bytes per element of the gradient reduce-scatter (``reduce_dtype``).
    """

    groups: tuple[GroupFacts, ...]
    world: int
    reduce_bytes: int

    @classmethod
    def of(cls, module: nn.Module, *, world: int, block_classes: Sequence[Union[str, type]] = (),
           mixed_precision: MixedPrecisionConfig = MixedPrecisionConfig(),
           persistence_threshold: int = PrefetchConfig.persistence_threshold,
           persistence_limit: int = PrefetchConfig.persistence_limit, unit_size: int = 0) -> "Inventory":
        """The inventory of ``module`` (real or on the meta device) as the engine would partition it
        (``unit_size``: the engine's, resolved: modules grouped into units of at most that many
        elements where no ``block_classes`` are given, :mod:`~lightning_zinf.engine.grouping`;
        0: a unit per module).

        Raises:
            ValueError: as :func:`~lightning_zinf.engine.partition.plan_units` (no parameters, a
                ``block_classes`` entry that matches nothing).
        """
        specs, uses = plan_units(module, block_classes,
                                 auto_blocks(module, unit_size) if unit_size and not block_classes else ())
        # Tied: used by a module outside the unit's own (a tied head); the members of a run of
        # siblings (grouping.py) are the unit's own modules, used one after another.
        own = [{id(m) for m in spec.modules} for spec in specs]
        users: dict[int, int] = {}
        for user, ids in uses.items():
            for i in ids:
                users[i] = users.get(i, 0) + (id(user) not in own[i] or specs[i].module is user)
        groups = []
        persistent_flags = persistent_units(specs, persistence_threshold, persistence_limit)
        for index, spec in enumerate(specs):
            kinds = split_by_kind(spec.params)
            persistent = persistent_flags[index]
            for members in kinds:
                first = members[0][1]
                numel = sum(p.numel() for _, p in members)
                groups.append(GroupFacts(
                    unit=index, unit_name=spec.name, numel=numel, shard_numel=shard_numel(numel, world),
                    storage_bytes=mixed_precision.storage_dtype(first.dtype, first.requires_grad).itemsize,
                    compute_bytes=mixed_precision.compute_dtype(first.dtype).itemsize,
                    trainable=first.requires_grad, persistent=persistent, tensors=len(members),
                    tied=users.get(index, 0) > 1,
                ))
        return cls(tuple(groups), world, mixed_precision.gradient_reduce_dtype.itemsize)

    @property
    def parameters(self) -> int:
        """Elements of the whole model."""
        return sum(g.numel for g in self.groups)
