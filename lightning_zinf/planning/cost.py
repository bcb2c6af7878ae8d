"""What a placement costs: the predicted per-rank peak of every memory-ledger category, and the
bytes a step moves over the host link and the disk.

The long-lived state is exact arithmetic on the inventory (ZeRO-Infinity's memory model, Rajbhandari
et al., SC'21, §3-4: per parameter, the shard in its storage dtype, a 16-bit compute copy where the
shard is offloaded and ``param_dtype`` is narrower, and for trainable ones an fp32 master, an fp32
gradient shard and the optimizer's per-element states, each on the tier the placement gives it).
The buffers that come and go during a step follow the engine's schedule
(:mod:`lightning_zinf.engine.schedule`): the persistent units plus the unit in use and the units
gathered ahead of it within ``PrefetchConfig.bucket_size`` elements, the full gradient of one unit
and of the persistent ones, and one unit's reduce-scatter (its cast to ``reduce_dtype`` and its
output shard). Records on NVMe cost host memory only through the staging cap the placement sets and
the records ``host_bytes`` keeps. Activations are not in the ledger and not predicted here.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

from lightning_zinf.offload.aligned import ALIGNMENT, round_up
from lightning_zinf.offload.host import first_that_fit
from lightning_zinf.planning.inventory import GroupFacts, Inventory

__all__ = ["Placement", "Prediction", "predict", "host_costs"]

#: Bytes of per-parameter scalar state an optimizer may keep (torch's Adam keeps ``step`` as a tensor).
_SCALARS = 8

@dataclass(frozen=True)
class Placement:
    """One choice of tiers: the :class:`~lightning_zinf.OffloadConfig` fields a plan sets.

    Attributes:
        param: Tier of the parameter shards: ``"none"`` (the compute device), ``"cpu"``, ``"nvme"``.
        optimizer: Tier of masters, gradient shards and optimizer states, the same three.
        host_bytes: Bytes of NVMe-tier records kept in host memory (``OffloadConfig.host_bytes``).
        staging_bytes: The NVMe staging cap (``OffloadConfig.staging_bytes``); 0 without NVMe.
        read_ahead: ``OffloadConfig.read_ahead`` when the plan sets it (0 with the least staging);
            ``None``: the user's.
    """

    param: str = "none"
    optimizer: str = "none"
    host_bytes: int = 0
    staging_bytes: int = 0
    read_ahead: Optional[int] = None

    @property
    def nvme(self) -> bool:
        """A tier is on NVMe."""
        return "nvme" in (self.param, self.optimizer)

    def describe(self) -> str:
        """``param=..., optimizer=...`` and the NVMe sizes, for the plan's table."""
        text = f"param={self.param}, optimizer={self.optimizer}"
        if self.nvme:
            text += f", host_bytes={self.host_bytes}, staging_bytes={self.staging_bytes}"
            text += f", read_ahead={self.read_ahead}" if self.read_ahead is not None else ""
        return text


@dataclass(frozen=True)
class Prediction:
    """A placement's predicted cost, per rank.

    Attributes:
        categories: Ledger category -> predicted peak bytes (each an upper bound of what
            :meth:`~lightning_zinf.ZeroEngine.memory` reports as its peak).
        device: Peak bytes on the compute device (the ledger's ``device_total``).
        host: Peak bytes of host memory outside the device's: host-tier state, NVMe staging and
            records kept in host memory. On a CPU compute device both are the same memory.
        disk_bytes: Bytes read plus written on NVMe per optimizer step (AdamW: 24 per parameter on
            NVMe: master and moments read and written; with ``param="nvme"`` the shards read at
            each gather).
        link_bytes: Bytes copied between host and device per step (an accelerator's host link:
            offloaded shards to the device for each gather, gradients to the host, new values back).
        kept_groups: Groups whose NVMe-tier records ``host_bytes`` keeps in host memory.
    """

    categories: dict[str, int]
    device: int
    host: int
    disk_bytes: int
    link_bytes: int
    kept_groups: int

    def total(self, accelerator: bool) -> int:
        """The peak this rank's memory holds: device and host apart on an accelerator, together on a CPU."""
        return self.device if accelerator else self.device + self.host


