"""The ZeRO-3 engine: partitions a model into units and drives gather, release and reduce-scatter.

Free of Lightning: any training loop can use it (the strategy in ``lightning_zinf.strategy`` is a
thin adapter). The method is ZeRO stage 3 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", SC'20, §5.3: parameters, gradients and optimizer states all
partitioned) with ZeRO-Infinity's bandwidth-centric partitioning and trace-based prefetch
(Rajbhandari et al., SC'21, arXiv 2104.07857, §6).

One step, as the hooks drive it:

1. Forward: a module's pre-hook gathers its unit (and units of parameters it shares with another
   module) in the compute dtype of the precision policy, gathering the next units of the trace
   ahead (and, for a unit with frozen parameters, threads the module's inputs through an identity
   autograd node); its post-hook releases the unit and registers a hook on its outputs' gradients.
2. Backward: that output hook re-gathers the unit before the module's backward runs. When autograd
   has accumulated the gradient of every trainable parameter of a flat group, the group's flat
   gradient is reduce-scattered (mean over ranks, in the reduce dtype) and added to this rank's
   fp32 gradient shard. The unit is released once that is done for all its trainable groups and,
   when it holds frozen parameters, the identity node threaded through its module's inputs has
   run (FSDP2's post-backward signal), so frozen weights are released as early as trainable
   ones. A callback at the end of backward flushes what is left.
3. Step: the user's optimizer steps the fp32 master shards (:meth:`ZeroEngine.shard_optimizer`);
   its step post-hook, :meth:`ZeroEngine.after_step`, casts them into the compute-dtype shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import multiprocessing.util
import os
import weakref
import zlib
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Collection, Hashable, Iterator, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zinf.comm import Collectives, Handle
from lightning_zinf.comm.topology import require_divisor
from lightning_zinf.config import MixedPrecisionConfig, OffloadConfig, PrefetchConfig, TilingConfig, ZeroPPConfig
from lightning_zinf.engine.activation import apply_activation_checkpointing
from lightning_zinf.engine.buffers import BufferPool
from lightning_zinf.engine.flat import FlatGroup, shard_numel
from lightning_zinf.engine.ledger import CATEGORIES, MemoryLedger
from lightning_zinf.engine.optim import clip_grad_norm_, refuse_unsharded_steps, shard_optimizer
from lightning_zinf.engine.partition import (LibraryInits, Replay, UnitSpec, creation_order, init_rng_state,
                                             materialize, parameter_slots, parent_modules, plan_units)
from lightning_zinf.engine.state_dict import StateDictHooks
from lightning_zinf.engine.trace import Tracer
from lightning_zinf.engine.transfer import HeldUntilWait, Transfers, resolve_device
from lightning_zinf.offload.activations import ActivationOffload
from lightning_zinf.offload.optimizer import OptimizerOffload
from lightning_zinf.offload.params import ParamOffload
from lightning_zinf.offload.preflight import ensure_space
from lightning_zinf.offload.stale import reclaim_stale_folders, swap_folder_name
from lightning_zinf.offload.staging import StagingPool
from lightning_zinf.offload.swapped import SwapSpace
from lightning_zinf.offload.swapper import NvmeSwapper
from lightning_zinf.tiling import tile_linear_layers

__all__ = ["ZeroEngine", "Unit"]

#: Decorates the engine's hook entry points so that a compiled module runs them as ordinary Python
#: calls: Dynamo would otherwise trace them, break its graph at their collectives and storage
#: pointers, and recompile them as the engine's state changes from call to call (FSDP2 disables
#: its hooks the same way). Recursive: nothing they call is traced either.
_eager = torch.compiler.disable(
    recursive=True,
    **({"reason": "lightning_zinf's hooks gather, release and reduce eagerly"}
       if "reason" in inspect.signature(torch.compiler.disable).parameters else {}),
)

_RELEASED, _INFLIGHT, _GATHERED = "released", "inflight", "gathered"
# Ledger categories the engine allocates and frees during a step; all on the compute device.
_MOVING = ("gathered", "secondary", "grad_buffers", "reduce_pending", "pooled")


class Unit:
    """A unit at run time: its flat groups and its gather state.

    Attributes:
        index: Position in :attr:`ZeroEngine.units` (the id recorded in traces).
        name: The owning module's qualified name.
        module: The owning module (a block's, or the module whose own parameters these are).
        groups: One :class:`FlatGroup` per (dtype, requires_grad) among its parameters.
        numel: Parameter elements in the unit.
        persistent: Stays gathered for the whole run (small units and the root's own parameters).
        trainable_groups: How many of ``groups`` are trainable; ``has_frozen``: some are not.
    """

    def __init__(self, index: int, name: str, groups: list[FlatGroup], persistent: bool,
                 module: Optional[nn.Module] = None) -> None:
        self.index = index
        self.name = name
        self.module = module
        self.groups = groups
        self.numel = sum(g.numel for g in groups)
        self.persistent = persistent
        self.trainable_groups = sum(g.trainable for g in groups)
        self.has_frozen = self.trainable_groups < len(groups)
        self.state = _RELEASED
        self.handles: list[Handle] = []
        self.acquired: list[FlatGroup] = []  # groups whose NVMe shards this gather brought in
        self.quantized = False  # the last gather was qwZ-quantized
        self.forward_depth = 0
        self.held = False
        self.reduced_groups = 0
        self.pending_backward = 0  # forward uses whose input-side post-backward node has not run yet
        self.kept = False  # stays gathered between forward passes (keep_gathered)


@_eager
def _call_weakly(method: weakref.WeakMethod, *args: Any) -> None:
    """Call ``method`` if its engine is alive. Python's garbage collector does not look inside a
    parameter's gradient hooks: one that held the engine, or a unit or group of it (which hold the
    parameter), would keep the engine, the model and every shard alive for the rest of the process."""
    bound = method()
    if bound is not None:
        bound(*args)


class ZeroEngine:
    """Partition ``module`` in place across the ranks of ``group`` and install the ZeRO-3 hooks.

    Parameters keep their identity (an optimizer or a tied reference still finds them) but between
    uses their ``.data`` is an empty tensor: only this rank's shard of each unit is resident. Use
    :meth:`gathered` to read or edit full values outside forward/backward.

    A model whose parameters are on the meta device (built under
    :func:`~lightning_zinf.engine.partition.meta_parameters`) is initialised unit by unit with each
    module's ``reset_parameters()``, from rank 0's random state, so no rank ever holds it whole. A
    model with real parameters is partitioned as it is, from rank 0's values (like DDP's broadcast).

    Args:
        module: The model. Its buffers are moved to ``device`` and stay replicated on every rank.
        block_classes: Module classes (or class names) whose whole subtree is one unit, e.g. a
            transformer block. Default: each module's own parameters are a unit.
        prefetch: Prefetch and persistence settings.
        device: Where shards, gathered parameters and gradient shards live (the compute device;
            ``"cuda"`` means the current CUDA device).
        group: The data-parallel process group (default: the world, or one local rank without
            ``torch.distributed``).
        auto_pass: Start a new trace pass at every forward of ``module`` itself. Drivers that call
            :meth:`begin_pass` themselves (the Lightning strategy) set this to ``False``.
        tiling: Replace large ``nn.Linear`` layers by :class:`~lightning_zinf.TiledLinear` before
            partitioning (:func:`~lightning_zinf.tiling.tile_linear_layers`), so each tile is a unit
            and gathering the layer needs memory for one tile. ``None``: no tiling (layers the
            model builds as ``TiledLinear`` are tiled regardless). The names of the replaced layers
            are in :attr:`tiled_layers`.
        zero_pp: ZeRO++ settings: the nodes (for hpZ, qgZ and the intra/inter-node byte counts),
            hpZ, qwZ and qgZ (:class:`~lightning_zinf.ZeroPPConfig`).
        mixed_precision: The precision policy (:class:`~lightning_zinf.MixedPrecisionConfig`):
            the dtype units are gathered and computed in, and the dtype of the gradient
            reduce-scatters. Default: each parameter's own dtype, reduce-scatters in fp32.
        activation_checkpointing: Module classes (or class names) whose forward is wrapped in
            torch's non-reentrant activation checkpointing
            (:func:`~lightning_zinf.engine.activation.apply_activation_checkpointing`); backward
            recomputes them, re-gathering their units.
        timeout: How long the collectives of the process groups the engine builds (control, hpZ's
            and qgZ's) wait for other ranks; give the world group's (the strategy does). ``None``:
            torch's default for a new group.
        preloaded: Qualified names of parameters whose values the caller loads right after
            construction (:func:`~lightning_zinf.checkpoint.load_full_state_dict`): built on the
            meta device, they get memory but no initialisation.

    Attributes:
        ledger: The :class:`~lightning_zinf.engine.ledger.MemoryLedger` of the buffers whose size
            changes during a step; :meth:`memory` adds the long-lived state.
        checkpointed_modules: Qualified names of the modules ``activation_checkpointing`` wrapped.
        collectives_issued: Gathers and reduce-scatters issued over the run (quoted by :meth:`progress`).
        optimizers: The optimizers :meth:`shard_optimizer` re-pointed, in order.
        plain_layouts: For each of ``optimizers``, per param group, per parameter the user gave it:
            ``(flat group index, position in the group)``, or ``None`` for a frozen parameter (the
            optimizer's plain, unsharded state dict numbers them in this order).
        state_dict_hooks: The :class:`~lightning_zinf.engine.state_dict.StateDictHooks` that make
            ``module.state_dict()``/``load_state_dict()`` read and write full values.
        waiting_in: The agreement check this rank is blocked in, waiting for the other ranks (a
            description), or None; the strategies' watch publishes it, so that two ranks waiting
            in different calls are reported as a deadlock (:mod:`lightning_zinf.comm.watch`).
        on_departure: Called with a description of the next collective when this rank leaves the
            agreed trace (before it checks with the other ranks), and with ``None`` once they agreed;
            the strategies point it at their :class:`~lightning_zinf.comm.watch.RankWatch`.

    Raises:
        ValueError: the model has no parameters; a module built on the meta device has no
            ``reset_parameters()``; a ``block_classes`` or ``activation_checkpointing`` entry is
            malformed, or an ``activation_checkpointing`` entry matches no module;
            ``zero_pp.ranks_per_node`` or (with hpZ) ``zero_pp.hpz_partition_size`` does not divide
            the world size (the message names the option, its value and the divisors allowed).
        SwapError: with ``param="nvme"``, the parameter shards' swap files would not fit in the
            free space at ``nvme_path`` (checked on every rank before anything is materialised or
            written: :func:`~lightning_zinf.offload.preflight.ensure_space`), or the swap folder
            cannot be made.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        block_classes: Sequence[Union[str, type]] = (),
        prefetch: PrefetchConfig = PrefetchConfig(),
        offload: OffloadConfig = OffloadConfig(),
        device: Union[str, torch.device] = "cpu",
        group: Optional[dist.ProcessGroup] = None,
        auto_pass: bool = True,
        tiling: Optional[TilingConfig] = None,
        zero_pp: ZeroPPConfig = ZeroPPConfig(),
        mixed_precision: MixedPrecisionConfig = MixedPrecisionConfig(),
        activation_checkpointing: Sequence[Union[str, type]] = (),
        timeout: Optional[timedelta] = None,
        preloaded: Collection[str] = (),
    ) -> None:
        if getattr(module, "_zinf_engine", None) is not None:
            raise ValueError(
                f"{type(module).__name__} is already partitioned by a ZeroEngine; reuse that engine "
                "(`module._zinf_engine`) instead of building a second one over empty parameters."
            )
        self.module = module
        self._preloaded = preloaded
        self.device = resolve_device(device)
        self.transfers = Transfers(self.device)
        world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        # torchrun's LOCAL_WORLD_SIZE, where it fits the group (a sub-group may not span whole nodes).
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 0))
        ranks_per_node = zero_pp.ranks_per_node or (local if local and world % local == 0 else world)
        hpz_size = (zero_pp.hpz_partition_size or ranks_per_node) if zero_pp.hpz else None
        _check_group_sizes(zero_pp, world, ranks_per_node)
        self.zero_pp = zero_pp
        self.comm = Collectives(group, ranks_per_node=ranks_per_node, hpz_partition_size=hpz_size,
                                qwz_block=zero_pp.block if zero_pp.qwz else None,
                                qgz_bits=zero_pp.qgz_bits if zero_pp.qgz else None, block=zero_pp.block,
                                timeout=timeout, device=self.device)
        self.prefetch = prefetch
        self.mixed_precision = mixed_precision
        on_device = list(_MOVING)
        on_device += ["shards_device"] * (offload.param == "none") + ["grad_shards", "optimizer"] * (offload.optimizer == "none")
        self.ledger = MemoryLedger(tuple(on_device))
        self.auto_pass = auto_pass
        self.tracer = Tracer(self.comm, enabled=prefetch.enabled)
        self.offload_config = offload
        self._created_groups = 0
        self._shard_device = torch.device("cpu") if offload.param != "none" else self.device
        self.tiled_layers = tile_linear_layers(module, tiling) if tiling is not None else []
        self.checkpointed_modules = apply_activation_checkpointing(module, activation_checkpointing)
        specs, uses = plan_units(module, block_classes)
        # Before any shard exists: the preflight counts the swap files the partitioning will write.
        swapped = ParamOffload.planned_bytes(self._swapped_shards(specs)) if offload.param == "nvme" else 0
        self.space = _make_swap_space(offload, self.comm, self.device, swapped)
        self.swapper = self.space.swapper if self.space is not None else None
        self.param_offload = ParamOffload(self.space) if offload.param == "nvme" else None
        self.units = self._partition(specs)
        self._uses = {m: [self.units[i] for i in ids] for m, ids in uses.items()}
        self._ahead: dict[int, Unit] = {}
        self.gathered_ahead = 0  # units gathered by prefetch, over the run (for tests and monitoring)
        # The most bytes of full (gathered or in-flight) parameter buffers at once over the run: the
        # working memory that units (and tiles) bound. Per step: ``ledger.peak["gathered"]``.
        self.peak_gathered_bytes = 0
        self._pending: list[tuple[Handle, list[Tensor], list[bool], FlatGroup]] = []
        self.pool = BufferPool(self.device, self.ledger)
        self._in_transit: list[FlatGroup] = []  # gradient slices on their way to host-side shards
        self._activation_offload: Optional[ActivationOffload] = None
        self._live: dict[int, Unit] = {}  # units gathered or in flight, by index
        self._keep_budget = 0  # keep_gathered(): bytes of units that may stay gathered between passes
        self._issued: list[int] = []  # collectives since the last agreement check (unit indices)
        self.collectives_issued = 0  # gathers and reduce-scatters over the run
        # Told what this rank is about to issue after leaving the agreed trace, before it waits for
        # the others to agree, and None once they did (the strategy's RankWatch: when no other rank
        # left it there, the divergence is reported on every rank without waiting for the timeout).
        self.on_departure: Optional[Any] = None
        self._force_check = 0  # inside gathered(): user code, so its gathers are checked too
        self.waiting_in: Optional[str] = None  # the agreement check this rank waits in (for the watch)
        self._departure_agreed = False  # this pass left its trace and every rank agreed on the branch
        self.optimizers: list[torch.optim.Optimizer] = []
        self.plain_layouts: list[list[list[Optional[tuple[int, int]]]]] = []  # per optimizer (shard_optimizer)
        self._backward_end_queued = False
        self._calls: dict[nn.Module, list[Optional[_Use]]] = {}  # per module, its forward calls in progress
        self._gathered_depth = 0  # nested gathered() blocks
        for buffer_owner in module.modules():
            for name, buf in buffer_owner._buffers.items():
                if buf is not None:
                    buffer_owner._buffers[name] = buf.to(self.device)
        self._group_index = {id(g): i for i, g in enumerate(self.groups)}
        self.offload: Optional[OptimizerOffload] = None
        if offload.optimizer != "none":
            self.offload = OptimizerOffload(self.groups, offload, self.space, self.param_offload)
        self._hooks = self._install_hooks()
        self.state_dict_hooks = StateDictHooks(self)
        self._hooks += self.state_dict_hooks.install()
        refuse_unsharded_steps(self, [p for g in self.groups if g.trainable for p in g.params])
        module._zinf_engine = self  # type: ignore[assignment]
        self._mark_partitioned(True)
        self._gather_all([u for u in self.units if u.persistent])

    # --- construction -----------------------------------------------------------------------------
    def _partition(self, specs: list[UnitSpec]) -> list[Unit]:
        on_meta = any(p.is_meta for spec in specs for _, p in spec.params)
        names = {m: n for n, m in self.module.named_modules()}
        slots = parameter_slots(self.module) if on_meta else {}
        parents = parent_modules(self.module) if on_meta else {}
        built_real = frozenset(id(p) for p in self.module.parameters() if not p.is_meta)
        to_load = set(self._preloaded)
        preloaded = frozenset(id(p) for n, p in self.module.named_parameters(remove_duplicate=False)
                              if p.is_meta and n in to_load)
        shapes = {id(p): p.shape for p in self.module.parameters()}
        own_rng = torch.get_rng_state()
        if on_meta:
            start = init_rng_state(specs)
            torch.set_rng_state(self.comm.broadcast((own_rng if start is None else start).clone()))
        units: list[Optional[Unit]] = [None] * len(specs)
        done: set[int] = set()  # parameters materialised so far, over the units
        # What the parameter-less modules of a transformers model wait for, counted once.
        inits = LibraryInits(list(self.module.modules()), parents) if on_meta else None
        # Materialised in the order eager construction draws (a unit's first module's creation), so
        # the random stream is consumed as it would be; kept in plan order (the trace's unit ids).
        first_made = [spec.modules[creation_order(spec.modules)[0]] if spec.modules else spec.module for spec in specs]
        order = creation_order(first_made) if on_meta else range(len(specs))
        replay = Replay(specs, list(self.module.modules())) if on_meta else None
        try:
            for index in order:
                spec = specs[index]
                if on_meta:
                    materialize(spec, names, slots, shapes, parents, built_real, preloaded, done, replay, inits)
                # Values built for real (in __init__, or loaded) are rank 0's, as DDP broadcasts
                # them; materialised ones are drawn alike on every rank from rank 0's RNG state.
                groups = [self._flat_group(members, any(id(p) in built_real for _, p in members))
                          for members in _split_by_kind(spec.params)]
                persistent = spec.is_root or sum(g.numel for g in groups) <= self.prefetch.persistence_threshold
                units[index] = Unit(index, spec.name, groups, persistent, spec.module)
            if replay is not None:
                replay.until(float("inf"))  # dropped after the last module: the stream ends as eager's
        finally:
            if on_meta:
                torch.set_rng_state(own_rng)
        return units  # type: ignore[return-value]  # every index filled

    def _stored_quantized(self, trainable: bool) -> bool:
        # Codes are a fraction of the shard: they stay in memory, not in a swap file.
        return self.zero_pp.frozen_bits is not None and not trainable

    def _swapped_shards(self, specs: list[UnitSpec]) -> list[tuple[torch.dtype, int]]:
        """``(storage dtype, shard elements)`` of each flat group that :meth:`_flat_group` will put in
        a swap file, from the plan alone (the parameters may still be on the meta device)."""
        shards = []
        for spec in specs:
            for members in _split_by_kind(spec.params):
                first = members[0][1]
                if not self._stored_quantized(first.requires_grad):
                    shards.append((self.mixed_precision.storage_dtype(first.dtype, first.requires_grad),
                                   shard_numel(sum(p.numel() for _, p in members), self.comm.world_size)))
        return shards

    def _flat_group(self, members: list[tuple[str, nn.Parameter]], from_rank0: bool) -> FlatGroup:
        params = [p for _, p in members]
        source = torch.cat([p.detach().reshape(-1) for p in params]).to(self.device)
        if from_rank0:
            self.comm.broadcast(source)  # ranks must shard identical values
        group = FlatGroup([n for n, _ in members], params, source, self.comm, self.device, self._shard_device,
                          storage_dtype=self.mixed_precision.storage_dtype(params[0].dtype, params[0].requires_grad),
                          compute_dtype=self.mixed_precision.compute_dtype(params[0].dtype),
                          reduce_dtype=self.mixed_precision.gradient_reduce_dtype, ledger=self.ledger,
                          transfers=self.transfers, pin_shard=self.param_offload is None)
        if self._stored_quantized(group.trainable):
            group.store_quantized(self.zero_pp.frozen_bits, self.zero_pp.block)
        elif self.param_offload is not None:
            self.param_offload.add(group, f"p{self._created_groups}")
        self._created_groups += 1
        return group

    def _install_hooks(self) -> list[Any]:
        hooks: list[Any] = []
        if self.auto_pass:
            hooks.append(self.module.register_forward_pre_hook(self._root_pre_forward))
        for module in self._uses:
            hooks.extend(self._hook_module(module))
        on_grad = weakref.WeakMethod(self._on_grad)
        for unit in self.units:
            for position, group in enumerate(unit.groups):
                if group.trainable:
                    for index, p in enumerate(group.params):
                        hook = functools.partial(_call_weakly, on_grad, unit.index, position, index)
                        hooks.append(p.register_post_accumulate_grad_hook(hook))
        return hooks

    def _hook_module(self, module: nn.Module) -> list[Any]:
        # always_call: checkpointing stops a recomputation by raising inside a module's forward;
        # the post-hook must still end that use of the unit.
        return [module.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
                module.register_forward_hook(self._post_forward, always_call=True)]

    # --- public API -------------------------------------------------------------------------------
    @property
    def groups(self) -> list[FlatGroup]:
        """All flat groups, unit by unit."""
        return [g for u in self.units for g in u.groups]

    def begin_pass(self, kind: Hashable) -> None:
        """Mark the start of a forward (+ backward) pass of ``kind`` (e.g. ``"train"``, ``"eval"``).

        Finishes the previous pass: waits for gathers still in flight and releases units gathered
        ahead but never used; frees the gradient shards the optimizer has consumed (after
        ``zero_grad()``). Every rank must call it at the same points.
        """
        self.state_dict_hooks.reset()
        self._settle(boundary=True)
        if self.offload is None:  # offloaded gradient shards are the offload's to manage
            for group in self.groups:
                group.free_consumed_grads()
        self._check_requires_grad()
        if not self._keep_budget:  # inside keep_gathered(): checked once, at its end
            self.verify_ranks_agree(f"the agreement check at the start of a forward pass ({kind!r}) of the partitioned model")
        self.tracer.begin_pass(kind)
        self._departure_agreed = False

    def _check_requires_grad(self) -> None:
        for group in self.groups:
            for name, p in zip(group.names, group.params):
                if p.requires_grad != group.trainable:
                    raise RuntimeError(
                        f"Parameter '{name}' was {'trainable' if group.trainable else 'frozen'} when the model "
                        f"was partitioned and is now {'trainable' if p.requires_grad else 'frozen'}. Freeze or "
                        "unfreeze parameters before the strategy sets up (in `__init__` or `configure_model`); "
                        "changing it later (e.g. a fine-tuning callback that unfreezes) is not supported yet."
                    )

    def register_external_parameter(self, module: nn.Module, param: nn.Parameter) -> None:
        """Gather ``param``'s unit whenever ``module`` runs, for a parameter that ``module``'s forward
        uses although another module owns it (``F.linear(x, self.emb.weight)``). Without this the
        parameter is an empty tensor there (DeepSpeed's ``register_external_parameter``).

        Raises:
            ValueError: ``param`` is not a parameter of the partitioned model.
        """
        owner = next((u for u in self.units for g in u.groups if any(p is param for p in g.params)), None)
        if owner is None:
            raise ValueError("register_external_parameter: the tensor is not a parameter of the partitioned model.")
        uses = self._uses.setdefault(module, [])
        if not uses:
            self._hooks.extend(self._hook_module(module))
        if owner not in uses:
            uses.append(owner)

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Re-point a freshly built optimizer at this rank's fp32 master shards (in place), and
        run :meth:`after_step` after each of its steps (a step post-hook).

        See :func:`lightning_zinf.engine.optim.shard_optimizer` for the rules and errors. With
        ``optimizer="nvme"`` every rank first checks that the swap files this optimizer adds (fp32
        masters, gradient shards, its per-element states) fit in ``nvme_path``
        (:func:`~lightning_zinf.offload.preflight.ensure_space`; collective), and raises
        :class:`~lightning_zinf.offload.SwapError` before writing any of them if they do not.
        """
        # Masters are made from the shards, which may be on NVMe: one group's shard in memory at a time.
        def shard_resident(group: FlatGroup) -> contextlib.AbstractContextManager[None]:
            if self.param_offload is None:
                return contextlib.nullcontext()
            return self.param_offload.resident([group], write_back=False)

        if self.offload is not None and self.offload.nvme:
            self.swapper.planned_bytes = ensure_space(
                self.comm, self.offload_config.nvme_path, self.offload.planned_bytes(optimizer),
                "fp32 masters, gradient shards and optimizer states", before=self._swap_file_bytes())
        if self.offload is not None:
            self.offload.place_masters(shard_resident)
        elif self.offload_config.param != "none":
            # The shard leaves the device (or memory): the fp32 master the optimizer steps must not be it.
            for group in self.groups:
                if group.trainable and group.master is None:
                    with shard_resident(group):
                        group.make_master(separate=True)
        # Where each parameter the user gave the optimizer went, for its plain (unsharded) state dict.
        where = {id(p): (i, j) for i, g in enumerate(self.groups) if g.trainable for j, p in enumerate(g.params)}
        layout = [[where.get(id(p)) for p in param_group["params"]] for param_group in optimizer.param_groups]
        shard_optimizer(optimizer, self.groups)
        self.plain_layouts.append(layout)
        if self.offload is not None and self.offload.nvme:
            self.offload.wrap_zero_grad(optimizer)
        self.optimizers.append(optimizer)
        optimizer.register_step_pre_hook(lambda opt, *_: self._before_step(opt))
        optimizer.register_step_post_hook(lambda *_: self.after_step())
        return optimizer

    def _swap_file_bytes(self) -> int:
        """Bytes of this rank's swap files now (records written, in memory or not)."""
        return sum(n for part in (self.param_offload, self.offload) if part is not None for n in part.tier_bytes().values())

    def _before_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._settle()
        self.verify_ranks_agree("the agreement check before an optimizer step")
        if self.offload is not None:
            if self._shard_device != self.device:
                self.transfers.host_wait_h2d()  # the step rewrites host-tier shards a gather may read
            # Sub-group by sub-group, each one's updated shards copied out while the next steps;
            # the optimizer's own step then has nothing left.
            self.offload.step(optimizer)

    def resident_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for training state, by tier (``device``, ``cpu``, ``nvme``).

        ``device``: parameter shards, gathered parameters, hpZ secondary partitions and gradient
        buffers (in use and pooled), plus the fp32 masters, fp32 gradient shards and optimizer
        states when the optimizer is not offloaded.
        ``cpu``: with parameter or optimizer offload, those tensors currently in CPU memory.
        ``nvme``: with NVMe offload, the bytes of those tensors that are in swap files now. On a
        machine without an accelerator the device is the CPU as well; the split says which tier
        the engine placed each tensor on. :meth:`memory` splits the same bytes by category.
        """
        state = self._state_bytes()
        moving = sum(self.ledger.now[c] for c in _MOVING)
        optimizer_side = state["grad_shards"] + state["optimizer"]
        offloaded = self.offload is not None
        return {
            "device": state["shards_device"] + moving + (0 if offloaded else optimizer_side),
            "cpu": state["shards_cpu"] + (optimizer_side if offloaded else 0),
            "nvme": state["shards_nvme"] + state["optimizer_nvme"],
        }

    def memory(self) -> dict[str, tuple[int, int]]:
        """The memory ledger: bytes this rank holds now and at most since the last
        :meth:`reset_memory_peaks` (a training step), by category (what each holds:
        :data:`~lightning_zinf.engine.ledger.CATEGORIES`).

        Gathered units, secondary partitions, gradient buffers and reduce-scatters in flight are
        accounted as the engine allocates and frees them, so their peaks are exact; the shards,
        gradient shards, optimizer state and staging memory are counted from the state now (their
        peak is the largest value seen by these calls, and staging's the pool's own peak).

        Returns:
            Category -> ``(bytes now, peak bytes)``.
        """
        for category, nbytes in self._state_bytes().items():
            self.ledger.set(category, nbytes)
        if self.space is not None:
            self.ledger.set("staging", self.space.pool.in_use)
            self.ledger.peak["staging"] = max(self.ledger.peak["staging"], self.space.pool.peak)
        return {c: (self.ledger.now[c], self.ledger.peak[c]) for c in CATEGORIES}

    def reset_memory_peaks(self) -> None:
        """Start a new peak window of :meth:`memory` (call at the start of a training step)."""
        self.memory()
        self.ledger.reset_peaks()
        if self.space is not None:
            self.space.pool.peak = self.space.pool.in_use

    def _state_bytes(self) -> dict[str, int]:
        """Bytes of the long-lived state, by ledger category, counted by storage (swapped tensors
        are views of one staging buffer per record; an fp32 master that is the shard counts once)."""
        out = dict.fromkeys(("shards_device", "shards_cpu", "shards_nvme", "grad_shards", "optimizer", "optimizer_nvme"), 0)
        seen: set[int] = set()

        def add(category: str, t: Optional[Tensor]) -> None:
            storage = t.untyped_storage() if t is not None else None
            if storage is not None and storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                out[category] += storage.nbytes()  # 0 while swapped out

        shards = "shards_device" if self.offload_config.param == "none" else "shards_cpu"
        for group in self.groups:
            for t in (group.shard, group.codes, group.scales):
                add(shards, t)
            add("optimizer", group.master)
            add("grad_shards", group.grad_shard)
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, Tensor):
                        add("optimizer", value)
        if self.param_offload is not None:
            out["shards_nvme"] = self.param_offload.tier_bytes()["nvme"]
        if self.offload is not None:
            out["optimizer_nvme"] = self.offload.tier_bytes()["nvme"]
        return out

    def offload_activations(self) -> contextlib.AbstractContextManager[None]:
        """A context in which the tensors autograd saves for backward are kept in host memory,
        except parameters and views of gathered parameter buffers (the re-gather restores those):
        :class:`~lightning_zinf.offload.activations.ActivationOffload`."""
        if self._activation_offload is None:
            self._activation_offload = ActivationOffload(self.transfers, self._is_gathered)
        return self._activation_offload()

    def _is_gathered(self, tensor: Tensor) -> bool:
        return any(g.holds_storage_of(tensor) for u in self._live.values() for g in u.groups)

    def verify_ranks_agree(self, where: str = "an agreement check of the engine") -> None:
        """Check that every rank issued the same gathers and reduce-scatters, unit for unit, since
        the last check (one all-reduce of two integers; the sequences travel only on a mismatch).
        Run at every pass boundary and before every optimizer step, so a rank whose control flow
        diverged (a different branch over units of the same size, which the collectives
        themselves cannot notice) stops training before a wrong update is applied.

        Args:
            where: What this check is, for :attr:`waiting_in` while it waits for the other ranks.

        Raises:
            RuntimeError: the ranks' sequences differ; the message gives the first difference.
        """
        issued, self._issued = self._issued, []
        if self.comm.world_size == 1:
            return
        digest = zlib.crc32(",".join(map(str, issued)).encode())
        with self._waiting(where):
            agreed = self.comm.all_equal(digest)
        if agreed:
            return
        # Every rank saw the mismatch: gather the sequences (only now) to say where they part.
        entries = self.comm.all_gather_object(("sequence", where, issued[:4096]))
        self._raise_if_elsewhere(entries)
        sequences = [entry[2] for entry in entries]
        first = next(i for i in range(max(map(len, sequences))) if len({tuple(q[i:i + 1]) for q in sequences}) > 1)
        seen = ", ".join(f"rank {r}: {self._describe(q[first]) if first < len(q) else 'end'}"
                         for r, q in enumerate(sequences))
        raise RuntimeError(
            f"Ranks diverged: collective #{first} since the last check was {seen}. Every rank must run "
            "the same modules in the same order (control flow that depends on rank-local data must "
            "agree across ranks, e.g. by deciding on rank 0 and broadcasting)."
        )

    def _describe(self, issued: int) -> str:
        """A collective as ``_issued`` records it: a unit's index, or ``-1 - group index``."""
        if issued >= 0:
            unit = self.units[issued]
            return f"gather of unit '{unit.name}' ({unit.numel:,} elements)"
        group = self.groups[-1 - issued]
        return f"reduce-scatter of '{group.names[0]}'{'...' if len(group.names) > 1 else ''} ({group.numel:,} elements)"

    def progress(self) -> str:
        """Where this rank is: how many gathers and reduce-scatters it has issued and the last one
        (for messages about ranks that fell behind or went elsewhere)."""
        issued = self._issued  # swapped, not cleared, by the main thread: this list stays whole
        last = f": {self._describe(issued[-1])}" if issued else ""
        return f"collective #{self.collectives_issued}{last}"

    def _agree_on(self, issued: int) -> None:
        """Before issuing a collective the agreed trace does not certify: check with every rank
        that it is about to issue the same one (one host-side all-reduce of a hash), so ranks that
        diverged (a module run on some ranks only, units of other sizes, another order) raise this
        error instead of reaching the backend with mismatched collectives, which gloo answers by
        aborting the process and NCCL by hanging.

        Raises:
            RuntimeError: the ranks are about to issue different collectives (every rank raises,
                naming each rank's); or, after this rank left the agreed trace, the others did not
                come to the check within the timeout (they follow the trace).
        """
        if self.comm.world_size == 1 or (self.tracer.certified and not self._force_check):
            return
        what = self._describe(issued)
        departed = self.tracer.departed and not self._departure_agreed
        if departed and self.on_departure is not None:
            self.on_departure(f"collective #{self.collectives_issued}: {what}")
        try:
            with self._waiting(f"the agreement check before its {what}"):
                agreed = self.comm.all_equal(zlib.crc32(f"{issued}:{self._numel_of(issued)}".encode()))
        except Exception as error:
            if not departed:
                raise
            expected = self.tracer.expected
            raise RuntimeError(
                f"Ranks diverged: rank {self.comm.rank} left the order of collectives every rank agreed on: its "
                f"collective #{self.collectives_issued} is a {what}, where the agreed order has "
                f"{'the end of the pass' if expected is None else self._describe(expected)}; the other ranks did "
                "not take the same branch (they waited in that collective). Every rank must run the same modules "
                "in the same order (decide data-dependent branches on rank 0 and broadcast the decision)."
            ) from error
        if agreed:
            if departed:
                self._departure_agreed = True  # every rank took the branch: no more notices this pass
                if self.on_departure is not None:
                    self.on_departure(None)
            return
        entries = self.comm.all_gather_object(("next", f"about to issue a {what}", what))
        self._raise_if_elsewhere(entries)
        seen = [entry[2] for entry in entries]
        raise RuntimeError(
            f"Ranks diverged: at collective #{self.collectives_issued} "
            + ", ".join(f"rank {r} was about to issue a {w}" for r, w in enumerate(seen))
            + ". Every rank must run the same modules in the same order (a module run on some ranks only, or "
            "control flow that depends on rank-local data, must be decided on rank 0 and broadcast)."
        )

    @staticmethod
    def _raise_if_elsewhere(entries: list[tuple[str, str, Any]]) -> None:
        """The ranks' ``(kind, where, payload)`` of a failed agreement check: when they were at
        different kinds of check (one at a pass boundary, another before a gather), the all-reduce
        paired calls that do not correspond, so say where each rank was.

        Raises:
            RuntimeError: the kinds differ; names each rank's place.
        """
        if len({entry[0] for entry in entries}) > 1:
            raise RuntimeError(
                "Ranks diverged: " + ", ".join(f"rank {r} was at {entry[1]}" for r, entry in enumerate(entries))
                + ". Every rank must make the same calls on a partitioned model, in the same order: every forward "
                "pass, state_dict()/load_state_dict(), optimizer steps (code that runs them on one rank only must "
                "run them on every rank)."
            )

    @contextmanager
    def _waiting(self, what: str) -> Iterator[None]:
        self.waiting_in = what
        try:
            yield
        finally:
            self.waiting_in = None

    def _numel_of(self, issued: int) -> int:
        return self.units[issued].numel if issued >= 0 else self.groups[-1 - issued].numel

    @contextmanager
    def state_resident(self, write_back: bool, groups: Optional[list[FlatGroup]] = None) -> Iterator[None]:
        """The parameter shards, fp32 masters, gradient shards and optimizer states of ``groups``
        (default: all) in memory for the block (with NVMe offload they are in swap files
        otherwise); ``write_back``: they were modified (a load, an edit), so write them out
        afterwards. For checkpoints and edits: one group at a time keeps memory to one group's state."""
        self._settle()
        self.transfers.host_wait_h2d()  # the host may write host-tier shards a gather still reads
        groups = self.groups if groups is None else groups
        with contextlib.ExitStack() as stack:
            for group in groups:
                stack.enter_context(group.shard_resident(write_back))  # frozen groups stored quantized
            if self.param_offload is not None:
                stack.enter_context(self.param_offload.resident([g for g in groups if g.codes is None], write_back))
            if self.offload is not None:
                stack.enter_context(self.offload.resident(self.optimizers, write_back, groups))
            yield

    def master_fragments(self) -> list[Tensor]:
        """This rank's fp32 master fragments (1-D), as the sharded optimizer holds them."""
        return [f for g in self.groups if g.trainable for f in g.fragments]

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Clip gradient shards by the global L2 norm over all ranks; returns the norm (0-d fp32).

        With NVMe optimizer offload the gradients may be on disk: the norm comes from the squared
        norms recorded as they were accumulated, and the scaling is applied as each sub-group is
        swapped in for the step.
        """
        if self.offload is not None and self.offload.nvme:
            self._settle()
            norm = self.comm.all_reduce_sum(self.offload.global_grad_sq_norm()).sqrt()  # on the host
            self.offload.clip_coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            return norm
        return clip_grad_norm_(self.master_fragments(), max_norm, self.comm)

    def after_step(self) -> None:
        """After ``optimizer.step()`` (called by the hook :meth:`shard_optimizer` installs): cast
        masters into compute shards, mark gradients consumed, re-gather persistent units."""
        self._settle(boundary=True)
        if self._shard_device != self.device:
            self.transfers.host_wait_h2d()  # host-tier shards are rewritten below
        for group in self.groups:
            # An offloaded optimizer rewrote the shards of what it stepped already (OptimizerOffload.step).
            rewrites = self.param_offload is not None and group.master is not None and not group.host_state
            if rewrites:
                self.param_offload.will_overwrite(group)
            group.after_step()
            if rewrites:
                self.param_offload.changed(group)
        # Updated shards copied from host-side masters (in order, on the copy stream) are read by
        # compute from here on: order it after them, without waiting on the host.
        self.transfers.wait_on_device(self.transfers.record())
        self._gather_all([u for u in self.units if u.persistent])

    @contextmanager
    def gathered(self, write_back: bool = False) -> Iterator[None]:
        """Gather every unit for the duration of the block (like FSDP's ``summon_full_params``),
        with the exact values in the parameters' own dtype (the fp32 masters under a bf16
        policy, not the bf16 copies forward computes with).

        Args:
            write_back: Copy edits made to the full parameters inside the block back into the shards
                on exit. Every rank must make the same edits.
        """
        self._settle()
        units = list(self.units)
        for unit in units:
            unit.forward_depth += 1
        self._gathered_depth += 1
        try:
            self._force_check += 1
            try:
                self._gather_all(units, read=True)
            finally:
                self._force_check -= 1
            yield
            if write_back:
                with self.state_resident(write_back=True):
                    for group in self.groups:
                        group.write_back()
        finally:
            self._gathered_depth -= 1
            for unit in units:
                unit.forward_depth -= 1
                self._maybe_release(unit)
            if self._gathered_depth == 0:  # an enclosing block still wants the exact values
                self._gather_all([u for u in units if u.persistent])  # back to the compute dtype

    # --- one unit at a time, exactly (state_dict / load_state_dict) ---------------------------------
    def begin_unit_access(self) -> None:
        """Finish every collective and swap in flight before code reads or writes parameters unit
        by unit (:meth:`hold_exact`); call once per traversal, not per unit."""
        self._settle()

    def hold_exact(self, unit: Unit) -> None:
        """Gather ``unit`` with its exact values in the parameters' own dtype (the fp32 masters'
        values under a bf16 policy, as :meth:`gathered`) and keep it gathered until
        :meth:`drop_exact`. Collective: every rank must hold the same units in the same order.
        The per-unit counterpart of :meth:`gathered` (FSDP's full state dict gathers one
        FlatParameter at a time the same way; Zhao et al., VLDB'23, §3.4).

        Raises:
            RuntimeError: the ranks are about to gather different units, or are in different calls
                (:meth:`_agree_on`'s check, which every gather here makes); nothing stays held.
        """
        unit.forward_depth += 1
        self._force_check += 1
        try:
            self._gather_all([unit], read=True)
        except BaseException:
            unit.forward_depth -= 1
            raise
        finally:
            self._force_check -= 1

    def drop_exact(self, unit: Unit, write_back: bool) -> None:
        """End a :meth:`hold_exact`: with ``write_back``, copy this rank's slice of the (edited or
        loaded) full values into its shards and fp32 masters first (only the elements that
        changed: unedited masters keep their fp32 bits); then release the unit unless something
        else holds it. A persistent unit stays gathered in the parameters' dtype until
        :meth:`end_unit_access`."""
        try:
            if write_back:
                with self.state_resident(write_back=True, groups=unit.groups):
                    for group in unit.groups:
                        group.write_back()
        finally:
            unit.forward_depth -= 1
            self._maybe_release(unit)

    def end_unit_access(self, units: Collection[Unit]) -> None:
        """After a traversal of :meth:`hold_exact` calls: the persistent ones among ``units`` go back
        to their compute-dtype gather (collective, as the holds were)."""
        if self._gathered_depth == 0:  # inside gathered(): its exit does it
            self._gather_all([u for u in units if u.persistent])

    @contextmanager
    def keep_gathered(self, budget: int) -> Iterator[None]:
        """Within the block, a unit that finishes its forward stays gathered while the gathered
        bytes stay within ``budget`` (bytes), so later forward passes (the decode steps of one
        ``generate()``) do not gather it again; on exit every unit kept is released. For passes
        without gradients; a backward inside the block still works (units are released as usual).
        Every rank must run the same forward passes in the block while gathers happen
        (``transformers``' ``generate`` does, with ``synced_gpus``, which it turns on for a model
        this engine partitions). When the budget holds every unit, only the first forward gathers,
        so ``generate`` runs without ``synced_gpus`` (no all-reduce per token): a rank whose
        sequences end first may stop. DeepSpeed's hybrid engine likewise gathers the model once per
        ``generate`` call; this does so within a memory budget.

        Args:
            budget: Most bytes of gathered parameters kept (``0``: release as usual).
        """
        previous = self._keep_budget
        self._keep_budget = budget
        whole = budget >= sum(g.padded_numel * g.compute_dtype.itemsize for g in self.groups)
        if whole:
            self._mark_partitioned(False)
        try:
            yield
        finally:
            if whole:
                self._mark_partitioned(True)
            self._keep_budget = previous
            if previous == 0:
                self._settle()
                for unit in self.units:
                    unit.kept = False
                    self._maybe_release(unit)
                self.verify_ranks_agree()

    def release_all(self) -> None:
        """Wait for outstanding collectives and swaps, and release every non-persistent unit."""
        self._settle()
        for side in (self.param_offload, self.offload):
            if side is not None:
                side.settle_all()

    def remove_hooks(self) -> None:
        """Detach the engine from the model (the parameters stay partitioned)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    # --- gather / release -------------------------------------------------------------------------
    def _start_gather(self, unit: Unit, exact: bool = False, read: bool = False) -> None:
        """Start gathering ``unit`` for compute; with qwZ quantized unless ``exact`` (persistent
        units). ``read``: exactly, in the parameters' own dtype (:meth:`gathered`, whose values
        users read and edit)."""
        exact = exact or read
        self._agree_on(unit.index)
        self.collectives_issued += 1
        self._issued.append(unit.index)
        if self.param_offload is not None:
            # A group gathered from its hpZ secondary partition, or stored quantized, needs no shard
            # from NVMe.
            unit.acquired = [g for g in unit.groups if (g.secondary is None or exact) and g.codes is None]
            for group in unit.acquired:
                self.param_offload.acquire(group)
        unit.quantized = self.comm.qwz_block is not None and not exact and not unit.persistent
        before = sum(g.gathered_nbytes for g in unit.groups)
        # Exact gathers come from the shards: a secondary partition may hold qwZ-quantized values.
        unit.handles = [g.start_gather(unit.quantized, from_secondary=not exact, read=read) for g in unit.groups]
        unit.state = _INFLIGHT
        self._live[unit.index] = unit
        self.ledger.add("gathered", sum(g.gathered_nbytes for g in unit.groups) - before)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.ledger.now["gathered"])

    @property
    def gathered_bytes(self) -> int:
        """Bytes of full (gathered or in-flight) parameter buffers now."""
        return self.ledger.now["gathered"]

    def _wait_gather(self, unit: Unit) -> None:
        if unit.state != _INFLIGHT:
            return
        for handle in unit.handles:
            handle.wait()
        for group in unit.groups:
            group.finish_gather()
            # Not from a gather for reading in another dtype: the secondary partition feeds compute.
            if self.comm.hpz is not None and not unit.persistent and group.secondary is None and group.holds_compute:
                group.keep_secondary()
        if self.param_offload is not None:
            # The shards' staging buffers go back to the pool: the copies reading them must be done
            # (waited for on the device only, so far). Issued a unit or more ago, they usually are.
            for handle in unit.handles:
                if isinstance(handle, HeldUntilWait):
                    handle.wait_on_host()
            for group in unit.acquired:
                self.param_offload.drop(group)
            unit.acquired = []
        unit.handles, unit.state = [], _GATHERED

    def _gather_all(self, units: list[Unit], read: bool = False) -> None:
        """Gather ``units`` exactly, for compute (persistent units) or for reading (:meth:`gathered`):
        a released or gathered unit is (re-)gathered from the current shards, except one gathered
        for reading that is asked for reading again; one in flight is waited for, and gathered
        again if its gather was quantized (qwZ) or in the other dtype."""
        for unit in units:
            fits = not unit.quantized and all(g.holds_exact if read else g.holds_compute for g in unit.groups)
            if unit.state == _INFLIGHT:
                if fits:
                    continue
                self._wait_gather(unit)
            elif unit.state == _GATHERED and read and fits:
                continue
            self._start_gather(unit, exact=True, read=read)
        for unit in units:
            self._wait_gather(unit)

    def _acquire(self, unit: Unit) -> None:
        upcoming = self.tracer.request(unit.index)
        self._ahead.pop(unit.index, None)
        if unit.state == _RELEASED:
            self._start_gather(unit)
        if upcoming:
            self._gather_ahead(upcoming)
            if self.param_offload is not None:
                ahead = [self.units[i] for i in upcoming if self.units[i].state == _RELEASED]
                self.param_offload.read_ahead(g for u in ahead[: self.offload_config.read_ahead] for g in u.groups
                                              if g.secondary is None and g.codes is None)
        self._wait_gather(unit)

    def _gather_ahead(self, upcoming: list[int]) -> None:
        """Start gathering the next released units of the trace, within the bucket budget; the
        first one always (a unit larger than the budget would otherwise never be prefetched)."""
        budget = self.prefetch.bucket_size - sum(u.numel for u in self._ahead.values())
        for index in upcoming:
            unit = self.units[index]
            if unit.state != _RELEASED or index in self._ahead:
                continue
            if unit.numel > budget and self._ahead:
                break
            self._start_gather(unit)
            self._ahead[index] = unit
            self.gathered_ahead += 1
            budget -= unit.numel

    def _maybe_release(self, unit: Unit) -> None:
        if unit.kept:
            return
        if (
            unit.state == _GATHERED
            and not unit.persistent
            and unit.forward_depth == 0
            and not unit.held
            and unit.index not in self._ahead
        ):
            if self._keep_budget and self._kept_bytes() + sum(g.gathered_nbytes for g in unit.groups) <= self._keep_budget:
                unit.kept = True  # for the next forward pass of this keep_gathered block
                return
            for group in unit.groups:
                self.ledger.add("gathered", -group.gathered_nbytes)
                group.release()
            unit.state = _RELEASED
            self._live.pop(unit.index, None)

    def _mark_partitioned(self, on: bool) -> None:
        # transformers' generate() reads FSDP2's marker to keep all ranks stepping until every
        # rank's sequences are done (synced_gpus): forward passes gather collectively here too.
        # Dynamo reads the pair FSDP2 sets: parameters keep their identity while their storage comes
        # and goes, so it takes them as graph inputs and guards nothing on them (with the marker
        # alone it refuses the module and runs it uncompiled).
        for submodule in self.module.modules():
            submodule._is_fsdp_managed_module = on  # type: ignore[assignment]
            submodule._fsdp_use_orig_params = on  # type: ignore[assignment]

    def _kept_bytes(self) -> int:
        return sum(g.gathered_nbytes for u in self._live.values() if u.kept for g in u.groups)

    def _settle(self, boundary: bool = False) -> None:
        """Finish every collective in flight and release what no pass is using.

        At a pass boundary no module is running, so use counts left over from a forward that
        raised (and was caught by user code) are cleared rather than keeping stale units gathered.
        """
        self._drain_reduces()
        self._finish_host_grads()
        self._ahead.clear()
        if boundary:
            self._backward_end_queued = False  # its callback died with a backward that raised
            self._calls.clear()
        # Between passes every unit's counters are reset; otherwise only units gathered or in flight
        # (``_live``) have anything to finish, so that a checkpoint's or a state dict's per-unit
        # calls cost O(1) each, not O(units).
        for unit in self.units if boundary else list(self._live.values()):
            if boundary:
                unit.forward_depth, unit.held, unit.reduced_groups, unit.pending_backward = 0, False, 0, 0
                for group in unit.groups:
                    group.discard_grads(self.pool)
            self._wait_gather(unit)
            self._maybe_release(unit)
        if boundary and self.param_offload is not None:
            self.param_offload.settle_all()

    # --- hooks ------------------------------------------------------------------------------------
    @_eager
    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        self.begin_pass((module.training, torch.is_grad_enabled()))

    @_eager
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        units = self._uses[module]
        for unit in units:
            unit.forward_depth += 1
            self._acquire(unit)
        policy = self.mixed_precision
        if policy.param_dtype is not None and policy.cast_forward_inputs:
            cast = functools.partial(_cast_floating, dtype=policy.param_dtype)
            args, kwargs = _map_tensors(args, cast), _map_tensors(kwargs, cast)
        # Frozen parameters get no gradient hook that says when autograd is done with them: thread
        # the inputs through an identity node whose backward runs right after this call's backward
        # (FSDP2's post-backward signal; a hook on the inputs' gradients would wait for every other
        # module that reads the same inputs, such as the sibling tiles of a layer). Not in a
        # recomputation: the original forward's node is the one its backward runs.
        use = None
        frozen = [u for u in units if u.has_frozen]
        if torch.is_grad_enabled() and _in_backward():
            # Recomputed by activation checkpointing for the backward that follows: held until
            # that backward has run, not released after this forward and gathered again.
            for unit in units:
                unit.held = True
        elif frozen and torch.is_grad_enabled():
            inputs = [t for t in _tensors_in((args, kwargs)) if t.requires_grad]
            if inputs:
                use = _Use(frozen)
                signalled = iter(_PostBackward.apply(functools.partial(self._post_backward, use), *inputs))
                swap = lambda t: next(signalled) if t.requires_grad else t  # noqa: E731  (_tensors_in's order)
                args, kwargs = _map_tensors(args, swap), _map_tensors(kwargs, swap)
        self._calls.setdefault(module, []).append(use)
        return args, kwargs

    @_eager
    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        units = self._uses[module]
        use = self._calls[module].pop()
        for unit in units:
            unit.forward_depth -= 1
        tensors = list(_tensors_in(output))
        released = {g.active.untyped_storage().data_ptr() for u in units if not u.persistent for g in u.groups}
        if any(t.untyped_storage().data_ptr() in released for t in tensors):
            # An output that is a view of a parameter (learned queries) would point into storage
            # the release below frees: hand out a copy instead.
            output = _map_tensors(output, lambda t: t.clone() if t.untyped_storage().data_ptr() in released else t)
            tensors = list(_tensors_in(output))
        # Also in a recomputation: reentrant checkpointing runs backward over the recomputed graph.
        if torch.is_grad_enabled():
            outputs = [t for t in tensors if t.requires_grad]
            if outputs:
                hook = functools.partial(self._pre_backward, units, use)
                torch.autograd.graph.register_multi_grad_hook(outputs, hook, mode="any")
        for unit in units:
            self._maybe_release(unit)
        return output

    @_eager
    def _pre_backward(self, units: list[Unit], use: Optional[_Use], grad: Any) -> None:
        self._queue_backward_end()
        if use is not None and not use.counted:
            # Counted only now: a forward whose graph is never run backward leaves no count behind.
            use.counted = True
            for unit in use.units:
                unit.pending_backward += 1
        for unit in units:
            unit.held = True
            self._acquire(unit)
            for group in unit.groups:
                if group.trainable:
                    group.prepare_grads(self.pool)

    @_eager
    def _post_backward(self, use: _Use) -> None:
        """Autograd has run the backward of one forward use (the identity node on the module's
        inputs has their gradients)."""
        if not use.counted:
            return
        use.counted = False
        for unit in use.units:
            unit.pending_backward -= 1
            self._release_after_backward(unit)

    @_eager
    def _on_grad(self, unit_index: int, position: int, index: int, param: Tensor) -> None:
        unit = self.units[unit_index]
        group = unit.groups[position]
        self._queue_backward_end()
        if not group.mark_ready(index):
            return
        unit.reduced_groups += 1
        # Released before the reduce-scatter takes its buffers (FSDP2's order): the gradients are
        # in their own tensors, so the gathered weights are not needed for it.
        self._release_after_backward(unit)
        self._reduce(group)

    def _release_after_backward(self, unit: Unit) -> None:
        """Release a unit held for backward once autograd is done with it: every trainable group
        reduced (every node that used a trainable parameter has run) and, for a unit with frozen
        groups, the identity node of every forward use run. A frozen unit whose inputs need no
        gradient has no such node and stays held until the end of backward."""
        if unit.held and unit.pending_backward <= 0 and unit.reduced_groups >= unit.trainable_groups:
            unit.reduced_groups, unit.held = 0, False
            self._maybe_release(unit)

    def _queue_backward_end(self) -> None:
        if not self._backward_end_queued:
            self._backward_end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)

    @_eager
    def _backward_end(self) -> None:
        """Flush partially complete gradients, finish the reduce-scatters, release held units."""
        self._backward_end_queued = False
        for group in self.groups:
            if group.trainable and group.any_ready:
                self._reduce(group)
            elif group.grads_prepared:
                group.discard_grads(self.pool)
        self._drain_reduces()
        self._finish_host_grads()
        self.pool.release_free()
        self._expose_grads()
        for unit in self.units:
            unit.pending_backward = 0  # uses whose inputs' gradients were never needed
            if unit.held:
                unit.held, unit.reduced_groups = False, 0
                self._maybe_release(unit)

    def _expose_grads(self) -> None:
        """Agree with the other ranks which parameters received a gradient (one host-side
        all-reduce of one flag per trainable parameter) and hand the optimizer gradients for those only."""
        trainable = [g for g in self.groups if g.trainable]
        flags = self.comm.any_rank([r for g in trainable for r in g.received])
        start = 0
        for group in trainable:
            group.expose_grads(flags[start : start + len(group.params)])
            start += len(group.params)

    # --- gradients --------------------------------------------------------------------------------
    def _reduce(self, group: FlatGroup) -> None:
        self._agree_on(-1 - self._group_index[id(group)])
        self.collectives_issued += 1
        self._issued.append(-1 - self._group_index[id(group)])
        # One reduce-scatter in flight at most (FSDP2's order): the previous one is finished before
        # this one takes its buffers, so one unit's reduce buffers (a full-size cast to the reduce
        # dtype under mixed precision) are alive at a time.
        self._drain_reduces()
        handle, buffers, got = group.start_reduce(self.pool)
        self._pending.append((handle, buffers, got, group))
        if not self.prefetch.overlap_reduce:
            self._drain_reduces()

    def _finish_host_grads(self) -> None:
        """Wait on the host for the gradient slices copied towards host-side gradient shards, and
        add those accumulating onto earlier micro-batches (the copy stream is in order: after the
        first wait the others have completed)."""
        for group in self._in_transit:
            group.finish_host_grads()
        self._in_transit = []

    def _drain_reduces(self) -> None:
        while self._pending:
            self._finish_reduce(self._pending.pop(0))

    def _finish_reduce(self, pending: tuple[Handle, list[Tensor], list[bool], FlatGroup]) -> None:
        handle, buffers, got, group = pending
        handle.wait()
        index = self._group_index[id(group)]
        if self.offload is not None:
            self.offload.before_accumulate(index)
        # Landing buffers of earlier groups accumulating onto a previous micro-batch are added once
        # their copies have arrived, without blocking; the host waits only to keep at most
        # _MAX_LANDING groups' landing buffers alive.
        landing = [g for g in self._in_transit if g is not group and g.host_adds_pending]
        for i, earlier in enumerate(landing):
            if earlier.host_grads_arrived or len(landing) - i >= _MAX_LANDING:
                earlier.finish_host_grads()
        kept = group.accumulate(buffers[0], got)
        self._in_transit = [g for g in self._in_transit if g.grads_in_transit and g is not group]
        if group.grads_in_transit:
            self._in_transit.append(group)
        if group.swapped_optimizer:
            self._finish_host_grads()  # the shard is swapped out next: its bytes must be here
        if self.offload is not None:
            self.offload.after_accumulate(index)
        if kept:
            self.pool.forget(buffers[0])
        for buffer in buffers[1:] if kept else buffers:
            self.pool.give(buffer)


