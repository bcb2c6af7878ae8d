"""lightning_zinf: ZeRO-Infinity as a PyTorch Lightning strategy.

Importing the package registers ``Trainer(strategy="zero_infinity")`` (importing it again is
harmless). The engine underneath, :class:`ZeroEngine`, needs no Lightning.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_zinf.checkpoint import CheckpointError, load_full_state_dict
from lightning_zinf.config import OffloadConfig, PrefetchConfig
from lightning_zinf.engine import ZeroEngine, meta_parameters
from lightning_zinf.strategy import ZeroInfinityStrategy

__all__ = [
    "CheckpointError",
    "OffloadConfig",
    "PrefetchConfig",
    "ZeroEngine",
    "ZeroInfinityStrategy",
    "load_full_state_dict",
    "meta_parameters",
]

ZeroInfinityStrategy.register_strategies(StrategyRegistry)
