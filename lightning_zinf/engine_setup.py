"""The engine built from the strategies' options, the same way for the Trainer and for Fabric, with
the pretrained full weights ``load_full_weights`` names loaded into it."""

from __future__ import annotations

import dataclasses
import logging
import os
from datetime import timedelta
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, TypeVar, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from lightning_zinf.checkpoint import CheckpointError, checkpoint_keys, load_full_state_dicts, matching_prefix, \
    provided_parameters
from lightning_zinf.config import MixedPrecisionConfig
from lightning_zinf.engine import ZeroEngine
from lightning_zinf.heap import keep_within
from lightning_zinf.options import ZeroOptions
from lightning_zinf.engine.grouping import auto_blocks, unit_size_for
from lightning_zinf.engine.partition import matches_classes, resolve_block_classes
from lightning_zinf.planning import Inventory, MemoryPlan, plan_memory
from lightning_zinf.planning.activations import ActivationPlan
from lightning_zinf.planning.cost import Placement
from lightning_zinf.planning.sharding import ShardingChoice, auto_sharding
from lightning_zinf.offload import SwapError
from lightning_zinf.planning.bandwidth import measure_bandwidths, measure_collective
from lightning_zinf.planning.profile import ForwardProfile, profile_forward, time_blocks

__all__ = ["build_engine", "checkpointed_layers", "memory_plan"]

log = logging.getLogger(__name__)


