"""The Lightning-free ZeRO-3 core: units, flat buffers, hooks, gather/release, prefetch trace."""

from lightning_zinf.engine.engine import Unit, ZeroEngine
from lightning_zinf.engine.flat import FlatGroup
from lightning_zinf.engine.partition import meta_parameters, plan_units

__all__ = ["ZeroEngine", "Unit", "FlatGroup", "meta_parameters", "plan_units"]
