"""``state_dict()`` and ``load_state_dict()`` of a partitioned model, as on the plain model.

Between uses a partitioned parameter is an empty tensor, so torch's own traversal would save
0-element tensors and refuse every full-size value with "size mismatch ... torch.Size([0])". Torch
gives each module state-dict hooks; this module installs them on every module that holds
partitioned parameters (and on the model's root), so that code which never heard of the engine
(LitGPT's checkpoint loader and LoRA save, PEFT, Lightning's strategies for other back ends) reads
and writes full values, one unit at a time. FSDP's ``FULL_STATE_DICT`` is the precedent (Zhao et
al., "PyTorch FSDP", VLDB'23, §3.4: state dicts unshard one FlatParameter at a time).

- ``state_dict()``: before a module saves its own parameters, each unit they belong to (a block's
  units at the block) is gathered with its exact values, copied to CPU memory, and released at
  once; the parameters point at those copies while the module and its children save, and back at
  their (empty) shards afterwards. The rank holds at most one gathered unit beyond its shards; the
  result holds the full model in CPU memory (on rank 0 only under
  :func:`state_dict_options` ``(rank0_only=True)``).
- ``load_state_dict(sd)``: a module's load pre-hook runs inside its ``_load_from_state_dict`` after
  the module's own key remapping (LitGPT's LoRA maps ``lm_head.weight`` to ``lm_head.linear.weight``
  there) and gathers the units of its parameters exactly; torch then checks shapes against the full
  sizes and copies the values in; once nothing else will copy into a unit (at the next hook, or at
  the block's post-hook), this rank's slice is written into its shards and fp32 masters and the
  unit is released. Missing and unexpected keys are torch's own.

Every rank must call either method (a collective per unit), with the same state dict for a load.
"""

from __future__ import annotations

import functools
import weakref
from contextlib import contextmanager
from typing import Any, Collection, Iterator, Optional, Protocol

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_zinf.comm import Collectives
from lightning_zinf.comm.exit import hold_groups
from lightning_zinf.engine.units import Unit

__all__ = ["StateDictHooks", "state_dict_options", "UnitAccess"]


class UnitAccess(Protocol):
    """What the hooks use of the engine (:class:`~lightning_zinf.ZeroEngine` is one): its model,
    units, collectives and compute device, and its exact access to one unit at a time."""

    module: nn.Module
    units: list[Unit]
    comm: Collectives
    device: torch.device

    def begin_unit_access(self) -> None:
        """Settle what is in flight before a traversal."""

    def hold_exact(self, unit: Unit) -> None:
        """Gather ``unit`` with its exact values and keep it gathered (collective)."""

    def drop_exact(self, unit: Unit, write_back: bool) -> None:
        """End a hold, writing edits back into the shards first with ``write_back``."""

    def end_unit_access(self, units: Collection[Unit]) -> None:
        """After a traversal: the persistent ones among ``units`` back to their compute gather."""


