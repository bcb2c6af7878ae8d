"""What a placement costs: the predicted per-rank peak of every memory-ledger category, and the
bytes a step moves over the host link and the disk.

The long-lived state is exact arithmetic on the inventory (ZeRO-Infinity's memory model, Rajbhandari
et al., SC'21, §3-4: per parameter, the shard in its storage dtype, a 16-bit compute copy where the
shard is offloaded and ``param_dtype`` is narrower, and for trainable ones an fp32 master, an fp32
gradient shard and the optimizer's per-element states, each where the engine puts it for the
placement: with parameters on the device under a narrower ``param_dtype`` and the optimizer offloaded,
the fp32 shard in host memory and, with the optimizer on NVMe, a master record of its own). NVMe
records are laid out as the swapper writes them (whole 4096-byte blocks); they cost host memory
through the staging cap, the records ``host_bytes`` keeps (at most ``host_bytes`` on any rank) and,
on the CPU, the block each aligned buffer takes beyond its size. The buffers that come and go during
a step follow the engine's schedule (:mod:`lightning_zinf.engine.schedule`), in padded sizes: the
persistent and tied units plus the unit in use and those gathered ahead of it within
``PrefetchConfig.bucket_size`` elements, in forward and in backward order, or the transient buffers
of the persistent units' coalesced re-gather after a step; the full gradients of the persistent
units and of one unit; one group's reduce-scatter (its cast to ``reduce_dtype`` and its output
shard); on an accelerator the device copies of host-side shards; on the CPU the free buffers its
pools keep (:mod:`lightning_zinf.engine.buffers`). Activations are not in the ledger and not
predicted here.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

import torch

from lightning_zinf.comm.collectives import gloo_received_nbytes
from lightning_zinf.engine.buffers import SLACK
from lightning_zinf.engine.units import COALESCE_BYTES
from lightning_zinf.offload.aligned import ALIGNMENT
from lightning_zinf.offload.host import DEVICE_STATE_BYTES, first_that_fit
from lightning_zinf.offload.swapped import record_layout
from lightning_zinf.planning.inventory import GroupFacts, Inventory

__all__ = ["Placement", "Prediction", "device_split_costs", "host_costs", "predict", "stepped_on_device"]

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
        device_bytes: With ``optimizer="cpu"`` and ``param="none"``: ``OffloadConfig.device_bytes``,
            the first trainable groups stepped on the device.
    """

    param: str = "none"
    optimizer: str = "none"
    host_bytes: int = 0
    staging_bytes: int = 0
    read_ahead: Optional[int] = None
    device_bytes: int = 0

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
        if self.device_bytes:
            text += f", device_bytes={self.device_bytes}"
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
        kept_groups: Groups whose NVMe-tier records ``host_bytes`` keeps in host memory (on the
            rank with the largest records: a rank that owns no element of a group may keep more).
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


@dataclass(frozen=True)
class _Record:
    """One NVMe swap record of a group.

    Attributes:
        category: The ledger category its bytes count in while they are in memory.
        nbytes: Its size as written (:func:`~lightning_zinf.offload.swapped.record_layout`: regions
            on 64-byte boundaries, whole 4096-byte ``O_DIRECT`` blocks).
        keepable: ``OffloadConfig.host_bytes`` may keep it in host memory (a gradient shard's never).
        everywhere: Every rank has it (the optimizer states' is absent on a rank that owns no
            element of the group, so that rank's groups cost less there).
    """

    category: str
    nbytes: int
    keepable: bool = True
    everywhere: bool = True


def _layout(*region_bytes: int) -> int:
    return record_layout([(str(i), torch.uint8, n) for i, n in enumerate(region_bytes)])[1]