def host_costs(inventory: Inventory, placement: Placement, state_bytes: int) -> list[int]:
    """Bytes that keeping each group's NVMe records in host memory costs, for the groups with
    records on NVMe, in order (what :meth:`OptimizerOffload.plan_host
    <lightning_zinf.offload.optimizer.OptimizerOffload.plan_host>` and :class:`ParamOffload
    <lightning_zinf.offload.params.ParamOffload>` count): the shard and compute copy with
    ``param="nvme"``; with ``optimizer="nvme"`` a trainable group's master (unless an fp32 shard on
    NVMe is the master) and its per-element states."""
    costs = []
    for g in inventory.groups:
        records = []
        if placement.param == "nvme":
            records += [g.storage_bytes * g.shard_numel, g.compute_bytes * g.shard_numel if g.keeps_copy else 0]
        if g.trainable and placement.optimizer == "nvme":
            shares = placement.param == "nvme" and g.storage_bytes == 4
            # One record for the states, a region per state (two for Adam), each aligned.
            records += [0 if shares else 4 * g.shard_numel, state_bytes * g.shard_numel + ALIGNMENT]
        cost = sum(round_up(r, ALIGNMENT) for r in records if r)
        if cost:
            costs.append(cost)
    return costs


def _swapped_shard_bytes(g: GroupFacts) -> int:
    return g.shard_numel * (g.storage_bytes + (g.compute_bytes if g.keeps_copy else 0))


def predict(inventory: Inventory, placement: Placement, *, bucket_size: int, state_bytes: int = 8,
            accelerator: bool = False, copy_ahead_bytes: int = 0) -> Prediction:
    """The peak each ledger category reaches per rank under ``placement``, and the step's traffic.

    Args:
        inventory: The model's flat groups.
        placement: The tiers.
        bucket_size: ``PrefetchConfig.bucket_size`` (elements gathered ahead of use).
        state_bytes: Bytes of optimizer state per trainable element (AdamW, Adam: 8, two fp32
            moments; SGD with momentum: 4; plain SGD: 0).
        accelerator: The compute device is an accelerator (else the CPU, whose engine keeps freed
            gradient and gather buffers for reuse: the ``pooled`` and ``gathers_kept`` categories).
        copy_ahead_bytes: ``OffloadConfig.copy_ahead_bytes`` (``param="cpu"`` on an accelerator).

    Returns:
        The :class:`Prediction`.
    """
    cats: dict[str, int] = defaultdict(int)
    host_tier = {"none": "device", "cpu": "host", "nvme": "disk"}
    where: dict[str, int] = defaultdict(int)  # "device" / "host" / "disk" -> bytes of long-lived state

    kept_unrounded = 0

    def put(category: str, tier: str, nbytes: int) -> None:
        nonlocal kept_unrounded
        kept_unrounded += nbytes if kept and tier == "host" and has_nvme else 0
        if tier == "disk":  # records are laid out in aligned regions (O_DIRECT)
            category = "shards_nvme" if category.startswith("shards") else "optimizer_nvme"
            nbytes = round_up(nbytes, ALIGNMENT)
        cats[category] += nbytes
        where[tier] += nbytes

    kept_costs = host_costs(inventory, placement, state_bytes)
    kept_count = first_that_fit(kept_costs, placement.host_bytes) if placement.nvme else 0
    nvme_index = 0
    disk_bytes = link_bytes = 0
    for g in inventory.groups:
        s = g.shard_numel
        has_nvme = bool((placement.param == "nvme") or (g.trainable and placement.optimizer == "nvme"))
        kept = has_nvme and nvme_index < kept_count
        nvme_index += has_nvme
        param_tier = host_tier[placement.param]
        opt_tier = host_tier[placement.optimizer]
        if kept:
            param_tier = "host" if param_tier == "disk" else param_tier
            opt_tier = "host" if opt_tier == "disk" else opt_tier
        if placement.param == "none":
            if g.trainable and placement.optimizer != "none" and g.keeps_copy:
                put("shards_device", "device", g.compute_bytes * s)  # ZeRO-Offload: a 16-bit copy on the device
                put("shards_cpu", opt_tier, g.storage_bytes * s)  # the shard is the master, on the host
            else:
                put("shards_device", "device", g.storage_bytes * s)
                if g.trainable and (placement.optimizer != "none" or g.storage_bytes != 4):
                    put("optimizer", opt_tier, 4 * s)
        else:
            put("shards_cpu", param_tier, _swapped_shard_bytes(g))
            shares = g.keeps_copy or (placement.param == "nvme" and g.storage_bytes == 4)
            if g.trainable and not shares:
                put("optimizer", opt_tier, 4 * s)
            if accelerator:
                link_bytes += 2 * g.compute_bytes * s  # to the device for the forward's and backward's gathers
            if param_tier == "disk":
                disk_bytes += 2 * g.compute_bytes * s  # read for each gather
        if g.trainable:
            put("grad_shards", opt_tier, 4 * s)
            # Per-element states, and per parameter a few scalars (Adam's ``step`` counter).
            put("optimizer", opt_tier, state_bytes * s + _SCALARS * g.tensors)
            if opt_tier == "disk":
                disk_bytes += 2 * (4 + state_bytes) * s  # master and states, read and written by the step
            if accelerator and placement.optimizer != "none":
                link_bytes += inventory.reduce_bytes * s + g.compute_bytes * s  # gradient up, new values down

    # Kept records are aligned buffers of their own (StagingPool.outside).
    rounding = sum(kept_costs[:kept_count]) - kept_unrounded
    cats["optimizer" if placement.optimizer == "nvme" else "shards_cpu"] += rounding
    where["host"] += rounding
    moving = _moving(inventory, bucket_size, accelerator, copy_ahead_bytes if placement.param == "cpu" else 0)
    cats.update(moving)
    moving_total = moving["gathered"] + moving["grad_buffers"] + moving["reduce_pending"] + moving["staged"]
    if not accelerator:  # freed buffers kept for reuse trade places with those in use; one unit's slack
        moving_total += _largest_grad(inventory)
    staging = placement.staging_bytes if placement.nvme else 0
    if staging:
        cats["staging"] = staging
        for category in ("shards_cpu", "grad_shards", "optimizer"):
            # Resident records live in staging: a category holds its kept bytes plus at most the cap.
            cats[category] += min(staging, cats["shards_nvme" if category == "shards_cpu" else "optimizer_nvme"])
    device = where["device"] + moving_total
    host = where["host"] + staging
    cats["device_total"] = device
    return Prediction(dict(cats), device, host, disk_bytes, link_bytes, kept_count)


