"""The memory planner: one per-rank budget instead of hand-picked tiers (``memory_budget``).

:mod:`~lightning_zinf.planning.inventory` reads what a model will hold once partitioned,
:mod:`~lightning_zinf.planning.cost` predicts a placement's peak per ledger category and its
traffic, :mod:`~lightning_zinf.planning.planner` chooses the fastest placement that fits.
"""

from lightning_zinf.planning.cost import Placement, Prediction, predict
from lightning_zinf.planning.inventory import GroupFacts, Inventory
from lightning_zinf.planning.planner import BudgetError, MemoryPlan, plan_memory
from lightning_zinf.planning.sizes import format_bytes, parse_bytes

__all__ = ["BudgetError", "GroupFacts", "Inventory", "MemoryPlan", "Placement", "Prediction", "format_bytes",
           "parse_bytes", "plan_memory", "predict"]