def _records(g: GroupFacts, placement: Placement, state_bytes: int, world: int) -> list[_Record]:
    """``g``'s swap records under ``placement``, as :class:`~lightning_zinf.offload.params.ParamOffload`
    and :class:`~lightning_zinf.offload.optimizer.OptimizerOffload` write them (none without an NVMe tier)."""
    s = g.shard_numel
    records = []
    if placement.param == "nvme":
        records.append(_Record("shards_cpu", _layout(g.storage_bytes * s)))
        if g.keeps_copy:
            records.append(_Record("shards_cpu", _layout(g.compute_bytes * s)))
    if g.trainable and placement.optimizer == "nvme":
        if not (placement.param == "nvme" and g.storage_bytes == 4):  # else the shard's record is the master
            records.append(_Record("optimizer", _layout(4 * s)))
        records.append(_Record("grad_shards", _layout(4 * s), keepable=False))
        if state_bytes:  # one region per fp32 state (Adam: two)
            regions = [4 * s] * (state_bytes // 4) + ([state_bytes % 4 * s] if state_bytes % 4 else [])
            records.append(_Record("optimizer", _layout(*regions), everywhere=g.numel > (world - 1) * s))
    return records


def host_costs(inventory: Inventory, placement: Placement, state_bytes: int, buffers: bool = False) -> list[int]:
    """Bytes that keeping each group's NVMe records in host memory costs, for the groups with
    records ``host_bytes`` may keep, in order: what :meth:`OptimizerOffload.plan_host
    <lightning_zinf.offload.optimizer.OptimizerOffload.plan_host>` and :meth:`ParamOffload.add
    <lightning_zinf.offload.params.ParamOffload.add>` count against ``host_bytes`` on the rank with
    the most (the shard and compute copy with ``param="nvme"``; with ``optimizer="nvme"`` a
    trainable group's master, unless an fp32 shard on NVMe is the master, and its per-element
    states; never the gradient shard). ``buffers``: each record with the 4096 bytes its buffer of
    its own takes beyond it in host memory (:func:`~lightning_zinf.offload.aligned.aligned_empty`),
    which ``host_bytes`` does not count."""
    costs = []
    for g in inventory.groups:
        kept = [r.nbytes for r in _records(g, placement, state_bytes, inventory.world) if r.keepable]
        if kept:
            costs.append(sum(kept) + (ALIGNMENT * len(kept) if buffers else 0))
    return costs


def _swapped_shard_bytes(g: GroupFacts) -> int:
    return g.shard_numel * (g.storage_bytes + (g.compute_bytes if g.keeps_copy else 0))


def _master_is_shard(g: GroupFacts, placement: Placement) -> bool:
    # The optimizer steps the fp32 shard in place: on the device without offload, or where a 16-bit
    # copy feeds the gathers and the shard sits with the optimizer in host memory (FlatGroup.make_master).
    if g.storage_bytes != 4:
        return False
    if placement.optimizer == "none":
        return placement.param == "none"
    return placement.optimizer == "cpu" and placement.param in ("none", "cpu") and g.keeps_copy


def _resident(sizes: list[int], cap: int) -> int:
    """The most bytes records of ``sizes`` hold in a staging pool capped at ``cap``: at most the cap
    (or all of them), plus the block each buffer takes beyond its size, for as many as fit at once."""
    return min(cap, sum(sizes)) + ALIGNMENT * first_that_fit(sorted(sizes), cap)


def predict(inventory: Inventory, placement: Placement, *, bucket_size: int, state_bytes: int = 8,
            accelerator: bool = False, copy_ahead_bytes: int = 0, sharding: str = "full") -> Prediction:
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
        sharding: ``"full"`` or ``"grad_op"`` (every unit a forward gathers held until its backward:
            the gathered window is the whole model's units).

    Returns:
        The :class:`Prediction`: every category an upper bound of the ledger's peak on every rank.
    """
    cats: dict[str, int] = defaultdict(int)
    where: dict[str, int] = defaultdict(int)  # "device" / "host" / "disk" -> bytes of long-lived state

    def put(category: str, tier: str, nbytes: int) -> None:
        cats[category] += nbytes
        where[tier] += nbytes

    tiers = {"none": "device", "cpu": "host", "nvme": None}  # None: in records
    param_tier, opt_tier = tiers[placement.param], tiers[placement.optimizer]
    records = [_records(g, placement, state_bytes, inventory.world) for g in inventory.groups]
    keepable = [[r for r in rs if r.keepable] for rs in records]
    host_bytes = placement.host_bytes if placement.nvme else 0
    # Each rank keeps the longest prefix of its groups that fits host_bytes: the rank with the largest
    # records the fewest groups, one that owns no element of some group's states maybe more.
    fewest = first_that_fit([sum(r.nbytes for r in rs) for rs in keepable if rs], host_bytes)
    most = first_that_fit([sum(r.nbytes for r in rs if r.everywhere) for rs in keepable if rs], host_bytes)
    kept_bytes: dict[str, int] = defaultdict(int)
    kept_records: dict[str, int] = defaultdict(int)
    on_disk: dict[str, list[int]] = defaultdict(list)
    disk_bytes = link_bytes = 0
    # A first fp32 reduce-scatter output on the gradient shard's device becomes the shard
    # (FlatGroup.accumulate): on the CPU a pooled buffer, possibly larger than the shard.
    exact_grads, largest = accelerator or inventory.reduce_bytes != 4, _largest_request(inventory)
    position = 0  # among the groups with records host_bytes may keep
    on_device = stepped_on_device(inventory, placement)
    for index, (g, rs, ks) in enumerate(zip(inventory.groups, records, keepable)):
        s = g.shard_numel
        if index < len(on_device) and on_device[index]:
            _on_device(g, put, state_bytes, exact_grads, largest)
            continue
        surely_kept = bool(ks) and position < fewest
        for r in ks if position < most else ():
            kept_bytes[r.category] += r.nbytes
            kept_records[r.category] += 1
        for r in rs:
            if not (r.keepable and surely_kept):
                on_disk[r.category].append(r.nbytes)
        position += bool(ks)
        if placement.param == "none":
            if g.trainable and placement.optimizer != "none" and g.keeps_copy:
                # ZeRO-Offload's layout: the 16-bit copy on the device, the fp32 shard in host memory
                # (the optimizer's master, or with the optimizer on NVMe what its master is sent into).
                put("shards_device", "device", g.compute_bytes * s)
                put("shards_cpu", "host", g.storage_bytes * s)
            else:
                put("shards_device", "device", g.storage_bytes * s)
        else:
            if param_tier is not None:
                put("shards_cpu", param_tier, _swapped_shard_bytes(g))
            if accelerator:
                link_bytes += 2 * g.compute_bytes * s  # to the device for the forward's and backward's gathers
            if placement.param == "nvme" and not surely_kept:
                disk_bytes += 2 * g.compute_bytes * s  # read for each gather
        if not g.trainable:
            continue
        if opt_tier is not None:
            if not _master_is_shard(g, placement):
                put("optimizer", opt_tier, 4 * s)
            put("grad_shards", opt_tier, 4 * s if exact_grads else _served(4 * s, largest))
            put("optimizer", opt_tier, state_bytes * s)
        elif not surely_kept:
            disk_bytes += 2 * (4 + state_bytes) * s  # master and states, read and written by the step
        # Per parameter a few scalars (Adam's ``step``), in memory whatever the tier of the rest.
        put("optimizer", opt_tier or "host", _SCALARS * g.tensors)
        if accelerator and placement.optimizer != "none":
            link_bytes += inventory.reduce_bytes * s + g.compute_bytes * s  # gradient up, new values down

    # Records kept in host memory have buffers of their own; at most host_bytes together, on any rank.
    for category, nbytes in kept_bytes.items():
        put(category, "host", min(nbytes, host_bytes) + ALIGNMENT * kept_records[category])
    surplus = sum(min(n, host_bytes) for n in kept_bytes.values()) - min(sum(kept_bytes.values()), host_bytes)
    where["host"] -= surplus  # the categories' bounds overlap: together they keep host_bytes at most
    staging = placement.staging_bytes if placement.nvme else 0
    for category, sizes in on_disk.items():
        put("shards_nvme" if category == "shards_cpu" else "optimizer_nvme", "disk", sum(sizes))
        if staging:  # the resident part of a category lives in staging buffers, within the cap
            cats[category] += _resident(sizes, staging)
    buffers = first_that_fit(sorted(n for sizes in on_disk.values() for n in sizes), staging) if staging else 0
    moving, moving_total = _moving(inventory, bucket_size, accelerator, placement.param, copy_ahead_bytes,
                                   hold=sharding == "grad_op")
    cats.update(moving)
    if staging:
        cats["staging"] = staging
    device = where["device"] + moving_total
    host = where["host"] + staging + ALIGNMENT * buffers
    cats["device_total"] = device
    return Prediction(dict(cats), device, host, disk_bytes, link_bytes, fewest)


def stepped_on_device(inventory: Inventory, placement: Placement) -> list[bool]:
    """Per group (in order), whether ``placement.device_bytes`` steps it on the device: the first
    trainable groups until the next does not fit at :data:`~lightning_zinf.offload.host.DEVICE_STATE_BYTES`
    per shard element, as :class:`~lightning_zinf.engine.build.UnitBuilder` chooses them."""
    room = placement.device_bytes if (placement.param, placement.optimizer) == ("none", "cpu") else 0
    chosen = []
    for g in inventory.groups:
        cost = DEVICE_STATE_BYTES * g.shard_numel
        fits = g.trainable and 0 <= cost <= room
        if g.trainable:
            room = room - cost if fits else -1
        chosen.append(fits)
    return chosen


def device_split_costs(inventory: Inventory, state_bytes: int = 8,
                       accelerator: bool = True) -> list[tuple[int, int]]:
    """Per trainable group, in order: the ``device_bytes`` it takes when stepped on the device
    (what :func:`stepped_on_device` counts), and the bytes it then adds to the device's predicted
    peak over ZeRO-Offload's layout (its shard in its dtype and its optimizer side, less the 16-bit
    copy it no longer needs): ``predict``'s device total with the first ``k`` groups so placed is
    that of none plus the first ``k`` of these."""
    exact_grads, largest = accelerator or inventory.reduce_bytes != 4, _largest_request(inventory)
    out = []
    for g in inventory.groups:
        if not g.trainable:
            continue
        added = [0]

        def put(category: str, tier: str, nbytes: int) -> None:
            added[0] += nbytes if tier == "device" else 0

        _on_device(g, put, state_bytes, exact_grads, largest)
        offloaded = (g.compute_bytes if g.keeps_copy else g.storage_bytes) * g.shard_numel
        out.append((DEVICE_STATE_BYTES * g.shard_numel, added[0] - offloaded))
    return out


def _on_device(g: GroupFacts, put, state_bytes: int, exact_grads: bool, largest: int) -> None:
    """A trainable group stepped on the device beside ZeRO-Offload: placed as without offload."""
    s = g.shard_numel
    put("shards_device", "device", g.storage_bytes * s)
    if not _master_is_shard(g, Placement()):
        put("optimizer_device", "device", 4 * s)
    put("optimizer_device", "device", (4 * s if exact_grads else _served(4 * s, largest)) + state_bytes * s)
    put("optimizer_device", "device", _SCALARS * g.tensors)


@dataclass
class _Unit:
    numel: int = 0  # elements (the prefetch budget counts these)
    nbytes: int = 0  # gather buffer bytes (padded shards, compute dtype)
    grad_bytes: int = 0  # gradient bytes in grad_buffers during its backward
    loose_bytes: int = 0  # of which autograd's own gradients (cast for the reduce-scatter), not pooled
    persistent: bool = False
    tied: bool = False


def _casts(inventory: Inventory, g: GroupFacts) -> bool:
    # Gradients come out of backward in another dtype than the reduce-scatter's (FlatGroup.casts_gradients):
    # autograd's own per-parameter gradients, else one pooled flat buffer.
    return g.compute_bytes != inventory.reduce_bytes


def _units(inventory: Inventory, accelerator: bool) -> dict[int, _Unit]:
    units: dict[int, _Unit] = {}
    largest = _largest_request(inventory)
    for g in inventory.groups:
        padded = g.shard_numel * inventory.world
        u = units.setdefault(g.unit, _Unit(persistent=g.persistent, tied=g.tied))
        u.numel += g.numel
        u.nbytes += padded * g.compute_bytes
        if g.trainable:
            if _casts(inventory, g):
                u.grad_bytes += g.numel * g.compute_bytes
                u.loose_bytes += g.numel * g.compute_bytes
            else:
                u.grad_bytes += padded * g.compute_bytes if accelerator else _served(padded * g.compute_bytes, largest)
    return units


def _largest_request(inventory: Inventory) -> int:
    """The largest buffer the gradient pool hands out (a flat gradient or its cast to ``reduce_dtype``)."""
    return max((g.shard_numel * inventory.world * max(g.compute_bytes, inventory.reduce_bytes)
                for g in inventory.groups if g.trainable), default=0)


def _served(nbytes: int, largest: int) -> int:
    # On the CPU the gradient pool serves a request with a free buffer of up to SLACK times its
    # size, none larger than the largest ever requested (engine/buffers.py, BufferPool.take).
    return max(nbytes, min(int(SLACK * nbytes), largest))


def _window(sequence: list[_Unit], bucket_size: int) -> int:
    """The most gather-buffer bytes held at one unit's use: it and the released units after it in
    ``sequence`` within ``bucket_size`` elements, the first always (Schedule._gather_ahead)."""
    most = 0
    for i, unit in enumerate(sequence):
        held, nbytes, budget = {id(unit)}, unit.nbytes, bucket_size
        for later in sequence[i + 1:]:
            if id(later) in held:  # gathered already (a unit used again next, from forward to backward)
                continue
            if later.numel > budget and len(held) > 1:
                break
            held.add(id(later))
            nbytes += later.nbytes
            budget -= later.numel
        most = max(most, nbytes)
    return most


def _regathered(inventory: Inventory, accelerator: bool, param: str) -> int:
    """Bytes of the transient buffers of the persistent units' coalesced re-gather after a step
    (UnitStates.gather_exact): per compute dtype, buckets of at most ``COALESCE_BYTES`` of gather
    buffer, each packing its shards and the gathered rows ((W + 1) times its shards' bytes), two
    buckets in flight at once. Only shards in device memory are coalesced."""
    if inventory.world == 1 or (accelerator and param != "none"):
        return 0
    buckets: dict[int, list[list[int]]] = {}  # compute bytes -> [gather bytes, shard bytes] per bucket
    for g in inventory.groups:
        gather = g.shard_numel * inventory.world * g.compute_bytes
        if not g.persistent or gather > COALESCE_BYTES:
            continue
        open_buckets = buckets.setdefault(g.compute_bytes, [])
        if not open_buckets or open_buckets[-1][0] + gather > COALESCE_BYTES:
            open_buckets.append([0, 0])
        open_buckets[-1][0] += gather
        open_buckets[-1][1] += g.shard_numel * g.compute_bytes
    sizes = [(inventory.world + 1) * shards for per_dtype in buckets.values() for _, shards in per_dtype]
    return max((sum(sizes[i:i + 2]) for i in range(len(sizes))), default=0)


def _pool_held(inventory: Inventory, units: dict[int, _Unit]) -> int:
    """The most bytes the CPU gradient pool holds in one backward, in use and free (BufferPool).

    A new buffer has its request's size and is made only when no free buffer serves the request,
    which one of the same size always does; so the pool holds no more buffers of a size than
    requests in use at once that such a buffer may serve (of that size down to 1/SLACK of it). In
    use at once: the flat gradients of the persistent and tied units (the whole backward), those of
    the unit in backward (taken as its backward starts, unless cast for the reduce-scatter: then
    one at a time, as each reduce-scatter starts) and the previous unit's last, in its
    reduce-scatter, and that reduce-scatter's output shard."""
    made: dict[int, int] = defaultdict(int)  # size -> requests of that size in one backward
    outs, cast, persistent = set(), set(), []
    flats: dict[int, list[int]] = defaultdict(list)  # non-persistent unit -> its flat gradients' sizes
    for g in inventory.groups:
        if not g.trainable:
            continue
        if inventory.world > 1:
            outs.add(g.shard_numel * inventory.reduce_bytes)
            made[g.shard_numel * inventory.reduce_bytes] += 1
        casts = _casts(inventory, g)
        flat = g.shard_numel * inventory.world * (inventory.reduce_bytes if casts else g.compute_bytes)
        made[flat] += 1
        if casts:
            cast.add(flat)
        elif units[g.unit].persistent or units[g.unit].tied:
            persistent.append(flat)
        else:
            flats[g.unit].append(flat)
    backward = [flats[i] for i in sorted(flats, reverse=True)]
    held = 0
    for size, count in made.items():
        def serves(n: int) -> bool:
            return size / SLACK <= n <= size

        in_use = sum(map(serves, persistent)) + any(map(serves, outs)) + any(map(serves, cast))
        in_use += max((sum(map(serves, current)) + any(map(serves, previous[-1:]))
                       for previous, current in zip([[]] + backward, backward)), default=0)
        held += size * min(in_use, count)
    return held


@functools.lru_cache(maxsize=64)
def _moving(inventory: Inventory, bucket_size: int, accelerator: bool, param: str,
            copy_ahead: int, hold: bool = False) -> tuple[dict[str, int], int]:
    """The step buffers' categories, and the most their sum (the moving part of ``device_total``)
    reaches; ``hold``: units held from their forward to their backward (``grad_op``)."""
    units = _units(inventory, accelerator)
    # Persistent units stay gathered; a tied one may stay from its first use to its last.
    persistent = [u for u in units.values() if u.persistent or u.tied]
    order = [u for _, u in sorted(units.items()) if not u.persistent]
    # Forward, then backward's reverse order; under grad_op every unit is held when backward starts.
    window = sum(u.nbytes for u in order if not u.tied) if hold else _window(order + order[::-1], bucket_size)
    held = sum(u.nbytes for u in persistent) + window  # gather buffers in use at most, the re-gather's aside
    regathered = _regathered(inventory, accelerator, param)
    largest = max((u.grad_bytes for u in order), default=0)
    pool = _largest_request(inventory)
    # One group's reduce-scatter at a time: its input (a cast to reduce_dtype) and output shard, and
    # on the CPU (gloo) the peers' copies of the shard that a large one receives within a node (a
    # bound across nodes, where gloo keeps its copy inside its library).
    reduce = received = 0
    for g in inventory.groups:
        if g.trainable:
            flat = g.shard_numel * inventory.world * inventory.reduce_bytes
            shard = g.shard_numel * inventory.reduce_bytes if inventory.world > 1 else 0
            copies = 0 if accelerator else gloo_received_nbytes(inventory.world, shard)
            received = max(received, copies)
            reduce = max(reduce, flat + shard if accelerator else _served(flat, pool) + _served(shard, pool) + copies)
    out = {
        "gathered": held - window + max(window, regathered),
        "grad_buffers": sum(u.grad_bytes for u in persistent) + largest,
        "reduce_pending": reduce,
        "staged": 0,
        "pooled": 0,
        "gathers_kept": 0,
    }
    if accelerator:
        if param != "none":
            # Host-side shards copied to the device: those copied ahead (param="cpu"), and those of
            # the gathers in flight, held until each is waited for (DeviceCopies).
            out["staged"] = (copy_ahead if param == "cpu" else 0) + window // inventory.world
        return out, out["gathered"] + out["grad_buffers"] + out["reduce_pending"] + out["staged"]
    # The CPU keeps released gather memory (at most what was in use at once beyond what stays in use:
    # GatherPool) and gradient buffers within a backward (BufferPool); the re-gather after a step
    # runs with neither pool's buffers in use.
    out["gathers_kept"] = window + sum(u.nbytes for u in persistent if not u.persistent)
    out["pooled"] = _pool_held(inventory, units)
    loose = sum(u.loose_bytes for u in persistent) + max((u.loose_bytes for u in order), default=0)
    return out, held + max(out["pooled"] + loose + received, regathered)