#: Groups whose gradient slices may wait in landing buffers for their host-side add at once.
_MAX_LANDING = 2


class _Use:
    """One forward call of a module whose units hold frozen parameters: counted in their
    ``pending_backward`` when its backward starts, uncounted when its identity node runs."""

    __slots__ = ("units", "counted")

    def __init__(self, units: list[Unit]) -> None:
        self.units = units
        self.counted = False


class _PostBackward(torch.autograd.Function):
    """Identity on the input tensors of a module whose unit holds frozen parameters; its backward
    runs ``callback`` once autograd has the gradients of those inputs, i.e. once this call of the
    module has run backward (FSDP2's ``RegisterPostBackwardFunction`` plays the same part). As
    there, the module receives views, so it must not modify its inputs in place."""

    @staticmethod
    def forward(ctx: Any, callback: Any, *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


def _check_group_sizes(zero_pp: ZeroPPConfig, world: int, ranks_per_node: int) -> None:
    """Refuse, naming the option the user set, a ``ZeroPPConfig`` group size that does not divide
    the world into equal groups (before any process group is built from it).

    Raises:
        ValueError: ``zero_pp.ranks_per_node`` or, with ``hpz=True``, ``zero_pp.hpz_partition_size``
            does not divide ``world``.
    """
    if zero_pp.ranks_per_node is not None:
        require_divisor(
            "ZeroPPConfig.ranks_per_node", zero_pp.ranks_per_node, world,
            "ranks are numbered node by node, the same number on every node",
            "Set zero_pp.ranks_per_node to the processes per machine, or leave it unset (the strategy's devices "
            "per node, else LOCAL_WORLD_SIZE, else one node).",
        )
    if zero_pp.hpz and zero_pp.hpz_partition_size is not None:
        require_divisor(
            "ZeroPPConfig.hpz_partition_size", zero_pp.hpz_partition_size, world,
            "hpZ's secondary partitions are held by groups of that many consecutive ranks",
            f"Set zero_pp.hpz_partition_size to one of those, normally the ranks per node ({ranks_per_node}, which "
            "keeps each group inside a node), or leave it unset (= ranks_per_node).",
        )


def _in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (a checkpointed module is then
    being recomputed)."""
    return torch._C._current_graph_task_id() != -1


def _cast_floating(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t


def _tensors_in(obj: Any) -> Iterator[Tensor]:
    """Every tensor in a module output: nested tuples, lists, mappings (Hugging Face ModelOutput
    included) and dataclasses."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors_in(value)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors_in(getattr(obj, f.name))


def _map_tensors(obj: Any, fn: Any) -> Any:
    """``obj`` with every tensor ``t`` found by :func:`_tensors_in` replaced by ``fn(t)``."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        mapped = {k: _map_tensors(v, fn) for k, v in obj.items()}
        try:
            return type(obj)(mapped)
        except TypeError:
            return mapped
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj) if f.init})
    return obj


def _split_by_kind(params: list[tuple[str, nn.Parameter]]) -> list[list[tuple[str, nn.Parameter]]]:
    """Split a unit's parameters into runs of one dtype and one ``requires_grad``, order kept."""
    kinds: dict[tuple[torch.dtype, bool], list[tuple[str, nn.Parameter]]] = {}
    for name, p in params:
        kinds.setdefault((p.dtype, p.requires_grad), []).append((name, p))
    return list(kinds.values())


def _make_swap_space(config: OffloadConfig, comm: Collectives, device: torch.device,
                     planned: int) -> Optional[SwapSpace]:
    """The rank's NVMe swapper, in a folder of its own under ``config.nvme_path``, and its staging
    pool (``nvme`` only). The folder and its files are removed when the swapper is closed or the
    process exits cleanly; folders that killed processes of this host left in ``nvme_path`` are
    removed first (:func:`reclaim_stale_folders`). Then, before the folder is made, the preflight
    checks that ``planned`` bytes per rank (the parameter shards' swap files) fit there
    (:func:`ensure_space`; collective).

    Raises:
        ValueError: ``pin_memory=True`` with a CPU compute device.
        SwapError: ``planned`` does not fit in the free space (on every rank), or the folder cannot
            be created (see :class:`NvmeSwapper`).
    """
    if "nvme" not in (config.param, config.optimizer):
        return None
    pin = config.pin_memory if config.pin_memory is not None else device.type != "cpu"
    if pin and device.type == "cpu":
        raise ValueError(
            "OffloadConfig.pin_memory=True needs an accelerator: page-locking host memory fails without "
            "one. Leave pin_memory unset (it is on exactly when the compute device is an accelerator)."
        )
    cap = config.staging_bytes
    if cap is None:
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", comm.world_size))
        cap = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (8 * max(ranks_here, 1))
    reclaim_stale_folders(config.nvme_path)  # what killed runs left behind, before we need the space
    total = ensure_space(comm, config.nvme_path, planned, "parameter shards")
    folder = os.path.join(config.nvme_path, swap_folder_name(comm.rank))
    swapper = NvmeSwapper(folder, config.aio)
    swapper.planned_bytes = total
    # At a clean exit: multiprocessing's exit hook covers worker processes (which leave through
    # os._exit, skipping atexit), and it is itself registered with atexit in a main process.
    multiprocessing.util.Finalize(swapper, swapper.close, exitpriority=10)
    return SwapSpace(swapper, StagingPool(cap, pin_memory=pin))
