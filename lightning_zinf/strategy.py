"""``ZeroInfinityStrategy``: the Lightning glue around :class:`~lightning_zinf.engine.ZeroEngine`.

Everything about sharding lives in the engine; this module only maps Lightning's lifecycle onto it:
``configure_model`` runs with parameters on the meta device, ``setup`` partitions the model and
moves the user's optimizer onto the fp32 master shards (whose step hook does the engine's post-step
work), and each ``*_step`` starts a trace pass.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Generator, Optional, Sequence

import torch
import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import ReduceOp
from lightning.fabric.utilities.imports import _IS_INTERACTIVE
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zinf.checkpoint import load_sharded, save_sharded
from lightning_zinf.config import MixedPrecisionConfig, OffloadConfig, PrefetchConfig, TilingConfig, ZeroPPConfig
from lightning_zinf.engine import ZeroEngine, meta_parameters
from lightning_zinf.launcher import NotebookLauncher
from lightning_zinf.comm.watch import RankWatch
from lightning_zinf.options import (RankLayout, ZeroOptions, all_reduce, barrier, broadcast, build_engine, finish_run,
                                    init_distributed, module_buffers, optimizer_hyperparameters, register_presets,
                                    report_failure, restore_hyperparameters, start_watch)
from lightning_zinf.precision import policy_for, to_zero_precision

__all__ = ["ZeroInfinityStrategy"]


def _weights_only_passed_to_trainer() -> Optional[bool]:
    """The ``weights_only`` given to the ``trainer.fit``/``validate``/``test``/``predict`` call under
    way, or ``None``. Lightning (2.6) passes it to ``Strategy.load_checkpoint`` only for strategies
    that restore before setup; for one that restores after (this one, like DeepSpeed's)
    ``Trainer._run`` calls ``_restore_modules_and_callbacks(ckpt_path)`` without it, so it is read
    from that call's frame. Not found (another Lightning), it stays ``None``: the safe load."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is pl.Trainer._run.__code__:
            return frame.f_locals.get("weights_only")
        frame = frame.f_back
    return None


class ZeroInfinityStrategy(RankLayout, ParallelStrategy):
    """ZeRO stage 3 data parallelism for Lightning: parameters, gradients and optimizer states are
    partitioned across all ranks (Rajbhandari et al., ZeRO, SC'20 §5; ZeRO-Infinity, SC'21 §5-6).

    Use ``Trainer(strategy="zero_infinity")`` after ``import lightning_zinf``, or pass an instance to
    set options. Build the model in ``LightningModule.configure_model`` so it is partitioned unit by
    unit as it is built and never exists whole on one rank (its modules' ``reset_parameters()``
    initialise it); a model built in ``__init__`` is partitioned at setup from rank 0's values.
    The optimizer from ``configure_optimizers`` (any elementwise torch optimizer) and its LR
    schedulers work unchanged; the strategy steps it on fp32 master shards.

    Outside forward/backward, parameters are empty tensors; read or edit full values inside
    :meth:`gathered_parameters`.

    Args:
        block_classes: Module classes (or their names, e.g. ``["Block"]``) whose whole subtree is
            gathered as one unit; typically the transformer block. Default: every module's own
            parameters are a unit.
        prefetch: A :class:`~lightning_zinf.PrefetchConfig` (or a mapping of its fields).
        offload: An :class:`~lightning_zinf.OffloadConfig` (or a mapping of its fields): where the
            optimizer's fp32 state lives (device, CPU or NVMe).
        tiling: A :class:`~lightning_zinf.TilingConfig` (or a mapping of its fields): split every
            ``nn.Linear`` with more weight elements than its threshold into tiles gathered one at a
            time (ZeRO-Infinity §5.1.3), at setup, before the model is partitioned. Default: none.
        zero_pp: A :class:`~lightning_zinf.ZeroPPConfig` (or a mapping of its fields): ZeRO++'s hpZ,
            and the ranks per node (default: the devices per node the Trainer was given).
        mixed_precision: A :class:`~lightning_zinf.MixedPrecisionConfig` (or a mapping of its
            fields): the dtype units are gathered and computed in and the dtype of gradient
            reduce-scatters. Default: derived from ``Trainer(precision=...)`` (``"bf16-mixed"``
            gathers and computes in bf16 and reduce-scatters in fp32; see the README).
        activation_checkpointing: Module classes (or class names, e.g. ``["Block"]``) whose forward
            runs under torch's non-reentrant activation checkpointing: backward recomputes them,
            re-gathering their units. Lightning's ``FSDPStrategy(activation_checkpointing_policy=...)``.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: As for
            any Lightning ``ParallelStrategy``; the Trainer sets them.
        process_group_backend: ``"gloo"``, ``"nccl"``...; default from the device (gloo on CPU).
        timeout: How long a collective may wait for other ranks before failing (a rank that died or
            diverged then ends the run with an error instead of a hang).
        load_full_weights: A checkpoint to start from, loaded partitioned when the model is set up
            (Lightning's DeepSpeed strategy has the option of this name): a Hugging Face model
            folder, a ``.safetensors`` or ``.bin`` file (:func:`~lightning_zinf.load_full_state_dict`).
            Each rank reads only its shards' bytes; parameters built in ``configure_model`` that it
            holds are not initialised first. Parameters it does not hold (PEFT adapters) keep their
            initialisation, and the log says which; entries that match no parameter are an error.
        load_prefix: Where the checkpoint's model sits in the LightningModule (``"model."``); by
            default the prefix under which the most checkpoint keys name a parameter (a PEFT-wrapped
            layer's ``base_layer`` counts as the layer).
        exclude_frozen_parameters: Leave frozen parameters out of the checkpoints (DeepSpeed's option
            of this name): a LoRA run saves its adapters and their optimizer state only. Resuming is
            exact when the model is built with the same frozen values (``load_full_weights``).

    Raises:
        ValueError: an invalid option value (the message names the field and what is allowed).
    """

    strategy_name = "zero_infinity"

    def __init__(
        self,
        *,
        block_classes: Sequence[str | type] = (),
        prefetch: Optional[PrefetchConfig] = None,
        offload: Optional[OffloadConfig] = None,
        tiling: Optional[TilingConfig] = None,
        zero_pp: Optional[ZeroPPConfig] = None,
        mixed_precision: Optional[MixedPrecisionConfig] = None,
        activation_checkpointing: Sequence[str | type] = (),
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: timedelta = default_pg_timeout,
        load_full_weights: Optional[str | os.PathLike] = None,
        load_prefix: Optional[str] = None,
        exclude_frozen_parameters: bool = False,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.options = ZeroOptions(
            block_classes=block_classes, prefetch=prefetch, offload=offload, tiling=tiling, zero_pp=zero_pp,
            mixed_precision=mixed_precision, activation_checkpointing=activation_checkpointing,
            load_full_weights=load_full_weights, load_prefix=load_prefix,
            exclude_frozen_parameters=exclude_frozen_parameters,
        )
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._engine: Optional[ZeroEngine] = None
        self._watch: Optional[RankWatch] = None

    # --- topology --------------------------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        """True: Lightning then gives each rank its own slice of the data (``DistributedSampler``)."""
        return True

    # --- compiled LightningModule -----------------------------------------------------------------
    @property
    def _lightning_module(self) -> Optional["pl.LightningModule"]:
        return self._zinf_lightning_module

    @_lightning_module.setter
    def _lightning_module(self, module: Optional["pl.LightningModule"]) -> None:
        """Accept ``torch.compile(lit_module)`` (Lightning's documented pattern), as DDP does.

        ``Trainer.fit``/``validate``/``test``/``predict`` unwrap the compiled module (its
        ``forward`` and ``*_step`` methods stay compiled), assign it here, then refuse it unless the
        strategy is one of Lightning's own, named in a fixed list. The engine's hooks are opaque to
        Dynamo, so the compiled steps run here as under DDP: the module is taken with Lightning's
        record of the compilation cleared, which that check reads (``to_uncompiled`` then no longer
        applies to it). Compiled steps break their graphs at each unit's module, where the engine
        gathers; compiling the blocks in ``configure_model`` keeps whole graphs (see the README).
        """
        if getattr(module, "_compiler_ctx", None) is not None:
            module._compiler_ctx = None  # type: ignore[union-attr]
        self._zinf_lightning_module = module

    @property
    def engine(self) -> ZeroEngine:
        """The engine partitioning the LightningModule (available after setup)."""
        if self._engine is None:
            raise RuntimeError("The zero_infinity engine exists only after the Trainer has set up the model.")
        return self._engine

    @property
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else to_zero_precision(Precision())

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        self._precision_plugin = None if precision_plugin is None else to_zero_precision(precision_plugin)

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            return
        if _IS_INTERACTIVE:
            # Re-running sys.argv is impossible in a notebook; fork is Lightning's interactive launcher.
            self._launcher = NotebookLauncher(self)
        else:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        init_distributed(self.cluster_environment, self.root_device, self._process_group_backend, self._timeout)
        if self._watch is None:
            self._watch = start_watch(self.global_rank, self.world_size, self._timeout, lambda: self._engine)

    # --- model ------------------------------------------------------------------------------------
    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Parameters created inside (``configure_model``) go to the meta device until setup."""
        with meta_parameters():
            yield

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        """Partition the LightningModule (or reuse its engine), then shard the optimizers."""
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        # A model already partitioned (fit then test, or a second Trainer) keeps its engine.
        self._engine = getattr(self.model, "_zinf_engine", None)
        if self._engine is None:
            self._engine = build_engine(
                self.model, self.options, device=self.root_device, ranks_per_node=self.num_processes,
                precision=policy_for(self.precision_plugin),
                loss_scaling=getattr(self.precision_plugin, "scaler", None) is not None,
                timeout=self._timeout, auto_pass=False,
            )
        self.precision_plugin.engine = self._engine  # type: ignore[attr-defined]
        if self._watch is not None:
            self._engine.on_departure = self._watch.note_departure
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    @override
    def model_to_device(self) -> None:
        """Nothing to move: the engine placed shards and buffers on ``root_device`` at setup."""

    @override
    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        """Build the user's optimizers, then re-point them at this rank's fp32 master shards."""
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        self.optimizers = [self.engine.shard_optimizer(optimizer) for optimizer in self.optimizers]

    @contextmanager
    def gathered_parameters(self, write_back: bool = False) -> Generator[None, None, None]:
        """Every parameter at its full value inside the block (collective: call on all ranks).

        Args:
            write_back: Keep edits made inside the block (every rank must make the same edits).
        """
        with self.engine.gathered(write_back=write_back):
            yield

    # --- steps ------------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Start a train trace pass, then run the LightningModule's step (with its saved
        activations in CPU memory under ``OffloadConfig(activations=True)``)."""
        self.engine.begin_pass("train")
        if not self.options.offload.activations:
            return super().training_step(*args, **kwargs)
        with self.engine.offload_activations():
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Start a validation trace pass, then run the LightningModule's step (units kept gathered
        across its forward passes within ``PrefetchConfig.inference_budget``)."""
        self.engine.begin_pass("validate")
        with self.engine.keep_gathered(self.options.prefetch.inference_budget):
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """Start a test trace pass, then run the LightningModule's step (as validation)."""
        self.engine.begin_pass("test")
        with self.engine.keep_gathered(self.options.prefetch.inference_budget):
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Start a predict trace pass, then run the LightningModule's step: a ``generate()`` in
        it gathers each unit once while the units fit ``PrefetchConfig.inference_budget``."""
        self.engine.begin_pass("predict")
        with self.engine.keep_gathered(self.options.prefetch.inference_budget):
            return super().predict_step(*args, **kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradients are reduce-scattered every micro-batch and accumulated in fp32 shards, which
        costs no memory for full gradients; there is no synchronisation to skip."""
        with nullcontext():
            yield

    # --- collectives ------------------------------------------------------------------------------
    @override
    def barrier(self, name: Optional[str] = None) -> None:
        barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return broadcast(obj, src)

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Optional[Any] = None, reduce_op: Optional[ReduceOp | str] = "mean"
    ) -> Tensor | Any:
        return all_reduce(tensor, group, reduce_op)

    # --- checkpoints ------------------------------------------------------------------------------
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Load after setup: the checkpoint fills the shards and optimizer states the setup created."""
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        """Optimizer tensors are in the shard files; :meth:`load_checkpoint` restores them."""
        return False

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's buffers (replicated on every rank); parameters live in the shard files."""
        assert self.lightning_module is not None
        return module_buffers(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Hyper-parameters per param group; per-element state goes to the shard files."""
        return optimizer_hyperparameters(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None) -> None:
        """Write a sharded checkpoint directory at ``filepath`` (see :mod:`lightning_zinf.checkpoint`)."""
        if storage_options is not None:
            raise TypeError("zero_infinity checkpoints do not use a CheckpointIO: storage_options is not supported.")
        with_optimizer = "optimizer_states" in checkpoint
        save_sharded(self.engine, self.optimizers if with_optimizer else [], self.broadcast(filepath), checkpoint,
                     exclude_frozen=self.options.exclude_frozen_parameters)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load shards (at this or another world size) and return Lightning's state for its loops.

        ``weights_only`` is what ``trainer.fit(ckpt_path=..., weights_only=...)`` passes: ``None``
        (the default) or ``True`` reads ``meta.pt`` without running code from it (torch's
        weights-only unpickler and :data:`~lightning_zinf.checkpoint.CHECKPOINT_GLOBALS`), ``False``
        unpickles it fully, for a file the user trusts.

        Raises:
            CheckpointError: not a checkpoint, a missing or corrupt shard file, another model's, or a
                ``meta.pt`` naming code the safe load refuses (on every rank: each reads it).
        """
        assert self.lightning_module is not None
        if weights_only is None:
            weights_only = _weights_only_passed_to_trainer()
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        meta = load_sharded(self.engine, self.optimizers, self.broadcast(checkpoint_path), load_optimizer=fitting,
                            weights_only=weights_only)
        restore_hyperparameters(self.optimizers, meta.get("optimizer_states", []) if fitting else [])
        return meta

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        """Restore buffers; the parameters were loaded into the shards by :meth:`load_checkpoint`."""
        assert self.lightning_module is not None
        self.lightning_module.load_state_dict(checkpoint.get("state_dict", {}), strict=False)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Nothing: :meth:`load_checkpoint` restored the optimizers."""

    # --- failures, teardown, registration -----------------------------------------------------------
    @override
    def on_exception(self, exception: BaseException) -> None:
        """Tell the other ranks (they end within a few seconds with this message, rather than at the
        backend's timeout with its own); if another rank failed first, this rank's error is the
        consequence, and that rank's message is added to it (:func:`~lightning_zinf.options.report_failure`)."""
        report_failure(self._watch, exception)

    @override
    def teardown(self) -> None:
        # Unlike the base class, keep the model where it is: its state lives in the shards, and a
        # following validate/test/predict reuses the engine.
        finish_run(self._engine, self._watch)
        self._watch = None
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``"zero_infinity"`` and the presets ``"zero_infinity_offload"`` (parameters and
        optimizer state in CPU memory), ``"zero_infinity_nvme"`` (both on NVMe, under
        ``tempfile.gettempdir()``), ``"zero_pp"`` (ZeRO++: hpZ, qwZ, qgZ) and ``"zero_pp_nvme"``
        (ZeRO++ and NVMe); safe to call again (re-importing in a notebook)."""
        register_presets(strategy_registry, cls)
