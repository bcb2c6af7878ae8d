"""``ZeroInfinityStrategy``: the Lightning glue around :class:`~lightning_zinf.engine.ZeroEngine`.

Everything about sharding lives in the engine; this module only maps Lightning's lifecycle onto it:
``configure_model`` runs with parameters on the meta device, ``setup`` partitions the model and
moves the user's optimizer onto the fp32 master shards (whose step hook does the engine's post-step
work), and each ``*_step`` starts a trace pass.
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import ExitStack, contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Generator, Mapping, Optional, Sequence

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
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.distributed.constants import default_pg_timeout
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zinf.checkpoint import (FORMAT, OptimizerCountError, is_sharded_checkpoint, load_sharded, read_meta,
                                      refuse_reserved_keys, require_checkpoint, save_sharded)
from lightning_zinf.checkpoint.durable import remove_checkpoint
from lightning_zinf.config import (MixedPrecisionConfig, OffloadConfig, PreemptionConfig, PrefetchConfig, TilingConfig,
                                   ZeroPPConfig)
from lightning_zinf.engine import ZeroEngine, meta_parameters
from lightning_zinf.engine.state_dict import state_dict_options
from lightning_zinf.checkpoint.full import (full_optimizer_state_dict, load_full_checkpoint,
                                            load_full_optimizer_state_dict, load_trainable_checkpoint,
                                            save_full_checkpoint, trainable_only, trainable_state_dict)
from lightning_zinf.launcher import NotebookLauncher
from lightning_zinf.finetuning import present_parameters_to_finetuning
from lightning_zinf.comm.watch import RankWatch
from lightning_zinf.checkpoint_entries import module_buffers, optimizer_hyperparameters, restore_hyperparameters
from lightning_zinf.distributed import RankLayout, all_reduce, barrier, broadcast, init_distributed
from lightning_zinf.engine_setup import build_engine, memory_plan
from lightning_zinf.planning import MemoryPlan
from lightning_zinf.failures import finish_run, report_failure, start_watch
from lightning_zinf.options import ZeroOptions, register_presets
from lightning_zinf.preemption_exit import mark_script_launcher
from lightning_zinf.unsupported import refuse_checkpoint_io
from lightning_zinf.precision import policy_for, refuse_clipping_by_value, to_zero_precision
from lightning_zinf.preemption import Preemption
from lightning_zinf.preemption_trainer import take_over_signals
from lightning_zinf.repoint import Successors
from lightning_zinf.summary import use_sharded_summary

log = logging.getLogger(__name__)

__all__ = ["ZeroInfinityStrategy"]


def _caller_running(code: Any) -> Any:
    """The innermost frame of the calling stack that runs ``code`` (a function's ``__code__``), or ``None``."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    return frame


def _weights_only_passed_to_trainer() -> Optional[bool]:
    """The ``weights_only`` given to the ``trainer.fit``/``validate``/``test``/``predict`` call under
    way, or ``None``. Lightning (2.6) passes it to ``Strategy.load_checkpoint`` only for strategies
    that restore before setup; for one that restores after (this one, like DeepSpeed's)
    ``Trainer._run`` calls ``_restore_modules_and_callbacks(ckpt_path)`` without it, so it is read
    from that call's frame. Not found (another Lightning), it stays ``None``: the safe load."""
    frame = _caller_running(pl.Trainer._run.__code__)
    return None if frame is None else frame.f_locals.get("weights_only")


def _checked_optimizer_states(checkpoint: dict[str, Any], count: int, path: Any) -> list[dict[str, Any]]:
    """The checkpoint's optimizer states, which must be one per optimizer of the run.

    Raises:
        OptimizerCountError: the checkpoint holds the state of more or fewer optimizers (a
            ``RuntimeError``, as Lightning's ``FSDPStrategy`` raises, and a ``CheckpointError``).
    """
    saved = checkpoint.get("optimizer_states", [])
    if len(saved) != count:
        raise OptimizerCountError(
            f"{path} holds the state of {len(saved)} optimizer(s) but configure_optimizers returns {count}: it was "
            "saved by a run configured differently. Return the same optimizers to resume it, or load its weights "
            "alone (LightningModule.load_from_checkpoint, or load_full_state_dict for a sharded checkpoint)."
        )
    return saved


class ZeroInfinityStrategy(RankLayout, ParallelStrategy):
    """ZeRO stage 3 data parallelism for Lightning: parameters, gradients and optimizer states are
    partitioned across all ranks (Rajbhandari et al., ZeRO, SC'20 §5; ZeRO-Infinity, SC'21 §5-6).

    Use ``Trainer(strategy="zero_infinity")`` after ``import lightning_zinf``, or pass an instance to
    set options. Build the model in ``LightningModule.configure_model`` so it is partitioned unit by
    unit as it is built and never exists whole on one rank (its modules' ``reset_parameters()``
    initialise it), or inside ``trainer.init_module()`` (the same: on the meta device until setup);
    a model built in ``__init__`` otherwise is partitioned at setup from rank 0's values.
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
            gathers and computes in bf16 and reduce-scatters in fp32; see ``docs/precision.md``).
        activation_checkpointing: Module classes (or class names, e.g. ``["Block"]``) whose forward
            runs under torch's non-reentrant activation checkpointing: backward recomputes them,
            re-gathering their units. Lightning's ``FSDPStrategy(activation_checkpointing_policy=...)``.
        sharding: ``"full"`` (default; ZeRO-3, Lightning's ``"FULL_SHARD"``): each unit is gathered
            for its forward, released after it, and gathered again for its backward.
            ``"grad_op"`` (ZeRO-2, ``"SHARD_GRAD_OP"``, FSDP2's ``reshard_after_forward=False``):
            a unit gathered by a training forward stays gathered until its backward is done with
            it, which saves backward's gathers for the memory of every unit's full parameters
            through the step; gradients and optimizer state stay sharded. The same values, bit for
            bit, and the same checkpoints. ``"hybrid"`` (``"HYBRID_SHARD"``, MiCS, FSDP2's 2-D
            mesh): ZeRO-3 within groups of ``shard_group_size`` ranks (a node by default), each
            group holding a replica of the sharded state; gathers and reduce-scatters stay in the
            group, and each gradient shard is all-reduced across the groups. The values of
            ``"full"`` up to the order of the two-level mean's additions; its checkpoints are
            those of a world of ``shard_group_size`` ranks and load in any mode and world size.
            ``"auto"``: at setup the ranks measure the links within and between nodes (and the
            step's compute from ``example_input_array``) and run as ``"full"`` or ``"hybrid"``,
            ``"full"`` with ZeRO++'s hpZ, qwZ and qgZ, or ``"hybrid"`` with qgZ (the all-reduce
            across the groups as codes), whichever is predicted fastest
            (:mod:`lightning_zinf.planning.sharding`; logged, and kept as
            ``engine.sharding_choice``). Lightning's names are accepted in any case. A
            ``memory_budget`` plans with the held units and the one gather a step (``grad_op``),
            or the shard group's state (``hybrid``).
        shard_group_size: With ``sharding="hybrid"``: ranks per shard group, a divisor of the
            world size (default: the devices per node). FSDPStrategy's ``device_mesh=(replicas,
            shard_group_size)``, DeepSpeed's ``mics_shard_size``.
        accelerator: As for any Lightning ``ParallelStrategy``; the Trainer sets it.
        parallel_devices: As for any Lightning ``ParallelStrategy``; the Trainer sets it.
        cluster_environment: As for any Lightning ``ParallelStrategy``; the Trainer sets it.
        precision_plugin: As for any Lightning ``ParallelStrategy``; the Trainer sets it.
        checkpoint_io: Must be ``None``: checkpoints do not go through a ``CheckpointIO``.
        process_group_backend: ``"gloo"``, ``"nccl"``...; default from the device (gloo on CPU).
        timeout: How long a collective may wait for other ranks before failing (a rank that died or
            diverged then ends the run with an error instead of a hang).
        load_full_weights: A checkpoint to start from, loaded partitioned when the model is set up
            (Lightning's DeepSpeed strategy has the option of this name): a Hugging Face model
            folder, a ``.safetensors`` or ``.bin`` file (:func:`~lightning_zinf.load_full_state_dict`).
            Each rank reads only its shards' bytes; parameters built in ``configure_model`` that it
            holds are not initialised first. Parameters it does not hold (PEFT adapters) keep their
            initialisation, and the log says which; entries that match no parameter are an error.
            For a LightningModule holding several pretrained models, a mapping ``{prefix: checkpoint}``
            (``{"actor.": sft_folder, "reward.": "rm.safetensors"}``; in YAML a mapping of strings):
            each prefix names a submodule (the trailing dot optional), and its checkpoint loads under
            it, or under the submodule of it where the most of its keys name a parameter (``"actor."``
            holding a PEFT model loads at ``"actor.base_model.model."``). All load in one pass, each
            rank reading only its shards' bytes; parameters under no prefix keep their values or
            initialisation. Raises ``ValueError`` at construction for overlapping prefixes (one a
            submodule of the other's, naming both) or with ``load_prefix``, and ``CheckpointError``
            at setup for a prefix naming no submodule (listing the top-level ones).
        load_prefix: Where the checkpoint's model sits in the LightningModule (``"model."``); by
            default the prefix under which the most checkpoint keys name a parameter (a PEFT-wrapped
            layer's ``base_layer`` counts as the layer). Only with a single checkpoint.
        exclude_frozen_parameters: Leave frozen parameters out of the checkpoints (DeepSpeed's option
            of this name): a LoRA run saves its adapters and their optimizer state only. Resuming is
            exact when the model is built with the same frozen values (``load_full_weights``).
        state_dict_type: ``"sharded"`` (default): a checkpoint is a folder with one shard file per
            rank (:mod:`lightning_zinf.checkpoint`), written in parallel and readable at any world
            size. ``"full"``: one file, written by rank 0, in the format DDP and one device write
            (the full ``state_dict`` and plain optimizer states, gathered one unit at a time), which
            they, ``LightningModule.load_from_checkpoint`` and this strategy load (Lightning's
            ``FSDPStrategy(state_dict_type=...)``). Either type resumes a run from the other, and
            from a DDP or one-device checkpoint.
        preemption: A :class:`~lightning_zinf.PreemptionConfig` (or a mapping of its fields): a
            SIGTERM or SIGUSR1 (by default) delivered to any rank makes every rank finish the
            current training step, save the checkpoint (by default the ModelCheckpoint's
            ``last.ckpt``) and exit with 128 + the signal's number, ready for
            ``trainer.fit(..., ckpt_path="last")`` to resume exactly (see ``docs/checkpoints.md``, "Preemption").
            Lightning's own SIGTERM handling is not used under this strategy.
        memory_budget: Bytes per rank (an integer, or a string such as ``"40GiB"``, ``"12GB"``)
            that the engine's memory may reach at its peak, on the compute device (on a CPU
            device: the process's memory, where every tier but NVMe lives). At setup a planner
            chooses the offload tiers, the records kept in host memory instead of NVMe, the NVMe
            staging cap and, if it must, a smaller prefetch bucket: the fastest placement whose
            predicted peak fits (:mod:`lightning_zinf.planning`). ``offload`` then only gives
            ``nvme_path`` (NVMe is considered only with one), ``read_ahead``, ``aio``,
            ``copy_ahead_bytes`` and at most ``sub_group_size``; tiers and sizes given too are
            refused, as are hpZ, qwZ, ``frozen_bits`` and ``tiling``, which the planner does not
            count yet. The plan is logged at setup and kept as
            ``strategy.engine.memory_plan``; :meth:`memory_plan` prints it without training.
            With the model's ``example_input_array`` the plan counts the step's activations and
            chooses which blocks keep them; without, the first training step measures them.
            Default ``None``: the tiers you give.
            Raises :class:`~lightning_zinf.planning.BudgetError` at setup, naming the smallest
            budget that fits, when none does.
        host_memory_budget: With ``memory_budget`` on an accelerator: bytes per rank of host
            memory the plan may use (host tiers, NVMe staging, records kept); default no cap.
        activation_memory: With ``memory_budget``: bytes of it (per rank, as ``memory_budget``)
            that the placement leaves to activations beyond those the example input's plan counts.
            Without ``example_input_array`` setup cannot see the batch, so by default (``None``: 0)
            the placement may take the whole budget and the first training step's activations get
            what it leaves: every block then runs checkpointed but those that fit
            (``strategy.engine.activation_plan``). Give ``example_input_array``, or what a step's
            activations need (the log line of the first step says), to keep them.

    Raises:
        ValueError: an invalid option value (the message names the field and what is allowed).
        NotImplementedError: a ``checkpoint_io`` (or, when the Trainer is built, a ``CheckpointIO``
            in ``Trainer(plugins=...)``): every rank writes its own shards, so it would never be called.
        UnsupportedPrecisionError: when the Trainer is built, a precision other than ``"32-true"``,
            ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``, ``"16-true"`` (a ``ValueError``, as
            Lightning's sharded strategies raise for a ``precision=`` string, and a ``TypeError``,
            as ``FSDPStrategy`` raises for a plugin).
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
        # The mapping first: for a YAML mapping, jsonargparse would take its text as the str member.
        load_full_weights: Optional[Mapping[str, str | os.PathLike] | str | os.PathLike] = None,
        load_prefix: Optional[str] = None,
        exclude_frozen_parameters: bool = False,
        state_dict_type: str = "sharded",
        preemption: Optional[PreemptionConfig] = None,
        memory_budget: Optional[int | str] = None,
        host_memory_budget: Optional[int | str] = None,
        activation_memory: Optional[int | str] = None,
        sharding: str = "full",
        shard_group_size: Optional[int] = None,
    ) -> None:
        refuse_checkpoint_io(checkpoint_io, type(self).__name__)
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
            exclude_frozen_parameters=exclude_frozen_parameters, state_dict_type=state_dict_type,
            preemption=preemption, memory_budget=memory_budget, host_memory_budget=host_memory_budget,
            activation_memory=activation_memory, sharding=sharding, shard_group_size=shard_group_size,
        )
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._engine: Optional[ZeroEngine] = None
        self._loop_keep = ExitStack()  # an evaluation loop's units kept gathered from step to step
        self._loop_steps = 0  # the steps of the evaluation loop in progress so far
        self._successors = Successors()  # what partitioning put in place of the model's parameters
        self._watch: Optional[RankWatch] = None
        self._preemption: Optional[Preemption] = None

    def memory_plan(self, model: nn.Module) -> MemoryPlan:
        """The placement ``memory_budget`` gives ``model`` (the LightningModule, real or built on
        the meta device) on this strategy's devices, without building or training anything:
        ``print(strategy.memory_plan(model).describe())``. Call it once the Trainer is built
        (it sets the devices and precision). A LightningModule's ``configure_model`` is called
        first, under :func:`~lightning_zinf.meta_parameters` (on the meta device, recorded: the
        fit that follows builds the same model), as the fit would call it: Lightning asks that
        hook to be idempotent.

        Raises:
            ValueError: no ``memory_budget`` was given.
            BudgetError: no placement fits (the message names the smallest budget that would).
        """
        if self.options.memory_budget is None:
            raise ValueError("memory_plan() needs memory_budget: ZeroInfinityStrategy(memory_budget='40GiB').")
        if isinstance(model, pl.LightningModule):
            with meta_parameters():
                model.configure_model()
        plan = memory_plan(model, self.options, device=self.root_device, precision=policy_for(self.precision_plugin),
                           loss_scaling=getattr(self.precision_plugin, "scaler", None) is not None,
                           world=self.num_nodes * self.num_processes, ranks_per_node=self.num_processes)
        assert plan is not None
        return plan

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
        gathers; compiling the blocks in ``configure_model`` keeps whole graphs (see ``docs/compile.md``).
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

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        """Lightning's default ``TorchCheckpointIO``. Checkpoints bypass it (every rank writes its
        shards); Lightning still deletes old checkpoints through it (``ModelCheckpoint(save_top_k=...)``,
        a recursive delete, so it removes a checkpoint folder)."""
        return super().checkpoint_io

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: Optional[CheckpointIO]) -> None:
        """The Trainer sets a plugin given in ``Trainer(plugins=[...])`` here, at its construction.

        Raises:
            NotImplementedError: any plugin: it would never be called
                (:func:`~lightning_zinf.unsupported.refuse_checkpoint_io`).
        """
        refuse_checkpoint_io(io, type(self).__name__)
        self._checkpoint_io = io

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if _IS_INTERACTIVE and not self.cluster_environment.creates_processes_externally:
            # Re-running sys.argv is impossible in a notebook; fork is Lightning's interactive launcher.
            self._launcher = NotebookLauncher(self)
        else:
            # Also in a process that torchrun, SLURM or the launching rank started: the launcher
            # then starts nothing, but gives this process its share of the CPU threads (the cores
            # over the ranks per node), as Lightning's DDP does. Without it such a rank ran as many
            # threads as the machine has cores, beside the other ranks.
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
            mark_script_launcher(self._launcher)  # they exit 0 after a preemption save (preemption_exit_status)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        init_distributed(self.cluster_environment, self.root_device, self._process_group_backend, self._timeout)
        if self._watch is None:
            self._watch = start_watch(self.global_rank, self.world_size, self._timeout,
                                      lambda: [self._engine] if self._engine is not None else [])
        if self._preemption is None:
            self._preemption = Preemption(self.options.preemption)
            self._preemption.connect()  # collective: the agreement's gloo group
            if self._watch is not None:  # every rank started its watch before that collective
                self._watch.learn_pids()
        self._preemption.install()  # a signal during set-up is acted on at the first step's end

    @property
    def preemption(self) -> Preemption:
        """This rank's :class:`~lightning_zinf.preemption.Preemption` (after the environment is set
        up): its ``received`` signal, and ``stopping`` once the ranks agreed to stop.

        Raises:
            RuntimeError: before ``setup_environment``.
        """
        if self._preemption is None:
            raise RuntimeError("The zero_infinity strategy handles preemption signals once its environment is set up.")
        return self._preemption

    # --- model ------------------------------------------------------------------------------------
    # ``model_sharded_context`` is deliberately not overridden: ``trainer.init_module()`` warns that it
    # cannot build the model properly whenever a strategy overrides it, and here it can. The meta
    # device comes from ``tensor_init_context``, which both ``init_module`` and ``configure_model`` enter.
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """How ``trainer.init_module(empty_init)`` and ``configure_model`` (entered with ``None``) build
        tensors: on this rank's device, in the precision plugin's dtype, and

        - ``None``: parameters on the meta device, so nothing of the model is allocated on any
          rank; at setup the engine materialises them unit by unit, with the values eager
          construction gives them on rank 0, whatever ``__init__`` does, and partitions them (see
          :func:`~lightning_zinf.meta_parameters`). Buffers are real.
        - ``empty_init=True``: the same, with the ``torch.nn.init`` calls inside skipped (values to
          be loaded or set later), as Lightning's other strategies skip them.
        - ``empty_init=False``: real parameters, initialised as the modules do, whole on every
          rank; setup partitions them from rank 0's values.

        Lightning's ``FSDPStrategy`` and ``ModelParallelStrategy`` build on the meta device for
        ``empty_init=True`` too; ``None`` means meta here because the model is never meant to exist
        whole on a rank. The deprecated ``configure_sharded_model`` hook runs outside this context:
        its model is built for real.
        """
        if empty_init is False:
            with super().tensor_init_context(empty_init=False):
                yield
            return
        with self.root_device, self.precision_plugin.tensor_init_context(), meta_parameters(bool(empty_init)):
            yield

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        """Partition the LightningModule (or reuse its engine), then shard the optimizers.

        As Lightning's ``FSDPStrategy``: ``Trainer(sync_batchnorm=True)`` converts the batch-norm
        layers to ``SyncBatchNorm`` before a fit. The model summary at fit start counts the
        partitioned parameters at their full sizes (:class:`~lightning_zinf.ShardedModelSummary`).

        Raises:
            NotSupportedError: ``gradient_clip_algorithm="value"`` with NVMe optimizer offload (a
                ``MisconfigurationException``, as Lightning's DeepSpeed strategy raises here).
        """
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        # A model already partitioned (fit then test, or a second Trainer) keeps its engine.
        self._engine = getattr(self.model, "_zinf_engine", None)
        if self._engine is None:
            if trainer.state.fn == TrainerFn.FITTING and self._layer_sync is not None:
                # Before partitioning: the engine hooks the modules this replaces.
                self.model = self._layer_sync.apply(self.model)
            before = Successors.names_of(self.model)
            self._engine = build_engine(
                self.model, self.options, device=self.root_device, ranks_per_node=self.num_processes,
                precision=policy_for(self.precision_plugin),
                loss_scaling=getattr(self.precision_plugin, "scaler", None) is not None,
                timeout=self._timeout, auto_pass=False,
            )
            self._successors.record(self.model, before)
        self.precision_plugin.engine = self._engine  # type: ignore[attr-defined]
        clips_by_value = trainer.gradient_clip_val and trainer.gradient_clip_algorithm == "value"
        if trainer.state.fn == TrainerFn.FITTING and clips_by_value:
            refuse_clipping_by_value(self._engine)  # now, rather than after the first step's backward
        use_sharded_summary(trainer.callbacks)
        present_parameters_to_finetuning(trainer.callbacks, self._engine)
        take_over_signals(trainer, self.preemption, min(self._timeout.total_seconds(), 60.0))
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    @override
    def model_to_device(self) -> None:
        """Nothing to move: the engine placed shards and buffers on ``root_device`` at setup."""

    @override
    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        """Build the user's optimizers, then re-point them at this rank's fp32 master shards. An
        optimizer the LightningModule built before the model was partitioned (in ``__init__`` or
        ``configure_model``, returned by ``configure_optimizers``) is first pointed at the
        parameters that replaced the ones it holds: real ones for meta-device parameters, a tiled
        layer's tiles for its ``weight`` and ``bias`` (:class:`~lightning_zinf.repoint.Successors`)."""
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        for optimizer in self.optimizers:
            self._successors.repoint(optimizer)
        self.optimizers = [self.engine.shard_optimizer(optimizer) for optimizer in self.optimizers]

    @contextmanager
    def gathered_parameters(self, write_back: bool = False) -> Generator[None, None, None]:
        """Every parameter at its full value inside the block (collective: call on all ranks).

        Args:
            write_back: Keep edits made inside the block (every rank must make the same edits).
        """
        with self.engine.gathered(write_back=write_back):
            yield

    @contextmanager
    def generation(self) -> Generator[None, None, None]:
        """A generation phase inside ``training_step`` (RLHF rollouts: ``generate()`` of the actor,
        reward and reference forwards), with ZeRO++'s behaviour for it: units kept gathered within
        ``PrefetchConfig.inference_budget``, one stable trace per decode step, each shard
        quantized at most once by qwZ, and the training forward after it replaying the ``"train"``
        trace (:meth:`ZeroEngine.generation_phase <lightning_zinf.ZeroEngine.generation_phase>`;
        ZeRO++, Wang et al. 2023, §4; DeepSpeed's hybrid engine, DeepSpeed-Chat). Every rank
        must enter it; use it under ``torch.no_grad()``::

            def training_step(self, batch, batch_idx):
                with torch.no_grad(), self.trainer.strategy.generation():
                    out = self.actor.generate(batch, max_new_tokens=20, do_sample=True)
                    reward = self.reward(out).logits
                loss = ...  # the actor's forward with gradients, outside the phase
        """
        with self.engine.generation_phase(self.options.prefetch.inference_budget):
            yield

    # --- steps ------------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Start a train trace pass, then run the LightningModule's step (with its saved
        activations in CPU memory under ``OffloadConfig(activations=True)``; under
        ``memory_budget``, the first step's activations measured: ``engine.activation_plan``)."""
        self.engine.begin_pass("train")
        plan = self.engine.activation_plan
        with plan.scope() if plan is not None else nullcontext():
            if not self.options.offload.activations:
                return self._step_end(super().training_step(*args, **kwargs))
            with self.engine.offload_activations():
                return self._step_end(super().training_step(*args, **kwargs))

    def _step_end(self, output: Any) -> Any:
        """After the LightningModule's step: ranks that ran different modules in it meet."""
        self.engine.meet("step end")
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Start a validation trace pass, then run the LightningModule's step (units kept gathered
        across its forward passes, and from step to step of the loop, within
        ``PrefetchConfig.inference_budget``)."""
        self._begin_loop_pass("validate")
        with self.engine.keep_gathered(self.options.prefetch.inference_budget, verify=False):
            output = super().validation_step(*args, **kwargs)
        return self._step_end(output)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """Start a test trace pass, then run the LightningModule's step (as validation)."""
        self._begin_loop_pass("test")
        with self.engine.keep_gathered(self.options.prefetch.inference_budget, verify=False):
            output = super().test_step(*args, **kwargs)
        return self._step_end(output)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Start a predict trace pass, then run the LightningModule's step: a ``generate()`` in
        it gathers each unit once per loop while the units fit ``PrefetchConfig.inference_budget``
        (the loop keeps them from step to step)."""
        self._begin_loop_pass("predict")
        with self.engine.keep_gathered(self.options.prefetch.inference_budget, verify=False):
            output = super().predict_step(*args, **kwargs)
        return self._step_end(output)

    # The start of an evaluation loop: the units its steps keep gathered within inference_budget
    # stay so from one step to the next (nothing changes the weights during the loop, as in
    # DeepSpeed's hybrid engine between generate() calls); each step's keep_gathered is then nested
    # in the loop's, and the loop's end releases them, before training goes on.
    @override
    def on_validation_start(self) -> None:
        self._keep_for_loop()

    @override
    def on_test_start(self) -> None:
        self._keep_for_loop()

    @override
    def on_predict_start(self) -> None:
        self._keep_for_loop()

    def _keep_for_loop(self) -> None:
        self._loop_keep.close()  # a loop that raised and did not reach its end
        self._loop_steps = 0
        budget = self.options.prefetch.inference_budget
        if self._engine is not None and budget:
            self._loop_keep.enter_context(self._engine.keep_gathered(budget, verify=False))

    def _begin_loop_pass(self, kind: str) -> None:
        """Begin the pass of an evaluation loop's step. With units kept from step to step, the
        loop's first step gathers what the later ones find gathered: its collectives differ from
        theirs, so the later steps are a kind of pass of their own (each kind's passes issue the
        same collectives, which is what an agreed trace certifies)."""
        kept = self._loop_steps > 0 and self.options.prefetch.inference_budget > 0
        self._loop_steps += 1
        self.engine.begin_pass((kind, "kept") if kept else kind)

    # The end of each loop: ranks whose steps did not split evenly (Lightning does not pad a predict
    # loop's batches) meet here, the ones done serving the others' remaining steps, as DDP's ranks
    # would simply go on.
    @override
    def on_train_end(self) -> None:
        self._loop_end()

    @override
    def on_validation_end(self) -> None:
        self._loop_end()

    @override
    def on_test_end(self) -> None:
        self._loop_end()

    @override
    def on_predict_end(self) -> None:
        self._loop_end()

    def _loop_end(self) -> None:
        self._loop_keep.close()
        if self._engine is not None:
            self._engine.meet("loop end")

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradients are reduce-scattered every micro-batch and accumulated in fp32 shards, which
        costs no memory for full gradients; there is no synchronisation to skip."""
        with nullcontext():
            yield

    # --- collectives ------------------------------------------------------------------------------
    # Each first meets the other ranks at the engine (Lightning's logging, early stopping and
    # checkpoint callbacks call them; ranks that ran different modules then serve each other first).
    @override
    def barrier(self, name: Optional[str] = None) -> None:
        self._before_collective()
        barrier(self._watch)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._before_collective()
        return broadcast(obj, src)

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Optional[Any] = None, reduce_op: Optional[ReduceOp | str] = "mean"
    ) -> Tensor | Any:
        self._before_collective()
        return all_reduce(tensor, group, reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        self._before_collective()
        return super().all_gather(tensor, group, sync_grads)

    def _before_collective(self) -> None:
        if self._engine is not None:
            self._engine.meet("collective")

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
        """The LightningModule's state dict, as Lightning's ``FSDPStrategy`` returns it (collective):

        - ``state_dict_type="full"``: the whole state dict on rank 0, on the CPU, gathered one unit
          at a time; ``{}`` on the other ranks. With ``exclude_frozen_parameters=True``: the buffers
          and the trainable parameters only, and no frozen unit is gathered
          (:func:`~lightning_zinf.checkpoint.full.trainable_state_dict`).
        - ``"sharded"``: every partitioned parameter as a ``DTensor`` sharded on dim 0 over the ranks,
          each rank holding its rows (FSDP's sharded state dict:
          :func:`~lightning_zinf.state_dict_options` ``(sharded=True)``, each unit gathered once), and
          the buffers. When the Trainer builds a checkpoint with it, the buffers alone: the
          parameters go to the shard files, and gathering them there would be wasted.
        """
        assert self.lightning_module is not None
        module = self.lightning_module
        if self.options.state_dict_type == "sharded":
            if _caller_running(_CheckpointConnector.dump_checkpoint.__code__) is not None:
                return module_buffers(module)
            with state_dict_options(module, sharded=True):
                return module.state_dict()
        if self.options.exclude_frozen_parameters:
            state = {**module_buffers(module), **trainable_state_dict(self.engine, rank0_only=True)}
        else:
            with state_dict_options(module, rank0_only=True):
                state = module.state_dict()
        return state if self.is_global_zero else {}

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """With ``state_dict_type="full"``: the state dict the optimizer would have over the
        unpartitioned model, on rank 0, and ``{}`` on the other ranks, as Lightning's
        ``FSDPStrategy`` returns it (:func:`~lightning_zinf.checkpoint.full.full_optimizer_state_dict`;
        collective). With ``"sharded"``: hyper-parameters per param group; per-element state goes
        to the shard files."""
        if self.options.state_dict_type == "full":
            state = full_optimizer_state_dict(self.engine, optimizer, rank0_only=True)
            return state if self.is_global_zero else {}
        return optimizer_hyperparameters(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None) -> None:
        """Write a sharded checkpoint directory at ``filepath`` (see :mod:`lightning_zinf.checkpoint`),
        or with ``state_dict_type="full"`` one file from rank 0, in DDP's format
        (:func:`~lightning_zinf.checkpoint.full.save_full_checkpoint`). Collective.

        Raises:
            TypeError: ``storage_options`` (as Lightning's FSDP and DeepSpeed strategies).
            ValueError: (sharded) the checkpoint holds an entry under a name ``meta.pt`` uses for its
                own record (``"zinf"``...: :data:`~lightning_zinf.checkpoint.RESERVED_KEYS`, added in
                ``on_save_checkpoint``, say); nothing is written.
            IsADirectoryError: (full) ``filepath`` is a folder that is not a checkpoint (as
                Lightning's ``FSDPStrategy`` raises).

        Warns:
            UserWarning: once per process, when a sharded checkpoint's name has a file's suffix
                (``model.pt``, ``last.ckpt``): it is written as a folder (as Lightning's DeepSpeed
                strategy warns for ZeRO-3 checkpoints).
        """
        if storage_options is not None:
            raise TypeError("zero_infinity checkpoints do not use a CheckpointIO: storage_options is not supported.")
        path = self.broadcast(filepath)
        if self.options.state_dict_type == "full":
            save_full_checkpoint(checkpoint, path, writer=self.is_global_zero, broadcast=self.broadcast)
            return
        refuse_reserved_keys(checkpoint, path)
        if "state_dict" in checkpoint:  # a DTensor's values are in the shard files
            checkpoint = {**checkpoint, "state_dict": {k: v for k, v in checkpoint["state_dict"].items()
                                                       if not isinstance(v, DTensor)}}
        with_optimizer = "optimizer_states" in checkpoint
        save_sharded(self.engine, self.optimizers if with_optimizer else [], path, checkpoint,
                     exclude_frozen=self.options.exclude_frozen_parameters)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Remove a checkpoint (rank 0), renamed aside first so that no instant shows a
        half-removed checkpoint under its name (:func:`~lightning_zinf.checkpoint.durable.remove_checkpoint`)."""
        if self.is_global_zero:
            remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load a checkpoint of either type (at this or another world size), or a DDP or one-device
        ``.ckpt`` file, and return Lightning's state for its loops. When fitting, the optimizers'
        state is restored here (sharded: from the shard files; a file: each rank keeps its slices of
        the plain optimizer states); a file's model weights load in :meth:`load_model_state_dict`.

        ``weights_only`` is what ``trainer.fit(ckpt_path=..., weights_only=...)`` passes: ``None``
        (the default) or ``True`` reads ``meta.pt`` (or the file) without running code from it
        (torch's weights-only unpickler and :data:`~lightning_zinf.checkpoint.CHECKPOINT_GLOBALS`),
        ``False`` unpickles it fully, for a file the user trusts.

        Raises:
            CheckpointNotFoundError: on every rank, nothing at ``checkpoint_path``, a folder that is
                not a checkpoint, or a part of one (its ``save-<id>/`` folder, a shard file: the
                message names the checkpoint folder to pass instead). A ``FileNotFoundError``, as DDP
                and DeepSpeed raise, and a ``CheckpointError``.
            OptimizerCountError: when fitting, a checkpoint with more or fewer optimizers than the
                run has (a ``RuntimeError``, as Lightning's ``FSDPStrategy`` raises, and a ``CheckpointError``).
            CheckpointError: a missing or corrupt shard file, another model's checkpoint, or a
                ``meta.pt`` naming code the safe load refuses (on every rank: each reads it).
        """
        assert self.lightning_module is not None
        if weights_only is None:
            weights_only = _weights_only_passed_to_trainer()
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        path = self.broadcast(checkpoint_path)
        require_checkpoint(path)
        if not is_sharded_checkpoint(path):
            checkpoint = load_full_checkpoint(path, weights_only)
            if fitting:
                saved = _checked_optimizer_states(checkpoint, len(self.optimizers), path)
                for optimizer, state in zip(self.optimizers, saved):
                    load_full_optimizer_state_dict(self.engine, optimizer, state)
            return checkpoint
        if fitting:
            _checked_optimizer_states(read_meta(path, weights_only), len(self.optimizers), path)
        meta = load_sharded(self.engine, self.optimizers, path, load_optimizer=fitting, weights_only=weights_only)
        restore_hyperparameters(self.optimizers, meta.get("optimizer_states", []) if fitting else [])
        return meta

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        """A file's ``state_dict`` loads through the LightningModule's ``load_state_dict`` (each
        rank keeps its shards' part, one unit at a time); after a sharded load, which filled the
        shards, the buffers. A file saved with ``exclude_frozen_parameters=True`` (no frozen
        parameter in it) loads the trainable parameters into their shards alone
        (:func:`~lightning_zinf.checkpoint.full.load_trainable_state_dict`): the frozen ones keep
        the values the model was built with.

        Raises:
            CheckpointError: such a file lacks a trainable parameter, or holds a key that names
                neither a parameter nor a buffer of the module.
        """
        assert self.lightning_module is not None
        state = checkpoint.get("state_dict", {})
        if isinstance(checkpoint.get("zinf"), dict) and checkpoint["zinf"].get("format") == FORMAT:
            self.lightning_module.load_state_dict(state, strict=False)
        elif self.options.exclude_frozen_parameters and trainable_only(self.lightning_module, state):
            load_trainable_checkpoint(self.engine, state, strict)
        else:
            self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Nothing: :meth:`load_checkpoint` restored the optimizers."""

    # --- failures, teardown, registration -----------------------------------------------------------
    @override
    def on_exception(self, exception: BaseException) -> None:
        """Tell the other ranks (they end within a few seconds with this message, rather than at the
        backend's timeout with its own); if another rank failed first, this rank's error is the
        consequence, and that rank's message is added to it (:func:`~lightning_zinf.failures.report_failure`)."""
        report_failure(self._watch, exception)
        try:
            self._loop_keep.close()  # the units an evaluation loop kept gathered (as a step's own keep does when it raises)
        except Exception as error:  # the run's own error is the one to report; this one follows from it
            log.warning("lightning_zinf: releasing the units an evaluation loop kept gathered failed after the run's "
                        "error: %s", error)

    @override
    def teardown(self) -> None:
        # Unlike the base class, keep the model where it is: its state lives in the shards, and a
        # following validate/test/predict reuses the engine.
        finish_run([self._engine] if self._engine is not None else [], self._watch)
        self._watch = None
        if self._preemption is not None and self._preemption.stopping is None:
            self._preemption.uninstall()  # after a preemption stop the signals stay ignored until the exit
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
