"""One memory budget instead of tiers: the placement a run fits in, chosen before it starts.

The user gives a per-rank budget; the planner weighs the placements the engine supports
(:func:`~lightning_zinf.planning.cost.predict` gives each one's peak and traffic) and takes, among
those that fit, the one whose step moves the fewest bytes over the disk and the host link, timed at
the bandwidths measured on this machine (:mod:`~lightning_zinf.planning.bandwidth`; ZeRO-Infinity
§4.2 sizes its tiers by the same bandwidths). On an accelerator the placements are ZeRO-3 on the
device, ZeRO-Offload (optimizer state on the host, Ren et al., ATC'21), parameters and optimizer
state on the host, and the NVMe tiers of ZeRO-Infinity (Rajbhandari et al., SC'21, §5); on a CPU
device, where the host tiers are the same memory, only the NVMe ones free any. Placement is partial
where the engine allows it: an NVMe placement keeps as many of the first groups' records in host
memory as the budget leaves room for (``OffloadConfig.host_bytes``), each kept byte a byte the disk
no longer reads and writes every step, and gives the rest to the staging cap; on an accelerator
ZeRO-Offload keeps as many of the first groups' optimizer state on the device as the room holds
(``OffloadConfig.device_bytes``: stepped there, nothing of theirs on the host link). Placements whose
step overlaps come first; then, if none fits, NVMe ones with the least staging (a synchronous
step); then all of them with the prefetch bucket shrunk to the next unit (on an accelerator the
user's bucket and one unit ahead are weighed together). A refusal names the smallest budget that
would fit and what would then be placed where.

With the example input profiled (:mod:`~lightning_zinf.planning.profile`) each placement is weighed
with every count of blocks that keep their activations, and on an accelerator with some of the
others keeping theirs in host memory (ZeRO-Infinity §5.1.2's activation offload, per block), the
rest checkpointed, by the predicted step (:mod:`~lightning_zinf.planning.timing`). Without one,
activations are planned from the first training step (:mod:`~lightning_zinf.planning.activations`).

DeepSpeed and FSDP2 leave every tier to the user (DeepSpeed's one partial knob is
``offload_optimizer.ratio``); DeepSpeed's DeepCompile plans activation offload under ``torch.compile``.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Optional

from lightning_zinf.config import OffloadConfig, PrefetchConfig
from lightning_zinf.offload.aligned import ALIGNMENT, round_up
from lightning_zinf.offload.host import first_that_fit
from lightning_zinf.planning.bandwidth import Bandwidths
from lightning_zinf.planning.cost import Placement, Prediction, device_split_costs, host_costs, predict
from lightning_zinf.planning.inventory import Inventory
from lightning_zinf.planning.profile import ForwardProfile
from lightning_zinf.planning.timing import StepTime, step_time
from lightning_zinf.planning.sizes import format_bytes

__all__ = ["BudgetError", "MemoryPlan", "plan_memory"]

#: Optimizer sub-groups the staging cap holds at least: the step reads the next ones ahead of the
#: one it runs and writes the last ones behind it (below four it runs synchronously).
_SUB_GROUPS = 4


class BudgetError(ValueError):
    """No placement fits the memory budget; the message names the smallest budget that would."""


@dataclass(frozen=True)
class MemoryPlan:
    """The placement chosen for a budget, and what it is predicted to cost.

    Attributes:
        budget: The per-rank budget in bytes (``memory_budget``).
        host_budget: The per-rank host-memory cap in bytes, or ``None``.
        accelerator: The compute device is an accelerator (else the budget covers host and device
            together: they are one memory).
        placement: The tiers chosen.
        prediction: Its predicted peaks and traffic.
        prefetch: The prefetch settings to run with (the given ones, or a smaller bucket).
        sub_group_size: ``OffloadConfig.sub_group_size`` to run with.
        bandwidths: The bandwidths the traffic was timed with.
        considered: Every placement weighed at the user's bucket: ``(placement, predicted peak
            bytes, seconds of traffic per step)``.
        activation_bytes: Bytes of the budget left to activations (``activation_memory``).
        step: The predicted step time, term by term.
        kept_blocks: Blocks (the first ones) that keep their activations, the others checkpointed;
            ``None``: chosen from the first training step (no example input profiled).
        activations: Predicted peak bytes of activations with ``kept_blocks`` (0 when ``None``).
        profile: The example input's forward the activations and compute were planned from, or ``None``.
        offloaded_blocks: Blocks after the kept ones whose activations wait in host memory between
            forward and backward (an accelerator's), the rest checkpointed.
    """

    budget: int
    host_budget: Optional[int]
    accelerator: bool
    placement: Placement
    prediction: Prediction
    prefetch: PrefetchConfig
    sub_group_size: int
    bandwidths: Bandwidths = Bandwidths()
    considered: tuple[tuple[Placement, int, float], ...] = ()
    activation_bytes: int = 0
    step: Optional[StepTime] = None
    kept_blocks: Optional[int] = None
    activations: int = 0
    profile: Optional[ForwardProfile] = None
    offloaded_blocks: int = 0

    @property
    def host_activations(self) -> int:
        """Bytes of host memory the offloaded blocks' activations take (0 without a profile)."""
        if self.profile is None or self.kept_blocks is None:
            return 0
        return self.profile.offloaded_bytes(self.kept_blocks, self.offloaded_blocks)

    def offload_config(self, given: OffloadConfig) -> OffloadConfig:
        """``given`` (its ``nvme_path``, ``aio``, ``read_ahead``...) with the planned tiers and sizes."""
        fields = dict(param=self.placement.param, optimizer=self.placement.optimizer,
                      host_bytes=self.placement.host_bytes, sub_group_size=self.sub_group_size,
                      staging_bytes=self.placement.staging_bytes or None, device_bytes=self.placement.device_bytes)
        if self.placement.read_ahead is not None:
            fields["read_ahead"] = self.placement.read_ahead
        return dataclasses.replace(given, **fields)

    def _activation_choice(self, blocks: int) -> str:
        kept, offloaded = self.kept_blocks, self.offloaded_blocks
        checkpointed = blocks - kept - offloaded
        if kept == blocks:
            return "every block keeping its own"
        if checkpointed == blocks:
            return "every block checkpointed"
        if offloaded == blocks:
            return "every block keeping its own in host memory"
        parts = [f"the first {kept} of {blocks} blocks keeping theirs"] if kept else []
        if offloaded:
            parts.append(f"the next {offloaded} keeping theirs in host memory" if kept else
                         f"the first {offloaded} of {blocks} blocks keeping theirs in host memory")
        if checkpointed:
            parts.append("the rest checkpointed")
        return ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]

    def describe(self) -> str:
        """The plan as the strategy logs it: the budget, the placement, the predicted peak per
        ledger category and in total, the bytes a step moves (and their time at the measured
        bandwidths), and the other placements weighed."""
        p = self.prediction
        where = "device and host together: one memory" if not self.accelerator else "device"
        lines = [f"lightning_zinf memory plan: budget {format_bytes(self.budget)} per rank ({where})"
                 + (f", host {format_bytes(self.host_budget)}" if self.host_budget is not None else ""),
                 f"  placement: {self.placement.describe()}, bucket_size={self.prefetch.bucket_size}"
                 f"{' (one unit gathered ahead)' if not self.prefetch.bucket_size else ''}, "
                 f"sub_group_size={self.sub_group_size}"]
        if self.placement.host_bytes:
            lines.append(f"  groups kept in host memory instead of NVMe: {p.kept_groups}")
        lines.append(f"  predicted peak: device {format_bytes(p.device)}, host {format_bytes(p.host)}, "
                     f"total {format_bytes(p.total(self.accelerator))}"
                     + (f", and {format_bytes(self.activation_bytes)} left to activations" if self.activation_bytes else "")
                     + "; per ledger category, each at its own peak:")
        for category, nbytes in sorted(p.categories.items(), key=lambda kv: -kv[1]):
            if nbytes and category != "device_total" and not category.endswith("_nvme"):
                lines.append(f"    {category:<16} {format_bytes(nbytes)}")
        on_disk = [f"{c} {format_bytes(n)}" for c, n in p.categories.items() if c.endswith("_nvme") and n]
        if on_disk:
            lines.append(f"  in NVMe swap files (not memory): {', '.join(on_disk)}")
        if self.kept_blocks is not None:
            blocks = len(self.profile.blocks) if self.profile is not None else self.kept_blocks
            lines.append(f"  activations: {format_bytes(self.activations)} at the peak, {self._activation_choice(blocks)} "
                         f"(from the example input); in all {format_bytes(p.total(self.accelerator) + self.activations)}"
                         + (f"; {format_bytes(self.host_activations)} of activations in host memory"
                            if self.offloaded_blocks else ""))
        moved = 2 * self.profile.offloaded_traffic(self.kept_blocks, self.offloaded_blocks) \
            if self.offloaded_blocks and self.profile is not None and self.kept_blocks is not None else 0
        link = p.link_bytes + moved
        traffic = f"  per step: {format_bytes(p.disk_bytes)} NVMe I/O, {format_bytes(link)} host link" + (
            f" ({format_bytes(moved)} of offloaded activations)" if moved else "")
        b = self.bandwidths
        if b.disk or b.link:
            measured = ", ".join(f"{name} {value / 1e9:.2f} GB/s" for name, value in (("disk", b.disk), ("link", b.link))
                                 if value)
            traffic += f": {b.seconds(p.disk_bytes, link):.3f} s at the measured {measured} per rank"
        lines.append(traffic)
        if self.step is not None:
            lines.append(f"  {self.step.describe()}")
        for placement, peak, seconds in self.considered:
            if placement != self.placement:
                fits = "fits" if peak + self.activation_bytes <= self.budget else "does not fit"
                what = "step" if self.step is not None and self.step.total is not None else "traffic"
                kept = " with every block's activations kept" if self.kept_blocks is not None else ""
                lines.append(f"  weighed: {placement.describe()}: peak {format_bytes(peak)}{kept} ({fits})"
                             + (f", {what} {seconds:.3f} s" if b.disk or b.link or what == "step" else ""))
        return "\n".join(lines)


