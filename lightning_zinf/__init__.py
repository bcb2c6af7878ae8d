"""lightning_zinf: ZeRO-Infinity as a PyTorch Lightning strategy.

Importing the package registers ``Trainer(strategy="zero_infinity")`` (importing it again is
harmless). The engine underneath, :class:`ZeroEngine`, needs no Lightning.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_zinf.checkpoint import CheckpointError, load_full_state_dict
from lightning_zinf.config import MixedPrecisionConfig, OffloadConfig, PrefetchConfig, TilingConfig, ZeroPPConfig
from lightning_zinf.engine import ZeroEngine, meta_parameters
from lightning_zinf.strategy import ZeroInfinityStrategy
from lightning_zinf.tiling import TiledLinear, tile_linear_layers

__all__ = [
    "CheckpointError",
    "MixedPrecisionConfig",
    "OffloadConfig",
    "PrefetchConfig",
    "TiledLinear",
    "TilingConfig",
    "ZeroEngine",
    "ZeroInfinityStrategy",
    "ZeroPPConfig",
    "load_full_state_dict",
    "meta_parameters",
    "tile_linear_layers",
]

ZeroInfinityStrategy.register_strategies(StrategyRegistry)
