"""Frozen configuration dataclasses for the ZeRO-Infinity engine.

One small dataclass per concern instead of dozens of flat flags. Every field is validated when the
object is built: a bad value raises :class:`ValueError` naming the field and what is allowed, so a
typo in a YAML file fails at start-up instead of being silently ignored.
"""

from __future__ import annotations

import difflib
import os
import signal
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, Sequence, TypeVar, Union

import torch

from lightning_zinf.offload.aio import AioConfig

__all__ = ["MixedPrecisionConfig", "OffloadConfig", "PrefetchConfig", "PreemptionConfig", "TilingConfig", "ZeroPPConfig",
           "coerce_config", "sharding_mode", "PREEMPTION_SIGNALS"]

_C = TypeVar("_C")


def _require(ok: bool, owner: str, field: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{owner}.{field}={value!r} is invalid: allowed values are {allowed}.")


@dataclass(frozen=True, kw_only=True)
class PrefetchConfig:
    """How communication overlaps compute (ZeRO-Infinity §6.2, "overlap-centric design"):
    parameters gathered ahead of use, gradients reduce-scattered behind it.

    The first forward/backward pass of each kind (training, evaluation) records the order in which
    units are gathered (the *trace*); every rank checks that its trace matches the others'. Later
    passes replay it, all-gathering the next units while the current one computes. When the order
    changes (data-dependent control flow) the engine falls back to on-demand gathering for the rest
    of that pass and records the trace again.

    Attributes:
        enabled: Gather ahead along the trace. ``False`` gathers every unit on demand.
        bucket_size: Most parameter elements (a count, not bytes) gathered ahead of use at once;
            the next unit is always gathered ahead, even when it alone is larger.
            DeepSpeed's ``stage3_prefetch_bucket_size`` (whose default is 5e7; 1e7 cost no speed and
            saved ≈190 MiB per rank on the 91M GPT benchmark, see examples/benchmarks/RESULTS.md).
            It also bounds reuse: a unit the trace uses again after a forward use with at most
            this many elements gathered in between (the last units of a forward, first in its
            backward; a module called twice) stays gathered, counted as gathered ahead, instead of
            being released and gathered again (DeepSpeed's ``stage3_max_reuse_distance``, there
            unbounded by the bucket).
        unit_size: Without ``block_classes``: the most parameter elements of a unit when the engine
            groups modules into units itself (:mod:`lightning_zinf.engine.grouping`: the largest
            subtrees of at most this size, consecutive sibling ones packed together, each a unit).
            ``None``: ``bucket_size`` (a unit's fixed cost is the host's, which prefetch does not
            hide: the fewest units that fit what may be gathered ahead anyway are the fastest;
            0 with ``bucket_size=0``); the default. ``0``: a unit per module (each module's own
            parameters), as DeepSpeed does by default. Ignored when ``block_classes`` is
            given. DeepSpeed's ``stage3_module_granularity_threshold``, without measuring by hand.
        persistence_threshold: Units with at most this many elements stay gathered for the whole run
            (they are still sharded for the optimizer and re-gathered after each step). Avoids many
            tiny collectives for biases and norms. DeepSpeed's ``stage3_param_persistence_threshold``.
        persistence_limit: Most parameter elements (a count, not bytes) of all persistent units
            together, the root's own parameters aside: where the units under
            ``persistence_threshold`` hold more, the smallest are kept (the ones whose fixed cost
            per unit weighs most per element), in the model's order among equals, until the next
            does not fit; the others are gathered and released as usual. Keeps the gathered memory
            flat in depth for a model of thousands of small units (a unit per module of a deep
            stack, many small experts). DeepSpeed's ``stage3_model_persistence_threshold`` (there
            unlimited by default).
        overlap_reduce: Keep a unit's gradient reduce-scatter in flight while the backward of the
            next unit computes, finishing it when the next one starts (DeepSpeed's ``overlap_comm``;
            FSDP2 does so on GPUs). ``False`` waits for each right after issuing it: one unit's
            reduce buffers less at the peak (under mixed precision a full-size cast to the reduce
            dtype), at the cost of that overlap.
        inference_budget: Bytes of gathered parameters that may stay gathered from one forward
            pass to the next through a validation, test or prediction loop, from one step to the
            next (the strategy keeps them from the loop's start to its end, before training goes
            on; :meth:`~lightning_zinf.ZeroEngine.keep_gathered` for your own loop). ``generate()``
            then gathers each unit once per loop instead of once per token (DeepSpeed's hybrid
            engine: once per call) while the units kept fit the budget; the rest are gathered per
            forward as usual. When the whole model fits, the passes after the units are kept run
            without the engine's forward hooks (:meth:`~lightning_zinf.ZeroEngine.begin_pass`).
            ``0`` (default): every unit is released after each forward but those used again
            within ``bucket_size`` (memory stays the ZeRO-3 bound).

    Raises:
        ValueError: a negative ``bucket_size``, ``unit_size``, ``persistence_threshold``,
            ``persistence_limit`` or ``inference_budget``.
    """

    enabled: bool = True
    bucket_size: int = 10_000_000
    unit_size: Optional[int] = None
    persistence_threshold: int = 100_000
    persistence_limit: int = 10_000_000
    overlap_reduce: bool = True
    inference_budget: int = 0

    def __post_init__(self) -> None:
        for name in ("enabled", "overlap_reduce"):
            _require(isinstance(getattr(self, name), bool), "PrefetchConfig", name, getattr(self, name), "True or False")
        _require(isinstance(self.inference_budget, int) and not isinstance(self.inference_budget, bool)
                 and self.inference_budget >= 0, "PrefetchConfig", "inference_budget", self.inference_budget,
                 "an integer >= 0 (a number of bytes)")
        _require(self.unit_size is None or (isinstance(self.unit_size, int) and not isinstance(self.unit_size, bool)
                                            and self.unit_size >= 0), "PrefetchConfig", "unit_size", self.unit_size,
                 "None (the bucket_size), 0 (a unit per module) or an integer > 0 (elements per unit)")
        for name in ("bucket_size", "persistence_threshold", "persistence_limit"):
            value = getattr(self, name)
            _require(
                isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                "PrefetchConfig",
                name,
                value,
                "an integer >= 0 (a number of elements)",
            )


_TIERS = ("none", "cpu", "nvme")


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """Where training state lives (ZeRO-Infinity §5-6, the "infinity offload engine").

    Attributes:
        param: Tier of the parameter shards (in the parameters' dtype): ``"none"`` (the compute
            device), ``"cpu"`` (CPU memory, copied to the device for each gather) or ``"nvme"``
            (a swap file per shard, read back along the prefetch trace ahead of use and dropped
            after the gather; written only when the shard changes). DeepSpeed's ``offload_param.device``.
        optimizer: Tier of the fp32 master shards, fp32 gradient shards and optimizer states:
            ``"none"`` (the compute device), ``"cpu"`` (CPU memory; the step runs on the CPU) or
            ``"nvme"`` (files under ``nvme_path``; swapped into CPU memory one sub-group at a time
            for the step, the next sub-group read ahead while the current one steps; gradient
            shards stay in staging memory from backward to the step that consumes them, written
            only when staging memory is needed or a checkpoint swaps them out). DeepSpeed's
            ``offload_optimizer.device``.
        nvme_path: Folder (it must exist and be writable) in which the engine creates one folder per
            rank for its swap files, and removes it at a clean exit. Folders that killed runs of this
            host left there are removed at the next start. Required for ``"nvme"``.
        sub_group_size: Most fp32 elements stepped (and, with ``"nvme"``, resident) at once; a flat
            group larger than this is stepped alone. DeepSpeed's ``sub_group_size`` (default 1e9).
        read_ahead: With ``param="nvme"``: how many units of the prefetch trace beyond the one
            being gathered have their shards read from NVMe ahead of time.
        copy_ahead_bytes: With ``param="cpu"`` on an accelerator: most bytes of device memory
            holding shards copied from the host ahead of their gathers. Along the prefetch trace,
            the next units' shards (their 16-bit compute copies under mixed precision; 1/W of a
            unit each) are copied to the device while earlier units compute, beyond the units
            gathered ahead within ``PrefetchConfig.bucket_size``, so the link stays busy ahead of
            compute (ZeRO-Infinity §6.2). Counted in the memory ledger under ``staged``. ``0``
            turns it off (each shard is copied when its gather is issued).
        activations: Keep the tensors autograd saves for backward in host memory (page-locked on
            an accelerator, copied on the copy stream) during the training step, and copy them
            back for backward (ZeRO-Infinity §5.1.2). Parameters and views of gathered parameter
            buffers are left to the re-gather, not copied
            (:class:`~lightning_zinf.offload.activations.ActivationOffload`). Only useful with an
            accelerator; on a CPU device it costs a copy and saves nothing.
        aio: How the NVMe swapper does its I/O (block size, queue depth, threads, ``O_DIRECT``):
            an :class:`~lightning_zinf.offload.AioConfig` or a mapping of its fields.
        staging_bytes: Cap, in bytes per rank, on the host memory that holds records swapped in
            from NVMe (parameter shards read ahead, optimizer sub-groups being stepped, gradient
            shards being written). Buffers are page-aligned (``O_DIRECT`` without a copy), reused
            by size, and never exceed the cap: when it is reached, writes in flight are completed
            to free buffers, and if that is not enough training stops with an error naming this
            option. ``None``: an eighth of this machine's memory shared among the ranks on it
            (``LOCAL_WORLD_SIZE``, else the world size). What DeepSpeed splits into
            ``buffer_count`` x ``buffer_size`` (per kind) is one budget here; how many buffers are
            in use at once follows ``read_ahead`` (parameters) and ``sub_group_size`` (optimizer).
        host_bytes: Bytes per rank of ``nvme``-tier state kept in host memory instead of swap files,
            for whole flat groups, the first ones in the model's order (the forward's, for most
            models) until the next does not fit: with ``optimizer="nvme"`` a group's fp32 master,
            the per-element states of the first optimizer sharded (e.g. Adam's two moments), and
            with ``param="nvme"`` its shard and 16-bit compute copy (gradient shards stay held in
            staging memory as without); a frozen group (a LoRA base), and any group with
            ``param="nvme"`` alone, its shard and copy, read at every forward and backward. Those
            bytes are then neither written nor read by any step, forward or backward: they cost
            host memory (outside ``staging_bytes``, counted in the memory ledger's ``shards_cpu``
            and ``optimizer``) and take their traffic off the disk: under AdamW at least 12 bytes
            per parameter read and 12 written per step, the master and two moments
            (:mod:`lightning_zinf.offload.host`). DeepSpeed's ``offload_optimizer.ratio`` makes the
            same trade between the device and the CPU. ``0`` (the default): everything on NVMe,
            as in ZeRO-Infinity.
        device_bytes: With ``optimizer="cpu"`` and ``param="none"`` (ZeRO-Offload): bytes per rank of
            device memory for the optimizer side of whole trainable flat groups, the first ones in
            the model's order until the next does not fit, each counted at 16 bytes per element of
            its shard (an fp32 master, an fp32 gradient shard and two fp32 moments, AdamW's). Those
            groups are placed as without offload (their shard in its dtype on the device, the
            master beside it or the shard itself) and stepped there by the optimizer itself,
            during ``optimizer.step()``; the others are stepped on the host as ZeRO-Offload does,
            their gradients and new values crossing the host link. Counted in the memory ledger's
            ``optimizer_device``. DeepSpeed's ``offload_optimizer.ratio`` (Twin-Flow) sets by hand
            the share of the parameters updated on the CPU. ``0`` (the default): every group on
            the host.
        pin_memory: Page-lock the staging buffers (faster, asynchronous copies to an accelerator).
            ``None``: on when the compute device is an accelerator, off on the CPU, where pinning
            fails; ``True`` without an accelerator is an error. On CUDA the pool registers buffers
            of its own with the runtime, so the page-locked bytes are the staging bytes, under
            the same cap (:class:`~lightning_zinf.offload.staging.StagingPool`).
        overlap: Read the next sub-group ahead and write the previous one behind while the current
            one steps. ``False`` runs every transfer to completion first (to measure what overlap buys).
        overlap_step: With the optimizer offloaded, ``optimizer.step()`` only starts the step: it
            runs in the background, group by group in the order the next forward gathers them,
            and the forward of a unit waits only for its own groups' step (checkpoints, state
            dicts and the next step wait for all of it). The weights and optimizer states are
            bit-identical to a synchronous step's: the same arithmetic on the same tensors, with
            the options the param groups had at the call. ``False``: the step completes inside
            ``optimizer.step()``. (:mod:`lightning_zinf.offload.stepping`.)

    Raises:
        ValueError: an unknown tier, ``"nvme"`` without ``nvme_path``, a non-positive
            ``sub_group_size`` or ``staging_bytes``, a negative ``read_ahead``, ``copy_ahead_bytes`` or
            ``host_bytes``, a ``host_bytes`` with no ``nvme`` tier, a negative ``device_bytes`` or one
            without ``optimizer="cpu"`` and ``param="none"``.
    """

    param: str = "none"
    optimizer: str = "none"
    nvme_path: Optional[str] = None
    sub_group_size: int = 25_000_000
    read_ahead: int = 2
    copy_ahead_bytes: int = 128 << 20
    overlap: bool = True
    overlap_step: bool = True
    activations: bool = False
    aio: AioConfig = AioConfig()
    staging_bytes: Optional[int] = None
    host_bytes: int = 0
    device_bytes: int = 0
    pin_memory: Optional[bool] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "aio", coerce_config(AioConfig, self.aio))  # a YAML mapping works too
        for name in ("param", "optimizer"):
            value = getattr(self, name)
            _require(value in _TIERS, "OffloadConfig", name, value, " / ".join(map(repr, _TIERS)))
            if value == "nvme" and not self.nvme_path:
                raise ValueError(
                    f"OffloadConfig.{name}='nvme' needs nvme_path: a folder on a fast disk where the engine may "
                    f"create its swap folder, e.g. OffloadConfig({name}='nvme', nvme_path='/local_nvme')."
                )
        _require(
            isinstance(self.read_ahead, int) and not isinstance(self.read_ahead, bool) and self.read_ahead >= 0,
            "OffloadConfig",
            "read_ahead",
            self.read_ahead,
            "an integer >= 0 (a number of units)",
        )
        _require(
            isinstance(self.sub_group_size, int) and not isinstance(self.sub_group_size, bool) and self.sub_group_size > 0,
            "OffloadConfig",
            "sub_group_size",
            self.sub_group_size,
            "an integer > 0 (a number of elements)",
        )
        _require(isinstance(self.copy_ahead_bytes, int) and not isinstance(self.copy_ahead_bytes, bool)
                 and self.copy_ahead_bytes >= 0, "OffloadConfig", "copy_ahead_bytes", self.copy_ahead_bytes,
                 "an integer >= 0 (bytes of device memory, e.g. 134_217_728; 0 turns copying ahead off)")
        for name in ("overlap", "overlap_step", "activations"):
            _require(isinstance(getattr(self, name), bool), "OffloadConfig", name, getattr(self, name), "True or False")
        _require(self.pin_memory is None or isinstance(self.pin_memory, bool), "OffloadConfig", "pin_memory",
                 self.pin_memory, "None (automatic), True or False")
        _require(
            self.staging_bytes is None or (isinstance(self.staging_bytes, int) and not isinstance(self.staging_bytes, bool)
                                           and self.staging_bytes > 0),
            "OffloadConfig",
            "staging_bytes",
            self.staging_bytes,
            "None (automatic) or an integer > 0 (bytes per rank, e.g. 4_000_000_000)",
        )
        _require(isinstance(self.host_bytes, int) and not isinstance(self.host_bytes, bool) and self.host_bytes >= 0,
                 "OffloadConfig", "host_bytes", self.host_bytes, "an integer >= 0 (bytes per rank, e.g. 2_000_000_000)")
        if self.host_bytes and "nvme" not in (self.param, self.optimizer):
            raise ValueError(
                f"OffloadConfig.host_bytes={self.host_bytes} keeps NVMe-tier state in host memory, but neither param nor "
                "optimizer is 'nvme' (everything is in memory already). Drop host_bytes, or set param='nvme' or "
                "optimizer='nvme'."
            )
        _require(isinstance(self.device_bytes, int) and not isinstance(self.device_bytes, bool) and self.device_bytes >= 0,
                 "OffloadConfig", "device_bytes", self.device_bytes, "an integer >= 0 (bytes per rank, e.g. 2_000_000_000)")
        if self.device_bytes and (self.optimizer, self.param) != ("cpu", "none"):
            raise ValueError(
                f"OffloadConfig.device_bytes={self.device_bytes} keeps the first groups' optimizer state on the device "
                f"beside ZeRO-Offload, but optimizer={self.optimizer!r} and param={self.param!r}: it needs "
                "optimizer='cpu' and param='none'. Drop device_bytes, or offload the optimizer to 'cpu' alone."
            )