def _candidates(accelerator: bool, nvme: bool, optimizer_on_nvme: bool) -> list[tuple[str, str]]:
    if accelerator:
        order = [("none", "none"), ("none", "cpu"), ("cpu", "cpu"), ("none", "nvme"), ("cpu", "nvme"), ("nvme", "nvme")]
    else:
        order = [("none", "none"), ("none", "nvme"), ("nvme", "nvme")]
    return [(p, o) for p, o in order if (nvme or "nvme" not in (p, o)) and (optimizer_on_nvme or o != "nvme")]


def _min_staging(inventory: Inventory, param: str, optimizer: str, state_bytes: int, read_ahead: int,
                 sub_groups: int) -> int:
    """The staging cap a placement runs with: ``sub_groups`` optimizer sub-groups (master, states
    and gradient of the largest group; four overlap the step, and at least three are needed) and, with
    parameters on NVMe, the shards of the units read ahead plus the one gathered, or those of every
    persistent unit if more."""
    need = 0
    trainable = [g.shard_numel for g in inventory.groups if g.trainable]
    if optimizer == "nvme" and trainable:
        s = max(trainable)
        # Master, gradient and states records, each aligned, the states' regions each aligned too;
        # three sub-groups at least: the one stepped, the one whose records are written or made,
        # and the gradient shards held from backward (measured: two run out with parameters on NVMe).
        per_sub_group = 2 * round_up(4 * s, ALIGNMENT) + round_up(state_bytes * s, ALIGNMENT) + 2 * ALIGNMENT
        need += max(sub_groups, 3) * per_sub_group
    if param == "nvme":
        per_unit: dict[int, int] = {}
        for g in inventory.groups:
            per_unit[g.unit] = per_unit.get(g.unit, 0) + g.shard_numel * (g.storage_bytes + g.compute_bytes)
        # The persistent units are gathered all at once (at construction and after each step), each
        # group's record in staging until the gathers complete.
        persistent = sum(round_up(g.shard_numel * max(g.storage_bytes, g.compute_bytes), ALIGNMENT)
                         for g in inventory.groups if g.persistent)
        need += max((read_ahead + 2) * (max(per_unit.values()) + 2 * ALIGNMENT), persistent)
    return need