class StateDictHooks:
    """The state-dict hooks of one engine's model (installed by :class:`~lightning_zinf.ZeroEngine`).

    Args:
        engine: The engine; held weakly (the model's hooks must not keep a dropped engine alive).

    Attributes:
        rank0_only: ``state_dict()`` returns the partitioned parameters on rank 0 only (the other
            ranks' dicts hold buffers alone), so a large model is never whole on every rank.
        sharded: ``state_dict()`` returns each partitioned parameter as a ``DTensor`` sharded on
            dim 0 over the engine's ranks (``Shard(0)``, torch.chunk's split), holding this rank's
            rows only, on the compute device: what ``torch.distributed.checkpoint`` saves and
            reshards.
        parameters: ``False``: ``state_dict()`` leaves the partitioned parameters out and gathers
            nothing (buffers and extra state only). Set these through :func:`state_dict_options`.
    """

    def __init__(self, engine: UnitAccess) -> None:
        self._engine = weakref.ref(engine)
        self.rank0_only = False
        self.sharded = False
        self.parameters = True
        self._mesh: Any = None
        owner: dict[int, Unit] = {id(p): u for u in engine.units for g in u.groups for p in g.params}
        self._full_shapes = {id(p): shape for u in engine.units for g in u.groups for p, shape in zip(g.params, g.shapes)}
        # Per module: the units its own parameters belong to, and the units it is the home of (a
        # block's, whose parameters its children register): gathered when the module is reached.
        self._needs: dict[nn.Module, list[Unit]] = {}
        self._direct: dict[nn.Module, list[tuple[str, nn.Parameter]]] = {}
        homes: dict[nn.Module, list[Unit]] = {}
        for unit in engine.units:
            homes.setdefault(unit.module, []).append(unit)
        for module in engine.module.modules():
            direct = [(n, p) for n, p in module._parameters.items() if p is not None and id(p) in owner]
            needs = {owner[id(p)].index: owner[id(p)] for _, p in direct}
            if direct:
                self._direct[module] = direct
            for unit in homes.get(module, ()):
                needs.setdefault(unit.index, unit)
            if needs:
                self._needs[module] = sorted(needs.values(), key=lambda u: u.index)
        # A unit complete once its module's own _load_from_state_dict has run: every parameter is
        # registered by the module that reaches it (a module's unit, a tile); a block's is not.
        self._own_only = set()
        for unit in engine.units:
            direct = {id(p) for _, p in self._direct.get(unit.module, ())}
            if all(id(p) in direct for g in unit.groups for p in g.params):
                self._own_only.add(unit.index)
        self._depth = 0
        self._touched: dict[int, Unit] = {}
        self._copies: dict[int, nn.Module] = {}  # unit index -> module whose post-hook restores it
        self._made: dict[int, list[list[Any]]] = {}  # unit index -> its copies, for one traversal
        self._held: dict[int, tuple[Unit, nn.Module]] = {}  # loading: unit index -> (unit, holder)

    def install(self) -> list[Any]:
        """Register the hooks on every module that needs them and on the root; returns the handles."""
        engine = self._engine()
        assert engine is not None
        handles = []
        # Partials, not bound methods: torch marks a public post-hook with an attribute.
        save_pre, save_post, load_pre, load_post = (functools.partial(f, self) for f in (
            StateDictHooks._save_pre, StateDictHooks._save_post, StateDictHooks._load_pre, StateDictHooks._load_post))
        for module in dict.fromkeys([engine.module, *self._needs]):
            handles += [module.register_state_dict_pre_hook(save_pre),
                        module.register_state_dict_post_hook(save_post),
                        module.register_load_state_dict_pre_hook(load_pre),
                        module.register_load_state_dict_post_hook(load_post)]
        return handles

    def reset(self) -> None:
        """Forget a traversal that an exception ended midway (called at every pass boundary, when
        no state dict is being read or written): parameters copied out point back at their units."""
        engine = self._engine()
        if engine is None or self._depth == 0:
            return
        for index in self._copies:
            for group in engine.units[index].groups:
                group.repoint()
        self._depth, self._touched, self._copies, self._held, self._made = 0, {}, {}, {}, {}

    # --- traversal bookkeeping -----------------------------------------------------------------------
    def _enter(self, engine: UnitAccess) -> None:
        if self._depth == 0:
            engine.begin_unit_access()
        self._depth += 1

    def _leave(self, engine: UnitAccess) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._flush(engine, owner=None)
            touched, self._touched, self._made = list(self._touched.values()), {}, {}
            engine.end_unit_access(touched)

    # --- state_dict ------------------------------------------------------------------------------------
    def _save_pre(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        engine = self._engine()
        if engine is None or not self.parameters:
            return
        self._enter(engine)
        keep = not self.rank0_only or engine.comm.rank == 0
        for unit in self._needs.get(module, ()):
            if unit.index in self._copies:
                continue  # copied at its block, which is still saving
            copies = self._made.get(unit.index)  # a tied parameter met again: the same tensors
            if copies is None:
                engine.hold_exact(unit)
                self._touched[unit.index] = unit
                try:
                    copies = [[self._copy(p.detach(), engine) if keep else None for p in g.params] for g in unit.groups]
                finally:
                    engine.drop_exact(unit, write_back=False)
                self._made[unit.index] = copies
            if keep:
                for group, values in zip(unit.groups, copies):
                    for p, value in zip(group.params, values):
                        p.data = value
            # On every rank, copied or not: the ranks must gather the same units.
            self._copies[unit.index] = module

    def _save_post(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        engine = self._engine()
        if engine is None:
            return
        if not self.parameters:
            for name, _ in self._direct.get(module, ()):
                state_dict.pop(prefix + name, None)
            return
        keep = not self.rank0_only or engine.comm.rank == 0
        for name, p in self._direct.get(module, ()):
            key = prefix + name
            if key not in state_dict:
                continue
            if not keep:
                del state_dict[key]
                continue
            if state_dict[key] is p:  # keep_vars: the parameter itself, which is about to be empty again
                state_dict[key] = p.data
            if self.sharded:
                state_dict[key] = self._as_dtensor(state_dict[key], self._full_shapes[id(p)], engine)
        for index, restorer in list(self._copies.items()):
            if restorer is module:
                del self._copies[index]
                for group in engine.units[index].groups:
                    group.repoint()
        self._leave(engine)

    def _copy(self, full: Tensor, engine: UnitAccess) -> Tensor:
        """What a state dict keeps of a gathered parameter: all of it on the CPU, or (sharded) this
        rank's dim-0 chunk on the device."""
        if not self.sharded or engine.comm.world_size == 1 or full.dim() == 0:
            return full.to("cpu" if not self.sharded else full.device, copy=True)
        chunks = torch.chunk(full, engine.comm.world_size, dim=0)  # fewer than W when dim 0 is short
        return chunks[engine.comm.rank].clone() if engine.comm.rank < len(chunks) else full.new_empty((0, *full.shape[1:]))

    def drop_groups(self) -> None:
        """Let go of the device mesh (and its process group), for good (at a normal exit:
        :mod:`lightning_zinf.comm.exit`)."""
        self._mesh = None

    def _as_dtensor(self, local: Tensor, shape: torch.Size, engine: UnitAccess) -> Tensor:
        if engine.comm.world_size == 1:
            return local
        if self._mesh is None:
            self._mesh = DeviceMesh.from_group(engine.comm.group, engine.device.type)
            hold_groups(self)  # the mesh keeps the group: let go of it at exit
        placement = Replicate() if len(shape) == 0 else Shard(0)
        return DTensor.from_local(local, self._mesh, [placement], run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())

    # --- load_state_dict -------------------------------------------------------------------------------
    def _load_pre(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
                  *args: Any) -> None:
        engine = self._engine()
        if engine is None:
            return
        if local_metadata.get("assign_to_params_buffers", False):
            raise RuntimeError(
                "load_state_dict(..., assign=True) would replace the parameters of a model partitioned by "
                "lightning_zinf (the engine would keep training the old ones): call it without assign=True; the "
                "values are copied into each rank's shards."
            )
        self._flush(engine, owner=None)  # the previous module's own units are complete
        self._enter(engine)
        for name, _ in self._direct.get(module, ()):
            value = state_dict.get(prefix + name)
            if isinstance(value, DTensor):  # a sharded state dict's (collective: every rank has the same keys)
                state_dict[prefix + name] = value.full_tensor()
        for unit in self._needs.get(module, ()):
            if unit.index in self._held:
                continue
            engine.hold_exact(unit)
            self._touched[unit.index] = unit
            # Complete after this module's own copy (flushed at the next hook), or once the module
            # that holds it, a block, has loaded its children (at its post-hook).
            self._held[unit.index] = (unit, module if unit.index not in self._own_only or unit.module is not module
                                      else None)

    def _load_post(self, module: nn.Module, incompatible_keys: Any) -> None:
        engine = self._engine()
        if engine is None:
            return
        self._flush(engine, owner=module)
        self._leave(engine)

    def _flush(self, engine: UnitAccess, owner: Optional[nn.Module]) -> None:
        """Write back and release the held units that are complete: those no module's post-hook
        waits for (``owner=None``: also everything, at the end of a traversal), or those of ``owner``."""
        done = [(i, unit) for i, (unit, holder) in self._held.items()
                if holder is None or holder is owner or (owner is None and self._depth == 0)]
        for index, unit in done:
            del self._held[index]
            engine.drop_exact(unit, write_back=True)


@contextmanager
def state_dict_options(module: nn.Module, *, sharded: bool = False, rank0_only: bool = False,
                       parameters: bool = True) -> Iterator[None]:
    """Within the block, ``module.state_dict()`` (of a model partitioned by a
    :class:`~lightning_zinf.ZeroEngine`) returns, for the partitioned parameters:

    - by default, full values on the CPU on every rank;
    - ``rank0_only=True``: full values on rank 0 only, the other ranks' dicts holding the buffers
      alone (FSDP's ``FullStateDictConfig(rank0_only=True)``);
    - ``sharded=True``: ``DTensor`` values sharded on dim 0 (``Shard(0)``, ``torch.chunk``'s split; 0-d
      ones replicated) over the engine's ranks, each rank holding its rows on the compute device
      (FSDP's ``SHARDED_STATE_DICT``): ``torch.distributed.checkpoint.save`` writes them in
      parallel and ``torch.distributed.checkpoint.load`` reshards them to any world size; the
      loaded dict goes back in with ``module.load_state_dict``, which accepts ``DTensor`` values
      (each is gathered, one parameter at a time, and written into the shards);
    - ``parameters=False``: no partitioned parameter, and nothing gathered (buffers and extra
      state only: what a sharded checkpoint keeps beside its shard files).

    Raises:
        ValueError: ``module`` is not partitioned by a ZeroEngine, or both options are set.
    """
    engine = getattr(module, "_zinf_engine", None)
    if engine is None:
        raise ValueError(f"{type(module).__name__} is not partitioned by lightning_zinf (no engine to configure).")
    if sharded and rank0_only:
        raise ValueError("state_dict_options: rank0_only applies to full state dicts; a sharded one is every rank's.")
    hooks = engine.state_dict_hooks
    previous = hooks.sharded, hooks.rank0_only, hooks.parameters
    hooks.sharded, hooks.rank0_only, hooks.parameters = sharded, rank0_only, parameters
    try:
        yield
    finally:
        hooks.sharded, hooks.rank0_only, hooks.parameters = previous
