"""The strategies' options and their registered presets, the same for the Trainer and for Fabric.

Both adapters are thin: :class:`~lightning_zinf.strategy.ZeroInfinityStrategy` maps the Trainer's
lifecycle and :class:`~lightning_zinf.fabric.ZeroInfinityFabricStrategy` Fabric's calls onto one
:class:`~lightning_zinf.engine.ZeroEngine`, built the same way for both from these options
(:func:`~lightning_zinf.engine_setup.build_engine`), so a model trained with one saves checkpoints
the other loads.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

from lightning_zinf.checkpoint import overlapping_prefixes
from lightning_zinf.planning.sizes import parse_bytes
from lightning_zinf.config import (
    MixedPrecisionConfig,
    sharding_mode,
    OffloadConfig,
    PreemptionConfig,
    PrefetchConfig,
    TilingConfig,
    ZeroPPConfig,
    coerce_config,
)

__all__ = ["ZeroOptions", "PRESETS", "register_presets"]


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
    memory_budget: Optional[Union[int, str]] = None
    host_memory_budget: Optional[Union[int, str]] = None
    activation_memory: Optional[Union[int, str]] = None
    sharding: str = "full"
    shard_group_size: Optional[int] = None

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
        for name in ("memory_budget", "host_memory_budget", "activation_memory"):
            value = getattr(self, name)
            coerced[name] = None if value is None else parse_bytes(value, name)
        coerced["sharding"] = sharding_mode(self.sharding)
        size = self.shard_group_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ValueError(f"shard_group_size={size!r}: give a positive number of ranks that divides the world "
                             "size (normally the ranks per node, the default), or leave it unset.")
        if coerced["sharding"] == "auto" and (coerced["zero_pp"].hpz or coerced["zero_pp"].qwz or coerced["zero_pp"].qgz):
            raise ValueError("sharding='auto' chooses ZeRO++'s hpz, qwz and qgz from the measured links: leave them "
                             "unset, or choose the sharding mode yourself.")
        if coerced["sharding"] == "hybrid" and coerced["zero_pp"].hpz:
            raise ValueError("sharding='hybrid' does not combine with ZeroPPConfig(hpz=True): a hybrid group gathers "
                             "within itself already (hpZ's copy within a node has nothing to serve). Drop hpz, or use "
                             "sharding='full' with it.")
        if size is not None and coerced["sharding"] != "hybrid":
            raise ValueError(f"shard_group_size={size} sets the groups of hybrid sharding: give sharding='hybrid' "
                             "with it (Lightning's 'HYBRID_SHARD'), or drop it.")
        for name in ("host_memory_budget", "activation_memory"):
            if coerced[name] is not None and coerced["memory_budget"] is None:
                raise ValueError(f"{name} is part of a memory plan: give memory_budget too (the compute device's bytes "
                                 "per rank), or leave both unset to choose the tiers yourself.")
        budget, reserve = coerced["memory_budget"], coerced["activation_memory"]
        if budget is not None and reserve is not None and reserve >= budget:
            raise ValueError(f"activation_memory={reserve} leaves nothing of memory_budget={budget} for the parameters, "
                             "gradients and optimizer state: give activation_memory less than memory_budget.")
        if budget is not None:
            _refuse_unplanned(coerced)
        if isinstance(self.load_full_weights, Mapping):
            coerced["load_full_weights"] = _weight_prefixes(self.load_full_weights, self.load_prefix)
        for name, value in coerced.items():
            object.__setattr__(self, name, value)  # frozen: normalised once, here


def _refuse_unplanned(options: Mapping[str, Any]) -> None:
    """With ``memory_budget``: refuse the options the plan would override (the offload tiers and
    sizes it chooses) and those it cannot count yet.

    Raises:
        ValueError: ``offload.param``, ``optimizer``, ``host_bytes``, ``staging_bytes``,
            ``device_bytes`` or ``activations`` is given (the plan offloads activations per block, on an accelerator);
            ZeRO++'s hpZ, qwZ or ``frozen_bits``, ``tiling`` or ``sharding="auto"`` is on. The
            message names each.
    """
    offload = options["offload"]
    chosen = [f"offload.{name}={getattr(offload, name)!r}" for name, default in
              (("param", "none"), ("optimizer", "none"), ("host_bytes", 0), ("staging_bytes", None),
               ("activations", False), ("device_bytes", 0))
              if getattr(offload, name) != default]
    if chosen:
        raise ValueError(
            f"memory_budget chooses the offload tiers and sizes itself (and, on an accelerator, which blocks offload "
            f"their activations), but {', '.join(chosen)} is given too: leave "
            "them unset (with a budget, offload may still set nvme_path, read_ahead, aio, copy_ahead_bytes and at most "
            "sub_group_size), or leave memory_budget unset to choose the tiers yourself."
        )
    zero_pp = options["zero_pp"]
    uncounted = [name for name, on in (
        ("zero_pp.hpz (secondary partitions)", zero_pp.hpz), ("zero_pp.qwz (quantized rows)", zero_pp.qwz),
        ("zero_pp.frozen_bits (frozen weights stored quantized)", zero_pp.frozen_bits is not None),
        ("tiling (each tile a unit of its own)", options["tiling"] is not None),
        ("sharding='auto' (a mode chosen from the links)", options["sharding"] == "auto")) if on]
    if uncounted:
        raise ValueError(
            f"memory_budget does not plan {', '.join(uncounted)} yet: its predictions would not hold. Turn "
            "them off, or leave memory_budget unset and choose the offload tiers yourself."
        )


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


# name -> (description, options): registered for the Trainer and for Fabric alike.
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "zero_infinity": ("ZeRO-3 partitioning of parameters, gradients and optimizer states (lightning_zinf)", {}),
    "zero_infinity_grad_op": (
        "ZeRO-2 (Lightning FSDP's SHARD_GRAD_OP): parameters gathered once a step, kept from forward to backward; "
        "gradients and optimizer state sharded (lightning_zinf)",
        {"sharding": "grad_op"},
    ),
    "zero_infinity_hybrid": (
        "Hybrid sharding (Lightning FSDP's HYBRID_SHARD, MiCS): ZeRO-3 within each node, the sharded state "
        "replicated across nodes; gradient shards all-reduced across them (lightning_zinf)",
        {"sharding": "hybrid"},
    ),
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
