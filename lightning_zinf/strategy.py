"""``ZeroInfinityStrategy``: the Lightning glue around :class:`~lightning_zinf.engine.ZeroEngine`.

Everything about sharding lives in the engine; this module only maps Lightning's lifecycle onto it:
``configure_model`` runs with parameters on the meta device, ``setup`` partitions the model and
moves the user's optimizer onto the fp32 master shards (whose step hook does the engine's post-step
work), and each ``*_step`` starts a trace pass.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Generator, Optional, Sequence

import torch
import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    ReduceOp,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.imports import _IS_INTERACTIVE
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch import Tensor
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zinf.checkpoint import (CheckpointError, checkpoint_keys, load_full_state_dict, load_sharded,
                                      matching_prefix, provided_parameters, save_sharded)
from lightning_zinf.config import (
    MixedPrecisionConfig,
    OffloadConfig,
    PrefetchConfig,
    TilingConfig,
    ZeroPPConfig,
    coerce_config,
)
from lightning_zinf.engine import ZeroEngine, meta_parameters
from lightning_zinf.launcher import NotebookLauncher
from lightning_zinf.precision import policy_for, to_zero_precision
from lightning_zinf.tiling import tile_views

__all__ = ["ZeroInfinityStrategy"]


class ZeroInfinityStrategy(ParallelStrategy):
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
        if isinstance(block_classes, (str, type)):
            block_classes = [block_classes]
        self.block_classes = tuple(block_classes)
        self.prefetch = coerce_config(PrefetchConfig, prefetch)
        self.offload = coerce_config(OffloadConfig, offload)
        self.tiling = None if tiling is None else coerce_config(TilingConfig, tiling)
        self.zero_pp = coerce_config(ZeroPPConfig, zero_pp)
        self.mixed_precision = None if mixed_precision is None else coerce_config(MixedPrecisionConfig, mixed_precision)
        if isinstance(activation_checkpointing, (str, type)):
            activation_checkpointing = [activation_checkpointing]
        self.activation_checkpointing = tuple(activation_checkpointing)
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.load_full_weights = load_full_weights
        self.load_prefix = load_prefix
        self.exclude_frozen_parameters = exclude_frozen_parameters
        self._engine: Optional[ZeroEngine] = None
        self.num_nodes = 1

    # --- topology ---------------------------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        """True: Lightning then gives each rank its own slice of the data (``DistributedSampler``)."""
        return True

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

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
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, backend, **kwargs)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

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
            weights, prefix, preloaded = self.load_full_weights, self.load_prefix, []
            if weights is not None:
                keys = checkpoint_keys(weights)  # headers only; the load reads the values
                prefix = prefix if prefix is not None else matching_prefix(self.model, keys)
                preloaded = provided_parameters(self.model, keys, prefix)
            self._engine = ZeroEngine(
                self.model,
                block_classes=self.block_classes,
                prefetch=self.prefetch,
                offload=self.offload,
                device=self.root_device,
                auto_pass=False,
                tiling=self.tiling,
                # Lightning numbers ranks node by node, with this many processes on each.
                zero_pp=dataclasses.replace(self.zero_pp, ranks_per_node=self.zero_pp.ranks_per_node or self.num_processes),
                mixed_precision=self.mixed_precision or policy_for(self.precision_plugin),
                activation_checkpointing=self.activation_checkpointing,
                timeout=self._timeout,
                preloaded=preloaded,
            )
            if weights is not None:
                self._load_full_weights(weights, prefix, preloaded)
        if getattr(self.precision_plugin, "scaler", None) is not None and self.offload.optimizer == "nvme":
            raise ValueError(
                "precision='16-mixed' (fp16 loss scaling) does not work with OffloadConfig(optimizer='nvme'): the "
                "gradients are on disk between backward and the optimizer step, so the scaler cannot unscale them "
                "or check them for inf/NaN. Use precision='bf16-mixed' (no scaler), or optimizer='cpu'."
            )
        self.precision_plugin.engine = self._engine  # type: ignore[attr-defined]
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

    def _load_full_weights(self, weights: str | os.PathLike, prefix: str, preloaded: list[str]) -> None:
        unexpected = load_full_state_dict(self._engine, weights, prefix=prefix, strict=False)
        if unexpected:
            raise CheckpointError(
                f"load_full_weights={str(weights)!r}: {len(unexpected)} of its entries match no parameter or buffer "
                f"of the model under load_prefix={prefix!r}: {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}. "
                "Check that it is this model's checkpoint, and pass load_prefix= where the model sits in the "
                "LightningModule (e.g. 'model.')."
            )
        loaded = set(preloaded)
        fresh = [n for n, _ in self.model.named_parameters() if n not in loaded]
        rank_zero_info(
            f"zero_infinity: loaded {len(loaded)} parameters from {weights} (prefix {prefix!r}); "
            f"{len(fresh)} are not in it and keep their initialisation"
            + (f": {fresh[:10]}{' ...' if len(fresh) > 10 else ''}" if fresh else "")
        )

    # --- steps ------------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Start a train trace pass, then run the LightningModule's step (with its saved
        activations in CPU memory under ``OffloadConfig(activations=True)``)."""
        self.engine.begin_pass("train")
        if not self.offload.activations:
            return super().training_step(*args, **kwargs)
        with self.engine.offload_activations():
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Start a validation trace pass, then run the LightningModule's step (units kept gathered
        across its forward passes within ``PrefetchConfig.inference_budget``)."""
        self.engine.begin_pass("validate")
        with self.engine.keep_gathered(self.prefetch.inference_budget):
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """Start a test trace pass, then run the LightningModule's step (as validation)."""
        self.engine.begin_pass("test")
        with self.engine.keep_gathered(self.prefetch.inference_budget):
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Start a predict trace pass, then run the LightningModule's step: a ``generate()`` in
        it gathers each unit once while the units fit ``PrefetchConfig.inference_budget``."""
        self.engine.begin_pass("predict")
        with self.engine.keep_gathered(self.prefetch.inference_budget):
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
        if _distributed_is_initialized():
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Optional[Any] = None, reduce_op: Optional[ReduceOp | str] = "mean"
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

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
        params = {name for name, _ in self.lightning_module.named_parameters(remove_duplicate=False)}
        params.update(view.name for view in tile_views(self.lightning_module).values())  # a TiledLinear's "weight"
        return {k: v for k, v in self.lightning_module.state_dict().items() if k not in params}

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Hyper-parameters per param group; per-element state goes to the shard files."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap a LightningOptimizer
        return {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None) -> None:
        """Write a sharded checkpoint directory at ``filepath`` (see :mod:`lightning_zinf.checkpoint`)."""
        if storage_options is not None:
            raise TypeError("zero_infinity checkpoints do not use a CheckpointIO: storage_options is not supported.")
        with_optimizer = "optimizer_states" in checkpoint
        save_sharded(self.engine, self.optimizers if with_optimizer else [], self.broadcast(filepath), checkpoint,
                     exclude_frozen=self.exclude_frozen_parameters)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load shards (at this or another world size) and return Lightning's state for its loops.

        Raises:
            CheckpointError: not a checkpoint, a missing or corrupt shard file, or another model's.
        """
        assert self.lightning_module is not None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        meta = load_sharded(self.engine, self.optimizers, self.broadcast(checkpoint_path), load_optimizer=fitting)
        for optimizer, saved in zip(self.optimizers, meta.get("optimizer_states", []) if fitting else []):
            for group, hyper in zip(optimizer.param_groups, saved["param_groups"]):
                group.update(hyper)
        return meta

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        """Restore buffers; the parameters were loaded into the shards by :meth:`load_checkpoint`."""
        assert self.lightning_module is not None
        self.lightning_module.load_state_dict(checkpoint.get("state_dict", {}), strict=False)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Nothing: :meth:`load_checkpoint` restored the optimizers."""

    # --- teardown / registration ------------------------------------------------------------------
    @override
    def teardown(self) -> None:
        # Unlike the base class, keep the model where it is: its state lives in the shards, and a
        # following validate/test/predict reuses the engine.
        if self._engine is not None:
            self._engine.release_all()
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
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="ZeRO-3 partitioning of parameters, gradients and optimizer states (lightning_zinf)",
            override=True,
        )
        strategy_registry.register(
            "zero_infinity_offload",
            cls,
            description="ZeRO-3 with parameters and optimizer state offloaded to CPU memory (lightning_zinf)",
            override=True,
            offload=OffloadConfig(param="cpu", optimizer="cpu"),
        )
        strategy_registry.register(
            "zero_infinity_nvme",
            cls,
            description="ZeRO-Infinity: parameters and optimizer state on NVMe, in the system's temporary folder "
            "(lightning_zinf)",
            override=True,
            offload=OffloadConfig(param="nvme", optimizer="nvme", nvme_path=tempfile.gettempdir()),
        )
        strategy_registry.register(
            "zero_pp",
            cls,
            description="ZeRO++: hpZ, qwZ and qgZ on top of ZeRO-3 (lightning_zinf)",
            override=True,
            zero_pp=ZeroPPConfig(hpz=True, qwz=True, qgz=True),
        )
        strategy_registry.register(
            "zero_pp_nvme",
            cls,
            description="ZeRO++ (hpZ, qwZ, qgZ) with parameters and optimizer state on NVMe, in the system's "
            "temporary folder (lightning_zinf)",
            override=True,
            zero_pp=ZeroPPConfig(hpz=True, qwz=True, qgz=True),
            offload=OffloadConfig(param="nvme", optimizer="nvme", nvme_path=tempfile.gettempdir()),
        )
