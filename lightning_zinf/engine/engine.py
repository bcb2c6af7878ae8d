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

The engine is a facade over parts with one concern each (FSDP2's split of its state, parameter
group and collectives is the model): construction (:mod:`~lightning_zinf.engine.build`), the hooks
that decide when (:mod:`~lightning_zinf.engine.schedule`), the unit state machine and the
reduce-scatter queue (:mod:`~lightning_zinf.engine.units`), rank agreement
(:mod:`~lightning_zinf.engine.agreement`), memory accounting
(:mod:`~lightning_zinf.engine.accounting`), state access for reading and editing
(:mod:`~lightning_zinf.engine.access`), generation inside training
(:mod:`~lightning_zinf.engine.generation`) and the optimizer step
(:mod:`~lightning_zinf.engine.steps`). It owns the wiring, the pass and step boundaries, and
the calls users make: optimizer sharding, clipping, gathers for reading and editing, state access
unit by unit.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import TYPE_CHECKING, Collection, Hashable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zinf.comm import Collectives
from lightning_zinf.config import (MixedPrecisionConfig, OffloadConfig, PrefetchConfig, TilingConfig, ZeroPPConfig,
                                   sharding_mode)
from lightning_zinf.engine.access import StateAccess
from lightning_zinf.engine.accounting import MOVING, MemoryAccounting
from lightning_zinf.engine.activation import apply_activation_checkpointing
from lightning_zinf.engine.agreement import RankAgreement
from lightning_zinf.engine.buffers import BufferPool, GatherPool
from lightning_zinf.engine.build import UnitBuilder, check_group_sizes, hybrid_group_size, make_swap_space, swapped_shards
from lightning_zinf.engine.exposure import GatherExposure
from lightning_zinf.engine.flat import FlatGroup
from lightning_zinf.engine.generation import Generation, mark_partitioned
from lightning_zinf.engine.grouping import auto_blocks, unit_size_for
from lightning_zinf.engine.ledger import MemoryLedger
from lightning_zinf.engine.freezing import Freezing
from lightning_zinf.engine.negotiation import LOOP_END, STEP_END, USER_COLLECTIVE
from lightning_zinf.engine.optim import refuse_unsharded_steps
from lightning_zinf.engine.partition import plan_units
from lightning_zinf.engine.schedule import Schedule
from lightning_zinf.engine.sharded import ShardedOptimizers
from lightning_zinf.engine.steps import OptimizerSteps
from lightning_zinf.engine.state_dict import StateDictHooks
from lightning_zinf.engine.trace import Tracer
from lightning_zinf.engine.transfer import Transfers, resolve_device
from lightning_zinf.engine.units import GATHERED, Unit, UnitStates
from lightning_zinf.heap import setup_phase
from lightning_zinf.offload.activations import ActivationOffload
from lightning_zinf.offload.optimizer import OptimizerOffload
from lightning_zinf.offload.params import ParamOffload
from lightning_zinf.tiling import tile_linear_layers

if TYPE_CHECKING:
    from lightning_zinf.planning import MemoryPlan
    from lightning_zinf.planning.activations import ActivationPlan
    from lightning_zinf.planning.sharding import ShardingChoice

__all__ = ["ZeroEngine", "Unit"]

_NVME_ADDING = ("not supported with OffloadConfig(optimizer='nvme') yet (its swap files are planned when the optimizer "
                "is sharded). Build the optimizer over every parameter it will train, or offload the optimizer to "
                "'cpu'.")


