"""lightning_zinf: ZeRO-Infinity as a PyTorch Lightning strategy.

Importing the package registers ``Trainer(strategy="zero_infinity")`` and
``Fabric(strategy="zero_infinity")``, with their presets (importing it again is harmless). The engine underneath, :class:`ZeroEngine`, needs no Lightning.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGIES
from lightning.pytorch.strategies import StrategyRegistry

from lightning_zinf.checkpoint import CheckpointError, load_full_state_dict
from lightning_zinf.config import (MixedPrecisionConfig, OffloadConfig, PreemptionConfig, PrefetchConfig, TilingConfig,
                                   ZeroPPConfig)
from lightning_zinf.engine import ZeroEngine, meta_parameters
from lightning_zinf.engine.state_dict import state_dict_options
from lightning_zinf.fabric import ZeroInfinityFabricStrategy
from lightning_zinf.strategy import ZeroInfinityStrategy
from lightning_zinf.summary import ShardedModelSummary
from lightning_zinf.tiling import TiledLinear, tile_linear_layers

__all__ = [
    "CheckpointError",
    "MixedPrecisionConfig",
    "OffloadConfig",
    "PreemptionConfig",
    "PrefetchConfig",
    "ShardedModelSummary",
    "TiledLinear",
    "TilingConfig",
    "ZeroEngine",
    "ZeroInfinityFabricStrategy",
    "ZeroInfinityStrategy",
    "ZeroPPConfig",
    "load_full_state_dict",
    "meta_parameters",
    "state_dict_options",
    "tile_linear_layers",
]

ZeroInfinityStrategy.register_strategies(StrategyRegistry)
ZeroInfinityFabricStrategy.register_strategies(FABRIC_STRATEGIES)