@dataclass(frozen=True, kw_only=True)
class TilingConfig:
    """Which ``nn.Linear`` layers are split into tiles, and how large a tile may be
    (ZeRO-Infinity §5.1.3, memory-centric tiling).

    At partition time every ``nn.Linear`` (exactly that class, not a subclass) whose weight has
    more than ``min_numel`` elements becomes a :class:`~lightning_zinf.TiledLinear` whose tiles
    hold at most ``tile_numel`` weight elements each. Each tile is its own unit, so gathering the
    layer needs memory for one tile (two with prefetch) instead of the whole weight.

    A tiling that would cut a layer into more than 1024 tiles (tiles under 1/1024 of their layer)
    or the model into more than 65,536 is refused when the engine applies it, naming the layer and
    the smallest ``tile_numel`` within the bound (:func:`~lightning_zinf.tiling.tile_linear_layers`,
    whose module explains the bounds).

    Attributes:
        tile_numel: Most weight elements in one tile (a count, not bytes). Layers are split along
            their output features into nearly equal row blocks; only a layer with more than
            ``tile_numel`` input features is also split along them.
        min_numel: Layers whose weight has at most this many elements are left alone. ``None``:
            ``tile_numel`` (a layer is tiled exactly when it does not fit in one tile).

    Raises:
        ValueError: ``tile_numel`` is not a positive integer, or ``min_numel`` is negative.
    """

    tile_numel: int
    min_numel: Optional[int] = None

    def __post_init__(self) -> None:
        _require(
            isinstance(self.tile_numel, int) and not isinstance(self.tile_numel, bool) and self.tile_numel > 0,
            "TilingConfig",
            "tile_numel",
            self.tile_numel,
            "an integer > 0 (weight elements per tile, e.g. 50_000_000)",
        )
        _require(
            self.min_numel is None
            or (isinstance(self.min_numel, int) and not isinstance(self.min_numel, bool) and self.min_numel >= 0),
            "TilingConfig",
            "min_numel",
            self.min_numel,
            "None (= tile_numel) or an integer >= 0 (weight elements)",
        )

    @property
    def threshold(self) -> int:
        """Weight elements above which a layer is tiled."""
        return self.tile_numel if self.min_numel is None else self.min_numel


