"""What the Trainer strategy and the Fabric strategy share: their options, how they build the
engine from them, the distributed set-up, and the registered presets.

Both adapters are thin: :class:`~lightning_zinf.strategy.ZeroInfinityStrategy` maps the Trainer's
lifecycle and :class:`~lightning_zinf.fabric.ZeroInfinityFabricStrategy` Fabric's calls onto one
:class:`~lightning_zinf.engine.ZeroEngine`, built here the same way for both, so a model trained
with one saves checkpoints the other loads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    ReduceOp,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utilities_rank_zero_only
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from lightning_zinf.checkpoint import CheckpointError, checkpoint_keys, load_full_state_dicts, matching_prefix, \
    overlapping_prefixes, provided_parameters
from lightning_zinf.comm.watch import RankWatch
from lightning_zinf.config import (
    MixedPrecisionConfig,
    OffloadConfig,
    PreemptionConfig,
    PrefetchConfig,
    TilingConfig,
    ZeroPPConfig,
    coerce_config,
)
from lightning_zinf.engine import ZeroEngine
from lightning_zinf.engine.state_dict import state_dict_options
from lightning_zinf.preemption import Preemption
from lightning_zinf.tiling import tile_views

__all__ = ["ZeroOptions", "RankLayout", "build_engine", "start_watch", "report_failure", "finish_run", "PRESETS",
           "register_presets", "module_buffers", "optimizer_hyperparameters", "restore_hyperparameters",
           "init_distributed", "barrier", "broadcast", "all_reduce", "NotSupportedError", "refuse_checkpoint_io",
           "checkpointed_layers", "mark_script_launcher", "preemption_exit_status", "wait_for_launched"]


@dataclass(frozen=True, kw_only=True)
class ZeroOptions:
    """The strategy's options, the same for the Trainer and for Fabric (each field is documented on
    :class:`~lightning_zinf.ZeroInfinityStrategy`'s argument of the same name).

    Mappings are accepted for the config fields (``offload={"optimizer": "cpu"}``) and a single
    class or name for the class lists. ``load_full_weights`` is a checkpoint path or a mapping
    ``{prefix: checkpoint path}``, kept with each prefix ending in a dot.

    Raises:
        ValueError: an invalid option value (the message names the field and what is allowed).
    """

    block_classes: Sequence[Union[str, type]] = ()
    prefetch: PrefetchConfig = PrefetchConfig()
    offload: OffloadConfig = OffloadConfig()
    tiling: Optional[TilingConfig] = None
    zero_pp: ZeroPPConfig = ZeroPPConfig()
    mixed_precision: Optional[MixedPrecisionConfig] = None
    activation_checkpointing: Sequence[Union[str, type]] = ()
    load_full_weights: Optional[Union[Mapping[str, Union[str, os.PathLike]], str, os.PathLike]] = None
    load_prefix: Optional[str] = None
    exclude_frozen_parameters: bool = False
    state_dict_type: str = "sharded"
    preemption: PreemptionConfig = PreemptionConfig()

    def __post_init__(self) -> None:
        if self.state_dict_type not in ("sharded", "full"):
            raise ValueError(
                f"state_dict_type={self.state_dict_type!r}: use 'sharded' (a folder with one shard file per rank, "
                "the default) or 'full' (one file, as DDP writes it, that DDP, one device and "
                "LightningModule.load_from_checkpoint load)."
            )
        def classes(value: Any) -> tuple:
            return (value,) if isinstance(value, (str, type)) else tuple(value)

        coerced = {
            "block_classes": classes(self.block_classes),
            "prefetch": coerce_config(PrefetchConfig, self.prefetch),
            "offload": coerce_config(OffloadConfig, self.offload),
            "tiling": None if self.tiling is None else coerce_config(TilingConfig, self.tiling),
            "zero_pp": coerce_config(ZeroPPConfig, self.zero_pp),
            "mixed_precision": (None if self.mixed_precision is None
                                else coerce_config(MixedPrecisionConfig, self.mixed_precision)),
            "activation_checkpointing": classes(self.activation_checkpointing),
            "preemption": coerce_config(PreemptionConfig, self.preemption),
        }
        if isinstance(self.load_full_weights, Mapping):
            coerced["load_full_weights"] = _weight_prefixes(self.load_full_weights, self.load_prefix)
        for name, value in coerced.items():
            object.__setattr__(self, name, value)  # frozen: normalised once, here


def _weight_prefixes(sources: Mapping[Any, Any], load_prefix: Optional[str]) -> dict[str, Union[str, os.PathLike]]:
    """``load_full_weights`` given as ``{prefix: source}``, checked and with each prefix ending in
    a dot (``"actor"`` and ``"actor."`` both name the submodule ``actor``; ``""`` the whole module).

    Raises:
        ValueError: ``load_prefix`` is also given, the mapping is empty, a key is not a string or a
            value not a path, or two prefixes overlap (one names a submodule of the other's, or
            both the same one); the message names them.
    """
    if load_prefix is not None:
        raise ValueError(
            f"load_prefix={load_prefix!r} cannot be combined with load_full_weights given as a mapping: the "
            "mapping's keys are the prefixes (load_full_weights={'actor.': sft_folder, 'reward.': rm_folder})."
        )
    if not sources:
        raise ValueError("load_full_weights={}: give at least one {prefix: checkpoint} entry, or leave it unset.")
    normalised: dict[str, Union[str, os.PathLike]] = {}
    given: dict[str, str] = {}
    for key, source in sources.items():
        if not isinstance(key, str) or not isinstance(source, (str, os.PathLike)):
            raise ValueError(
                f"load_full_weights={{{key!r}: {source!r}}}: each key must be a module prefix (a string such as "
                "'actor.') and each value a checkpoint path (a Hugging Face model folder, a .safetensors or .bin file)."
            )
        prefix = key if key == "" or key.endswith(".") else key + "."
        if prefix in normalised:
            raise ValueError(f"load_full_weights: the prefixes {given[prefix]!r} and {key!r} overlap: both name the "
                             f"submodule {prefix[:-1]!r}. Give each its own submodule.")
        normalised[prefix], given[prefix] = source, key
    clash = overlapping_prefixes(list(normalised))
    if clash is not None:
        first, second = (given[p] for p in clash)
        raise ValueError(
            f"load_full_weights: the prefixes {first!r} and {second!r} overlap: the parameters under the longer one "
            "would be loaded from two checkpoints. Give each pretrained model its own submodule, and one prefix for it."
        )
    return normalised


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
        CheckpointError: ``load_full_weights`` is not a readable checkpoint of this model, or (a
            mapping) a prefix names no submodule of ``module``, or none of a checkpoint's keys names a
            parameter or buffer under its prefix.

    Warns:
        UserWarning: ``options.activation_checkpointing`` is set but the model already checkpoints
            some layers itself (:func:`checkpointed_layers`); the option is then ignored.
    """
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
    )
    if parts:
        _load_full_weights(engine, parts, preloaded)
    return engine