def build_engine(
    module: nn.Module,
    options: ZeroOptions,
    *,
    device: torch.device,
    ranks_per_node: int,
    precision: MixedPrecisionConfig,
    loss_scaling: bool,
    timeout: Optional[timedelta],
    auto_pass: bool,
) -> ZeroEngine:
    """Partition ``module`` with ``options`` (and load ``options.load_full_weights`` into it).

    Args:
        module: The model (the LightningModule, or the module given to Fabric), on the meta device
            or real.
        options: The strategy's options.
        device: This rank's compute device.
        ranks_per_node: Processes per node, as the launcher numbers ranks (node by node); used
            unless ``options.zero_pp.ranks_per_node`` says otherwise.
        precision: The policy derived from the precision plugin, used unless
            ``options.mixed_precision`` is given.
        loss_scaling: The precision plugin scales the loss (fp16): refused with NVMe optimizer offload.
        timeout: How long the engine's own process groups wait for other ranks.
        auto_pass: The engine starts a trace pass at each forward of ``module`` (Fabric) rather
            than at each step the driver marks (the Trainer).

    Returns:
        The :class:`~lightning_zinf.engine.ZeroEngine` (also ``module._zinf_engine``).

    Raises:
        ValueError: fp16 loss scaling with NVMe optimizer offload.
        BudgetError: ``options.memory_budget`` fits no placement (:func:`memory_plan`).
        CheckpointError: ``load_full_weights`` is not a readable checkpoint of this model, or (a
            mapping) a prefix names no submodule of ``module``, or none of a checkpoint's keys names a
            parameter or buffer under its prefix.

    Warns:
        UserWarning: ``options.activation_checkpointing`` is set but the model already checkpoints
            some layers itself (:func:`checkpointed_layers`); the option is then ignored.
    """
    # The units pinned before any plan: a plan may lower the prefetch bucket, which must not
    # regroup the modules it planned for (unit_size=None follows the bucket).
    options = dataclasses.replace(options, prefetch=dataclasses.replace(options.prefetch, unit_size=_unit_size(options)))
    choice = None
    if options.sharding == "auto":
        options, choice = _auto_sharding(module, options, device, options.mixed_precision or precision, ranks_per_node,
                                         timeout)
    plan = memory_plan(module, options, device=device, precision=options.mixed_precision or precision,
                       loss_scaling=loss_scaling, ranks_per_node=ranks_per_node)
    if plan is not None:
        rank_zero_info(plan.describe())
        # The options the engine runs with: the plan's tiers and sizes, chosen (no budget left to plan).
        options = dataclasses.replace(options, offload=plan.offload_config(options.offload), prefetch=plan.prefetch,
                                      memory_budget=None, host_memory_budget=None, activation_memory=None)
    if loss_scaling and options.offload.optimizer == "nvme":
        raise ValueError(
            "precision='16-mixed' (fp16 loss scaling) does not work with OffloadConfig(optimizer='nvme'): the "
            "gradients are on disk between backward and the optimizer step, so the scaler cannot unscale them "
            "or check them for inf/NaN. Use precision='bf16-mixed' (no scaler), or optimizer='cpu'."
        )
    parts = _weight_parts(module, options)
    preloaded = [name for part in parts for name in provided_parameters(module, part.keys, part.prefix)]
    engine = ZeroEngine(
        module,
        block_classes=options.block_classes,
        prefetch=options.prefetch,
        offload=options.offload,
        device=device,
        auto_pass=auto_pass,
        tiling=options.tiling,
        zero_pp=dataclasses.replace(options.zero_pp, ranks_per_node=options.zero_pp.ranks_per_node or ranks_per_node),
        mixed_precision=options.mixed_precision or precision,
        activation_checkpointing=_activation_checkpointing(module, options.activation_checkpointing),
        timeout=timeout,
        preloaded=preloaded,
        sharding=options.sharding,
        shard_group_size=options.shard_group_size,
    )
    engine.memory_plan = plan
    engine.sharding_choice = choice
    if engine.unit_size and not options.block_classes:
        rank_zero_info(f"lightning_zinf: modules grouped into {len(engine.units)} units of at most "
                       f"{engine.unit_size:,} elements (PrefetchConfig.unit_size; block_classes names the "
                       "units instead)")
    if options.sharding == "hybrid":
        comm = engine.comm
        rank_zero_info(f"lightning_zinf: hybrid sharding: {comm.replicas} groups of {comm.shard_size} consecutive ranks"
                       + (" (one group of every rank: the same as sharding='full'"
                          + (", and qgZ has nothing to quantize: it quantizes only what crosses between groups"
                             if options.zero_pp.qgz else "")
                          + "; set shard_group_size, or the ranks per node, below the world size)"
                          if comm.replicas == 1 else
                          ", each holding the sharded state; gradient shards all-reduced across the groups"))
    # Host memory under a budget: the heap keeps no more free memory than the budget leaves.
    if plan is not None and not plan.accelerator:
        keep_within(plan.budget - plan.prediction.total(False) - plan.activations - plan.activation_bytes)
    elif plan is not None and plan.host_budget is not None:
        keep_within(plan.host_budget - plan.prediction.host - plan.host_activations)
    if plan is not None and not options.activation_checkpointing and not checkpointed_layers(module):
        blocks = _blocks(module, options.block_classes)
        if blocks:
            engine.activation_plan = ActivationPlan(blocks, plan.budget, plan.prediction.total(plan.accelerator),
                                                    engine.states.holds_storage_of, kept=plan.kept_blocks,
                                                    offloaded=plan.offloaded_blocks, offload=engine.offload_activations)
            if auto_pass and plan.kept_blocks is None:  # Fabric: the model's forward is the training forward
                engine.activation_plan.scope_every_forward(module)
    if parts:
        _load_full_weights(engine, parts, preloaded)
    return engine


