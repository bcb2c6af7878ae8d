"""The Lightning-free ZeRO-3 core: :class:`ZeroEngine`, a facade over parts with one concern each.

- ``engine``: the facade (wiring, pass and step boundaries, the calls users make);
- ``build``: the plan becomes units of flat groups, initialised and sharded onto their tier;
- ``schedule``: the hooks that decide when a unit is gathered, prefetched and released;
- ``units``: the unit state machine (gather, wait, release) and the reduce-scatter queue;
- ``agreement``: every rank issues the same collectives, or every rank raises;
- ``accounting``: bytes by category and tier;
- ``flat``, ``buffers``, ``transfer``, ``trace``, ``optim``, ``state_dict``, ``partition``,
  ``activation``, ``ledger``: flat groups, buffer pools, host/device copies, the prefetch trace,
  optimizer sharding, state dicts, the unit plan, activation checkpointing, the memory ledger.

``docs/architecture.md`` walks one training step through them.
"""

from lightning_zinf.engine.engine import Unit, ZeroEngine
from lightning_zinf.engine.flat import FlatGroup
from lightning_zinf.engine.partition import meta_parameters, plan_units

__all__ = ["ZeroEngine", "Unit", "FlatGroup", "meta_parameters", "plan_units"]