@dataclass
class _Unit:
    numel: int = 0  # elements
    nbytes: int = 0  # gathered bytes
    grad_numel: int = 0  # trainable elements
    grad_bytes: int = 0  # their full gradient, in the compute dtype
    persistent: bool = False
    tied: bool = False


def _units(inventory: Inventory) -> dict[int, _Unit]:
    units: dict[int, _Unit] = {}
    for g in inventory.groups:
        u = units.setdefault(g.unit, _Unit(persistent=g.persistent, tied=g.tied))
        u.numel += g.numel
        u.nbytes += g.numel * g.compute_bytes
        if g.trainable:
            u.grad_numel += g.numel
            u.grad_bytes += g.numel * g.compute_bytes
    return units


def _largest_grad(inventory: Inventory) -> int:
    return max((u.grad_bytes for u in _units(inventory).values() if not u.persistent), default=0)


def _moving(inventory: Inventory, bucket_size: int, accelerator: bool, copy_ahead: int) -> dict[str, int]:
    units = _units(inventory)
    # Persistent units stay gathered; a tied one may stay from its first use to its last.
    persistent = [u for u in units.values() if u.persistent or u.tied]
    order = [u for _, u in sorted(units.items()) if not u.persistent]
    window = 0  # the unit in use and those gathered ahead of it (Schedule._gather_ahead)
    for i, unit in enumerate(order):
        ahead, budget = 0, bucket_size
        for later in order[i + 1:]:
            if later.numel > budget and ahead:
                break
            ahead += later.nbytes
            budget -= later.numel
        window = max(window, unit.nbytes + ahead)
    largest = max((u.grad_bytes for u in order), default=0)
    reduce = max((u.grad_numel for u in order), default=0) * inventory.reduce_bytes
    out = {
        "gathered": sum(u.nbytes for u in persistent) + window,
        "grad_buffers": sum(u.grad_bytes for u in persistent) + largest,
        "reduce_pending": reduce + -(-reduce // inventory.world),  # the cast to reduce_dtype and the output shard
        "staged": 0,
        "pooled": 0,
        "gathers_kept": 0,
    }
    if accelerator and copy_ahead:
        out["staged"] = copy_ahead + max((u.nbytes for u in order), default=0) // inventory.world
    if not accelerator:
        out["pooled"] = out["grad_buffers"] + out["reduce_pending"] + largest
        out["gathers_kept"] = window
    return out