class NotSupportedError(MisconfigurationException, NotImplementedError, ValueError):
    """A combination of options and calls the strategy cannot honour (clipping gradients by value
    while they are on NVMe...), raised before it would silently do something else.

    It is each type Lightning's sharded strategies raise for such a case, so code written for them
    catches it: ``MisconfigurationException`` (the Trainer's ``DeepSpeedStrategy``, e.g. for
    ``gradient_clip_algorithm="value"``), ``NotImplementedError`` (Fabric's ``DeepSpeedStrategy``
    and ``FSDPStrategy``), and ``ValueError`` (what this package raised for it before).
    """


def refuse_checkpoint_io(checkpoint_io: Optional[CheckpointIO], strategy: str) -> None:
    """Refuse a user's ``CheckpointIO`` plugin (``plugins=[...]``, or the strategy's ``checkpoint_io=``).

    The strategies write and read their checkpoints themselves (every rank its own shard files,
    :mod:`lightning_zinf.checkpoint`), so a plugin would never be called, and the storage, format
    or asynchrony the user chose would be lost without a word. Lightning's Fabric ``FSDPStrategy``
    and ``ModelParallelStrategy`` refuse one the same way, with this type (its Trainer strategies
    ignore it).

    Args:
        checkpoint_io: The plugin given, or ``None``.
        strategy: The strategy's class name, for the message.

    Raises:
        NotImplementedError: ``checkpoint_io`` is not ``None``.
    """
    if checkpoint_io is not None:
        raise NotImplementedError(
            f"{strategy} does not use a CheckpointIO plugin: it writes and reads its checkpoints itself (every "
            f"rank its own shards), so {type(checkpoint_io).__name__} would never be called. Remove it from "
            "`plugins=` (or `checkpoint_io=`); give the checkpoint's path to ModelCheckpoint(dirpath=...), "
            "trainer.save_checkpoint(path) or fabric.save(path, ...) to choose where it is written."
        )


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


