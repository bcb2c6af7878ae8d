"""Memory accounting: the bytes a rank holds, by ledger category and by tier.

The buffers whose size changes during a step (gathered units, hpZ secondary partitions, gradient
and reduce buffers) are accounted in the :class:`~lightning_zinf.engine.ledger.MemoryLedger` as
they are allocated and freed, so their peaks are exact. The long-lived state (parameter shards,
fp32 masters, gradient shards, optimizer states, swap files, staging memory) is counted here from
what exists now, by storage, so a tensor that is a view of another, or a master that is the shard
itself, counts once. The categories follow ZeRO-Infinity's memory model (Rajbhandari et al., SC'21,
§3-4: parameters, gradients and optimizer states per tier, plus working memory).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_zinf.engine.flat import FlatGroup
from lightning_zinf.engine.ledger import CATEGORIES, MemoryLedger
from lightning_zinf.offload.optimizer import OptimizerOffload
from lightning_zinf.offload.params import ParamOffload
from lightning_zinf.offload.swapped import SwapSpace

__all__ = ["MemoryAccounting", "MOVING"]

#: Ledger categories the engine allocates and frees during a step; all on the compute device.
MOVING = ("gathered", "secondary", "grad_buffers", "reduce_pending", "staged", "pooled", "gathers_kept")

_STATE = ("shards_device", "shards_cpu", "shards_nvme", "grad_shards", "optimizer", "optimizer_device", "optimizer_nvme")


class MemoryAccounting:
    """Counts an engine's memory into its ledger and splits it by tier.

    Args:
        ledger: The engine's ledger (the moving categories are kept there as buffers come and go:
            ``gathered`` by the unit state machine, ``secondary`` and ``grad_buffers`` by the flat
            groups, ``reduce_pending`` and ``pooled`` by the buffer pool, ``staged`` by the device copies of
            host-tier shards).
        groups: The engine's flat groups.
        optimizers: The engine's sharded optimizers; the list the engine appends to (their states
            are counted as they are created).
        shards_offloaded: Parameter shards live off the compute device (``param`` offload).
        param_offload: NVMe parameter offload, or None.
        offload: Optimizer offload, or None.
        space: The NVMe swap space (its staging pool), or None.
    """

    def __init__(self, ledger: MemoryLedger, groups: list[FlatGroup], optimizers: list[torch.optim.Optimizer], *,
                 shards_offloaded: bool, param_offload: Optional[ParamOffload], offload: Optional[OptimizerOffload],
                 space: Optional[SwapSpace]) -> None:
        self.ledger = ledger
        self.groups = groups
        self.optimizers = optimizers
        self.shards_offloaded = shards_offloaded
        self.param_offload = param_offload
        self.offload = offload
        self.space = space

    def resident_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for training state, by tier (``device``, ``cpu``, ``nvme``; the
        engine's :meth:`~lightning_zinf.ZeroEngine.resident_bytes`).

        ``device``: parameter shards, gathered parameters, hpZ secondary partitions and gradient
        buffers (in use and pooled), plus the fp32 masters, fp32 gradient shards and optimizer
        states when the optimizer is not offloaded, or of the groups stepped on the device when
        it is (``OffloadConfig.device_bytes``).
        ``cpu``: with parameter or optimizer offload, those tensors currently in CPU memory.
        ``nvme``: with NVMe offload, the bytes of those tensors that are in swap files now. On a
        machine without an accelerator the device is the CPU as well; the split says which tier
        the engine placed each tensor on. :meth:`memory` splits the same bytes by category.
        """
        state = self.state_bytes()
        moving = sum(self.ledger.now[c] for c in MOVING)
        optimizer_side = state["grad_shards"] + state["optimizer"]
        offloaded = self.offload is not None
        return {
            "device": state["shards_device"] + moving + (0 if offloaded else optimizer_side) + state["optimizer_device"],
            "cpu": state["shards_cpu"] + (optimizer_side if offloaded else 0),
            "nvme": state["shards_nvme"] + state["optimizer_nvme"],
        }

    def memory(self) -> dict[str, tuple[int, int]]:
        """The memory ledger: bytes this rank holds now and at most since the last
        :meth:`~lightning_zinf.ZeroEngine.reset_memory_peaks` (a training step), by category (what
        each holds: :data:`~lightning_zinf.engine.ledger.CATEGORIES`; the engine's
        :meth:`~lightning_zinf.ZeroEngine.memory`).

        Gathered units, secondary partitions, gradient buffers and reduce-scatters in flight are
        accounted as the engine allocates and frees them, so their peaks are exact; the shards,
        gradient shards, optimizer state and staging memory are counted from the state now (their
        peak is the largest value seen by these calls, and staging's the pool's own peak).

        Returns:
            Category -> ``(bytes now, peak bytes)``.
        """
        for category, nbytes in self.state_bytes().items():
            self.ledger.set(category, nbytes)
        if self.space is not None:
            self.ledger.set("staging", self.space.pool.in_use)
            self.ledger.peak["staging"] = max(self.ledger.peak["staging"], self.space.pool.peak)
        return {c: (self.ledger.now[c], self.ledger.peak[c]) for c in CATEGORIES}

    def reset_peaks(self) -> None:
        """Start a new peak window (the state counted now is its start)."""
        self.memory()
        self.ledger.reset_peaks()
        if self.space is not None:
            self.space.pool.peak = self.space.pool.in_use

    def state_bytes(self) -> dict[str, int]:
        """Bytes of the long-lived state, by ledger category, counted by storage (swapped tensors
        are views of one staging buffer per record; an fp32 master that is the shard counts once)."""
        out = dict.fromkeys(_STATE, 0)
        seen: set[int] = set()

        def add(category: str, t: Optional[Tensor]) -> None:
            storage = t.untyped_storage() if t is not None else None
            if storage is not None and storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                out[category] += storage.nbytes()  # 0 while swapped out

        for group in self.groups:
            # A device copy's shard is the master on the host (ZeRO-Offload's layout); the copy is the device's.
            shards = "shards_cpu" if self.shards_offloaded or group.keeps_device_copy else "shards_device"
            for t in (group.shard, group.codes, group.scales):
                add(shards, t)
            add("shards_device" if group.keeps_device_copy else shards, group.compute_shard)
            add("optimizer_device" if group.optimizer_on_device else "optimizer", group.master)
            add("optimizer_device" if group.optimizer_on_device else "grad_shards", group.grad_shard)
        on_device = {id(f) for g in self.groups if g.optimizer_on_device for f in g.fragments}
        for optimizer in self.optimizers:
            # Snapshots: a step in the background (offload.stepping) may be adding states now.
            for fragment, state in list(optimizer.state.items()):
                for value in list(state.values()):
                    if isinstance(value, Tensor):
                        add("optimizer_device" if id(fragment) in on_device else "optimizer", value)
        if self.param_offload is not None:
            out["shards_nvme"] = self.param_offload.tier_bytes()["nvme"]
        if self.offload is not None:
            out["optimizer_nvme"] = self.offload.tier_bytes()["nvme"]
        return out
