"""A placement's predicted step time, term by term: compute, recompute, collectives, the optimizer
step, and the disk and host-link traffic the compute does not hide.

Each term is a count of this run's work over a rate measured on this machine at setup:
- compute: the forward's FLOPs (:mod:`~lightning_zinf.planning.profile`, on the example input) at
  the seconds per FLOP of a block run for real; backward is two forwards (Kaplan et al., 2020, §2.1:
  6 FLOPs per parameter and token, a third of them forward);
- recompute: the forward FLOPs of the checkpointed blocks at what checkpointing added to a block
  run for real;
- collectives: the bytes ZeRO-3 moves per step (Rajbhandari et al., SC'20, §7.2: every unit gathered
  for the forward and again for backward, the persistent ones once after the step, and every
  gradient reduce-scattered; units used again within the prefetch bucket, tied and frozen units
  as :func:`unit_gathers` says), at the all-gather bandwidth of a probe among the run's ranks;
- optimizer step: the trainable elements of this rank's shard at the seconds per element of
  torch's AdamW on the tier that steps them (host or device; under ``OffloadConfig.device_bytes``
  the first groups on the device, the rest on the host);
- disk and host link: :class:`~lightning_zinf.planning.cost.Prediction`'s bytes at their bandwidths,
  and on the link the saved tensors of the blocks whose activations are offloaded, to the host in
  the forward and back in backward.

How they add (the engine's schedule): on a CPU device compute, collectives (gloo, on the same
cores) and the optimizer step follow one another, and the NVMe reads and writes proceed during the
forward (the step's records are read ahead and written behind it,
:mod:`~lightning_zinf.offload.stepping`), so what exceeds the forward shows, and at least half of
them, since the swapper and the background step share the cores with the compute. On an accelerator
the collectives and the host-link copies run on their own streams beside the compute and show only
where they exceed it (the link per pass: the forward against the activations copied out and half
the other copies, backward against the copies back and the other half); those terms were not yet
measured on a GPU.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

from lightning_zinf.config import PrefetchConfig
from lightning_zinf.engine.trace import reuse_costs
from lightning_zinf.planning.bandwidth import Bandwidths
from lightning_zinf.planning.cost import Placement, Prediction, stepped_on_device
from lightning_zinf.planning.inventory import Inventory
from lightning_zinf.planning.profile import ForwardProfile

__all__ = ["StepTime", "collective_bytes", "step_time", "unit_gathers"]

#: Share of the disk's seconds that shows on a CPU device however long the forward: 0.55-0.8 of it
#: showed in examples/benchmarks/budget.py's runs on 2 cores (RESULTS.md, issue 40, session 24).
_CPU_DISK_SHOWN = 0.5


@dataclass(frozen=True)
class StepTime:
    """A step's predicted seconds per term, per rank.

    Attributes:
        forward: The forward's compute (``None``: no example input, compute not predicted).
        backward: Backward's compute (``None`` likewise).
        recompute: The checkpointed blocks' forwards again in backward (``None`` likewise).
        collectives: The gathers and reduce-scatters (0 with one rank; ``None``: not measured).
        optimizer: The optimizer step on this rank's shard (``None``: not measured).
        disk: NVMe reads and writes, all of them (what shows is :attr:`exposed_disk`).
        link: Host-link copies, all of them (an accelerator's), the offloaded activations' included.
        accelerator: The compute device is an accelerator (terms overlap there).
        activation_link: Of ``link``, the offloaded activations' copies one way (to the host in
            the forward; as many back in backward).
    """

    forward: Optional[float]
    backward: Optional[float]
    recompute: Optional[float]
    collectives: Optional[float]
    optimizer: Optional[float]
    disk: float
    link: float
    accelerator: bool
    activation_link: float = 0.0

    @property
    def exposed_disk(self) -> float:
        """Disk seconds the forward does not hide: on a CPU device at least half of them (the
        swapper's copies and the background optimizer step share the cores with the compute)."""
        hidden = max(0.0, self.disk - (self.forward or 0.0))
        return hidden if self.accelerator else max(hidden, _CPU_DISK_SHOWN * self.disk)

    @property
    def exposed_collectives(self) -> float:
        """Collective seconds that show: all on a CPU device, beyond the compute on an accelerator."""
        seconds = self.collectives or 0.0
        return max(0.0, seconds - self._compute) if self.accelerator else seconds

    @property
    def exposed_link(self) -> float:
        """Host-link seconds the compute does not hide (an accelerator's copies run beside it):
        per pass, the forward against the offloaded activations' copies to the host (the next
        offloaded block waits for them) and half the other traffic (shards copied for the
        forward's gathers, or new values sent after the step), backward and its recompute against
        the copies back and the other half (gradients, the backward's gathers)."""
        other = max(0.0, self.link - 2 * self.activation_link)
        forward = self.forward or 0.0
        backward = (self.backward or 0.0) + (self.recompute or 0.0)
        return (max(0.0, self.activation_link + other / 2 - forward)
                + max(0.0, self.activation_link + other / 2 - backward))

    @property
    def _compute(self) -> float:
        return (self.forward or 0.0) + (self.backward or 0.0) + (self.recompute or 0.0)

    @property
    def total(self) -> Optional[float]:
        """The predicted step in seconds, or ``None`` when the compute is not predicted."""
        if self.forward is None:
            return None
        return self._compute + self.exposed_collectives + (self.optimizer or 0.0) + self.exposed_disk + self.exposed_link

    def describe(self) -> str:
        """One line: the total and its terms."""
        def s(value: Optional[float]) -> str:
            return "not measured" if value is None else f"{value:.3f} s"

        terms = (f"collectives {s(self.collectives)}, optimizer step {s(self.optimizer)}, NVMe {self.disk:.3f} s "
                 f"({self.exposed_disk:.3f} s not hidden by the forward)")
        if self.accelerator:
            terms += f", host link {self.link:.3f} s ({self.exposed_link:.3f} s not hidden by the compute)"
        if self.forward is None:
            return (f"predicted step: compute not predicted (no example_input_array on the model, or its forward or "
                    f"blocks did not run to be timed); {terms}")
        return (f"predicted step {self.total:.3f} s: forward {self.forward:.3f} s, backward {self.backward:.3f} s, "
                f"recompute {self.recompute:.3f} s, {terms}")


def unit_gathers(inventory: Inventory, sharding: str = "full",
                 bucket_size: Optional[int] = PrefetchConfig.bucket_size) -> Counter:
    """How many times a training step gathers each non-persistent unit, by unit index, as the
    engine's schedule runs it on the trace of one forward and backward, modelled from the
    inventory: the forward uses the units in the plan's order and a tied one (an embedding that
    is also the output layer) once more at its end; backward uses the units it reaches (every unit
    from the first trainable one on, and tied ones) in the reverse order, the tied ones first, and
    holds each until its gradients are reduced. After a forward use a unit is released, unless
    the trace uses it again soon, which :meth:`Tracer.reuse_cost
    <lightning_zinf.engine.trace.Tracer.reuse_cost>` gives for this trace (the engine's reuse
    within ``bucket_size``; ``None``: prefetch is off, which keeps nothing for reuse), or, under
    ``sharding="grad_op"``, unless its output needs a gradient (a trainable unit, or any after the
    first trainable one): then it is held until its backward.

    Returns:
        Gathers per step, by unit index (units never gathered absent: a ``Counter`` reads 0).
    """
    sizes: dict[int, int] = {}
    trainable: set[int] = set()
    tied: list[int] = []
    for g in (g for g in inventory.groups if not g.persistent):
        sizes[g.unit] = sizes.get(g.unit, 0) + g.numel
        if g.trainable:
            trainable.add(g.unit)
        if g.tied and g.unit not in tied:
            tied.append(g.unit)
    first = min((g.unit for g in inventory.groups if g.trainable), default=None)
    units = sorted(sizes)
    reached = [u for u in units if first is not None and (u in tied or u >= first)]
    forward = units + tied
    order = forward + [u for u in tied if u in reached] + [u for u in reversed(reached) if u not in tied]
    costs = reuse_costs(order, [sizes.get(u, 0) for u in range(max(units, default=-1) + 1)])
    gathers: Counter = Counter()
    gathered: set[int] = set()
    graph = False  # some trainable unit was used before: every later output needs a gradient
    for position, unit in enumerate(order):
        if unit not in gathered:
            gathers[unit] += 1
            gathered.add(unit)
        if position >= len(forward):
            continue  # held to the end of backward
        graph = graph or unit in trainable
        cost = costs[position]
        reused = cost is not None and bucket_size is not None and cost <= bucket_size
        if not (reused or (sharding == "grad_op" and graph and unit in reached)):
            gathered.discard(unit)
    return gathers


def collective_bytes(inventory: Inventory, sharding: str = "full", replicas: int = 1,
                     bucket_size: Optional[int] = PrefetchConfig.bucket_size) -> int:
    """Bytes a step gathers and reduce-scatters, whole (all ranks' parts), as the engine schedules
    them: each unit gathered in the compute dtype as often as :func:`unit_gathers` says (for the
    forward and again for backward, but units used again within ``bucket_size`` kept, tied and
    frozen units and ``sharding="grad_op"``'s holds counted there); a persistent unit once, after
    the step, if the step changes it; and each trainable group's gradient reduce-scattered in
    ``reduce_dtype``. Under ``sharding="hybrid"`` ``inventory`` is one shard group's (``G``
    ranks), whose gathers and reduce-scatters move ``(G - 1) / G`` of these bytes per rank, and
    each rank's gradient shard is also all-reduced across the ``replicas`` groups (``R``; a ring:
    ``2 (R - 1) / R`` of the shard per rank); the sum per rank is given as the bytes of an
    all-gather over all ``G R`` ranks that moves as much per rank, since the collective rate is
    measured on one (both legs at that rate: the group's, within a node, is counted as slow as
    the link between nodes). 0 with one rank."""
    if inventory.world * (replicas if sharding == "hybrid" else 1) == 1:
        return 0
    stepped = {g.unit for g in inventory.groups if g.trainable}
    per_unit = unit_gathers(inventory, sharding, bucket_size)
    total = all_reduced = 0  # all_reduced: a rank's gradient shards' bytes
    for g in inventory.groups:
        full = g.shard_numel * inventory.world
        gathers = (1 if g.unit in stepped else 0) if g.persistent else per_unit[g.unit]
        total += gathers * full * g.compute_bytes
        if g.trainable:
            total += full * inventory.reduce_bytes
            all_reduced += g.shard_numel * inventory.reduce_bytes
    if sharding != "hybrid" or replicas == 1:
        return total
    group, world = inventory.world, inventory.world * replicas
    per_rank = total * (group - 1) / group + 2 * (replicas - 1) / replicas * all_reduced
    return round(per_rank * world / (world - 1))


def step_time(inventory: Inventory, placement: Placement, prediction: Prediction, rates: Bandwidths, *,
              accelerator: bool, profile: Optional[ForwardProfile] = None, kept: int = 0,
              offloaded: int = 0, sharding: str = "full", replicas: int = 1,
              bucket_size: Optional[int] = PrefetchConfig.bucket_size) -> StepTime:
    """The predicted step of ``placement`` (whose cost is ``prediction``) with the first ``kept``
    blocks of ``profile`` keeping their activations, the next ``offloaded`` keeping theirs in host
    memory and the others checkpointed.

    Args:
        inventory: The model's flat groups.
        placement: The tiers.
        prediction: :func:`~lightning_zinf.planning.cost.predict` of ``placement``.
        rates: The measured bandwidths and rates.
        accelerator: The compute device is an accelerator.
        profile: The forward on the example, timed (``seconds_per_flop`` set); ``None``: compute
            not predicted.
        kept: Blocks of ``profile`` that keep their activations (the first ones).
        offloaded: Blocks after those whose activations are offloaded (an accelerator's).
        sharding: ``"full"``, ``"grad_op"`` or ``"hybrid"`` (:func:`collective_bytes`).
        replicas: Under ``"hybrid"``, the shard groups (:func:`collective_bytes`).
        bucket_size: The prefetch bucket the engine runs with, ``None`` with prefetch off (:func:`unit_gathers`).
    """
    forward = backward = recompute = None
    if profile is not None and profile.seconds_per_flop is not None:
        forward = profile.flops * profile.seconds_per_flop
        backward = 2 * forward
        recompute = profile.recompute_flops(kept, offloaded) * (profile.recompute_seconds_per_flop or 0.0)
    collectives = None
    if inventory.world * (replicas if sharding == "hybrid" else 1) == 1:
        collectives = 0.0
    elif rates.collective:
        collectives = collective_bytes(inventory, sharding, replicas, bucket_size) / rates.collective
    # Elements stepped on the device (every one without optimizer offload, the first groups' under
    # OffloadConfig.device_bytes) at the device's rate, the others at the host's.
    on_device = stepped_on_device(inventory, placement)
    device_elements = sum(g.shard_numel for g, there in zip(inventory.groups, on_device)
                          if g.trainable and (there or placement.optimizer == "none"))
    host_elements = sum(g.shard_numel for g in inventory.groups if g.trainable) - device_elements
    if not accelerator:
        device_elements, host_elements = 0, device_elements + host_elements
    optimizer = None
    if (rates.device_step is not None or not device_elements) and (rates.host_step is not None or not host_elements):
        optimizer = device_elements * (rates.device_step or 0.0) + host_elements * (rates.host_step or 0.0)
    moved = profile.offloaded_traffic(kept, offloaded) if profile is not None else 0
    link = prediction.link_bytes + 2 * moved
    return StepTime(forward, backward, recompute, collectives, optimizer,
                    prediction.disk_bytes / rates.disk if rates.disk else 0.0,
                    link / rates.link if rates.link else 0.0, accelerator,
                    moved / rates.link if rates.link else 0.0)
