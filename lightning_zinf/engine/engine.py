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
(:mod:`~lightning_zinf.engine.agreement`) and memory accounting
(:mod:`~lightning_zinf.engine.accounting`). It owns the wiring, the pass and step boundaries, and
the calls users make: optimizer sharding, clipping, gathers for reading and editing, state access
unit by unit.
"""

from __future__ import annotations

import contextlib
import os
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Collection, Hashable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_zinf.comm import Collectives
from lightning_zinf.config import MixedPrecisionConfig, OffloadConfig, PrefetchConfig, TilingConfig, ZeroPPConfig
from lightning_zinf.engine.accounting import MOVING, MemoryAccounting
from lightning_zinf.engine.activation import apply_activation_checkpointing
from lightning_zinf.engine.agreement import RankAgreement
from lightning_zinf.engine.buffers import BufferPool
from lightning_zinf.engine.build import UnitBuilder, check_group_sizes, make_swap_space, swapped_shards
from lightning_zinf.engine.flat import FlatGroup
from lightning_zinf.engine.freezing import Freezing
from lightning_zinf.engine.ledger import MemoryLedger
from lightning_zinf.engine.optim import clip_grad_norm_, refuse_unsharded_steps
from lightning_zinf.engine.partition import plan_units
from lightning_zinf.engine.ranges import phased
from lightning_zinf.engine.schedule import Schedule
from lightning_zinf.engine.sharded import ShardedOptimizers
from lightning_zinf.engine.state_dict import StateDictHooks
from lightning_zinf.engine.trace import Tracer
from lightning_zinf.engine.transfer import Transfers, resolve_device
from lightning_zinf.engine.units import Unit, UnitStates
from lightning_zinf.offload.activations import ActivationOffload
from lightning_zinf.offload.optimizer import OptimizerOffload
from lightning_zinf.offload.params import ParamOffload
from lightning_zinf.offload.preflight import ensure_space
from lightning_zinf.tiling import tile_linear_layers

__all__ = ["ZeroEngine", "Unit"]

_NVME_ADDING = ("not supported with OffloadConfig(optimizer='nvme') yet (its swap files are planned when the optimizer "
                "is sharded). Build the optimizer over every parameter it will train, or offload the optimizer to "
                "'cpu'.")


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
        units: The units, in plan order (a unit's ``index`` is its position).
        schedule: The :class:`~lightning_zinf.engine.schedule.Schedule`: the hooks that decide when
            units are gathered, prefetched and released.
        states: The :class:`~lightning_zinf.engine.units.UnitStates`: the unit state machine
            (gather, wait, release) and the reduce-scatter queue.
        agreement: The :class:`~lightning_zinf.engine.agreement.RankAgreement`: records the
            collectives this rank issues and checks that every rank issues the same.
        accounting: The :class:`~lightning_zinf.engine.accounting.MemoryAccounting` behind
            :meth:`memory` and :meth:`resident_bytes`.
        ledger: The :class:`~lightning_zinf.engine.ledger.MemoryLedger` of the buffers whose size
            changes during a step; :meth:`memory` adds the long-lived state.
        checkpointed_modules: Qualified names of the modules ``activation_checkpointing`` wrapped.
        optimizers: The optimizers :meth:`shard_optimizer` re-pointed, in order.
        plain_layouts: For each of ``optimizers``, per param group, per parameter the user gave it
            (``add_param_group`` included): ``(flat group index, position in the group)``, or
            ``None`` for a frozen tensor of another model (the optimizer's plain, unsharded state
            dict numbers them in this order).
        sharded: The :class:`~lightning_zinf.engine.sharded.ShardedOptimizers` behind ``optimizers``:
            what stands for each parameter in them, ``add_param_group``, and
            :meth:`~lightning_zinf.engine.sharded.ShardedOptimizers.presenting` for code that expects
            the model's parameters in their param groups.
        freezing: The :class:`~lightning_zinf.engine.freezing.Freezing` part: ``requires_grad`` may
            change between passes (freezing and unfreezing during training).
        state_dict_hooks: The :class:`~lightning_zinf.engine.state_dict.StateDictHooks` that make
            ``module.state_dict()``/``load_state_dict()`` read and write full values.

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
                                timeout=timeout, device=self.device)
        on_device = list(MOVING)
        on_device += ["shards_device"] * (offload.param == "none") + ["grad_shards", "optimizer"] * (offload.optimizer == "none")
        self.ledger = MemoryLedger(tuple(on_device))
        self.tracer = Tracer(self.comm, enabled=prefetch.enabled)
        self._nvme_path = offload.nvme_path
        self._shards_offloaded = offload.param != "none"
        self._shard_device = torch.device("cpu") if self._shards_offloaded else self.device
        self.tiled_layers = tile_linear_layers(module, tiling) if tiling is not None else []
        self.checkpointed_modules = apply_activation_checkpointing(module, activation_checkpointing)
        specs, uses = plan_units(module, block_classes)
        # Before any shard exists: the preflight counts the swap files the partitioning will write.
        swapped = (ParamOffload.planned_bytes(swapped_shards(specs, mixed_precision, zero_pp, self.comm.world_size))
                   if offload.param == "nvme" else 0)
        self.space = make_swap_space(offload, self.comm, self.device, swapped)
        self.swapper = self.space.swapper if self.space is not None else None
        self.param_offload = ParamOffload(self.space) if offload.param == "nvme" else None
        self.units = UnitBuilder(module, self.comm, device=self.device, shard_device=self._shard_device,
                                 mixed_precision=mixed_precision, zero_pp=zero_pp,
                                 persistence_threshold=prefetch.persistence_threshold, ledger=self.ledger,
                                 transfers=self.transfers, param_offload=self.param_offload,
                                 host_copies=offload.param == "cpu", preloaded=preloaded).build(specs)
        self.pool = BufferPool(self.device, self.ledger)
        self._activation_offload: Optional[ActivationOffload] = None
        self._gathered_depth = 0  # nested gathered() blocks
        self._auto_pass = auto_pass
        self._pass_kind: Optional[Hashable] = None  # of the last pass begun outside a generation phase
        self._in_phase = False  # inside generation_phase()
        for buffer_owner in module.modules():
            for name, buf in buffer_owner._buffers.items():
                if buf is not None:
                    buffer_owner._buffers[name] = buf.to(self.device)
        self.offload: Optional[OptimizerOffload] = None
        if offload.optimizer != "none":
            self.offload = OptimizerOffload(self.groups, offload, self.space, self.param_offload)
        self.sharded = ShardedOptimizers(self.groups, offload=self.offload, param_offload=self.param_offload,
                                         separate_masters=self._shards_offloaded,
                                         adding_refused=_NVME_ADDING if offload.optimizer == "nvme" else None)
        self.optimizers = self.sharded.optimizers
        self.plain_layouts = self.sharded.plain_layouts
        self.agreement = RankAgreement(self.comm, self.tracer, self.units, self.groups)
        self.states = UnitStates(self.units, comm=self.comm, ledger=self.ledger, pool=self.pool,
                                 agreement=self.agreement, prefetch=prefetch, param_offload=self.param_offload,
                                 offload=self.offload, transfers=self.transfers)
        self.accounting = MemoryAccounting(self.ledger, self.groups, self.optimizers,
                                           shards_offloaded=self._shards_offloaded, param_offload=self.param_offload,
                                           offload=self.offload, space=self.space)
        self.schedule = Schedule(module, self.units, {m: [self.units[i] for i in ids] for m, ids in uses.items()},
                                 states=self.states, tracer=self.tracer, comm=self.comm, pool=self.pool,
                                 prefetch=prefetch, mixed_precision=mixed_precision, param_offload=self.param_offload,
                                 read_ahead=offload.read_ahead, begin_pass=self.begin_pass if auto_pass else None)
        self.freezing = Freezing(self.units, self.comm, schedule=self.schedule, sharded=self.sharded,
                                 frozen_dtype=mixed_precision.frozen_dtype, nvme_optimizer=offload.optimizer == "nvme")
        self.state_dict_hooks = StateDictHooks(self)
        self._state_dict_handles = self.state_dict_hooks.install()
        refuse_unsharded_steps(self, [p for g in self.groups for p in g.params])
        module._zinf_engine = self  # type: ignore[assignment]
        self._mark_partitioned(True)
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
        """The agreement check this rank is blocked in, waiting for the other ranks (a description),
        or None; the strategies' watch publishes it, so that two ranks waiting in different calls
        are reported as a deadlock (:mod:`lightning_zinf.comm.watch`)."""
        return self.agreement.waiting_in

    @property
    def on_departure(self) -> Optional[Callable[[Optional[str]], Any]]:
        """Called with a description of the next collective when this rank leaves the agreed trace
        (before it checks with the other ranks), and with ``None`` once they agreed; the strategies
        point it at their :class:`~lightning_zinf.comm.watch.RankWatch`."""
        return self.agreement.on_departure

    @on_departure.setter
    def on_departure(self, callback: Optional[Callable[[Optional[str]], Any]]) -> None:
        self.agreement.on_departure = callback

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

        Raises:
            RuntimeError: the ranks changed ``requires_grad`` differently, or unfroze a parameter
                that cannot be (:meth:`Freezing.sync <lightning_zinf.engine.freezing.Freezing.sync>`);
                the ranks' collectives since the last check differ (:meth:`verify_ranks_agree`).
        """
        # Inside keep_gathered() and generation phases: checked once, at their end.
        self._begin_pass(kind, check=not self.states.keep_budget and not self._in_phase)
        if not self._in_phase:
            self._pass_kind = kind

    def _begin_pass(self, kind: Hashable, check: bool) -> None:
        self.state_dict_hooks.reset()
        self._settle(boundary=True)
        if self.offload is None:  # offloaded gradient shards are the offload's to manage
            for group in self.groups:
                group.free_consumed_grads()
        if check:
            self.verify_ranks_agree(f"the agreement check at the start of a forward pass ({kind!r}) of the partitioned model")
        # After the check: every rank is at this boundary. Not in a generation phase (PEFT's
        # disable_adapter() freezes the adapters for a while), nor for a pass without backward.
        if not self._in_phase and torch.is_grad_enabled():
            self.freezing.sync()
        self.tracer.begin_pass(kind)
        self.agreement.begin_pass()

    def _settle(self, boundary: bool = False) -> None:
        """Finish every collective in flight and release what no pass is using (at a pass
        boundary, also what a forward or backward that raised left behind)."""
        if boundary:
            self.schedule.reset()
        self.states.settle(boundary)

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
    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Re-point a freshly built optimizer at this rank's fp32 master shards (in place), and
        run :meth:`after_step` for the flat groups it steps after each of its steps (a step post-hook).

        See :meth:`ShardedOptimizers.adopt <lightning_zinf.engine.sharded.ShardedOptimizers.adopt>` for
        the rules and errors: the optimizer may hold frozen parameters (stepped once unfrozen), and
        its ``add_param_group`` takes the model's parameters. With ``optimizer="nvme"`` every rank
        first checks that the swap files this optimizer adds (fp32 masters, gradient shards, its
        per-element states) fit in ``nvme_path``
        (:func:`~lightning_zinf.offload.preflight.ensure_space`; collective), and raises
        :class:`~lightning_zinf.offload.SwapError` before writing any of them if they do not.
        """
        if self.offload is not None and self.offload.nvme:
            self.swapper.planned_bytes = ensure_space(
                self.comm, self._nvme_path, self.offload.planned_bytes(optimizer),
                "fp32 masters, gradient shards and optimizer states", before=self._swap_file_bytes())
        self.sharded.adopt(optimizer)
        if self.offload is not None and self.offload.nvme:
            self.offload.wrap_zero_grad(optimizer)
        optimizer.register_step_pre_hook(lambda opt, *_: self._before_step(opt))
        # The groups it steps: those holding a master fragment it was given (an unfreeze or
        # add_param_group may add some).
        optimizer.register_step_post_hook(lambda opt, *_: self.after_step(self.sharded.stepped(opt)))
        return optimizer

    def _swap_file_bytes(self) -> int:
        """Bytes of this rank's swap files now (records written, in memory or not)."""
        return sum(n for part in (self.param_offload, self.offload) if part is not None for n in part.tier_bytes().values())

    @phased("zinf.before_step")
    def _before_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._settle()
        self.verify_ranks_agree("the agreement check before an optimizer step")
        if self.offload is not None:
            if self._shard_device != self.device:
                self.transfers.host_wait_h2d()  # the step rewrites host-tier shards a gather may read
            # Sub-group by sub-group, each one's updated shards copied out while the next steps;
            # the optimizer's own step then has nothing left.
            self.offload.step(optimizer)

    # --- memory ----------------------------------------------------------------------------------
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
        return self.accounting.resident_bytes()

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
        return self.accounting.memory()

    def reset_memory_peaks(self) -> None:
        """Start a new peak window of :meth:`memory` (call at the start of a training step)."""
        self.accounting.reset_peaks()

    def offload_activations(self) -> contextlib.AbstractContextManager[None]:
        """A context in which the tensors autograd saves for backward are kept in host memory,
        except parameters and views of gathered parameter buffers (the re-gather restores those):
        :class:`~lightning_zinf.offload.activations.ActivationOffload`."""
        if self._activation_offload is None:
            self._activation_offload = ActivationOffload(self.transfers, self.states.holds_storage_of)
        return self._activation_offload()

    # --- rank agreement --------------------------------------------------------------------------
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
        self.agreement.verify(where)

    def progress(self) -> str:
        """Where this rank is: how many gathers and reduce-scatters it has issued and the last one
        (for messages about ranks that fell behind or went elsewhere)."""
        return self.agreement.progress()

    # --- state access ----------------------------------------------------------------------------
    @contextmanager
    def state_resident(self, write_back: bool, groups: Optional[list[FlatGroup]] = None) -> Iterator[None]:
        """The parameter shards, fp32 masters, gradient shards and optimizer states of ``groups``
        (default: all) in memory for the block (with NVMe offload they are in swap files
        otherwise); ``write_back``: they were modified (a load, an edit), so write them out
        afterwards, and drop their hpZ secondary partitions (which hold the old values). For
        checkpoints and edits: one group at a time keeps memory to one group's state."""
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
            try:
                yield
                if write_back and self.param_offload is not None:  # while the shards are in memory
                    self.param_offload.refresh_copies(groups)  # (a failed load keeps the files as they were)
            finally:
                if write_back:  # host copies and hpZ secondaries follow the shards, loaded in full or not
                    for group in groups:
                        group.shard_changed()
                        group.drop_secondary()

    def master_fragments(self) -> list[Tensor]:
        """This rank's fp32 master fragments (1-D), as the sharded optimizer holds them (those of
        groups frozen again included: they have no gradient)."""
        return [f for g in self.groups for f in g.fragments]

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

    @phased("zinf.after_step")
    def after_step(self, groups: Optional[Sequence[FlatGroup]] = None) -> None:
        """After ``optimizer.step()`` (called by the hook :meth:`shard_optimizer` installs, with the
        flat groups that optimizer steps: those holding a master fragment it was given): for
        ``groups``, cast the masters into the compute shards, mark the gradients consumed and drop
        the stale hpZ secondary partitions; then re-gather the persistent units that hold one of them.

        Other groups are left alone, so that several models or optimizers in one engine do not
        disturb each other: another optimizer's gradients keep accumulating across this step, as
        in plain torch, and frozen groups keep their secondary partitions (a step cannot change
        them; loads and edits drop them, :meth:`state_resident`). A group holding parameters of
        two optimizers is consumed by the step of either.

        Args:
            groups: The groups the optimizer that stepped holds, or ``None`` (after a load): every group.
        """
        self._settle(boundary=True)
        if self._shard_device != self.device:
            self.transfers.host_wait_h2d()  # host-tier shards are rewritten below
        stepped = self.groups if groups is None else groups
        for group in stepped:
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
        changed = {id(g) for g in stepped}
        self.states.gather_exact([u for u in self.units if u.persistent and any(id(g) in changed for g in u.groups)])

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
            with self.agreement.checked():
                self.states.gather_exact(units, read=True)
            yield
            if write_back:
                with self.state_resident(write_back=True):
                    for group in self.groups:
                        group.write_back()
        finally:
            self._gathered_depth -= 1
            for unit in units:
                unit.forward_depth -= 1
                self.states.maybe_release(unit)
            if self._gathered_depth == 0:  # an enclosing block still wants the exact values
                self.states.gather_exact([u for u in units if u.persistent])  # back to the compute dtype

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
                (the agreement check every gather here makes); nothing stays held.
        """
        unit.forward_depth += 1
        try:
            with self.agreement.checked():
                self.states.gather_exact([unit], read=True)
        except BaseException:
            unit.forward_depth -= 1
            raise

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
            self.states.maybe_release(unit)

    def end_unit_access(self, units: Collection[Unit]) -> None:
        """After a traversal of :meth:`hold_exact` calls: the persistent ones among ``units`` go back
        to their compute-dtype gather (collective, as the holds were)."""
        if self._gathered_depth == 0:  # inside gathered(): its exit does it
            self.states.gather_exact([u for u in units if u.persistent])

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
        previous = self.states.keep_budget
        self.states.keep_budget = budget
        whole = self._holds_whole_model(budget)
        if whole:
            self._mark_partitioned(False)
        try:
            yield
        finally:
            if whole:
                self._mark_partitioned(True)
            self.states.keep_budget = previous
            if previous == 0:
                self.states.release_kept()
                self.verify_ranks_agree()

    def _holds_whole_model(self, budget: int) -> bool:
        return budget >= sum(g.padded_numel * g.compute_dtype.itemsize for g in self.groups)

    @contextmanager
    def generation_phase(self, budget: int) -> Iterator[None]:
        """A generation phase inside a training step: RLHF's rollouts (``generate()`` of the
        actor, a reward model's forward, a reference forward under PEFT's ``disable_adapter()``),
        with ZeRO++'s behaviour for it (Wang et al., "ZeRO++", 2023, §4 and its RLHF generation
        results; DeepSpeed's hybrid engine and DeepSpeed-Chat switch the same way between
        generation and training). Use under ``torch.no_grad()``; every rank enters and leaves it
        at the same point. Inside it:

        - every outermost forward of a module of the model starts a trace pass of its own kind,
          ``("generation", qualified name of that module)`` (:meth:`Schedule.pass_per_outer_forward
          <lightning_zinf.engine.schedule.Schedule.pass_per_outer_forward>`), so each decode step
          replays one stable trace: after the first forward of each kind no gather is checked with
          the other ranks one by one (a control all-reduce each, across nodes), and no pass
          boundary checks either; the ranks' collectives are verified once, on exit;
        - parameters may be frozen and unfrozen for a while (PEFT's ``disable_adapter()`` sets the
          adapters' ``requires_grad`` off): flags are read at the next training pass after it;
        - units stay gathered within ``budget`` bytes as in :meth:`keep_gathered` (a budget below
          the whole model keeps ``transformers``' ``synced_gpus`` on, the whole model turns it off);
        - with qwZ, each flat group's shard is quantized at most once: the packed row of codes and
          scales made at its first quantized gather is kept (accounted as ``"secondary"``) and sent
          again by later gathers, until the phase ends or the shard changes (a step, a load, an
          edit). Groups stored as frozen codes are never quantized, and hpZ's secondary partitions
          keep re-gathers inside the node already. The rows sit on the compute device (about one
          byte per element of this rank's shards, outside ``budget``): with parameters offloaded
          to the host or NVMe that is a quarter of the fp32 shards' bytes brought to the device
          for the phase.

        On exit the kept units are released, the kept rows dropped, the ranks' collectives verified
        (one all-reduce) and, without ``auto_pass``, a pass of the kind begun before the phase
        (``"train"``) starts again, so the training forward and backward that follow replay their
        own trace: switching costs at most one gather more of each unit. A phase entered inside
        another is part of it.

        Args:
            budget: Most bytes of gathered parameters kept between forward passes (``0``: none).

        Raises:
            ValueError: ``budget`` is not a non-negative int.
            RuntimeError: on exit, the ranks' collectives in the phase differ (:meth:`verify_ranks_agree`).
        """
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise ValueError(f"generation_phase: budget must be a non-negative number of bytes (an int), got {budget!r}; "
                             "pass PrefetchConfig.inference_budget or 0.")
        if self._in_phase:
            yield
            return
        previous = self._pass_kind
        self._settle()
        # Every rank must enter: one that does not goes on to the agreed trace's gathers, which
        # only the watch can tell from a slow rank (a hang until the timeout otherwise).
        self.agreement.check_entry("entry into a generation phase, strategy.generation()")
        self._in_phase = True
        end_passes = self.schedule.pass_per_outer_forward(
            self.module, lambda name: self._begin_pass(("generation", name), check=False))
        for group in self.groups:
            group.keeps_qwz_row = True
        # The whole model kept: no synced_gpus, so ranks run different numbers of forward passes,
        # and a pass that leaves its kind's trace (a decode that skips a module only the prefill
        # runs) must not start a recording whose validation only some ranks would reach.
        self.tracer.rerecord = not self._holds_whole_model(budget)
        try:
            with self.keep_gathered(budget):  # verifies the ranks' collectives at its end
                try:
                    yield
                finally:
                    end_passes()
                    # Ranks may have run different numbers of decode passes: the last pass's trace is
                    # validated here, at the same point on every rank, before the check on exit.
                    self.tracer.end_pass()
        finally:
            self._in_phase = False
            self.tracer.rerecord = True
            for group in self.groups:
                group.keeps_qwz_row = False
                group.drop_qwz_row()  # after the release above settled the gathers that send it
        if previous is not None and not self._auto_pass:  # with auto_pass the next forward starts its pass
            self._begin_pass(previous, check=False)

    def release_all(self) -> None:
        """Wait for outstanding collectives and swaps, and release every non-persistent unit."""
        self._settle()
        for side in (self.param_offload, self.offload):
            if side is not None:
                side.settle_all()

    def remove_hooks(self) -> None:
        """Detach the engine from the model (the parameters stay partitioned)."""
        self.schedule.remove()
        for handle in self._state_dict_handles:
            handle.remove()
        self._state_dict_handles = []

    def _mark_partitioned(self, on: bool) -> None:
        # transformers' generate() reads FSDP2's marker to keep all ranks stepping until every
        # rank's sequences are done (synced_gpus): forward passes gather collectively here too.
        # Dynamo reads the pair FSDP2 sets: parameters keep their identity while their storage comes
        # and goes, so it takes them as graph inputs and guards nothing on them (with the marker
        # alone it refuses the module and runs it uncompiled).
        for submodule in self.module.modules():
            submodule._is_fsdp_managed_module = on  # type: ignore[assignment]
            submodule._fsdp_use_orig_params = on  # type: ignore[assignment]