def memory_plan(module: nn.Module, options: ZeroOptions, *, device: torch.device, precision: MixedPrecisionConfig,
                loss_scaling: bool = False, world: Optional[int] = None, ranks_per_node: int = 1) -> Optional[MemoryPlan]:
    """The placement ``options.memory_budget`` gives ``module`` over this process group's ranks
    (:func:`~lightning_zinf.planning.plan_memory`), or ``None`` without a budget. The model may
    be on the meta device; nothing is built or moved. ``world``: the ranks it will be sharded over
    (default: the process group's, else 1). The disk and host link are measured on rank 0
    (:func:`~lightning_zinf.planning.bandwidth.measure_bandwidths`), which every rank then uses,
    the disk's shared among the ``ranks_per_node`` ranks of a node. With fp16 loss scaling (``loss_scaling``)
    the optimizer state stays off NVMe, where the scaler could not check the gradients.

    Raises:
        BudgetError: no placement fits the budget (the message names the smallest that would).
        SwapError: rank 0 could not measure the disk under ``nvme_path`` (every rank raises it).

    What the plan would override or cannot count (given offload tiers, hpZ, qwZ, ``frozen_bits``,
    ``tiling``) is refused earlier, by :class:`~lightning_zinf.options.ZeroOptions`.
    """
    if options.memory_budget is None:
        return None
    distributed = dist.is_available() and dist.is_initialized()
    if world is None:
        world = dist.get_world_size() if distributed else 1
    if options.sharding == "hybrid":  # the state is sharded over one shard group
        world = options.shard_group_size or options.zero_pp.ranks_per_node or ranks_per_node
    bandwidths = _on_rank_0(lambda: measure_bandwidths(device, options.offload.nvme_path, options.offload.aio),
                            distributed, "measuring the disk and host link for memory_budget")
    if bandwidths.disk:  # the ranks of a node share its disk
        bandwidths = dataclasses.replace(bandwidths, disk=bandwidths.disk / max(ranks_per_node, 1))
    if distributed:
        bandwidths = dataclasses.replace(bandwidths, collective=measure_collective(device))
    inventory = Inventory.of(module, world=world, block_classes=options.block_classes, mixed_precision=precision,
                             persistence_threshold=options.prefetch.persistence_threshold,
                             persistence_limit=options.prefetch.persistence_limit, unit_size=_unit_size(options))
    return plan_memory(inventory, options.memory_budget, accelerator=device.type != "cpu", offload=options.offload,
                       prefetch=options.prefetch, host_budget=options.host_memory_budget,
                       optimizer_on_nvme=not loss_scaling, bandwidths=bandwidths,
                       activation_bytes=options.activation_memory or 0,
                       profile=_example_profile(module, options, device, precision, distributed),
                       plan_activations=_plans_activations(module, options), sharding=options.sharding,
                       replicas=max(1, (dist.get_world_size() if distributed else 1) // world))


def _auto_sharding(module: nn.Module, options: ZeroOptions, device: torch.device, precision: MixedPrecisionConfig,
                   ranks_per_node: int, timeout: Optional[timedelta]) -> tuple[ZeroOptions, ShardingChoice]:
    """``sharding="auto"``: the options with the mode and ZeRO++ switches
    :func:`~lightning_zinf.planning.sharding.auto_sharding` chooses (collective), the step's compute
    taken from ``example_input_array`` where the model has one (:func:`_example_profile`); the
    choice is logged on rank 0."""
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    per_node = options.zero_pp.ranks_per_node or ranks_per_node
    # The probes and the block timing draw random values: the run's random state is left as it
    # was, so a seeded run under auto trains as the same mode given by hand.
    with torch.random.fork_rng(devices=[device] if device.type != "cpu" else [], device_type=device.type):
        return _auto_choice(module, options, device, precision, world, per_node, distributed, timeout)


def _auto_choice(module: nn.Module, options: ZeroOptions, device: torch.device, precision: MixedPrecisionConfig,
                 world: int, per_node: int, distributed: bool,
                 timeout: Optional[timedelta]) -> tuple[ZeroOptions, ShardingChoice]:
    # The compute is timed on blocks: without block_classes, on the modules the units are made of.
    timing = options if options.block_classes else dataclasses.replace(options, block_classes=_unit_classes(module,
                                                                                                             options))
    profile = _example_profile(module, timing, device, precision, distributed, at_once=True) \
        if world // per_node > 1 else None
    compute = (3 * profile.flops * profile.seconds_per_flop  # backward is two forwards
               if profile is not None and profile.seconds_per_flop is not None else None)
    choice = auto_sharding(module, world=world, ranks_per_node=per_node, device=device,
                           block_classes=tuple(options.block_classes), mixed_precision=precision,
                           persistence_threshold=options.prefetch.persistence_threshold,
                           persistence_limit=options.prefetch.persistence_limit,
                           bucket_size=options.prefetch.bucket_size, unit_size=_unit_size(options),
                           prefetch_enabled=options.prefetch.enabled,
                           placement=Placement(param=options.offload.param, optimizer=options.offload.optimizer),
                           compute=compute, timeout=timeout)
    rank_zero_info(f"lightning_zinf: {choice.describe()}")
    zero_pp = dataclasses.replace(options.zero_pp, hpz=choice.zero_pp.hpz, qwz=choice.zero_pp.qwz,
                                  qgz=choice.zero_pp.qgz, qgz_bits=choice.zero_pp.qgz_bits)
    return dataclasses.replace(options, sharding=choice.sharding, zero_pp=zero_pp), choice


def _unit_classes(module: nn.Module, options: ZeroOptions) -> list[type]:
    """The classes of the modules the engine groups into units when no ``block_classes`` are
    given (:func:`~lightning_zinf.engine.grouping.auto_blocks`), in module order: blocks to time
    the step's compute on. Empty without grouping (``unit_size`` 0)."""
    size = _unit_size(options)
    return list(dict.fromkeys(type(m) for run in auto_blocks(module, size) for m in run)) if size else []


def _unit_size(options: ZeroOptions) -> int:
    """The elements per unit the engine will group the modules into (0: none), for a plan to count alike."""
    return unit_size_for(options.block_classes, options.prefetch.unit_size, options.prefetch.bucket_size)


def _plans_activations(module: nn.Module, options: ZeroOptions) -> bool:
    """The plan chooses which blocks checkpoint (the user checkpoints none of them already)."""
    return not options.activation_checkpointing and not checkpointed_layers(module)


def _example_profile(module: nn.Module, options: ZeroOptions, device: torch.device, precision: MixedPrecisionConfig,
                     distributed: bool, at_once: bool = False) -> Optional[ForwardProfile]:
    """The forward on ``module.example_input_array`` (Lightning's convention), profiled on every rank
    with fake tensors and timed (one block of each class run for real: on a CPU device by rank 0
    alone unless ``at_once``, on an accelerator by every rank at once, the slowest rank's rates), or ``None`` without an example
    or when its forward needs real values (:func:`~lightning_zinf.planning.profile.profile_forward`).
    Every rank plans with rank 0's profile, or with none if any rank has none (an example on some
    ranks only, or one that ran on fake tensors on some only): the plans must agree, and examples
    of other shapes on other ranks would give other counts."""
    example = getattr(module, "example_input_array", None)
    blocks = _blocks(module, options.block_classes)
    dtype = precision.param_dtype
    own = None if example is None else profile_forward(module, example, blocks, device=device, dtype=dtype)
    profile = own
    if distributed and dist.get_world_size() > 1:
        # Without the blocks' arguments (meta tensors only this rank's timing reads).
        sent = None if own is None else dataclasses.replace(
            own, blocks=tuple(dataclasses.replace(b, arguments=((), {})) for b in own.blocks))
        profiles: list[Optional[ForwardProfile]] = [None] * dist.get_world_size()
        dist.all_gather_object(profiles, sent)
        if any(p is None for p in profiles):
            if any(p is not None for p in profiles):
                rank_zero_info("lightning_zinf: example_input_array was profiled on some ranks only (missing, or not "
                               "run on fake tensors, on the others); activations are planned from the first training "
                               "step instead.")
            return None
        profile = profiles[0]
    if own is None or profile is None:
        return None
    def timed() -> tuple[Optional[float], Optional[float]]:
        try:
            measured = time_blocks(own, blocks, device=device, dtype=dtype)
        except Exception as error:  # a block that does not run on random inputs: compute not predicted
            log.info("lightning_zinf: timing a block for the memory plan failed (%s: %s); the plan weighs the "
                     "traffic alone.", type(error).__name__, error)
            return None, None
        return measured.seconds_per_flop, measured.recompute_seconds_per_flop

    if device.type == "cpu" and not at_once:
        # On a CPU device rank 0 times alone, the others waiting: ranks timing at once on shared
        # cores measured a recompute of 1.1 forwards, where training showed 0.5 (its recompute
        # fills the backward's waits on gloo) and rank 0 alone 0.65, its plain rate within 5% of a
        # real step's (RESULTS.md, issue 40, session 24).
        rates = _on_rank_0(timed, distributed, "timing a block")
    else:
        # On accelerators every rank times at once: a block with a collective inside
        # (SyncBatchNorm) finds every rank there. The slowest rank's rates count. So does
        # sharding="auto"'s plain rate on a CPU device: the ranks compute at once in training, and
        # the cores a machine's ranks share (the two-node testbed: 4 ranks on 2 cores) slow each.
        rates = timed()
        if distributed and dist.get_world_size() > 1:
            every: list[tuple[Optional[float], Optional[float]]] = [(None, None)] * dist.get_world_size()
            dist.all_gather_object(every, rates)
            rates = (None, None) if any(r[0] is None for r in every) else \
                (max(r[0] for r in every), max(r[1] or 0.0 for r in every))
    return dataclasses.replace(profile, seconds_per_flop=rates[0], recompute_seconds_per_flop=rates[1])


T = TypeVar("T")


def _on_rank_0(measure: Callable[[], T], distributed: bool, what: str) -> T:
    """Rank 0's ``measure()``, on every rank (every rank must make the same plan). A measurement
    that fails on rank 0 raises :class:`SwapError` with rank 0's message on every rank, so that no
    rank waits in the broadcast for a result that never comes."""
    measured: Any = None
    failure: Optional[Exception] = None
    if not distributed or dist.get_rank() == 0:
        try:
            measured = (measure(),)
        except Exception as error:  # sent as its message: any exception type, pickled or not
            failure = error
            measured = str(error) if isinstance(error, SwapError) else \
                f"{what} failed on rank 0: {type(error).__name__}: {error}"
    if distributed and dist.get_world_size() > 1:
        shared = [measured]
        dist.broadcast_object_list(shared, src=0)
        measured = shared[0]
    if isinstance(measured, str):
        raise SwapError(measured) from failure
    return measured[0]


def _blocks(module: nn.Module, block_classes: Sequence[Union[str, type]]) -> list[tuple[str, nn.Module]]:
    """The instances of ``block_classes`` in ``module``, outermost only, in module order: what a
    memory plan may checkpoint (:class:`~lightning_zinf.planning.activations.ActivationPlan`)."""
    if not block_classes:
        return []
    classes, names = resolve_block_classes(block_classes)
    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if matches_classes(sub, classes, names) is not None and not any(name.startswith(f + ".") for f, _ in found):
            found.append((name, sub))
    return found


def checkpointed_layers(module: nn.Module) -> list[str]:
    """The qualified names of ``module``'s submodules that already run under activation checkpointing
    set up outside the strategy: torch's ``CheckpointWrapper`` (``checkpoint_wrapper``,
    ``apply_activation_checkpointing``; what Lightning's ``FSDPStrategy`` looks for) and Hugging Face
    modules after ``gradient_checkpointing_enable()`` (their ``gradient_checkpointing`` is ``True``).
    Checkpointing called inside a ``forward`` (``torch.utils.checkpoint``) cannot be seen."""
    return [name for name, sub in module.named_modules()
            if isinstance(sub, CheckpointWrapper) or getattr(sub, "gradient_checkpointing", False) is True]


def _activation_checkpointing(module: nn.Module, classes: Sequence[Union[str, type]]) -> Sequence[Union[str, type]]:
    """``classes``, or none (with a warning) when the model checkpoints some layers itself: wrapping
    a layer inside a checkpointed one would recompute it twice in backward. Lightning's FSDP
    strategies make the same choice, with the same warning."""
    if not classes:
        return classes
    present = checkpointed_layers(module)
    if not present:
        return classes
    rank_zero_warn(
        f"activation_checkpointing={[getattr(c, '__name__', c) for c in classes]} is configured, but the model "
        f"already contains checkpointed layers ({', '.join(present[:5])}{' ...' if len(present) > 5 else ''}). "
        "The strategy's checkpointing is ignored; to use it instead, remove the model's own (checkpoint_wrapper, "
        "gradient_checkpointing_enable()) or leave activation_checkpointing unset."
    )
    return ()


class _WeightPart(NamedTuple):
    """One checkpoint of ``load_full_weights`` and where it loads."""

    key: Optional[str]  # the mapping's key (ends in a dot, or ""); None for a single checkpoint
    prefix: str  # where its model's parameters sit in the module (``key`` and the model's own prefix)
    source: Union[str, os.PathLike]
    keys: set[str]  # its tensor names


def _weight_parts(module: nn.Module, options: ZeroOptions) -> list[_WeightPart]:
    """The checkpoints ``options.load_full_weights`` names, each with the prefix it loads under
    (read from headers only; the load reads the values). A single checkpoint loads under
    ``load_prefix``, by default the prefix under which the most of its keys name a parameter; a
    mapping's checkpoint loads under its key, or under the submodule of it where the most of its
    keys name a parameter (``"actor."`` holding a PEFT model loads at ``"actor.base_model.model."``).

    Raises:
        CheckpointError: a checkpoint cannot be read; a mapping's key names no submodule of
            ``module`` (the message lists its top-level submodules), or none of its checkpoint's
            keys names a parameter or buffer under it.
    """
    weights = options.load_full_weights
    if weights is None:
        return []
    if not isinstance(weights, Mapping):
        keys = checkpoint_keys(weights)
        prefix = options.load_prefix if options.load_prefix is not None else matching_prefix(module, keys)
        return [_WeightPart(None, prefix, weights, keys)]
    submodules = dict(module.named_modules(remove_duplicate=False))
    parts = []
    for key, source in weights.items():
        name = key[:-1]  # keys end in a dot (ZeroOptions), but the whole module's, ""
        if name not in submodules:
            raise CheckpointError(
                f"load_full_weights: the prefix {key!r} names no submodule of {type(module).__name__}; its top-level "
                f"submodules are {[n for n, _ in module.named_children()]}."
            )
        keys = checkpoint_keys(source)
        try:
            inner = matching_prefix(submodules[name], keys)
        except CheckpointError:
            raise CheckpointError(
                f"load_full_weights[{key!r}]={str(source)!r}: none of its keys ({sorted(keys)[:5]} ...) names a "
                f"parameter or buffer of {key!r} ({type(submodules[name]).__name__}) or of a submodule of it. Check "
                "that the prefix names the module this checkpoint was saved from."
            ) from None
        parts.append(_WeightPart(key, key + inner, source, keys))
    return parts


def _load_full_weights(engine: ZeroEngine, parts: list[_WeightPart], preloaded: list[str]) -> None:
    """Load ``parts`` into ``engine``'s model in one pass (:func:`load_full_state_dicts`), refuse
    entries that match no parameter, and log what was loaded and what keeps its initialisation."""
    unexpected = load_full_state_dicts(engine, {part.prefix: part.source for part in parts}, strict=False)
    for part in parts:
        extra = unexpected[part.prefix]
        if not extra:
            continue
        option = (f"load_full_weights={str(part.source)!r}" if part.key is None
                  else f"load_full_weights[{part.key!r}]={str(part.source)!r}")
        advice = ("pass load_prefix= where the model sits in the LightningModule (e.g. 'model.')" if part.key is None
                  else "give the prefix of the module it was saved from")
        under = f"load_prefix={part.prefix!r}" if part.key is None else f"the prefix {part.prefix!r}"
        raise CheckpointError(
            f"{option}: {len(extra)} of its entries match no parameter or buffer of the model under {under}: "
            f"{extra[:10]}{' ...' if len(extra) > 10 else ''}. Check that it is this model's checkpoint, and {advice}."
        )
    loaded = set(preloaded)
    fresh = [n for n, _ in engine.module.named_parameters() if n not in loaded]
    for part in parts:
        count = sum(1 for n in preloaded if n.startswith(part.prefix))
        rank_zero_info(f"zero_infinity: loaded {count} parameters from {part.source} (prefix {part.prefix!r})")
    rank_zero_info(
        f"zero_infinity: {len(fresh)} parameters are in no checkpoint and keep their initialisation"
        + (f": {fresh[:10]}{' ...' if len(fresh) > 10 else ''}" if fresh else "")
    )
