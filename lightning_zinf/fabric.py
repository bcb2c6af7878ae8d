"""``ZeroInfinityFabricStrategy``: the Lightning Fabric glue around :class:`~lightning_zinf.engine.ZeroEngine`.

The same engine and options as the Trainer's :class:`~lightning_zinf.ZeroInfinityStrategy`, mapped
onto Fabric's calls: ``fabric.init_module()`` builds on the meta device, ``fabric.setup`` (or
``setup_module`` then ``setup_optimizers``) partitions the model and re-points the optimizer at the
fp32 master shards, each forward of the model starts a trace pass, and ``fabric.save``/``fabric.load``
write and read the Trainer's sharded checkpoint format, so a checkpoint moves between the two.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from typing import Any, Callable, NoReturn, Optional, Union

import lightning
import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _Sharded, _validate_keys_for_strict_loading
from lightning.fabric.utilities.distributed import ReduceOp
from lightning.fabric.utilities.imports import _IS_INTERACTIVE
from lightning.fabric.utilities.types import _PATH, _Stateful
from torch import Tensor, nn
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zinf.checkpoint import (MODEL_KEY, MODELS_DIR_KEY, MODELS_KEY, OPTIMIZER_KEYS, USER_STATE_KEY,
                                      CheckpointError, is_sharded_checkpoint, load_full_state_dict, load_sharded,
                                      model_folders, read_meta, require_checkpoint, save_sharded, save_sharded_models,
                                      user_entries)
from lightning_zinf.checkpoint.raw import PendingLoads
from lightning_zinf.comm.watch import RankWatch
from lightning_zinf.config import coerce_config
from lightning_zinf.engine import ZeroEngine, meta_parameters
from lightning_zinf.engine.state_dict import state_dict_options
from lightning_zinf.checkpoint.full import (full_optimizer_state_dict, load_full_checkpoint,
                                            load_full_optimizer_state_dict, load_trainable_checkpoint,
                                            save_full_checkpoint, trainable_only, trainable_state_dict)
from lightning_zinf.checkpoint_entries import module_buffers, optimizer_hyperparameters, restore_hyperparameters
from lightning_zinf.distributed import RankLayout, all_reduce, barrier, broadcast, init_distributed
from lightning_zinf.engine_setup import build_engine, memory_plan
from lightning_zinf.planning import MemoryPlan
from lightning_zinf.failures import finish_run, start_watch
from lightning_zinf.options import ZeroOptions, register_presets
from lightning_zinf.preemption_exit import mark_script_launcher, preemption_exit_status, wait_for_launched
from lightning_zinf.unsupported import refuse_checkpoint_io
from lightning_zinf.precision import policy_for, refuse_clipping_by_value, to_zero_fabric_precision
from lightning_zinf.preemption import Preemption
from lightning_zinf.repoint import Successors

__all__ = ["ZeroInfinityFabricStrategy"]


class ZeroInfinityFabricStrategy(RankLayout, ParallelStrategy, _Sharded):
    """ZeRO stage 3 data parallelism for Lightning Fabric (Rajbhandari et al., ZeRO, SC'20 §5;
    ZeRO-Infinity, SC'21 §5-6), on the same engine as the Trainer's strategy.

    Use ``Fabric(strategy="zero_infinity")`` (or a preset: ``"zero_infinity_offload"``,
    ``"zero_infinity_nvme"``, ``"zero_pp"``, ``"zero_pp_nvme"``) after ``import lightning_zinf``, or
    pass an instance to set options. Build the model inside ``fabric.init_module()`` so that it is
    created on the meta device and initialised unit by unit as it is partitioned, never whole on one
    rank; then ``fabric.setup(model, optimizer)``, or ``fabric.setup_module(model)`` followed by
    building the optimizer and ``fabric.setup_optimizers(optimizer)``. One model per strategy.

    Every forward of the set-up model starts a trace pass (a training pass when the model is in
    training mode with gradients enabled). ``fabric.backward`` reduce-scatters gradients as
    autograd produces them; ``fabric.clip_gradients(max_norm=...)`` clips by the global norm over
    every rank's shards; ``fabric.no_backward_sync`` is accepted and changes nothing (gradients are
    reduce-scattered into fp32 shards at every micro-batch, as in DeepSpeed's ZeRO-3: skipping that
    would need the full unsharded gradients in memory). ``fabric.save``/``fabric.load`` write and
    read a sharded checkpoint directory, the Trainer's format.

    Args:
        accelerator: As for any Fabric ``ParallelStrategy``; Fabric sets it.
        parallel_devices: As for any Fabric ``ParallelStrategy``; Fabric sets it.
        cluster_environment: As for any Fabric ``ParallelStrategy``; Fabric sets it.
        precision: As for any Fabric ``ParallelStrategy``; Fabric sets it.
        checkpoint_io: Must be ``None``: checkpoints do not go through a ``CheckpointIO``.
        process_group_backend: ``"gloo"``, ``"nccl"``...; default from the device (gloo on CPU).
        timeout: How long a collective may wait for other ranks before failing.
        **options: The fields of :class:`~lightning_zinf.options.ZeroOptions`, documented on
            :class:`~lightning_zinf.ZeroInfinityStrategy` (``block_classes``, ``prefetch``,
            ``offload``, ``tiling``, ``zero_pp``, ``mixed_precision``, ``activation_checkpointing``,
            ``load_full_weights``, ``load_prefix``, ``exclude_frozen_parameters``, ``state_dict_type``,
            ``preemption``: see :meth:`preempted` for the loop's side).

    Raises:
        ValueError: an unknown option (the message suggests the closest valid name) or an invalid value.
        NotImplementedError: a ``checkpoint_io`` (or a ``CheckpointIO`` in ``Fabric(plugins=...)``), as
            Lightning's Fabric ``FSDPStrategy`` raises: it would never be called.
    """

    strategy_name = "zero_infinity"

    def __init__(
        self,
        *,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: timedelta = default_pg_timeout,
        **options: Any,
    ) -> None:
        refuse_checkpoint_io(checkpoint_io, type(self).__name__)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=precision)
        try:
            self.options = coerce_config(ZeroOptions, options)
        except ValueError as error:  # say it of this class, whose keyword arguments they are
            raise ValueError(str(error).replace(ZeroOptions.__name__, type(self).__name__, 1)) from None
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._engines: list[ZeroEngine] = []  # one per model set up, in order
        self._successors = Successors()  # what partitioning put in place of the models' parameters
        self._pending = PendingLoads()  # fabric.load_raw before setup
        self._watch: Optional[RankWatch] = None
        self._preemption: Optional[Preemption] = None
        self._backward_sync_control = _EveryMicroBatch(self)

    # --- topology and set-up ----------------------------------------------------------------------
    @property
    def engine(self) -> ZeroEngine:
        """The engine partitioning the model (available after ``fabric.setup``/``setup_module``).

        Raises:
            RuntimeError: no model is set up yet, or several are (then use :meth:`engine_of`).
        """
        if not self._engines:
            raise RuntimeError("The zero_infinity engine exists only after `fabric.setup(model)` or "
                               "`fabric.setup_module(model)`.")
        if len(self._engines) > 1:
            raise RuntimeError(f"{len(self._engines)} models are set up with this strategy, each partitioned by its own "
                               "engine: use `fabric.strategy.engine_of(model)`.")
        return self._engines[0]

    @property
    def engines(self) -> list[ZeroEngine]:
        """The engines of the models set up so far, in the order they were set up."""
        return list(self._engines)

    def memory_plan(self, module: nn.Module) -> MemoryPlan:
        """The placement ``memory_budget`` gives ``module`` (real, or built in ``fabric.init_module()``)
        on this strategy's devices, without setting anything up:
        ``print(fabric.strategy.memory_plan(model).describe())``, after ``fabric.launch()``.

        Raises:
            ValueError: no ``memory_budget`` was given.
            BudgetError: no placement fits (the message names the smallest budget that would).
        """
        if self.options.memory_budget is None:
            raise ValueError("memory_plan() needs memory_budget: ZeroInfinityFabricStrategy(memory_budget='40GiB').")
        plan = memory_plan(module, self.options, device=self.root_device, precision=policy_for(self.precision),
                           loss_scaling=getattr(self.precision, "scaler", None) is not None,
                           world=self.num_nodes * self.num_processes, ranks_per_node=self.num_processes)
        assert plan is not None
        return plan

    def engine_of(self, obj: Union[nn.Module, Optimizer]) -> ZeroEngine:
        """The engine partitioning the set-up model ``obj``, or the one whose model ``obj``, an
        optimizer set up by this strategy, steps.

        Raises:
            TypeError: ``obj`` was not set up by this strategy (a submodule, another Fabric's model,
                an optimizer that was not set up).
        """
        if isinstance(obj, nn.Module):
            engine = getattr(obj, "_zinf_engine", None)
            if any(engine is e for e in self._engines):
                return engine
        else:
            optimizer = getattr(obj, "_optimizer", obj)  # a Fabric or Lightning wrapper's
            for engine in self._engines:
                if any(optimizer is o for o in engine.optimizers):
                    return engine
        raise TypeError(f"This {type(obj).__name__} was not set up by this {type(self).__name__}: pass the model "
                        "returned by `fabric.setup`/`fabric.setup_module`, or an optimizer set up with it.")

    @property
    @override
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    @override
    def precision(self, precision: Optional[Precision]) -> None:
        self._precision = None if precision is None else to_zero_fabric_precision(precision)

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        """There is none: ``fabric.save``/``fabric.load`` write and read checkpoints through the
        strategy itself (every rank its own shards).

        Raises:
            NotImplementedError: always, as Lightning's Fabric ``FSDPStrategy`` raises.
        """
        raise NotImplementedError(f"The `{type(self).__name__}` does not use the `CheckpointIO` plugin interface: "
                                  "fabric.save and fabric.load write and read its checkpoints themselves.")

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: Optional[CheckpointIO]) -> None:
        """Fabric sets a plugin given in ``Fabric(plugins=[...])`` here, at its construction.

        Raises:
            NotImplementedError: any plugin, as Lightning's Fabric ``FSDPStrategy`` raises: it would
                never be called (:func:`~lightning_zinf.unsupported.refuse_checkpoint_io`).
        """
        refuse_checkpoint_io(io, type(self).__name__)
        self._checkpoint_io = io

    def _check_set_up(self, module: nn.Module, call: str) -> None:
        """Raise ``TypeError`` unless ``module`` is the model this strategy set up (as Lightning's
        FSDP strategy requires its wrapped root module in ``clip_gradients_norm`` and
        ``no_backward_sync``): the call acts on the engine's shards, which are that model's alone."""
        if not any(getattr(module, "_zinf_engine", None) is e for e in self._engines):
            raise TypeError(
                f"{call} is only possible with the module set up by this {type(self).__name__} "
                f"(`model = fabric.setup(model, ...)` or `fabric.setup_module(model)`), not one of its submodules or "
                f"another model. Got: {type(module).__name__}."
            )

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if _IS_INTERACTIVE and not self.cluster_environment.creates_processes_externally:
            # A notebook cannot re-run sys.argv: fork, as Fabric's own notebook strategies do.
            self._launcher = _MultiProcessingLauncher(self, start_method="fork")
        else:
            # Also where torchrun, SLURM, the launching rank or the test harness started this
            # process: the launcher starts nothing then, but gives it its share of the CPU threads,
            # as Fabric's DDP does (ZeroInfinityStrategy._configure_launcher).
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
            mark_script_launcher(self._launcher)  # they exit 0 after a preemption save (exit_preempted)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._set_world_ranks()
        assert self.cluster_environment is not None
        init_distributed(self.cluster_environment, self.root_device, self._process_group_backend, self._timeout)
        # Fabric has no exception hook: the watch reports the script's uncaught exceptions itself.
        if self._watch is None:
            self._watch = start_watch(self.global_rank, self.world_size, self._timeout, lambda: self._engines)
        if self._preemption is None:
            self._preemption = Preemption(self.options.preemption)
            self._preemption.connect()  # collective: the agreement's gloo group
            if self._watch is not None:  # every rank started its watch before that collective
                self._watch.learn_pids()
        self._preemption.install()

    # --- preemption -------------------------------------------------------------------------------
    @property
    def preemption(self) -> Preemption:
        """This rank's :class:`~lightning_zinf.preemption.Preemption` (after ``fabric.launch()``).

        Raises:
            RuntimeError: before the environment is set up.
        """
        if self._preemption is None:
            raise RuntimeError("The zero_infinity strategy handles preemption signals once Fabric has launched.")
        return self._preemption

    def preempted(self) -> bool:
        """Whether any rank received one of ``PreemptionConfig.signals`` (SIGTERM, SIGUSR1 by
        default) since the start: collective, so call it on every rank at the same point of the loop,
        e.g. after each optimizer step (one all-reduce of one integer). Every rank gets the same
        answer. Then save and exit::

            if fabric.strategy.preempted():
                fabric.save(path, state)
                fabric.strategy.exit_preempted()

        Without the check the signals are recorded and ignored (``PreemptionConfig(enabled=False)``
        leaves them their previous handling: the process ends). Once it has returned ``True``, the
        signals are ignored until the process exits (:meth:`Preemption.ignore_signals`).
        """
        if self.preemption.agree() is None:
            return False
        self.preemption.ignore_signals()
        return True

    def exit_preempted(self) -> NoReturn:
        """End this process after :meth:`preempted` returned ``True`` (and the checkpoint was saved):
        raise ``SystemExit`` with ``PreemptionConfig.exit_code`` (128 + the signal's number by
        default), or 0 in a process Lightning's launcher started (a rank > 0 of ``python
        train.py``); the launching process first waits for those to end.

        Raises:
            SystemExit: always.
            RuntimeError: the ranks have not agreed to stop (:meth:`preempted` was not ``True``).
        """
        status = preemption_exit_status(self.preemption)
        wait_for_launched(self.launcher, min(self._timeout.total_seconds(), 60.0))
        raise SystemExit(status)

    # --- model and optimizers ---------------------------------------------------------------------
    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        """Parameters created inside go to the meta device, and get at setup, unit by unit, the
        values eager construction on this rank's device gives them (rank 0's:
        :func:`~lightning_zinf.meta_parameters`); ``empty_init=True`` skips ``torch.nn.init``
        calls inside, as Lightning's other strategies do (values loaded or set later).
        ``empty_init=False``: built for real on this rank's device, whole, and partitioned at setup
        from rank 0's values."""
        if empty_init is False:
            return super().module_init_context(empty_init=False)
        stack = ExitStack()
        stack.enter_context(self.root_device)
        stack.enter_context(self.precision.module_init_context())
        stack.enter_context(meta_parameters(empty_init=bool(empty_init)))
        return stack

    @override
    def module_sharded_context(self) -> AbstractContextManager:
        """Parameters created inside go to the meta device (see :meth:`module_init_context`)."""
        return meta_parameters()

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Optional[Any] = None
    ) -> tuple[nn.Module, list[Optimizer], Optional[Any]]:
        """``fabric.setup(model, optimizer)``: partition the model, then re-point the optimizers. An
        optimizer built before the model was partitioned is first pointed at the parameters that
        replaced the ones it holds (:class:`~lightning_zinf.repoint.Successors`): real ones for the
        meta-device parameters of ``fabric.init_module()``, and a tiled layer's tiles for its
        ``weight`` and ``bias`` (``tiling=``)."""
        module = self.setup_module(module)
        for optimizer in optimizers:
            self._successors.repoint(optimizer)
        return module, [self._shard(self.engine_of(module), optimizer) for optimizer in optimizers], scheduler

    def _shard(self, engine: ZeroEngine, optimizer: Optimizer) -> Optimizer:
        """``engine.shard_optimizer(optimizer)``, then the plain state dict ``fabric.load_raw`` gave
        it before, if any, sliced into its shards' state."""
        engine.shard_optimizer(optimizer)
        waiting = self._pending.take_optimizer(optimizer)
        if waiting is not None:
            load_full_optimizer_state_dict(engine, optimizer, dict(waiting))
        return optimizer

    def _is_set_up(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer`` was set up by this strategy (:meth:`engine_of` knows it)."""
        try:
            self.engine_of(optimizer)
        except TypeError:
            return False
        return True

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Partition ``module`` across the ranks (a collective) and return it, hooked. Each model set
        up gets an engine of its own (its units, its optimizers, its frozen weights stored with
        ``zero_pp.frozen_bits``): a student and its frozen teacher, a GAN's two networks, RLHF's
        actor, reference and reward models. Every rank must set up the same models in the same order.
        """
        engine = getattr(module, "_zinf_engine", None)
        if engine is None:
            before = Successors.names_of(module)
            engine = build_engine(
                module, self.options, device=self.root_device, ranks_per_node=self.num_processes,
                precision=policy_for(self.precision), loss_scaling=getattr(self.precision, "scaler", None) is not None,
                timeout=self._timeout, auto_pass=True,
            )
            self._successors.record(module, before)
            if self.options.offload.activations:
                _offload_activations_in_training_forwards(module, engine)
        if not any(engine is e for e in self._engines):
            self._engines.append(engine)
        waiting = self._pending.take_module(module)  # fabric.load_raw before this setup
        if waiting is not None:
            path, strict, weights_only = waiting
            self.load_checkpoint(path, module, strict=strict, weights_only=weights_only)
        return module

    @override
    def module_to_device(self, module: nn.Module) -> None:
        """Nothing to move: the engine places shards and buffers on ``root_device`` at setup."""

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Re-point ``optimizer`` (in place) at this rank's fp32 master shards, those of the set-up
        model whose parameters it holds. One built before ``fabric.setup_module`` over the model's
        real parameters is first pointed at those that replaced them (a tiled layer's tiles:
        :class:`~lightning_zinf.repoint.Successors`).

        Raises:
            RuntimeError: the model has not been set up yet.
        """
        self._successors.repoint(optimizer)
        first = next((p for group in optimizer.param_groups for p in group["params"]), None)
        for engine in self._engines:
            if any(first is p for p in engine.module.parameters()):
                return self._shard(engine, optimizer)
        if len(self._engines) == 1:
            return self._shard(self._engines[0], optimizer)  # which names what is wrong with it
        raise RuntimeError(
            "Set up the model before its optimizer: `fabric.setup(model, optimizer)`, or "
            "`model = fabric.setup_module(model)` and then `fabric.setup_optimizers(optimizer)`."
        )

    @contextlib.contextmanager
    def gathered_parameters(self, write_back: bool = False, module: Optional[nn.Module] = None) -> Any:
        """Every parameter at its full value inside the block (collective: call on all ranks).

        Args:
            write_back: Keep edits made inside the block (every rank must make the same edits).
            module: Only this set-up model's (default: every model set up with this strategy).
        """
        engines = [self.engine_of(module)] if module is not None else self._engines
        with ExitStack() as stack:
            for engine in engines:
                stack.enter_context(engine.gathered(write_back=write_back))
            yield

    def generation(self, module: nn.Module) -> AbstractContextManager:
        """A generation phase of the set-up model ``module`` (RLHF rollouts between training
        steps): its engine's :meth:`ZeroEngine.generation_phase
        <lightning_zinf.ZeroEngine.generation_phase>` within ``PrefetchConfig.inference_budget``
        (ZeRO++, Wang et al. 2023, §4; DeepSpeed's hybrid engine). Every rank must enter it; use
        it under ``torch.no_grad()``.

        Raises:
            TypeError: ``module`` was not set up by this strategy (:meth:`engine_of`).
        """
        return self.engine_of(module).generation_phase(self.options.prefetch.inference_budget)

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: Union[float, int],
        norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip the gradient shards by the L2 norm over every rank's shards (what
        ``torch.nn.utils.clip_grad_norm_`` gives on the unsharded model); returns that norm, a 0-d
        fp32 tensor, before clipping.

        Raises:
            TypeError: ``module`` is not the model set up with this strategy (as Lightning's FSDP
                strategy raises for a module it did not wrap).
            ValueError: ``norm_type`` other than 2.
            RuntimeError: the norm is not finite and ``error_if_nonfinite`` (as torch's).
        """
        self._check_set_up(module, "Gradient clipping (fabric.clip_gradients)")
        if float(norm_type) != 2.0:
            raise ValueError(f"zero_infinity clips by the L2 norm only; got norm_type={norm_type}. Use norm_type=2.")
        self.precision.unscale_gradients(optimizer)
        norm = self.engine_of(module).clip_grad_norm_(float(max_norm))
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(
                f"The total norm of the gradients is {norm.item()} (non-finite); pass error_if_nonfinite=False "
                "to fabric.clip_gradients to clip anyway."
            )
        return norm

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: Union[float, int]) -> None:
        """Clamp every gradient element to ``[-clip_val, clip_val]`` (elementwise, so exact on shards).

        Raises:
            NotSupportedError: with NVMe optimizer offload, where the gradients are on disk until the
                step (a ``NotImplementedError``, as Lightning Fabric's DeepSpeed strategy raises for
                clipping it cannot do, and a ``ValueError``).
        """
        self._check_set_up(module, "Gradient clipping (fabric.clip_gradients)")
        refuse_clipping_by_value(self.engine_of(module), fabric=True)
        super().clip_gradients_value(module, optimizer, clip_val)

    # --- collectives ------------------------------------------------------------------------------
    # Each first meets the other ranks at every engine: ranks that ran different modules serve
    # each other until all are here, so the collective pairs with the same one on every rank.
    @override
    def all_reduce(self, tensor: Tensor, group: Optional[Any] = None,
                   reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Tensor:
        self._before_collective()
        return all_reduce(tensor, group, reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        self._before_collective()
        return super().all_gather(tensor, group, sync_grads)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._before_collective()
        barrier(self._watch)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._before_collective()
        return broadcast(obj, src)

    def _before_collective(self) -> None:
        for engine in self._engines:
            engine.meet("collective")

    # --- checkpoints ------------------------------------------------------------------------------
    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Union[nn.Module, Optimizer, Any]],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """Write a checkpoint of ``state`` at ``path`` (collective).

        ``state_dict_type="sharded"`` (default): a sharded checkpoint directory in the Trainer's
        format: the model's buffers as ``state_dict`` and its optimizers' hyper-parameters as
        ``optimizer_states`` in ``meta.pt`` with the other entries of ``state`` (objects with a
        ``state_dict()`` saved as that), and the parameters and optimizer states in one shard file
        per rank (:func:`~lightning_zinf.checkpoint.save_sharded`). With several models set up, each
        model's checkpoint goes in a subfolder named by its key, the rest in ``meta.pt``
        (:func:`~lightning_zinf.checkpoint.save_sharded_models`).
        ``state_dict_type="full"``: one file from rank 0, what ``fabric.save`` writes under DDP: each
        model's full state dict and each optimizer's plain state dict under their keys, gathered one
        unit at a time (with ``exclude_frozen_parameters=True``, a model's trainable parameters and
        buffers only, and no frozen unit gathered); ``filter`` (per key of ``state``, a ``(name, value) -> keep`` function)
        keeps part of them (e.g. LoRA adapters only).

        Raises:
            TypeError: ``storage_options`` (as Lightning's FSDP strategy).
            NotImplementedError: ``filter`` with ``state_dict_type="sharded"`` (as Lightning's FSDP
                strategy: a sharded checkpoint holds every parameter).
            ValueError: ``state`` holds no model set up by this strategy, or another module.
        """
        if storage_options is not None:
            raise TypeError("zero_infinity checkpoints do not use a CheckpointIO: storage_options is not supported.")
        if filter and self.options.state_dict_type == "sharded":
            raise NotImplementedError(
                "fabric.save(filter=...) needs ZeroInfinityFabricStrategy(state_dict_type='full'): a sharded checkpoint "
                "holds every parameter (exclude_frozen_parameters=True leaves the frozen ones out)."
            )
        module_keys, optimizer_keys = self._split_state(state)
        path = self.broadcast(path)
        if self.options.state_dict_type == "full":
            full: dict[str, Any] = {}
            for key, value in state.items():
                if key in module_keys and self.options.exclude_frozen_parameters:
                    # Only the trainable flat groups are gathered: the frozen base never is.
                    value = {**module_buffers(value), **trainable_state_dict(self.engine_of(value), rank0_only=True)}
                elif key in module_keys:
                    with state_dict_options(value, rank0_only=True):
                        value = value.state_dict()
                elif key in optimizer_keys:
                    value = full_optimizer_state_dict(self.engine_of(value), value, rank0_only=True)
                elif isinstance(value, _Stateful):
                    value = value.state_dict()
                keep = (filter or {}).get(key)
                full[key] = {k: v for k, v in value.items() if keep(k, v)} if keep and isinstance(value, dict) else value
            save_full_checkpoint(full, path, writer=self.global_rank == 0, broadcast=self.broadcast)
            return
        # The entries that are neither a model nor an optimizer, kept apart from the checkpoint's own
        # ("state_dict", "optimizer_states", "zinf"...), so that any name is the user's to take.
        user: dict[str, Any] = {key: value.state_dict() if isinstance(value, _Stateful) else value
                                for key, value in state.items() if key not in module_keys and key not in optimizer_keys}
        meta = {USER_STATE_KEY: user}
        per_model = {}
        for key in module_keys:
            engine = self.engine_of(state[key])
            optimizers = {k: state[k] for k in optimizer_keys if self.engine_of(state[k]) is engine}
            per_model[key] = (engine, optimizers, {
                "state_dict": module_buffers(state[key]),
                "optimizer_states": [optimizer_hyperparameters(o) for o in optimizers.values()],
                "pytorch-lightning_version": lightning.__version__})  # the Trainer checks it
        if len(module_keys) == 1:
            engine, optimizers, own = per_model[module_keys[0]]
            # Which key each optimizer state was saved under: a load takes them by key, not position.
            own[OPTIMIZER_KEYS] = list(optimizers)
            own[MODEL_KEY] = module_keys[0]  # for zinf-consolidate's fabric.save layout
            save_sharded(engine, list(optimizers.values()), path, {**own, **meta},
                         exclude_frozen=self.options.exclude_frozen_parameters)
        else:
            save_sharded_models(per_model, path, meta, exclude_frozen=self.options.exclude_frozen_parameters)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Optional[Union[nn.Module, Optimizer, dict[str, Union[nn.Module, Optimizer, Any]]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Restore the objects in ``state`` from a checkpoint, in place, and return the entries not
        restored (``epoch``, ``global_step``... of a Trainer checkpoint). The checkpoint is a sharded
        directory (:meth:`save_checkpoint`'s or the Trainer strategy's, at this or another world
        size) or one file: a full checkpoint (``state_dict_type="full"``, or what ``fabric.save``
        writes under DDP or on one device), whose model entries load through each model's own
        ``load_state_dict`` (each rank keeps its shards' part, one unit at a time) and whose plain
        optimizer states are sliced into the sharded optimizers.

        ``weights_only``: ``None`` (the default) or ``True`` reads ``meta.pt`` or the file without
        running code from it (:func:`~lightning_zinf.checkpoint.read_meta`); ``False`` trusts it.

        ``state`` may also be a model alone (``fabric.load_raw``): a sharded checkpoint's weights,
        a ``torch.save`` file of a state dict (through ``model.load_state_dict(..., strict)``, so the
        model's own key remapping applies and torch reports what did not match), or a
        ``.safetensors`` file or Hugging Face folder (each rank reads its shards' byte ranges:
        :func:`~lightning_zinf.load_full_state_dict`). Or an optimizer alone, from a file of its
        plain state dict (each rank keeps its slices). A model or optimizer not set up yet takes a
        file's state dict as under DDP (:mod:`lightning_zinf.checkpoint.raw`: a model built inside
        ``fabric.init_module()`` is checked at once and filled when it is set up).

        Raises:
            ValueError: no ``state`` (a sharded checkpoint cannot be returned whole: consolidate it
                with ``zinf-consolidate``), ``state`` with a module another strategy set up, or an
                optimizer state dict whose param groups differ from the optimizer's.
            NotImplementedError: ``state`` is an optimizer alone and the checkpoint is sharded.
            KeyError: ``strict`` and an entry of ``state`` is not in the checkpoint (an optimizer
                included: a checkpoint saved without it loads with ``strict=False``, weights only).
            RuntimeError: ``strict`` and the model's keys do not match a file's (torch's message).
            CheckpointNotFoundError: on every rank, nothing at ``path``, a folder that is not a
                checkpoint, or a part of one (its ``save-<id>/`` folder, a shard file: the message
                names the checkpoint folder to pass instead). A ``FileNotFoundError``, as DDP and
                DeepSpeed raise, and a ``CheckpointError``.
            CheckpointError: a missing or corrupt shard file, another model's checkpoint, a sharded
                checkpoint given to a model not set up, or a ``meta.pt`` naming code the safe load refuses.
        """
        if not state:
            raise ValueError(
                "zero_infinity checkpoints are sharded: pass the objects to restore, e.g. "
                "fabric.load(path, {'model': model, 'optimizer': optimizer}). To read the full weights in one "
                "process, consolidate the checkpoint first (zinf-consolidate)."
            )
        path = self.broadcast(path)
        require_checkpoint(path, folders=isinstance(state, nn.Module))
        if isinstance(state, nn.Module) and not hasattr(state, "_zinf_engine"):
            self._pending.load_module(path, state, strict, weights_only)  # before setup, as under DDP
            return {}
        if isinstance(state, Optimizer) and not self._is_set_up(state):
            self._pending.load_optimizer(path, state, weights_only)
            return {}
        if isinstance(state, Optimizer) and not is_sharded_checkpoint(path):
            load_full_optimizer_state_dict(self.engine_of(state), state, load_full_checkpoint(path, weights_only))
            return {}
        if isinstance(state, nn.Module):
            self._split_state({"model": state})
            if Path(path).suffix == ".safetensors" or (Path(path).is_dir() and not is_sharded_checkpoint(path)):
                load_full_state_dict(self.engine_of(state), path, strict=strict)  # byte ranges of safetensors / HF
                return {}
            if not is_sharded_checkpoint(path):
                state.load_state_dict(load_full_checkpoint(path, weights_only), strict=strict)
                return {}
            state = {"model": state}
        if isinstance(state, Optimizer):
            # Lightning's FSDP strategy raises NotImplementedError for a lone optimizer too.
            raise NotImplementedError("Loading an optimizer alone from a sharded checkpoint is not supported: its "
                                      "state is in the checkpoint with the model's; "
                                      "fabric.load(path, {'model': model, 'optimizer': optimizer}).")
        module_keys, optimizer_keys = self._split_state(state)
        if not is_sharded_checkpoint(path):
            return self._load_full(path, state, module_keys, optimizer_keys, strict, weights_only)
        top = read_meta(path, weights_only)
        if MODELS_KEY in top:
            folders = model_folders(path, top)
            saved_models: dict[str, list[str]] = top.pop(MODELS_KEY)
            top.pop(MODELS_DIR_KEY, None)
        elif len(module_keys) == 1:
            # A Trainer's checkpoint names no optimizer: its states are taken in order.
            saved = top.get(OPTIMIZER_KEYS, optimizer_keys[: len(top.get("optimizer_states", []))])
            saved_models = {module_keys[0]: saved}
            folders = {module_keys[0]: Path(path)}
        else:
            raise CheckpointError(f"{path} holds one model, but {len(module_keys)} were asked for: {module_keys}.")
        missing = [k for k in module_keys if k not in saved_models]
        if missing:
            raise KeyError(f"The checkpoint {path} holds no model {missing}; it holds {list(saved_models)}.")
        meta = top
        for key in module_keys:
            mine = [k for k in optimizer_keys if self.engine_of(state[k]) is self.engine_of(state[key])]
            absent = [k for k in mine if k not in saved_models[key]]
            if absent and strict:
                raise KeyError(
                    f"The requested state contains optimizer(s) {absent} of model '{key}' but the checkpoint {path} "
                    f"holds the state of {len(saved_models[key])} ({saved_models[key]}): it was saved without them. "
                    "Pass strict=False to load the model's weights alone."
                )
            # Each requested optimizer takes the state saved under its key (at that index).
            optimizers = {saved_models[key].index(k): state[k] for k in mine if k in saved_models[key]}
            loaded = load_sharded(self.engine_of(state[key]), optimizers, folders[key],
                                  load_optimizer=bool(optimizers), weights_only=weights_only)
            loaded.pop(OPTIMIZER_KEYS, None)
            state[key].load_state_dict(loaded.pop("state_dict", {}), strict=False)  # buffers
            hyper = loaded.pop("optimizer_states", [])
            for index, optimizer in optimizers.items():
                restore_hyperparameters([optimizer], hyper[index:index + 1])
            if folders[key] == Path(path):
                meta = loaded
        meta = user_entries(meta)
        rest = [k for k in state if k not in module_keys and k not in optimizer_keys]
        _validate_keys_for_strict_loading(rest, meta.keys(), strict=strict)
        for key in rest:
            if key not in meta:
                continue
            if isinstance(state[key], _Stateful):
                state[key].load_state_dict(meta.pop(key))
            else:
                state[key] = meta.pop(key)
        return meta

    def _load_full(self, path: _PATH, state: dict[str, Any], module_keys: list[str], optimizer_keys: list[str],
                   strict: bool, weights_only: Optional[bool]) -> dict[str, Any]:
        """``fabric.load`` of a one-file checkpoint: as Fabric's DDP loads it, but partitioned."""
        checkpoint = load_full_checkpoint(path, weights_only)
        _validate_keys_for_strict_loading(list(state), checkpoint.keys(), strict=strict)
        for key in state:
            if key not in checkpoint:
                continue
            if key in module_keys:
                saved = checkpoint.pop(key)
                if self.options.exclude_frozen_parameters and trainable_only(self.engine_of(state[key]).module, saved):
                    load_trainable_checkpoint(self.engine_of(state[key]), saved, strict)
                else:
                    state[key].load_state_dict(saved, strict=strict)
            elif key in optimizer_keys:
                load_full_optimizer_state_dict(self.engine_of(state[key]), state[key], checkpoint.pop(key))
            elif isinstance(state[key], _Stateful):
                state[key].load_state_dict(checkpoint.pop(key))
            else:
                state[key] = checkpoint.pop(key)
        return checkpoint

    def _split_state(self, state: dict[str, Any]) -> tuple[list[str], list[str]]:
        """The keys of the partitioned models in ``state``, and of their optimizers.

        Raises:
            ValueError: ``state`` holds no model, or a module or optimizer this strategy did not set up.
        """
        modules = [k for k, v in state.items() if isinstance(v, nn.Module)]
        foreign = [k for k in modules if not any(getattr(state[k], "_zinf_engine", None) is e for e in self._engines)]
        if not modules or foreign:
            raise ValueError(
                "The checkpoint state must hold the models set up with this strategy, and no other module; it holds "
                f"{len(modules)} module(s) ({modules}), {len(foreign)} of them not set up with it ({foreign})."
            )
        optimizer_keys = [k for k, v in state.items() if isinstance(v, Optimizer)]
        for key in optimizer_keys:
            try:
                self.engine_of(state[key])
            except TypeError:
                raise ValueError("Every optimizer in the checkpoint state must have been set up with this strategy "
                                 "(fabric.setup(model, optimizer) or fabric.setup_optimizers(optimizer)).") from None
        return modules, optimizer_keys

    # --- teardown / registration ------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        finish_run(self._engines, self._watch)
        self._watch = None
        if self._preemption is not None and self._preemption.stopping is None:
            self._preemption.uninstall()
        # The base class's teardown, but for the CheckpointIO it would tear down: there is none.
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision.teardown()
        self.accelerator.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``"zero_infinity"`` and its presets for Fabric (the names the Trainer has);
        safe to call again."""
        register_presets(strategy_registry, cls)


class _EveryMicroBatch(_BackwardSyncControl):
    """``fabric.no_backward_sync``: gradients are reduce-scattered at every micro-batch and summed
    into fp32 shards (exact accumulation at 1/W of the memory); there is nothing to skip."""

    def __init__(self, strategy: ZeroInfinityFabricStrategy) -> None:
        self._strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        """A context that changes nothing.

        Raises:
            TypeError: ``enabled`` and ``module`` is not the model set up with this strategy (as
                Lightning's FSDP strategy raises for a module it did not wrap).
        """
        if enabled:
            self._strategy._check_set_up(module, "Blocking backward sync (fabric.no_backward_sync)")
        return nullcontext()


def _offload_activations_in_training_forwards(module: nn.Module, engine: ZeroEngine) -> None:
    """Keep the activations saved by each training forward of ``module`` in host memory
    (``OffloadConfig(activations=True)``; the Trainer's strategy does it around ``training_step``)."""
    scope = ExitStack()

    def enter(mod: nn.Module, args: Any) -> None:
        if mod.training and torch.is_grad_enabled():
            scope.enter_context(engine.offload_activations())

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(lambda *_: scope.close(), always_call=True)