@dataclass(frozen=True, kw_only=True)
class ZeroPPConfig:
    """ZeRO++ (Wang et al. 2023, arXiv:2306.10209): less communication across nodes.

    Attributes:
        ranks_per_node: Ranks on each node; ranks are numbered node by node, as launchers do.
            ``None``: the Lightning strategy's devices per node, else ``LOCAL_WORLD_SIZE``, else the
            world size (one node). Set it to simulate several nodes on one machine.
        hpz: hpZ (§3.2): after a unit's first gather since the last optimizer step, each rank keeps a
            *secondary partition* (1/``hpz_partition_size`` of the unit) and later gathers of the
            unit (backward, further micro-batches, validation) all-gather those inside the partition
            group, which does not cross nodes. Costs 1/``hpz_partition_size`` of the model per
            rank in memory on the compute device; the partitions are dropped at each optimizer
            step and whenever shards change (a load, an edit).
        hpz_partition_size: Ranks that together hold one secondary copy (consecutive ranks).
            ``None``: ``ranks_per_node``. Must divide the world size; only with ``hpz=True``.
        qwz: qwZ (§3.1): the all-gathers of parameter shards along the trace send blockwise INT8
            codes and one fp32 scale per ``block`` elements, and every rank dequantizes them into the
            full buffer: a quarter of the bytes of fp32 parameters, half of bf16/fp16. The gathered
            weights carry the quantization error (about 0.7% relative L2 on Gaussian values);
            masters, shards and optimizer steps stay exact. Persistent units and
            ``gathered()`` are gathered exactly.
        qgz: qgZ (§3.3): gradients are reduce-scattered as a hierarchical all-to-all of blockwise
            quantized codes instead of an fp32 reduce-scatter: each rank reorders and quantizes its
            flat gradient, the ranks of a node exchange and sum (dequantize, add in fp32,
            requantize), then ranks with the same local rank exchange across nodes and sum into
            the mean of their own partition. Across nodes travels 1/``nodes`` of what a
            reduce-scatter sends, in ``qgz_bits`` codes. The result carries the quantization error
            (about 18% relative L2 per reduction with INT4, 1% with INT8, on independent Gaussian
            gradients); the error of successive steps averages out in training. Under
            ``sharding="hybrid"`` the reduce-scatter stays within the shard group at full precision
            and the all-reduce of each gradient shard across the groups moves the codes instead
            (a reduce-scatter and an all-gather of codes, two quantizations; every group
            dequantizes the same codes, so the groups' copies stay equal).
        qgz_bits: 4 (ZeRO++'s choice) or 8.
        frozen_bits: Store the shards of frozen parameters (``requires_grad=False``: the base model
            of a LoRA fine-tuning) as blockwise INT8 (8) or INT4 (4) codes with one fp32 scale per
            ``block``, quantized once at setup: their all-gathers send the codes as stored and every
            rank dequantizes them for compute only. Shard memory falls to about 1/4 (INT8) or 1/8
            (INT4) of fp32. Checkpoints hold the dequantized values. ``None``: frozen parameters
            are stored like the others. Such shards stay in memory under ``param="nvme"``.
        block: Elements that share one quantization scale (a power of two from 64 to 4096).

    Raises:
        ValueError: a size that is not a positive integer, a ``block`` that is not a power of two
            in [64, 4096], or ``qgz_bits``/``frozen_bits`` other than 4 or 8.
    """

    ranks_per_node: Optional[int] = None
    hpz: bool = False
    hpz_partition_size: Optional[int] = None
    qwz: bool = False
    qgz: bool = False
    qgz_bits: int = 4
    frozen_bits: Optional[int] = None
    block: int = 256

    def __post_init__(self) -> None:
        _require(self.frozen_bits in (None, 4, 8) and not isinstance(self.frozen_bits, bool), "ZeroPPConfig",
                 "frozen_bits", self.frozen_bits, "None, 4 or 8")
        _require(self.qgz_bits in (4, 8) and not isinstance(self.qgz_bits, bool), "ZeroPPConfig", "qgz_bits",
                 self.qgz_bits, "4 or 8")
        for name in ("hpz", "qwz", "qgz"):
            _require(isinstance(getattr(self, name), bool), "ZeroPPConfig", name, getattr(self, name), "True or False")
        _require(
            isinstance(self.block, int) and not isinstance(self.block, bool) and 64 <= self.block <= 4096
            and self.block & (self.block - 1) == 0,
            "ZeroPPConfig",
            "block",
            self.block,
            "a power of two from 64 to 4096 (elements per quantization scale)",
        )
        for name in ("ranks_per_node", "hpz_partition_size"):
            value = getattr(self, name)
            _require(
                value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1),
                "ZeroPPConfig",
                name,
                value,
                "None (automatic) or an integer >= 1 (a number of ranks)",
            )
        # Ignored without hpZ: a size given alone (DeepSpeed's zero_hpz_partition_size turns hpZ on)
        # would otherwise leave the user believing hpZ runs.
        _require(self.hpz or self.hpz_partition_size is None, "ZeroPPConfig", "hpz_partition_size",
                 self.hpz_partition_size, "None unless hpz=True (set hpz=True for the hierarchical partition)")