# name -> (description, options): registered for the Trainer and for Fabric alike.
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "zero_infinity": ("ZeRO-3 partitioning of parameters, gradients and optimizer states (lightning_zinf)", {}),
    "zero_infinity_offload": (
        "ZeRO-3 with parameters and optimizer state offloaded to CPU memory (lightning_zinf)",
        {"offload": OffloadConfig(param="cpu", optimizer="cpu")},
    ),
    "zero_infinity_nvme": (
        "ZeRO-Infinity: parameters and optimizer state on NVMe, in the system's temporary folder (lightning_zinf)",
        {"offload": OffloadConfig(param="nvme", optimizer="nvme", nvme_path=tempfile.gettempdir())},
    ),
    "zero_pp": (
        "ZeRO++: hpZ, qwZ and qgZ on top of ZeRO-3 (lightning_zinf)",
        {"zero_pp": ZeroPPConfig(hpz=True, qwz=True, qgz=True)},
    ),
    "zero_pp_nvme": (
        "ZeRO++ (hpZ, qwZ, qgZ) with parameters and optimizer state on NVMe, in the system's temporary folder "
        "(lightning_zinf)",
        {"zero_pp": ZeroPPConfig(hpz=True, qwz=True, qgz=True),
         "offload": OffloadConfig(param="nvme", optimizer="nvme", nvme_path=tempfile.gettempdir())},
    ),
}


def register_presets(registry: Any, cls: type) -> None:
    """Register :data:`PRESETS` for ``cls`` in a Lightning strategy registry (Trainer's or
    Fabric's); safe to call again (re-importing in a notebook)."""
    for name, (description, options) in PRESETS.items():
        registry.register(name, cls, description=description, override=True, **options)