class ZeroEngine:
    """Partition ``module`` in place across the ranks of ``group`` and install the ZeRO-3 hooks.

    Parameters keep their identity (an optimizer or a tied reference still finds them) but between
    uses their ``.data`` is an empty tensor: only this rank's shard of each unit is resident. Use
    :meth:`gathered` to read or edit full values outside forward/backward.

    A model built under :func:`~lightning_zinf.engine.partition.meta_parameters` gets, unit by unit,
    the values eager construction gives it on rank 0, so no rank ever holds it whole; one with real
    parameters is partitioned from rank 0's values (like DDP's broadcast).

    Args:
        module: The model. Its buffers are moved to ``device`` and stay replicated on every rank.
        block_classes: Module classes (or class names) whose whole subtree is one unit, e.g. a
            transformer block. Default: units of at most ``prefetch.unit_size`` elements grouped
            by the engine (:mod:`~lightning_zinf.engine.grouping`; ``None``, the default: the
            prefetch bucket's size), or with ``unit_size=0`` each module's own parameters.
        prefetch: Prefetch, persistence and unit size settings.
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
        sharding: ``"full"`` (ZeRO-3: a unit is gathered for its forward, released, and gathered
            again for its backward), ``"grad_op"`` (ZeRO-2, FSDP's ``SHARD_GRAD_OP``: a unit
            gathered by a forward that records a graph stays gathered until its backward is done
            with it; gradients and optimizer state stay sharded) or ``"hybrid"`` (FSDP's
            ``HYBRID_SHARD``, MiCS: ZeRO-3 within groups of ``shard_group_size`` consecutive ranks,
            each group a replica of the sharded state; gradient shards all-reduced across the
            groups). Lightning's names are accepted (:func:`~lightning_zinf.config.sharding_mode`).
        shard_group_size: With ``sharding="hybrid"``: ranks per shard group, a divisor of the
            world size (default: the ranks per node, as hpZ's). Needs ``group=None``.

    Attributes:
        units: The units, in plan order (a unit's ``index`` is its position).
        unit_size: The most elements per unit of the modules grouped automatically
            (``prefetch.unit_size``, or its ``bucket_size`` where that is ``None``), or 0
            (``block_classes`` given, or a unit per module).
        schedule: The :class:`~lightning_zinf.engine.schedule.Schedule`: the hooks that decide when
            units are gathered, prefetched and released.
        states: The :class:`~lightning_zinf.engine.units.UnitStates`: the unit state machine
            (gather, wait, release) and the reduce-scatter queue.
        agreement: The :class:`~lightning_zinf.engine.agreement.RankAgreement`: records the
            collectives this rank issues and checks that every rank issues the same.
        accounting: The :class:`~lightning_zinf.engine.accounting.MemoryAccounting` behind
            :meth:`memory` and :meth:`resident_bytes`.
        access: The :class:`~lightning_zinf.engine.access.StateAccess`: exact reads and edits of the state.
        generation: The :class:`~lightning_zinf.engine.generation.Generation`: units kept, generation phases.
        steps: The :class:`~lightning_zinf.engine.steps.OptimizerSteps`: the sharded optimizers' steps.
        exposure: The :class:`~lightning_zinf.engine.exposure.GatherExposure`: the third training
            forward's time on gathers against its compute (``report``), and the warning when the
            gathers take longer.
        ledger: The :class:`~lightning_zinf.engine.ledger.MemoryLedger` of the buffers whose size
            changes during a step; :meth:`memory` adds the long-lived state.
        checkpointed_modules: Qualified names of the modules ``activation_checkpointing`` wrapped.
        optimizers: The optimizers :meth:`shard_optimizer` re-pointed, in order.
        plain_layouts: Per optimizer, per param group, per parameter given: ``(flat group index,
            position)``, or ``None`` for another model's tensor (the plain state dict's numbering).
        sharded: The :class:`~lightning_zinf.engine.sharded.ShardedOptimizers` behind ``optimizers``.
        freezing: The :class:`~lightning_zinf.engine.freezing.Freezing`: ``requires_grad`` changes.
        state_dict_hooks: The :class:`~lightning_zinf.engine.state_dict.StateDictHooks` that make
            ``module.state_dict()``/``load_state_dict()`` read and write full values.
        memory_plan: The :class:`~lightning_zinf.planning.MemoryPlan` the strategy's
            ``memory_budget`` chose this engine's placement with, or ``None``.
        sharding_choice: What the strategies' ``sharding="auto"`` chose and why
            (:class:`~lightning_zinf.planning.sharding.ShardingChoice`), else ``None``.
        activation_plan: The :class:`~lightning_zinf.planning.activations.ActivationPlan` that
            chooses, after the first training step, which blocks keep their activations under
            ``memory_budget``, or ``None``; :meth:`begin_pass` consults it.

    Raises:
        ValueError: an unknown ``sharding``; the model has no parameters; a module made on the meta device has no
            ``reset_parameters()``; a ``block_classes`` or ``activation_checkpointing`` entry is
            malformed, or an ``activation_checkpointing`` entry matches no module;
            ``zero_pp.ranks_per_node``, (with hpZ) ``zero_pp.hpz_partition_size`` or (hybrid)
            ``shard_group_size`` does not divide the world size (the message names the option, its
            value and the divisors allowed); ``shard_group_size`` without hybrid sharding; hybrid
            sharding with hpZ, or over a ``group`` other than the world.
        SwapError: with ``param="nvme"``, the parameter shards' swap files would not fit in the
            free space at ``nvme_path`` (checked on every rank before anything is materialised or
            written: :func:`~lightning_zinf.offload.preflight.ensure_space`), or the swap folder
            cannot be made.
    """

    @setup_phase()  # what building frees goes back to the system (lightning_zinf.heap)
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
        sharding: str = "full",
        shard_group_size: Optional[int] = None,
    ) -> None:
        sharding = sharding_mode(sharding)
        if sharding == "auto":
            raise ValueError("sharding='auto' is chosen at setup by ZeroInfinityStrategy and ZeroInfinityFabricStrategy "
                             "(from the measured links and the example input). In your own loop, call "
                             "lightning_zinf.planning.sharding.auto_sharding(...) and pass the mode and ZeRO++ switches "
                             "of its choice, or choose them yourself.")
        if getattr(module, "_zinf_engine", None) is not None:
            raise ValueError(
                f"{type(module).__name__} is already partitioned by a ZeroEngine; reuse that engine "
                "(`module._zinf_engine`) instead of building a second one over empty parameters."
            )
        self.module = module
        self.memory_plan: Optional["MemoryPlan"] = None  # set by the strategies' build_engine
        self.sharding_choice: Optional["ShardingChoice"] = None  # likewise
        self.activation_plan: Optional["ActivationPlan"] = None  # likewise
        self.device = resolve_device(device)
        self.transfers = Transfers(self.device)
        world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        # torchrun's LOCAL_WORLD_SIZE, where it fits the group (a sub-group may not span whole nodes).
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 0))
        ranks_per_node = zero_pp.ranks_per_node or (local if local and world % local == 0 else world)
        hpz_size = (zero_pp.hpz_partition_size or ranks_per_node) if zero_pp.hpz else None
        check_group_sizes(zero_pp, world, ranks_per_node)
        self.comm = Collectives(group, ranks_per_node=ranks_per_node, hpz_partition_size=hpz_size,
                                qwz_block=zero_pp.block if zero_pp.qwz else None,
                                qgz_bits=zero_pp.qgz_bits if zero_pp.qgz else None, block=zero_pp.block,
                                timeout=timeout, device=self.device,
                                shard_group_size=hybrid_group_size(sharding, shard_group_size, zero_pp, world,
                                                                   ranks_per_node))
        on_device = list(MOVING)
        on_device += ["shards_device"] * (offload.param == "none") + ["grad_shards", "optimizer"] * (offload.optimizer == "none")
        on_device += ["optimizer_device"] * bool(offload.device_bytes)
        self.ledger = MemoryLedger(tuple(on_device))
        self.tracer = Tracer(self.comm, enabled=prefetch.enabled)
        shards_offloaded = offload.param != "none"
        shard_device = torch.device("cpu") if shards_offloaded else self.device
        self.tiled_layers = tile_linear_layers(module, tiling) if tiling is not None else []
        self.checkpointed_modules = apply_activation_checkpointing(module, activation_checkpointing)
        # Without block_classes, modules are grouped into units of about unit_size elements
        # (grouping.py): a unit per module costs each small tensor its own hooks and collectives.
        self.unit_size = unit_size_for(block_classes, prefetch.unit_size, prefetch.bucket_size)
        specs, uses = plan_units(module, block_classes, auto_blocks(module, self.unit_size) if self.unit_size else ())
        # Before any shard exists: the preflight counts the swap files the partitioning will write.
        swapped = (ParamOffload.planned_bytes(swapped_shards(specs, mixed_precision, zero_pp, self.comm.shard_size))
                   if offload.param == "nvme" else 0)
        self.space = make_swap_space(offload, self.comm, self.device, swapped)
        self.swapper = self.space.swapper if self.space is not None else None
        # host_bytes: kept as shards are made, unless the optimizer is on NVMe too (then its first
        # sharding chooses, with the optimizer's state counted: OptimizerOffload.plan_host).
        self.param_offload = (ParamOffload(self.space, offload.host_bytes if offload.optimizer != "nvme" else 0)
                              if offload.param == "nvme" else None)
        self.gathers = GatherPool(self.device, self.ledger)
        self.units = UnitBuilder(module, self.comm, device=self.device, shard_device=shard_device,
                                 mixed_precision=mixed_precision, zero_pp=zero_pp,
                                 persistence_threshold=prefetch.persistence_threshold,
                                 persistence_limit=prefetch.persistence_limit, ledger=self.ledger,
                                 transfers=self.transfers, param_offload=self.param_offload,
                                 host_copies=offload.param == "cpu",
                                 device_copies=offload.param == "none" and offload.optimizer != "none",
                                 device_state_bytes=offload.device_bytes,
                                 preloaded=preloaded, gathers=self.gathers).build(specs)
        self.pool = BufferPool(self.device, self.ledger)
        self._activation_offload: Optional[ActivationOffload] = None
        for buffer_owner in module.modules():
            for name, buf in buffer_owner._buffers.items():
                if buf is not None:
                    buffer_owner._buffers[name] = buf.to(self.device)
        self.offload: Optional[OptimizerOffload] = None
        if offload.optimizer != "none":
            self.offload = OptimizerOffload(self.groups, offload, self.space, self.param_offload)
            if self.param_offload is not None:
                self.param_offload.rewrites = self.offload.rewrites
        self.sharded = ShardedOptimizers(self.groups, offload=self.offload, param_offload=self.param_offload,
                                         separate_masters=shards_offloaded,
                                         adding_refused=_NVME_ADDING if offload.optimizer == "nvme" else None)
        self.optimizers = self.sharded.optimizers
        self.plain_layouts = self.sharded.plain_layouts
        self.agreement = RankAgreement(self.comm, self.tracer, self.units, self.groups)
        self.states = UnitStates(self.units, comm=self.comm, ledger=self.ledger, pool=self.pool,
                                 agreement=self.agreement, prefetch=prefetch, param_offload=self.param_offload,
                                 offload=self.offload, transfers=self.transfers)
        self.accounting = MemoryAccounting(self.ledger, self.groups, self.optimizers,
                                           shards_offloaded=shards_offloaded, param_offload=self.param_offload,
                                           offload=self.offload, space=self.space)
        self.access = StateAccess(self.units, states=self.states, agreement=self.agreement, transfers=self.transfers,
                                  param_offload=self.param_offload, offload=self.offload, optimizers=self.optimizers,
                                  settle=self._settle)
        self.schedule = Schedule(module, self.units, {m: [self.units[i] for i in ids] for m, ids in uses.items()},
                                 states=self.states, tracer=self.tracer, comm=self.comm, pool=self.pool,
                                 prefetch=prefetch, mixed_precision=mixed_precision, param_offload=self.param_offload,
                                 read_ahead=offload.read_ahead, begin_pass=self.begin_pass if auto_pass else None,
                                 meet=self.agreement.waypoint_with,
                                 copy_ahead=offload.copy_ahead_bytes if offload.param == "cpu" else 0,
                                 hold_for_backward=sharding == "grad_op")
        if self.unit_size and not block_classes:
            # The modules inside a grouped unit are gathered by the module that owns it; one called
            # without that module's forward gathers the unit itself (Schedule.guard).
            for spec, unit in zip(specs, self.units):
                own = {id(p) for _, p in spec.params}
                for inner in spec.modules:
                    if inner not in uses and any(id(p) in own for p in inner._parameters.values() if p is not None):
                        self.schedule.guard(inner, unit)
        self.steps = OptimizerSteps(self.units, comm=self.comm, states=self.states, agreement=self.agreement,
                                    transfers=self.transfers, device=self.device, shard_device=shard_device,
                                    param_offload=self.param_offload,
                                    offload=self.offload, swapper=self.swapper, nvme_path=offload.nvme_path,
                                    sharded=self.sharded, settle=self._settle, tracer=self.tracer)
        self.exposure = GatherExposure(self.device, self.comm.rank, prefetch.enabled)
        self.states.exposure = self.exposure
        self.schedule.on_backward_start = self._backward_starts
        self.states.before_release_kept = self.schedule.restore  # a bypassed pass ends with its kept units
        self.freezing = Freezing(self.units, self.comm, schedule=self.schedule, sharded=self.sharded,
                                 frozen_dtype=mixed_precision.frozen_dtype, nvme_optimizer=offload.optimizer == "nvme")
        self.generation = Generation(module, self.units, states=self.states, tracer=self.tracer, schedule=self.schedule,
                                     agreement=self.agreement, settle=self._settle, begin_pass=self._begin_pass,
                                     auto_pass=auto_pass)
        self.state_dict_hooks = StateDictHooks(self)
        self._state_dict_handles = self.state_dict_hooks.install()
        refuse_unsharded_steps(self, [p for g in self.groups for p in g.params])
        module._zinf_engine = self  # type: ignore[assignment]
        mark_partitioned(module, True)
        with self.agreement.lockstep():  # every rank builds the engine at the same point
            self.states.gather_exact([u for u in self.units if u.persistent])

    # --- what the parts keep, as the engine's own ---------------------------------------------------
    @property
    def groups(self) -> list[FlatGroup]:
        """All flat groups, unit by unit."""
        return [g for u in self.units for g in u.groups]

    @property
    def collectives_issued(self) -> int:
        """Gathers and reduce-scatters issued over the run (quoted by :meth:`progress`)."""
        return self.agreement.collectives_issued

    @property
    def waiting_in(self) -> Optional[str]:
        """The agreement check this rank waits for the other ranks in (a description), or None; the
        watch reports two ranks waiting in different calls as a deadlock (:mod:`lightning_zinf.comm.watch`)."""
        return self.agreement.waiting_in

    @property
    def peak_gathered_bytes(self) -> int:
        """The most bytes of full (gathered or in-flight) parameter buffers at once over the run:
        the working memory that units (and tiles) bound. Per step: ``ledger.peak["gathered"]``."""
        return self.states.peak_gathered_bytes

    @property
    def gathered_ahead(self) -> int:
        """Units gathered by prefetch, over the run (for tests and monitoring)."""
        return self.states.gathered_ahead

    @property
    def gathered_bytes(self) -> int:
        """Bytes of full (gathered or in-flight) parameter buffers now."""
        return self.ledger.now["gathered"]

    # --- passes and steps -------------------------------------------------------------------------
    def begin_pass(self, kind: Hashable) -> None:
        """Mark the start of a forward (+ backward) pass of ``kind`` (e.g. ``"train"``, ``"eval"``).

        Finishes the previous pass: waits for gathers still in flight and releases units gathered
        ahead but never used; frees the gradient shards the optimizer has consumed (after
        ``zero_grad()``). Every rank must call it at the same points.

        A pass begun here, outside a forward (without ``auto_pass``), under ``torch.no_grad()``,
        inside :meth:`keep_gathered` with every unit kept gathered already and its kind's trace
        agreed, runs without the schedule's forward hooks (a later step of an evaluation loop that
        keeps the whole model): torch's call path of the unpartitioned model. They are back at the
        next pass, or when the kept units are released.

        Raises:
            RuntimeError: the ranks changed ``requires_grad`` differently, or unfroze a parameter
                that cannot be (:meth:`Freezing.sync <lightning_zinf.engine.freezing.Freezing.sync>`);
                the ranks' collectives since the last check differ (:meth:`verify_ranks_agree`).
        """
        # Inside keep_gathered() and generation phases: checked once, at their end (not inside an
        # evaluation loop's keep, verify=False, whose driver begins every step's pass on every rank).
        self._begin_pass(kind, check=not self.generation.verifying and not self.generation.active)
        if not self.generation.active:
            self.generation.resume_kind = kind
            if self._hooks_needless():
                self.schedule.bypass()

    def _hooks_needless(self) -> bool:
        """Whether the pass just begun needs no forward hook: every unit stays gathered in its
        compute buffers (kept by ``keep_gathered``, as an evaluation loop keeps the whole model, or
        persistent), nothing records a graph, no input is cast, and the kind's trace is agreed (so
        no rank records what another does not). Its forward passes then run as the unpartitioned
        model's, with none of the schedule's host time per module call
        (``examples/benchmarks/generation.py``). Not with ``auto_pass``, whose pass starts inside a
        forward, nor in a generation phase, whose passes start in the hooks, nor for a model a
        module of which returned a view of a parameter (the hooks hand out a copy, which must not
        point into gathered memory released later)."""
        policy = self.schedule.mixed_precision
        return (not self.schedule.starts_passes and bool(self.states.keep_budget) and not torch.is_grad_enabled()
                and not self.schedule.outputs_views
                and not (policy.param_dtype is not None and policy.cast_forward_inputs) and self.tracer.certified
                and all(u.state == GATHERED and (u.kept or u.persistent) and all(g.holds_compute for g in u.groups)
                        for u in self.units))

    def _begin_pass(self, kind: Hashable, check: bool) -> None:
        # PEFT's disable_adapter() freezes the adapters for a while in a generation phase; a pass
        # without backward leaves the flags to the next training pass.
        training = not self.generation.active and torch.is_grad_enabled()
        self.exposure.forward_end()  # before settling: a forward with no backward ends at its last gather
        self.schedule.restore()
        self.state_dict_hooks.reset()
        self.access.resume_keeping()  # after a state-dict traversal that raised
        self._settle(boundary=True)
        self.gathers.new_window()
        if self.offload is None:  # offloaded gradient shards are the offload's to manage
            for group in self.groups:
                group.free_consumed_grads()
        decision = self.agreement.begin_pass(kind, check, self.freezing.prepare() if training else None)
        if decision is not None:  # every rank is at a training pass, together
            self.freezing.apply(decision)
            if self.activation_plan is not None:
                self.activation_plan.at_training_pass(self.comm)
        self.exposure.pass_begins(training)
        self._exposure_done()

    def _backward_starts(self) -> None:
        # The forward is over: its waits for gathers are all counted (GatherExposure), and the
        # optimizer step's first state is read ahead.
        self.exposure.forward_end()
        self._exposure_done()
        self.steps.prepare_step()

    def _exposure_done(self) -> None:
        # Once measured (or given up), gathers no longer ask its clock.
        if self.exposure.finished:
            self.states.exposure = None

    def _settle(self, boundary: bool = False) -> None:
        """Finish every collective in flight and release what no pass is using (at a pass
        boundary, also what a forward or backward that raised left behind)."""
        if boundary:
            self.schedule.reset()
        self.states.settle(boundary)

    def meet(self, where: str) -> None:
        """Meet the other ranks at ``where``: ``"step end"`` (a LightningModule's step returned),
        ``"loop end"`` (a fit, validation, test or predict loop ended) or ``"collective"`` (before
        one the training code makes through the strategy: logging with ``sync_dist``, a barrier); ranks that ran different modules serve each other until all are
        there (:mod:`~lightning_zinf.engine.negotiation`). Every rank must call it at the same
        points; one waiting elsewhere makes every rank raise ``RuntimeError`` naming each one's.
        The forward hooks a pass took out (:meth:`begin_pass`) are back from here on: code after a
        step (epoch-end hooks, callbacks) runs forwards the pass's decision did not foresee."""
        self.schedule.restore()
        self.agreement.waypoint({"step end": STEP_END, "collective": USER_COLLECTIVE, "loop end": LOOP_END}[where])

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
        self.schedule.add_use(module, owner)

    # --- optimizer -------------------------------------------------------------------------------
    @setup_phase()
    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Re-point a freshly built optimizer at this rank's fp32 master shards (in place), and run
        :meth:`after_step` after each of its steps (:meth:`OptimizerSteps.shard_optimizer
        <lightning_zinf.engine.steps.OptimizerSteps.shard_optimizer>`: the rules and errors)."""
        return self.steps.shard_optimizer(optimizer)

    def master_fragments(self) -> list[Tensor]:
        """This rank's fp32 master fragments (1-D), as the sharded optimizer holds them."""
        return self.steps.master_fragments()

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Clip gradient shards by the global L2 norm over all ranks; returns the norm (0-d fp32)
        (:meth:`OptimizerSteps.clip_grad_norm_ <lightning_zinf.engine.steps.OptimizerSteps.clip_grad_norm_>`)."""
        return self.steps.clip_grad_norm_(max_norm)

    def after_step(self, groups: Optional[Sequence[FlatGroup]] = None) -> None:
        """After ``optimizer.step()``: the masters of ``groups`` (``None``: all) cast into the compute
        shards (:meth:`OptimizerSteps.after_step <lightning_zinf.engine.steps.OptimizerSteps.after_step>`)."""
        self.steps.after_step(groups)

    # --- memory ----------------------------------------------------------------------------------
    def resident_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for training state, by tier (``device``, ``cpu``, ``nvme``):
        :meth:`MemoryAccounting.resident_bytes <lightning_zinf.engine.accounting.MemoryAccounting.resident_bytes>`."""
        return self.accounting.resident_bytes()

    def memory(self) -> dict[str, tuple[int, int]]:
        """Category -> ``(bytes now, peak bytes since :meth:`reset_memory_peaks`)``: the memory ledger
        (:meth:`MemoryAccounting.memory <lightning_zinf.engine.accounting.MemoryAccounting.memory>`)."""
        return self.accounting.memory()

    def reset_memory_peaks(self) -> None:
        """Start a new peak window of :meth:`memory` (call at the start of a training step)."""
        self.accounting.reset_peaks()

    def offload_activations(self, fresh: bool = True) -> contextlib.AbstractContextManager[None]:
        """A context in which the tensors autograd saves for backward are kept in host memory,
        except parameters and views of gathered parameter buffers (the re-gather restores those):
        :class:`~lightning_zinf.offload.activations.ActivationOffload`. ``fresh=False``: the
        next block of the forward the last context began (the copies back ahead cross blocks)."""
        if self._activation_offload is None:
            self._activation_offload = ActivationOffload(self.transfers, self.states.holds_storage_of)
        return self._activation_offload(fresh)

    # --- rank agreement --------------------------------------------------------------------------
    def verify_ranks_agree(self, where: str = "an agreement check of the engine") -> None:
        """Check that every rank issued the same gathers and reduce-scatters since the last check;
        ``where`` names the check for :attr:`waiting_in`. Raises ``RuntimeError`` naming the first
        difference (:meth:`RankAgreement.verify <lightning_zinf.engine.agreement.RankAgreement.verify>`)."""
        self.agreement.verify(where)

    def progress(self) -> str:
        """Where this rank is: how many gathers and reduce-scatters it has issued and the last one
        (for messages about ranks that fell behind or went elsewhere)."""
        return self.agreement.progress()

    # --- state access ----------------------------------------------------------------------------
    def state_resident(self, write_back: bool,
                       groups: Optional[list[FlatGroup]] = None) -> contextlib.AbstractContextManager[None]:
        """The shards, masters, gradient shards and optimizer states of ``groups`` (default: all) in
        memory for the block; ``write_back``: written out afterwards
        (:meth:`StateAccess.state_resident <lightning_zinf.engine.access.StateAccess.state_resident>`)."""
        return self.access.state_resident(write_back, groups)

    def gathered(self, write_back: bool = False) -> contextlib.AbstractContextManager[None]:
        """Gather every unit, exactly, for the block; ``write_back``: edits go back into the shards
        (:meth:`StateAccess.gathered <lightning_zinf.engine.access.StateAccess.gathered>`)."""
        return self.access.gathered(write_back)

    # --- one unit at a time, exactly (state_dict / load_state_dict) ---------------------------------
    def begin_unit_access(self) -> None:
        """Settle before a traversal of :meth:`hold_exact` calls
        (:meth:`StateAccess.begin_unit_access <lightning_zinf.engine.access.StateAccess.begin_unit_access>`)."""
        self.access.begin_unit_access()

    def hold_exact(self, unit: Unit) -> None:
        """Gather ``unit`` exactly and hold it until :meth:`drop_exact`; collective
        (:meth:`StateAccess.hold_exact <lightning_zinf.engine.access.StateAccess.hold_exact>`)."""
        self.access.hold_exact(unit)

    def drop_exact(self, unit: Unit, write_back: bool) -> None:
        """End a :meth:`hold_exact`, writing edits back first with ``write_back``
        (:meth:`StateAccess.drop_exact <lightning_zinf.engine.access.StateAccess.drop_exact>`)."""
        self.access.drop_exact(unit, write_back)

    def end_unit_access(self, units: Collection[Unit]) -> None:
        """After a traversal: the persistent ``units`` back to their compute-dtype gather
        (:meth:`StateAccess.end_unit_access <lightning_zinf.engine.access.StateAccess.end_unit_access>`)."""
        self.access.end_unit_access(units)

    # --- generation inside training ---------------------------------------------------------------
    def keep_gathered(self, budget: int, verify: bool = True) -> contextlib.AbstractContextManager[None]:
        """Within the block, units that finish their forward stay gathered within ``budget`` bytes,
        so later forward passes (decode steps) do not gather them again; released on exit
        (:meth:`Generation.keep_gathered <lightning_zinf.engine.generation.Generation.keep_gathered>`)."""
        return self.generation.keep_gathered(budget, verify)

    def generation_phase(self, budget: int) -> contextlib.AbstractContextManager[None]:
        """A generation phase inside a training step (RLHF's rollouts, reward and reference forwards),
        units kept gathered within ``budget`` bytes (:meth:`Generation.phase
        <lightning_zinf.engine.generation.Generation.phase>`: ZeRO++'s behaviour inside, the errors)."""
        return self.generation.phase(budget)

    def release_all(self) -> None:
        """Wait for outstanding collectives and swaps, and release every non-persistent unit."""
        self._settle()
        # The optimizer's side first: a step still in flight writes parameter shards and copies.
        for side in (self.offload, self.param_offload):
            if side is not None:
                side.settle_all()
        self.gathers.clear()

    def remove_hooks(self) -> None:
        """Detach the engine from the model (the parameters stay partitioned)."""
        self.schedule.remove()
        for handle in self._state_dict_handles:
            handle.remove()
        self._state_dict_handles = []