# Signals a scheduler sends ahead of ending a job; not SIGKILL/SIGSTOP (they cannot be caught), nor
# SIGCONT (SLURM sends it with SIGTERM, and to resume a suspended job) or the fault signals.
PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP", "SIGQUIT", "SIGXCPU")


@dataclass(frozen=True, kw_only=True)
class PreemptionConfig:
    """What a rank does when the scheduler signals that the job is about to end (a preemption, a
    time limit, a node drain): save and stop cleanly, every rank at the same step.

    A signal in ``signals`` delivered to any one rank is only recorded by its handler (no I/O, no
    collective inside it). At the end of each training step that stepped the optimizer, the ranks
    agree whether any of them received one (one all-reduce of one integer, on a gloo group); if so
    every rank stops at that same step, the checkpoint is saved (collectively) and every process
    exits with ``exit_code``. Resuming from that checkpoint (``trainer.fit(..., ckpt_path="last")``)
    continues exactly as the run would have. See :mod:`lightning_zinf.preemption`.

    Attributes:
        enabled: Handle the signals. ``False``: the strategy installs no handler, and the signals
            keep the handling the process had before the Trainer ran (for SIGTERM and SIGUSR1 by
            default: the process ends); Lightning's own SIGTERM handler, which runs collectives
            inside the handler, is not installed under this strategy either way.
        signals: The signals that stop the run, by name (``"SIGTERM"``, ``"TERM"``) or number:
            any of ``SIGTERM`` (SLURM's and Kubernetes' notice before they end a job),
            ``SIGUSR1`` (what SLURM sends ``--signal=USR1@<seconds>`` before a time limit, and
            Lightning's SLURM requeue signal), ``SIGUSR2``, ``SIGINT``, ``SIGHUP``, ``SIGQUIT``,
            ``SIGXCPU`` (the CPU time limit warning of SGE and LSF). Under torchrun, add those
            other than SIGTERM, SIGINT, SIGHUP and SIGQUIT to ``--signals-to-handle`` for the agent
            to forward them to the workers.
        checkpoint: Where the Trainer saves: ``"last"`` (the Trainer's ModelCheckpoint's last
            checkpoint, ``<dirpath>/last.ckpt``, which ``trainer.fit(..., ckpt_path="last")``
            finds; a Trainer without a ModelCheckpoint saves as ``"hpc"``), ``"hpc"`` (Lightning's
            preemption checkpoint, ``<default_root_dir>/hpc_ckpt_<n>.ckpt``, which
            ``ckpt_path="hpc"`` loads, and which a Trainer started by SLURM resumes from when
            ``ckpt_path`` is not given), or a path. Fabric loops save where they choose.
        exit_code: The exit status of every process after the save (a process that Lightning's
            launcher started itself, a rank > 0 of ``python train.py``, exits 0 instead, so that
            the launching process, whose status the scheduler sees, is not killed as after a
            crash). ``None`` (default): 128 + the signal's number, the status a shell and a
            container runtime report for a process the signal killed (143 for SIGTERM, 138 for
            SIGUSR1): non-zero, so torchrun, a Kubernetes Job and SLURM do not take the run for
            finished, and matched by the rules that already cover a job killed by the signal
            (Kubernetes ``podFailurePolicy.onExitCodes``, SLURM's ``RequeueExit``). An integer
            from 0 to 255 otherwise (0 marks the job successful: nothing requeues it).

    Raises:
        ValueError: ``enabled`` not a bool; an empty ``signals`` while enabled, or a signal that is
            unknown or not one of those above; ``checkpoint`` empty or not a string or path; an
            ``exit_code`` outside 0-255.
    """

    enabled: bool = True
    signals: Sequence[Union[str, int]] = ("SIGTERM", "SIGUSR1")
    checkpoint: str = "last"
    exit_code: Optional[int] = None

    def __post_init__(self) -> None:
        _require(isinstance(self.enabled, bool), "PreemptionConfig", "enabled", self.enabled, "True or False")
        allowed = f"a non-empty list of signal names or numbers among {', '.join(PREEMPTION_SIGNALS)}"
        signals = (self.signals,) if isinstance(self.signals, (str, int)) else self.signals
        _require(isinstance(signals, (list, tuple)) and (len(signals) > 0 or not self.enabled), "PreemptionConfig",
                 "signals", self.signals, allowed + " (or enabled=False)")
        names = []
        for value in signals:
            name = _signal_name(value)
            _require(name in PREEMPTION_SIGNALS, "PreemptionConfig", "signals", value, allowed)
            if name not in names:
                names.append(name)
        object.__setattr__(self, "signals", tuple(names))  # frozen: normalised once, here
        checkpoint = os.fspath(self.checkpoint) if isinstance(self.checkpoint, os.PathLike) else self.checkpoint
        _require(isinstance(checkpoint, str) and checkpoint.strip() != "", "PreemptionConfig", "checkpoint",
                 self.checkpoint, "'last', 'hpc' or a path (a non-empty string)")
        object.__setattr__(self, "checkpoint", checkpoint)
        _require(self.exit_code is None or (isinstance(self.exit_code, int) and not isinstance(self.exit_code, bool)
                                            and 0 <= self.exit_code <= 255),
                 "PreemptionConfig", "exit_code", self.exit_code,
                 "None (128 + the signal's number) or an integer from 0 to 255")