# --- the checkpoint entries outside the shard files ---------------------------------------------------
def module_buffers(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` without its parameters (replicated buffers, extra state): what a
    checkpoint's ``state_dict`` entry holds, since the parameters are in the shard files. The
    partitioned parameters are not gathered for it (:func:`~lightning_zinf.state_dict_options`)."""
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    params.update(view.name for view in tile_views(module).values())  # a TiledLinear's "weight"
    engine = getattr(module, "_zinf_engine", None)
    with state_dict_options(module, parameters=False) if engine is not None else contextlib.nullcontext():
        state = module.state_dict()
    return {k: v for k, v in state.items() if k not in params}


def optimizer_hyperparameters(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer's hyper-parameters per param group (a checkpoint's ``optimizer_states`` entry);
    its per-element state is in the shard files."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap a LightningOptimizer
    return {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}


def restore_hyperparameters(optimizers: Sequence[torch.optim.Optimizer], saved: Sequence[dict[str, Any]]) -> None:
    """Put back what :func:`optimizer_hyperparameters` saved (learning rates a scheduler changed...)."""
    for optimizer, state in zip(optimizers, saved):
        for group, hyper in zip(optimizer.param_groups, state["param_groups"]):
            group.update(hyper)


# --- failures that reach every rank -------------------------------------------------------------------
def start_watch(rank: int, world_size: int, timeout: timedelta,
                engines: Callable[[], Sequence[ZeroEngine]]) -> Optional[RankWatch]:
    """Start this rank's :class:`~lightning_zinf.comm.watch.RankWatch` (nothing on one rank, or
    without a rendezvous store in the environment). A rank is declared dead, and an unmatched
    departure from the agreed trace a divergence, after half the collectives' ``timeout`` (at most
    a minute), so both end the run before the backend would; two ranks blocked in different calls
    (an engine's agreement check, the strategy's :func:`barrier`) are a deadlock after a few
    seconds. ``engines()`` (the strategy's, once built) supply the progress quoted in messages and
    the agreement check this rank waits in, and are told of departures. ``LIGHTNING_ZINF_WATCH=0`` turns it
    off (then a failing rank leaves the others to the backend's timeout, and NCCL's own timeout
    diagnostics, such as its flight recorder, run as without this package)."""
    if (world_size < 2 or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ
            or os.environ.get("LIGHTNING_ZINF_WATCH", "1") == "0"):
        return None

    def progress() -> str:
        current = engines()
        return current[-1].progress() if current else ""

    def waiting() -> Optional[str]:
        return next((e.waiting_in for e in engines() if e.waiting_in is not None), None)

    # Each watcher reads every rank's beat once per interval: W^2 store reads per interval in all.
    interval = max(1.0, world_size / 32)
    stale = max(min(timeout.total_seconds() / 2, 60.0), 10 * interval)
    try:
        watch = RankWatch(rank, world_size, interval=interval, stale=stale, progress=progress, waiting=waiting)
        watch.start()
    except Exception as error:  # the run goes on without it, as before it existed
        rank_zero_warn(f"lightning_zinf: no failure watch for this run ({error}); a failing rank may leave the "
                       "others waiting until the collectives' timeout.")
        return None
    return watch


def finish_run(engines: Sequence[ZeroEngine], watch: Optional[RankWatch]) -> None:
    """An adapter's teardown: release the engines' gathered units (collectives, skipped after a
    failure: the other ranks may be gone) and stop the watch (the normal end)."""
    failed = watch is not None and watch.first_failure() is not None
    for engine in engines if not failed else ():
        engine.release_all()
    if watch is not None:
        watch.stop()


def report_failure(watch: Optional[RankWatch], exception: BaseException) -> None:
    """Report ``exception`` to the other ranks; if the run failed first elsewhere (another rank's
    error, a divergence or a dead rank, and this rank's error is the consequence: a collective that
    broke or timed out), or this rank's collective failed and the watch knows which ranks were dead
    or elsewhere, add that message to ``exception`` (a note under its traceback, and on stderr)
    rather than raising another error, so the Trainer still tears down and finalises its loggers."""
    if watch is None or not isinstance(exception, Exception):
        return
    first = watch.report(exception)
    if first is None:
        return
    own = first.startswith(f"rank {watch.rank}: ")
    note = f"lightning_zinf: {'this collective failed' if own else 'the run failed first'}: {first}"
    if hasattr(exception, "add_note"):
        exception.add_note(note)
    print(f"[rank {watch.rank}] {note}", file=sys.stderr, flush=True)


# --- preemption: how a process ends after the agreed save ----------------------------------------------
_LAUNCHER_PID = "LIGHTNING_ZINF_LAUNCHER_PID"


def mark_script_launcher(launcher: Any) -> None:
    """Make the processes Lightning's ``_SubprocessScriptLauncher`` starts from this one know it
    (:func:`preemption_exit_status` tells them apart from ranks that torchrun or SLURM started):
    while it starts them, and only then, the environment they inherit names this process. Nothing
    for a launcher without Lightning 2's ``_call_children_scripts``."""
    spawn = getattr(launcher, "_call_children_scripts", None)
    if spawn is None:
        return

    def spawn_marked() -> None:
        os.environ[_LAUNCHER_PID] = str(os.getpid())
        try:
            spawn()
        finally:
            os.environ.pop(_LAUNCHER_PID, None)

    launcher._call_children_scripts = spawn_marked


def preemption_exit_status(preemption: Preemption) -> int:
    """The exit status of this process after a preemption stop: 0 for a process that Lightning's
    script launcher started (rank > 0 of ``python train.py``), else ``preemption.exit_code()``.

    The launching process watches the processes it started and kills every process (SIGKILL)
    when one of them ends with a non-zero status, taking it for a crash; its own status is the one
    a scheduler sees, and it exits with ``exit_code()`` once they have ended
    (:func:`wait_for_launched`). Ranks started by torchrun, SLURM or a cluster's launcher all exit
    with ``exit_code()``.

    Raises:
        RuntimeError: the ranks have not agreed to stop (:meth:`Preemption.agree`).
    """
    if os.environ.get(_LAUNCHER_PID) == str(os.getppid()):
        return 0
    return preemption.exit_code()


def wait_for_launched(launcher: Any, timeout: float) -> None:
    """In the process that launched the others (Lightning's script launcher), wait up to
    ``timeout`` seconds in all for them to end, so that it ends last, with the status the
    scheduler reads, and leaves no process behind. Nothing for other launchers."""
    deadline = time.monotonic() + timeout
    for proc in getattr(launcher, "procs", None) or ():
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rank_zero_warn(f"lightning_zinf: the process {proc.pid} this one launched has not ended {timeout:.0f} s "
                           "after the preemption checkpoint was saved; exiting without it.")


# --- the distributed plumbing both adapters need ------------------------------------------------------
class RankLayout:
    """One process per device of ``parallel_devices`` on each of ``num_nodes`` nodes, ranks numbered
    node by node: the topology properties both strategies derive from that (a mixin placed before
    the Lightning base class, which provides ``parallel_devices``, ``local_rank``, ``node_rank``,
    ``global_rank`` and ``cluster_environment``)."""

    parallel_devices: Optional[list[torch.device]]
    cluster_environment: Optional[ClusterEnvironment]
    local_rank: int
    node_rank: int
    global_rank: int
    _num_nodes: int = 1

    @property
    def root_device(self) -> torch.device:
        """This rank's device."""
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        """Nodes in the run (the connectors set it from ``num_nodes=``)."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Processes per node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Each rank reads its own slice of the data (``DistributedSampler``)."""
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        """Tell the cluster environment this rank's global rank and the world size (the Trainer's
        and Fabric's connectors call this, under these two names, before launching)."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utilities_rank_zero_only.rank = self.global_rank

    _set_world_ranks = set_world_ranks


def init_distributed(environment: ClusterEnvironment, device: torch.device, backend: Optional[str],
                     timeout: timedelta) -> None:
    """Join the default process group (a no-op when it exists): ``backend`` or the device's default
    (gloo on CPU, NCCL on CUDA), bound to ``device`` on an accelerator so NCCL connects eagerly."""
    kwargs: dict[str, Any] = {"timeout": timeout}
    if device.type != "cpu":
        kwargs["device_id"] = device
    _init_dist_connection(environment, backend or _get_default_process_group_backend_for_device(device), **kwargs)


def barrier(watch: Optional[RankWatch] = None) -> None:
    """Wait for every rank (nothing without ``torch.distributed``); while it waits, ``watch``
    publishes it (a rank that meanwhile waits elsewhere, in the model's forward say, is a deadlock
    the watch reports)."""
    if not _distributed_is_initialized():
        return
    if watch is not None:
        watch.blocked_in = "a barrier (trainer.strategy.barrier / fabric.barrier)"
    try:
        torch.distributed.barrier()
    finally:
        if watch is not None:
            watch.blocked_in = None


def broadcast(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank."""
    if not _distributed_is_initialized():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src)
    return box[0]


def all_reduce(tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Any:
    """``tensor`` reduced over ranks (mean by default, as Lightning's ``reduce``); non-tensors as they are."""
    if isinstance(tensor, Tensor):
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
    return tensor
