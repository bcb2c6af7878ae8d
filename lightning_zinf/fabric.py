"""``ZeroInfinityFabricStrategy``: the Lightning Fabric glue around :class:`~lightning_zinf.engine.ZeroEngine`.

The same engine and options as the Trainer's :class:`~lightning_zinf.ZeroInfinityStrategy`, mapped
onto Fabric's calls: ``fabric.init_module()`` builds on the meta device, ``fabric.setup`` (or
``setup_module`` then ``setup_optimizers``) partitions the model and re-points the optimizer at the
fp32 master shards, each forward of the model starts a trace pass, and ``fabric.save``/``fabric.load``
write and read the Trainer's sharded checkpoint format, so a checkpoint moves between the two.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from typing import Any, Callable, Optional, Union

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

from lightning_zinf.checkpoint import (is_sharded_checkpoint, load_full_state_dict, load_sharded, read_meta,
                                      save_sharded)
from lightning_zinf.comm.watch import RankWatch
from lightning_zinf.config import coerce_config
from lightning_zinf.engine import ZeroEngine, meta_parameters
from lightning_zinf.options import (RankLayout, ZeroOptions, all_reduce, barrier, broadcast, build_engine, finish_run,
                                    init_distributed, module_buffers, optimizer_hyperparameters, register_presets,
                                    restore_hyperparameters, start_watch)
from lightning_zinf.precision import policy_for, to_zero_fabric_precision

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
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision: As for any
            Fabric ``ParallelStrategy``; Fabric sets them.
        process_group_backend: ``"gloo"``, ``"nccl"``...; default from the device (gloo on CPU).
        timeout: How long a collective may wait for other ranks before failing.
        **options: The fields of :class:`~lightning_zinf.options.ZeroOptions`, documented on
            :class:`~lightning_zinf.ZeroInfinityStrategy` (``block_classes``, ``prefetch``,
            ``offload``, ``tiling``, ``zero_pp``, ``mixed_precision``, ``activation_checkpointing``,
            ``load_full_weights``, ``load_prefix``, ``exclude_frozen_parameters``).

    Raises:
        ValueError: an unknown option (the message suggests the closest valid name) or an invalid value.
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
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=precision)
        try:
            self.options = coerce_config(ZeroOptions, options)
        except ValueError as error:  # say it of this class, whose keyword arguments they are
            raise ValueError(str(error).replace(ZeroOptions.__name__, type(self).__name__, 1)) from None
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._engine: Optional[ZeroEngine] = None
        self._watch: Optional[RankWatch] = None
        self._backward_sync_control = _EveryMicroBatch()

    # --- topology and set-up ----------------------------------------------------------------------
    @property
    def engine(self) -> ZeroEngine:
        """The engine partitioning the model (available after ``fabric.setup``/``setup_module``)."""
        if self._engine is None:
            raise RuntimeError("The zero_infinity engine exists only after `fabric.setup(model)` or "
                               "`fabric.setup_module(model)`.")
        return self._engine

    @property
    @override
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    @override
    def precision(self, precision: Optional[Precision]) -> None:
        self._precision = None if precision is None else to_zero_fabric_precision(precision)

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            return  # torchrun, SLURM, or the test harness started the processes
        if _IS_INTERACTIVE:
            # A notebook cannot re-run sys.argv: fork, as Fabric's own notebook strategies do.
            self._launcher = _MultiProcessingLauncher(self, start_method="fork")
        else:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._set_world_ranks()
        assert self.cluster_environment is not None
        init_distributed(self.cluster_environment, self.root_device, self._process_group_backend, self._timeout)
        # Fabric has no exception hook: the watch reports the script's uncaught exceptions itself.
        if self._watch is None:
            self._watch = start_watch(self.global_rank, self.world_size, self._timeout, lambda: self._engine)

    # --- model and optimizers ---------------------------------------------------------------------
    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        """Parameters created inside go to the meta device, to be initialised unit by unit when the
        model is set up (``empty_init=False``: built for real on this rank's device, whole, and
        partitioned at setup from rank 0's values)."""
        if empty_init is False:
            return super().module_init_context(empty_init=False)
        stack = ExitStack()
        stack.enter_context(self.precision.module_init_context())
        stack.enter_context(meta_parameters())
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
        optimizer built over the model's meta-device parameters (inside ``fabric.init_module()``)
        is first pointed at the parameters that replaced them, matched by name."""
        before = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
        module = self.setup_module(module)
        after = dict(module.named_parameters(remove_duplicate=False))
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [after[before[id(p)]] if id(p) in before else p for p in group["params"]]
        return module, [self.setup_optimizer(optimizer) for optimizer in optimizers], scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Partition ``module`` across the ranks (a collective) and return it, hooked.

        Raises:
            ValueError: a second model (one model per strategy instance).
        """
        engine = getattr(module, "_zinf_engine", None)
        if self._engine is not None and engine is not self._engine:
            raise ValueError(
                "The zero_infinity Fabric strategy partitions one model; a second model was set up. Put the "
                "models in one nn.Module and set that up, or use one Fabric per model."
            )
        if engine is None:
            engine = build_engine(
                module, self.options, device=self.root_device, ranks_per_node=self.num_processes,
                precision=policy_for(self.precision), loss_scaling=getattr(self.precision, "scaler", None) is not None,
                timeout=self._timeout, auto_pass=True,
            )
            if self.options.offload.activations:
                _offload_activations_in_training_forwards(module, engine)
            if self._watch is not None:
                engine.on_departure = self._watch.note_departure
        self._engine = engine
        return module

    @override
    def module_to_device(self, module: nn.Module) -> None:
        """Nothing to move: the engine places shards and buffers on ``root_device`` at setup."""

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Re-point ``optimizer`` (in place) at this rank's fp32 master shards.

        Raises:
            RuntimeError: the model has not been set up yet.
        """
        if self._engine is None:
            raise RuntimeError(
                "Set up the model before its optimizer: `fabric.setup(model, optimizer)`, or "
                "`model = fabric.setup_module(model)` and then `fabric.setup_optimizers(optimizer)`."
            )
        return self._engine.shard_optimizer(optimizer)

    @contextlib.contextmanager
    def gathered_parameters(self, write_back: bool = False) -> Any:
        """Every parameter at its full value inside the block (collective: call on all ranks).

        Args:
            write_back: Keep edits made inside the block (every rank must make the same edits).
        """
        with self.engine.gathered(write_back=write_back):
            yield

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
            ValueError: ``norm_type`` other than 2.
            RuntimeError: the norm is not finite and ``error_if_nonfinite`` (as torch's).
        """
        if float(norm_type) != 2.0:
            raise ValueError(f"zero_infinity clips by the L2 norm only; got norm_type={norm_type}. Use norm_type=2.")
        self.precision.unscale_gradients(optimizer)
        norm = self.engine.clip_grad_norm_(float(max_norm))
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
            ValueError: with NVMe optimizer offload, where the gradients are on disk until the step.
        """
        if self.engine.offload is not None and self.engine.offload.nvme:
            raise ValueError("Clipping by value needs the gradients in memory; with OffloadConfig(optimizer='nvme') "
                             "use fabric.clip_gradients(max_norm=...), or optimizer='cpu'.")
        super().clip_gradients_value(module, optimizer, clip_val)

    # --- collectives ------------------------------------------------------------------------------
    @override
    def all_reduce(self, tensor: Tensor, group: Optional[Any] = None,
                   reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Tensor:
        return all_reduce(tensor, group, reduce_op)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return broadcast(obj, src)

    # --- checkpoints ------------------------------------------------------------------------------
    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Union[nn.Module, Optimizer, Any]],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """Write a sharded checkpoint directory at ``path`` (collective), in the Trainer's format:
        the model's buffers as ``state_dict`` and its optimizers' hyper-parameters as
        ``optimizer_states`` in ``meta.pt`` with the other entries of ``state`` (objects with a
        ``state_dict()`` saved as that), and the parameters and optimizer states in one shard
        file per rank (:func:`~lightning_zinf.checkpoint.save_sharded`).

        Raises:
            TypeError: ``storage_options`` or ``filter`` (a sharded checkpoint holds every parameter;
                ``exclude_frozen_parameters=True`` leaves the frozen ones out).
            ValueError: ``state`` holds no model set up by this strategy, or another module.
        """
        if storage_options is not None:
            raise TypeError("zero_infinity checkpoints do not use a CheckpointIO: storage_options is not supported.")
        if filter:
            raise TypeError("fabric.save(filter=...) is not supported by zero_infinity: the checkpoint is sharded and "
                            "holds every parameter (exclude_frozen_parameters=True leaves frozen ones out).")
        module_key, optimizer_keys = self._split_state(state)
        optimizers = [state[k] for k in optimizer_keys]
        meta: dict[str, Any] = {"state_dict": module_buffers(state[module_key]),
                                "optimizer_states": [optimizer_hyperparameters(o) for o in optimizers],
                                "pytorch-lightning_version": lightning.__version__}  # the Trainer checks it
        for key, value in state.items():
            if key != module_key and key not in optimizer_keys:
                meta[key] = value.state_dict() if isinstance(value, _Stateful) else value
        save_sharded(self.engine, optimizers, self.broadcast(path), meta,
                     exclude_frozen=self.options.exclude_frozen_parameters)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Optional[Union[nn.Module, Optimizer, dict[str, Union[nn.Module, Optimizer, Any]]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Restore the objects in ``state`` from a checkpoint written by :meth:`save_checkpoint` or by
        the Trainer's strategy (at this or another world size), in place, and return the entries
        not restored (``epoch``, ``global_step``... of a Trainer checkpoint).

        ``weights_only``: ``None`` (the default) or ``True`` reads ``meta.pt`` without running code
        from it (:func:`~lightning_zinf.checkpoint.read_meta`); ``False`` trusts the file.

        ``state`` may also be the model alone (``fabric.load_raw``): from a sharded checkpoint its
        weights are loaded; from a full state-dict file (``torch.save``, safetensors, a Hugging Face
        folder) each rank reads its shards' part (:func:`~lightning_zinf.load_full_state_dict`).

        Raises:
            ValueError: no ``state`` (a sharded checkpoint cannot be returned whole: consolidate it
                with ``zinf-consolidate``), or ``state`` without this strategy's model.
            KeyError: ``strict`` and an entry of ``state`` is not in the checkpoint (an optimizer
                included: a checkpoint saved without it loads with ``strict=False``, weights only).
            CheckpointError: not a checkpoint, a missing or corrupt shard file, another model's, or a
                ``meta.pt`` naming code the safe load refuses.
        """
        if not state:
            raise ValueError(
                "zero_infinity checkpoints are sharded: pass the objects to restore, e.g. "
                "fabric.load(path, {'model': model, 'optimizer': optimizer}). To read the full weights in one "
                "process, consolidate the checkpoint first (zinf-consolidate)."
            )
        path = self.broadcast(path)
        if isinstance(state, nn.Module):
            self._split_state({"model": state})
            if not is_sharded_checkpoint(path):
                load_full_state_dict(self.engine, path, strict=strict)  # safetensors, or torch.load(weights_only=True)
                return {}
            state = {"model": state}
        if isinstance(state, Optimizer):
            raise TypeError("The optimizer state is in the sharded checkpoint with the model's: "
                            "fabric.load(path, {'model': model, 'optimizer': optimizer}).")
        module_key, optimizer_keys = self._split_state(state)
        optimizers = [state[k] for k in optimizer_keys]
        saved = len(read_meta(path, weights_only).get("optimizer_states", [])) if optimizers else 0
        if saved < len(optimizers):
            if strict:
                raise KeyError(
                    f"The requested state contains optimizer(s) {optimizer_keys} but the checkpoint {path} holds the "
                    f"state of {saved}: it was saved without them. Pass strict=False to load the model's weights alone."
                )
            optimizers = []
        meta = load_sharded(self.engine, optimizers, path, load_optimizer=bool(optimizers), weights_only=weights_only)
        state[module_key].load_state_dict(meta.pop("state_dict", {}), strict=False)  # buffers
        restore_hyperparameters(optimizers, meta.pop("optimizer_states", []))
        meta.pop("zinf")
        meta.pop("pytorch-lightning_version", None)
        rest = [k for k in state if k != module_key and k not in optimizer_keys]
        _validate_keys_for_strict_loading(rest, meta.keys(), strict=strict)
        for key in rest:
            if key not in meta:
                continue
            if isinstance(state[key], _Stateful):
                state[key].load_state_dict(meta.pop(key))
            else:
                state[key] = meta.pop(key)
        return meta

    def _split_state(self, state: dict[str, Any]) -> tuple[str, list[str]]:
        """The key of the partitioned model in ``state``, and the keys of its optimizers."""
        modules = [k for k, v in state.items() if isinstance(v, nn.Module)]
        ours = [k for k in modules if getattr(state[k], "_zinf_engine", None) is self.engine]
        if len(ours) != 1 or len(modules) != 1:
            raise ValueError(
                f"The checkpoint state must hold exactly one model, the one set up with this strategy; it holds "
                f"{len(modules)} module(s) ({modules}), {len(ours)} of them set up with it."
            )
        optimizer_keys = [k for k, v in state.items() if isinstance(v, Optimizer)]
        if any(all(state[k] is not o for o in self.engine.optimizers) for k in optimizer_keys):
            raise ValueError("Every optimizer in the checkpoint state must have been set up with this strategy "
                             "(fabric.setup(model, optimizer) or fabric.setup_optimizers(optimizer)).")
        return ours[0], optimizer_keys

    # --- teardown / registration ------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        finish_run(self._engine, self._watch)
        self._watch = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``"zero_infinity"`` and its presets for Fabric (the names the Trainer has);
        safe to call again."""
        register_presets(strategy_registry, cls)


class _EveryMicroBatch(_BackwardSyncControl):
    """``fabric.no_backward_sync``: gradients are reduce-scattered at every micro-batch and summed
    into fp32 shards (exact accumulation at 1/W of the memory); there is nothing to skip."""

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
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