def _signal_name(value: Any) -> Optional[str]:
    """``value`` (``"SIGTERM"``, ``"term"``, ``15``, ``signal.SIGTERM``) as a signal's name, or
    ``None`` when it names no signal of this platform."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        try:
            return signal.Signals(value).name
        except ValueError:
            return None
    if isinstance(value, str):
        name = value.strip().upper()
        name = name if name.startswith("SIG") else "SIG" + name
        return name if isinstance(getattr(signal, name, None), signal.Signals) else None
    return None


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16, "16": torch.float16}


def _dtype(owner: str, field: str, value: Any) -> Optional[torch.dtype]:
    """``value`` as a floating torch dtype: a ``torch.dtype`` or a name (``"bf16"``, ``"bfloat16"``,
    ``"torch.bfloat16"``...), for YAML configs; ``None`` stays ``None``."""
    if value is None or isinstance(value, torch.dtype) and value in _DTYPES.values():
        return value
    key = str(value).removeprefix("torch.").lower() if isinstance(value, (str, torch.dtype)) else None
    _require(key in _DTYPES, owner, field, value, "None, torch.float32, torch.bfloat16 or torch.float16 (or their "
             "names: 'fp32', 'bf16', 'fp16', 'float32', 'bfloat16', 'float16')")
    return _DTYPES[key]


@dataclass(frozen=True, kw_only=True)
class MixedPrecisionConfig:
    """The precision policy of the engine: the dtype units are gathered and computed in, and the
    dtype gradients are reduce-scattered in (the semantics of FSDP2's ``MixedPrecisionPolicy`` and
    of DeepSpeed's ``bf16``/``fp16`` modes; Micikevicius et al., "Mixed Precision Training", 2018).

    The parameters keep their own dtype in the shards (the fp32 masters the optimizer steps, and
    what checkpoints and :meth:`~lightning_zinf.ZeroEngine.gathered` show). Each shard is cast to
    ``param_dtype`` *before* the all-gather, so a bf16 gather moves half of fp32's bytes, and forward
    and backward run on the gathered ``param_dtype`` weights: autocast then has nothing to cast for
    them, so neither its weight cache nor autograd keeps a second copy of a gathered weight.
    Gradients come out of backward in ``param_dtype``, are reduce-scattered in ``reduce_dtype`` and
    accumulated into fp32 gradient shards. Frozen parameters are gathered in ``param_dtype`` too.

    The ``zero_infinity`` strategy derives the policy from ``Trainer(precision=...)`` unless one is
    given: ``"bf16-mixed"`` -> ``param_dtype=bfloat16, reduce_dtype=float32``; ``"16-mixed"`` ->
    ``param_dtype=float16, reduce_dtype=float32``; the ``-true`` precisions -> no cast
    (``param_dtype=None``). See the docs' Precision page (``docs/precision.md``) for what each setting moves and keeps.

    Attributes:
        param_dtype: Dtype of gathered floating-point parameters (``torch.bfloat16``,
            ``torch.float16``, ``torch.float32``, or a name such as ``"bf16"``). ``None``: each
            parameter's own dtype (no cast).
        reduce_dtype: Dtype of the gradient reduce-scatter (and of its qgZ codes' input).
            ``None``: ``float32``. Whatever it is, gradients accumulate into fp32 shards.
        cast_forward_inputs: Cast floating-point tensors among the arguments of every module that
            gathers a unit to ``param_dtype`` before its forward (FSDP2's option of the same name),
            so an op outside autocast's lists (a LayerNorm fed an fp32 tensor, which the CPU cannot
            mix with bf16 weights) sees one dtype. Only with a ``param_dtype``.
        frozen_dtype: Dtype the shards of frozen floating-point parameters (``requires_grad=False``:
            the base model of a LoRA fine-tuning) are stored in, converted once at setup. ``None``:
            their own dtype, exact (FSDP2 keeps them so). With ``param_dtype=bf16``, ``"bf16"``
            halves an fp32 base's shard memory and changes no computed value, since the frozen
            shards are cast to bf16 for every gather anyway (DeepSpeed's bf16 mode keeps the whole
            model in bf16). The frozen parameters are then that dtype in state dicts, checkpoints
            and :meth:`~lightning_zinf.ZeroEngine.gathered`, as after ``module.to(dtype)``.

    Raises:
        ValueError: a dtype that is not one of the three floating types above (or their names).
    """

    param_dtype: Optional[Union[torch.dtype, str]] = None
    reduce_dtype: Optional[Union[torch.dtype, str]] = None
    cast_forward_inputs: bool = True
    frozen_dtype: Optional[Union[torch.dtype, str]] = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "frozen_dtype"):
            object.__setattr__(self, name, _dtype("MixedPrecisionConfig", name, getattr(self, name)))
        _require(isinstance(self.cast_forward_inputs, bool), "MixedPrecisionConfig", "cast_forward_inputs",
                 self.cast_forward_inputs, "True or False")

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a parameter of ``dtype`` is gathered and computed in."""
        return self.param_dtype if self.param_dtype is not None and dtype.is_floating_point else dtype

    def storage_dtype(self, dtype: torch.dtype, trainable: bool) -> torch.dtype:
        """The dtype the shards of a parameter of ``dtype`` are stored in: ``frozen_dtype`` for a
        frozen (``trainable=False``) floating-point parameter when it is set, else ``dtype``."""
        return self.frozen_dtype if self.frozen_dtype is not None and not trainable and dtype.is_floating_point else dtype

    @property
    def gradient_reduce_dtype(self) -> torch.dtype:
        """The dtype of gradient reduce-scatters (``reduce_dtype``, default fp32)."""
        return self.reduce_dtype if self.reduce_dtype is not None else torch.float32


def coerce_config(cls: type[_C], value: _C | Mapping[str, Any] | None) -> _C:
    """Build config ``cls`` from an instance, a mapping of its fields, or ``None`` (defaults).

    Args:
        cls: A frozen config dataclass such as :class:`PrefetchConfig`.
        value: An instance of ``cls`` (returned as is), a mapping of field names to values, or ``None``.

    Returns:
        An instance of ``cls``.

    Raises:
        ValueError: the mapping names a field ``cls`` does not have (the message suggests the closest
            valid name and lists them all), or a field's value is invalid.
        TypeError: ``value`` is neither ``None``, a mapping nor a ``cls``.
    """
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
        for key in value:
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"{cls.__name__} has no option {key!r}.{hint} Valid options: {', '.join(names)}.")
        return cls(**value)
    raise TypeError(f"Expected a {cls.__name__} or a mapping of its fields, got {type(value).__name__}.")


#: Lightning's ``FSDPStrategy(sharding_strategy=...)`` names (and torch FSDP's ``ShardingStrategy``
#: members) for the modes this engine has.
_SHARDING_ALIASES = {"full": "full", "full_shard": "full", "grad_op": "grad_op", "shard_grad_op": "grad_op",
                     "hybrid": "hybrid", "hybrid_shard": "hybrid", "auto": "auto"}


def sharding_mode(value: Any) -> str:
    """``sharding`` normalised: ``"full"``, ``"grad_op"``, ``"hybrid"`` or ``"auto"`` (the
    strategies' choice at setup), from those names or Lightning's ``"FULL_SHARD"`` /
    ``"SHARD_GRAD_OP"`` / ``"HYBRID_SHARD"`` (any case, or torch's ``ShardingStrategy`` members).

    Raises:
        ValueError: another value (``"_HYBRID_SHARD_ZERO2"`` and ``"NO_SHARD"`` included: the
            message names the modes there are).
    """
    name = getattr(value, "name", value)
    mode = _SHARDING_ALIASES.get(name.lower()) if isinstance(name, str) else None
    if mode is None:
        nearest = {"no_shard": "NO_SHARD keeps every parameter on every rank: use Lightning's 'ddp' strategy, or "
                               "sharding='hybrid' with shard_group_size=1 (DDP's layout). ",
                   "_hybrid_shard_zero2": "_HYBRID_SHARD_ZERO2 (ZeRO-2 within a group) is not available; the "
                                          "nearest are 'hybrid' (ZeRO-3 within the group) and 'grad_op'. "}
        close = difflib.get_close_matches(name.lower(), list(_SHARDING_ALIASES), n=1) if isinstance(name, str) else []
        raise ValueError(
            f"sharding={value!r}: "
            + nearest.get(name.lower() if isinstance(name, str) else "", "")
            + (f"Did you mean {close[0]!r}? " if close and name.lower() not in nearest else "")
            + "Use 'full' (ZeRO-3, Lightning's 'FULL_SHARD': parameters gathered for each "
            "forward and again for backward), 'grad_op' (ZeRO-2, 'SHARD_GRAD_OP': gathered parameters kept from "
            "forward to backward; gradients and optimizer state sharded) or 'hybrid' ('HYBRID_SHARD', MiCS: "
            "ZeRO-3 within groups of shard_group_size ranks, by default a node, replicated across the groups), or "
            "'auto' (full or hybrid, with or without ZeRO++'s quantized collectives, chosen by the strategy at setup "
            "from the measured links).")
    return mode