def plan_memory(inventory: Inventory, budget: int, *, accelerator: bool, offload: OffloadConfig = OffloadConfig(),
                prefetch: PrefetchConfig = PrefetchConfig(), host_budget: Optional[int] = None,
                state_bytes: int = 8, optimizer_on_nvme: bool = True,
                bandwidths: Bandwidths = Bandwidths(), activation_bytes: int = 0,
                profile: Optional[ForwardProfile] = None, plan_activations: bool = True,
                sharding: str = "full", replicas: int = 1) -> MemoryPlan:
    """Choose the placement whose predicted per-rank peak fits ``budget`` with the least traffic
    (with ``profile``: the least predicted step), and with it which blocks keep, offload or
    recompute their activations and the prefetch depth.

    Among the placements that fit, the one whose step moves the fewest bytes over the disk and the
    host link (in seconds at ``bandwidths``) wins, ties going to the faster tiers; a step that
    overlaps (NVMe staging of four sub-groups) before a synchronous one, the user's prefetch
    bucket before the bucket of one unit.

    Args:
        inventory: The model's flat groups (:meth:`Inventory.of`).
        budget: Bytes per rank of the compute device's memory; on a CPU device, of the process's
            memory (device and host tiers are the same memory there).
        accelerator: The compute device is an accelerator.
        offload: The user's offload settings: their ``nvme_path`` (NVMe placements are considered
            only with one), ``read_ahead``, ``aio`` and ``copy_ahead_bytes`` are kept.
        prefetch: The user's prefetch settings; the bucket shrinks when nothing fits with it.
        host_budget: Bytes per rank of host memory the plan may use besides (an accelerator's);
            ``None``: no cap.
        state_bytes: Optimizer state bytes per trainable element (AdamW: 8).
        optimizer_on_nvme: Placements may put the optimizer state on NVMe (not under fp16 loss
            scaling, whose scaler reads every gradient between backward and the step).
        bandwidths: This machine's disk and host-link bandwidths per rank
            (:func:`~lightning_zinf.planning.bandwidth.measure_bandwidths`), which time each
            placement's traffic; unmeasured, the bytes themselves are compared.
        activation_bytes: Bytes of ``budget`` left to activations beyond what ``profile`` counts
            (``activation_memory``); the placement fits in the rest.
        profile: The forward on the example input (:mod:`~lightning_zinf.planning.profile`), timed;
            with it, the number of blocks that keep their activations is planned too (and on an
            accelerator with a measured link, of those that offload them), and placements are
            weighed by their predicted step (:func:`~lightning_zinf.planning.timing.step_time`).
        plan_activations: The plan may choose which blocks checkpoint; ``False`` when the user
            checkpoints them (``activation_checkpointing``, or the model's own): all are, and
            ``profile``'s activations are counted so.
        sharding: The user's ``sharding`` (``"grad_op"``: every unit held from its forward to its
            backward, gathered once a step), which the peaks and the collectives count.
        replicas: Under ``sharding="hybrid"``, the shard groups (``inventory`` is one group's):
            each gradient shard is also all-reduced across them, which the collectives count.

    Returns:
        The :class:`MemoryPlan`.

    Raises:
        BudgetError: no placement fits; the message gives the smallest budget that fits and its
            placement, or, when only NVMe would fit and no ``nvme_path`` is set, asks for one.
    """
    state_budget = budget - activation_bytes  # the placement's share; the rest is the activations'
    considered: list[tuple[Placement, int, float]] = []
    buckets = [prefetch.bucket_size] + ([0] if prefetch.bucket_size else [])
    smallest: Optional[tuple[int, Placement, int]] = None
    smallest_nvme: Optional[tuple[int, Placement, int]] = None
    candidates = _candidates(accelerator, offload.nvme_path is not None, optimizer_on_nvme)
    timed = profile is not None and profile.seconds_per_flop is not None
    choices = _activation_choices(profile, plan_activations, offloads=accelerator and bandwidths.link is not None)
    fits: dict[tuple, tuple[Placement, Prediction]] = {}
    split_costs = device_split_costs(inventory, state_bytes, accelerator)
    # Placements whose step overlaps first (NVMe staging of four sub-groups), weighed by their
    # predicted step (their traffic without an example input); then NVMe ones with the least
    # staging (a synchronous step); all of it at the user's bucket before the bucket of one unit.
    phases = [[(c, _SUB_GROUPS) for c in candidates], [(c, 1) for c in candidates if "nvme" in c]]
    # The prefetch depth: on an accelerator the user's bucket and one unit ahead are weighed together
    # (one unit ahead hides the gathers as well in the time model, and its memory may keep more
    # activations); on a CPU device, where the model has no overlap for the depth to buy, the
    # smaller bucket is tried only when nothing fits the user's.
    rounds = [(buckets, p) for p in phases] if accelerator else [([b], p) for b in buckets for p in phases]
    for depths, tries in rounds:
        fitting = []
        for (depth, bucket), (order, ((param, optimizer), sub_groups)), (kept, offloaded) in \
                itertools.product(enumerate(depths), enumerate(tries), choices):
            activations = profile.activation_bytes(kept or 0, offloaded) if profile is not None else 0
            host_activations = profile.offloaded_bytes(kept or 0, offloaded) if profile is not None else 0
            room = state_budget - activations
            host_room = None if host_budget is None else host_budget - host_activations
            # A placement is sized by the room it is given only where it has NVMe records to
            # keep in memory (on a CPU device that room, on an accelerator the host's), or, for
            # ZeRO-Offload on an accelerator, groups to step on the device (as many as the room holds).
            split = accelerator and (param, optimizer) == ("none", "cpu") and bool(split_costs)
            key = (bucket, sub_groups, param, optimizer,
                   None if "nvme" not in (param, optimizer) else host_room if accelerator else room)
            if split:
                base = fits.get(key) or _fit(inventory, param, optimizer, room, host_room, accelerator=accelerator,
                                             offload=offload, bucket=bucket, state_bytes=state_bytes,
                                             sub_groups=sub_groups, sharding=sharding)
                fits[key] = base
                groups = first_that_fit([added for _, added in split_costs], room - base[1].device)
                key = (*key, groups)
            if key not in fits:
                fits[key] = _fit(inventory, param, optimizer, room, host_room, accelerator=accelerator,
                                 offload=offload, bucket=bucket, state_bytes=state_bytes, sub_groups=sub_groups,
                                 device_bytes=sum(cost for cost, _ in split_costs[:groups]) if split else 0,
                                 sharding=sharding)
            placement, prediction = fits[key]
            peak = prediction.total(accelerator)
            step = step_time(inventory, placement, prediction, bandwidths, accelerator=accelerator,
                             profile=profile, kept=kept or 0, offloaded=offloaded, sharding=sharding,
                             replicas=replicas, bucket_size=bucket if prefetch.enabled else None)
            seconds = step.total if timed else bandwidths.seconds(prediction.disk_bytes, prediction.link_bytes)
            if bucket == prefetch.bucket_size and (kept, offloaded) == choices[0]:
                considered.append((placement, peak + activations, seconds))
            if peak <= room and (host_room is None or not accelerator or prediction.host <= host_room):
                # The least predicted time (traffic at the measured bandwidths, or bytes if none),
                # then the faster tiers, then more blocks kept, then fewer offloaded.
                cost = seconds if timed or bandwidths.disk or bandwidths.link else \
                    prediction.disk_bytes + prediction.link_bytes
                fitting.append((cost, depth, order, -(kept or 0), offloaded, placement, prediction, kept,
                                offloaded, step, activations, bucket))
            if smallest is None or peak + activations < smallest[0]:
                smallest = (peak + activations, placement, bucket)
            if placement.nvme and (smallest_nvme is None or peak + activations < smallest_nvme[0]):
                smallest_nvme = (peak + activations, placement, bucket)
        if fitting:
            *_, placement, prediction, kept, offloaded, step, activations, bucket = min(fitting, key=lambda f: f[:5])
            return MemoryPlan(budget, host_budget, accelerator, placement, prediction,
                              dataclasses.replace(prefetch, bucket_size=bucket),
                              _sub_group_size(inventory, offload, placement), bandwidths, tuple(considered),
                              activation_bytes, step, kept if plan_activations else None, activations, profile,
                              offloaded)
    assert smallest is not None
    peak, placement, bucket = smallest
    peak += activation_bytes
    reserved = f", {format_bytes(activation_bytes)} of it activation_memory" if activation_bytes else ""
    if profile is not None:
        reserved += (f", {format_bytes(profile.activation_bytes(0))} of it the example's activations with every "
                     "block checkpointed")
    message = (f"memory_budget={format_bytes(budget)} per rank is less than this model needs in any placement the "
               f"engine has: the least is {format_bytes(peak)}{reserved} ({placement.describe()}, "
               f"bucket_size={bucket}). Raise memory_budget to at least {peak} bytes")
    if profile is not None:
        message += ", or lower the batch size per device"
    if offload.nvme_path is None:
        message += (", or set offload.nvme_path to a folder on a fast disk so that the plan may put parameters "
                    "and optimizer state on NVMe")
    if accelerator and host_budget is not None:
        message += f", or raise host_memory_budget (now {format_bytes(host_budget)})"
    if offload.nvme_path is not None and smallest_nvme is not None and not placement.nvme:
        largest = max((g.shard_numel for g in inventory.groups if g.trainable), default=0)
        message += (f". NVMe placements were weighed too: the least needs {format_bytes(smallest_nvme[0] + activation_bytes)}"
                    f" ({smallest_nvme[1].describe()}), as its staging holds at least three optimizer sub-groups of "
                    f"the largest trainable flat group ({largest} elements per rank, {state_bytes + 8} bytes each: a "
                    "flat group is never split across sub-groups, and a large embedding is one), more than NVMe saves")
    raise BudgetError(message + ".")


def _activation_choices(profile: Optional[ForwardProfile], plan_activations: bool,
                        offloads: bool) -> list[tuple[Optional[int], int]]:
    """The ``(kept, offloaded)`` block counts to weigh, the most memory first: without a profile
    ``(None, 0)`` (activations planned from the first step); when the user checkpoints every block
    ``(0, 0)``; else every count of kept blocks, and where activations may be offloaded (an
    accelerator with a measured host link) each with none, a quarter, half, three quarters and all
    of the blocks after them offloaded (the rest checkpointed). Blocks of a class are alike, so the
    count after the kept ones matters, not which; quarters keep the plan's time linear in depth."""
    if profile is None:
        return [(None, 0)]
    if not plan_activations:
        return [(0, 0)]
    blocks = len(profile.blocks)
    choices = []
    for kept in range(blocks, -1, -1):
        rest = blocks - kept
        shares = sorted({0, rest // 4, rest // 2, (3 * rest) // 4, rest}) if offloads else [0]
        choices.extend((kept, offloaded) for offloaded in shares)
    return choices


def _sub_group_size(inventory: Inventory, offload: OffloadConfig, placement: Placement) -> int:
    # Each trainable group its own sub-group when the optimizer is on NVMe: the staging cap then
    # holds several of them, and the step overlaps (_min_staging counts four).
    if placement.optimizer != "nvme":
        return offload.sub_group_size
    return min(offload.sub_group_size, max((g.shard_numel for g in inventory.groups if g.trainable), default=1))


def _fit(inventory: Inventory, param: str, optimizer: str, budget: int, host_budget: Optional[int], *,
         accelerator: bool, offload: OffloadConfig, bucket: int, state_bytes: int,
         sub_groups: int, device_bytes: int = 0, sharding: str = "full") -> tuple[Placement, Prediction]:
    """The placement ``(param, optimizer)`` sized to the budget: with NVMe, the staging of
    ``sub_groups`` optimizer sub-groups, then as many records kept in host memory as the room left holds, then the
    rest of the room as staging (up to the bytes on NVMe); ZeRO-Offload with ``device_bytes`` as given."""
    def run(placement: Placement) -> Prediction:
        return predict(inventory, placement, bucket_size=bucket, state_bytes=state_bytes, accelerator=accelerator,
                       copy_ahead_bytes=offload.copy_ahead_bytes, sharding=sharding)

    placement = Placement(param=param, optimizer=optimizer, device_bytes=device_bytes)
    if not placement.nvme:
        return placement, run(placement)
    read_ahead = offload.read_ahead if sub_groups > 1 else 0  # the least staging reads no unit ahead
    if param == "nvme" and read_ahead != offload.read_ahead:
        placement = dataclasses.replace(placement, read_ahead=read_ahead)
    staging = _min_staging(inventory, param, optimizer, state_bytes, read_ahead, sub_groups)
    # More staging than the records on NVMe buys nothing (all of them fit at once already).
    on_disk = _on_disk(run(placement))
    staging = min(staging, max(on_disk, _min_staging(inventory, param, optimizer, state_bytes, 0, 2)))
    base = run(dataclasses.replace(placement, staging_bytes=staging))
    # Room for host memory: on a CPU device the budget minus everything; on an accelerator the host cap.
    if accelerator:
        room = (host_budget - base.host) if host_budget is not None else \
            sum(host_costs(inventory, placement, state_bytes, buffers=True))  # no cap: every record kept
    else:
        room = budget - base.total(accelerator)
    if room <= 0:
        return dataclasses.replace(placement, staging_bytes=staging), base
    costs = host_costs(inventory, placement, state_bytes)
    # The kept groups' bytes (whole groups, in order), chosen by what their buffers take in memory.
    used = sum(costs[: first_that_fit(host_costs(inventory, placement, state_bytes, buffers=True), room)])
    prediction = run(dataclasses.replace(placement, staging_bytes=staging, host_bytes=used))
    spent = prediction.host - base.host  # the kept records, their buffers' blocks included
    grown = staging + max(0, min(room - spent, _on_disk(prediction) - staging))
    final = dataclasses.replace(placement, staging_bytes=grown, host_bytes=used)
    result = run(final)
    # Each staging buffer takes a block beyond its size: the growth gives back what that adds over the room.
    over = result.total(accelerator) - budget if not accelerator else \
        (result.host - host_budget if host_budget is not None else 0)
    if over > 0 and grown > staging:
        final = dataclasses.replace(final, staging_bytes=max(staging, grown - over))
        result = run(final)
    return final, result


def _on_disk(prediction: Prediction) -> int:
    return prediction.categories.get("shards_nvme", 0) + prediction.categories.get("optimizer_nvme", 0)
