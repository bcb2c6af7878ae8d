"""``sharding="auto"``: the sharding mode and ZeRO++'s switches chosen from the measured links.

At setup every rank takes part in two short probes (:func:`measure_links`): an all-gather among
the ranks of each node, every node at once, and one among the ranks with the same place in their
nodes, every such set at once. Each gives a rate as the slowest rank saw it: bytes a rank sends
to its node's ranks per second, and bytes a node sends across its link per second. A third probe
times quantizing and dequantizing on the compute device (:func:`measure_quantization`).

:func:`choose_sharding` then predicts, for each candidate, the seconds one training step's
collectives take, from the bytes the engine would move per link (the counts of the engine's own
:class:`~lightning_zinf.comm.collectives.CommBytes`, per flat group of the model's
:class:`~lightning_zinf.planning.inventory.Inventory`: :func:`step_bytes`) at the measured rates,
plus, for ZeRO++, its quantizing and dequantizing. The candidates:

- ``full`` (ZeRO-3): every unit gathered over all ranks for its forward and again for its
  backward; gradients reduce-scattered over all ranks.
- ``hybrid`` (MiCS, Zhang et al. 2022, §3): the same within a node; each gradient shard
  all-reduced across the nodes.
- ``full`` with ZeRO++ (hpZ, qwZ, qgZ; Wang et al. 2023, §3): forward gathers as INT8 codes over
  all ranks, backward gathers from the node's secondary partition, gradients as INT4 codes in a
  hierarchical all-to-all.

What shows of the collectives (the timing model of
:mod:`~lightning_zinf.planning.timing`): on a CPU device all of them (gloo shares the cores with
the compute); on an accelerator what exceeds the step's compute, when an example input gave the
compute (``example_input_array``), else all. The quantization's kernels run with the compute and
show in full. A candidate that costs more than ``full`` must earn it:

- ``hybrid`` holds a node's share of the state instead of the world's: taken only where that fits
  in the free memory the probe saw and it saves at least 3% of the predicted step;
- ZeRO++'s quantization changes the values that cross the link (weights to about 0.7% relative
  error, gradients to about 18% relative L2 per reduction with INT4 codes): taken only where it
  saves at least 10% of the best unquantized candidate's predicted step, never on a link fast
  enough that the step hides the collectives.

``grad_op`` (ZeRO-2) is not a candidate: it trades memory for one gather of the two, and the
activations it competes with are not known at setup. Choose it yourself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from lightning_zinf.comm.topology import NodeGroups, RankSetGroups, Topology
from lightning_zinf.config import ZeroPPConfig
from lightning_zinf.planning.inventory import Inventory

if TYPE_CHECKING:
    from lightning_zinf.config import MixedPrecisionConfig
    from lightning_zinf.planning.cost import Placement

__all__ = ["Links", "ShardingChoice", "auto_sharding", "choose_sharding", "measure_links", "measure_quantization",
           "step_bytes"]

#: Bytes each rank sends to each peer in the link probes (past a link's start-up, small for setup).
PROBE_BYTES = 8 << 20
#: Elements of the quantization probe.
PROBE_ELEMENTS = 1 << 20
#: The least share of the predicted step ``hybrid`` must save over ``full`` (it holds more memory).
MORE_MEMORY_GAIN = 0.03
#: The least share of the best unquantized candidate's predicted step ZeRO++ must save.
QUANTIZATION_GAIN = 0.10
#: The share of the free memory a candidate's predicted state may take (activations need the rest).
MEMORY_SHARE = 0.6
#: ZeRO++ as ``auto`` switches it on: hpZ, qwZ and qgZ with their defaults.
ZERO_PP = ZeroPPConfig(hpz=True, qwz=True, qgz=True)
CANDIDATES = ("full", "hybrid", "zero_pp")


@dataclass(frozen=True)
class Links:
    """Measured rates, bytes per second.

    Attributes:
        intra: What one rank sends to the other ranks of its node, every rank sending at once
            (``None``: one rank per node).
        inter: What one node sends across its link to the other nodes, every rank sending at once
            (``None``: one node).
    """

    intra: Optional[float]
    inter: Optional[float]


@dataclass(frozen=True)
class ShardingChoice:
    """What ``sharding="auto"`` chose, and why.

    Attributes:
        sharding: ``"full"`` or ``"hybrid"``.
        zero_pp: The ZeRO++ switches to run with (all off, or hpZ, qwZ and qgZ).
        links: The measured rates.
        steps: Per candidate weighed (``"full"``, ``"hybrid"``, ``"zero_pp"``), the predicted
            seconds of a step's compute (0 where not known) and of what shows of its collectives
            and quantization.
        fits: Per candidate, whether its predicted state fits the free memory.
        reason: Why, one sentence for the log.
    """

    sharding: str
    zero_pp: ZeroPPConfig
    links: Links = Links(None, None)
    steps: dict[str, float] = field(default_factory=dict)
    fits: dict[str, bool] = field(default_factory=dict)
    reason: str = ""

    def describe(self) -> str:
        """The choice, the rates and the predicted steps, one line."""
        mode = self.sharding + (" with ZeRO++ (hpZ, qwZ, qgZ)" if self.zero_pp.qgz else "")
        rates = ", ".join(f"{name} {rate / 1e6:.0f} MB/s" for name, rate in
                          (("within a node", self.links.intra), ("between nodes", self.links.inter)) if rate)
        steps = ", ".join(f"{name} {t * 1e3:.0f} ms" + ("" if self.fits.get(name, True) else " (does not fit)")
                          for name, t in self.steps.items())
        return (f"sharding='auto' chose {mode}: {self.reason}" + (f" (links: {rates}; " if rates else " (")
                + (f"predicted steps: {steps})" if steps else "nothing to weigh)"))


def step_bytes(inventory: Inventory, world: int, ranks_per_node: int, candidate: str,
               block: int = 256) -> tuple[float, float]:
    """Bytes one training step's collectives move under ``candidate``: ``(sent by one rank to
    its node's ranks, sent by one node across its link)``.

    Args:
        inventory: The model's flat groups (at any world size: only elements and dtypes are read).
        world: Ranks in all.
        ranks_per_node: Ranks per node (D); ``world // D`` nodes (N).
        candidate: ``"full"``, ``"hybrid"`` or ``"zero_pp"`` (module docstring).
        block: Elements per quantization scale (ZeRO++).

    Returns:
        ``(intra, inter)`` in bytes. A gather of a group of ``B`` bytes sends each peer this
        rank's ``B / shards``; a persistent unit is gathered once a step, others twice (forward and
        backward); a reduce-scatter sends each peer its slice; a ring all-reduce of ``R`` ranks
        sends ``2 (R - 1) / R`` of the buffer; qwZ and qgZ codes carry an fp32 scale per block.

    Raises:
        ValueError: an unknown ``candidate``.
    """
    d, n = ranks_per_node, world // ranks_per_node
    intra = inter = 0.0
    for g in inventory.groups:
        gathers = 1 if g.persistent else 2
        params = g.numel * g.compute_bytes
        grads = g.numel * inventory.reduce_bytes if g.trainable else 0
        if candidate == "full":
            intra += (d - 1) / world * (gathers * params + grads)
            inter += d * (world - d) / world * (gathers * params + grads)
        elif candidate == "hybrid":
            intra += (d - 1) / d * (gathers * params + grads)
            inter += 2 * (n - 1) / n * grads  # d ranks, each all-reducing its 1/d shard
        elif candidate == "zero_pp":
            codes = g.numel * (1 + 4 / block)  # INT8 and a scale per block
            # The forward gather as codes over every rank; backward's from the node's secondary.
            intra += (d - 1) / world * codes + (gathers - 1) * (d - 1) / d * params
            inter += d * (world - d) / world * codes
            if g.trainable:
                grad_codes = g.numel * (0.5 + 4 / block)  # INT4 and a scale per block
                intra += (d - 1) / d * grad_codes
                inter += (n - 1) / n * grad_codes
        else:
            raise ValueError(f"step_bytes: unknown candidate {candidate!r}; one of {CANDIDATES}")
    return intra, inter


def choose_sharding(inventory: Inventory, world: int, ranks_per_node: int, links: Links, *,
                    state_bytes: dict[str, int], free_bytes: Optional[int], compute: Optional[float] = None,
                    quantization: float = 0.0, accelerator: bool = False) -> ShardingChoice:
    """The sharding mode and ZeRO++ switches for ``links`` (module docstring).

    Args:
        inventory: The model's flat groups.
        world: Ranks in all.
        ranks_per_node: Ranks per node.
        links: The measured rates.
        state_bytes: Predicted bytes of this rank's state per candidate; one without an entry
            counts as ``"full"``'s.
        free_bytes: Memory free for the state on this rank (``None``: not known; then only
            candidates no larger than ``"full"`` are taken).
        compute: Seconds of a step's forward and backward (``None``: not known, counted as 0).
        quantization: Seconds per element of quantizing and dequantizing once
            (:func:`measure_quantization`).
        accelerator: The compute device is an accelerator (the collectives run beside the compute).

    Returns:
        The :class:`ShardingChoice`.
    """
    if world // ranks_per_node <= 1 or links.inter is None:
        return ShardingChoice("full", ZeroPPConfig(), links, reason="one node: no link between nodes to spare")
    work = compute or 0.0
    steps, fits = {}, {}
    for candidate in CANDIDATES:
        intra, inter = step_bytes(inventory, world, ranks_per_node, candidate)
        seconds = intra / (links.intra or float("inf")) + inter / links.inter
        if accelerator:
            seconds = max(0.0, seconds - work)
        if candidate == "zero_pp":
            # qwZ's forward gathers dequantize every element, qgZ quantizes and dequantizes each
            # trainable one: about two passes of both per element a step.
            seconds += 2 * quantization * sum(g.numel for g in inventory.groups)
        steps[candidate] = work + seconds
        need = state_bytes.get(candidate, state_bytes.get("full", 0))
        fits[candidate] = need <= state_bytes.get("full", 0) or (free_bytes is not None and
                                                                 need <= MEMORY_SHARE * free_bytes)
    best = "full"
    if not fits["hybrid"]:
        reason = "hybrid sharding's state (a node's share of the model) does not fit the free memory"
    elif steps["hybrid"] <= (1 - MORE_MEMORY_GAIN) * steps["full"]:
        best = "hybrid"
        reason = f"its step is predicted {steps['full'] / steps['hybrid']:.2f}x full sharding's and its state fits"
    else:
        reason = f"hybrid sharding would save less than {MORE_MEMORY_GAIN:.0%} of the step"
    saved = 1 - steps["zero_pp"] / steps[best]
    if fits["zero_pp"] and saved >= QUANTIZATION_GAIN:
        return ShardingChoice("full", ZERO_PP, links, steps, fits,
                              f"ZeRO++'s quantized collectives save {saved:.0%} of {best} sharding's predicted step "
                              f"(at least {QUANTIZATION_GAIN:.0%} must, for their rounding)")
    return ShardingChoice(best, ZeroPPConfig(), links, steps, fits,
                          reason + f"; ZeRO++'s quantization would save {max(0.0, saved):.0%} of the step, under the "
                          f"{QUANTIZATION_GAIN:.0%} it must")


def _timed_gather(group: Optional[dist.ProcessGroup], size: int, device: torch.device, nbytes: int,
                  repeats: int) -> float:
    """Mean seconds of an all-gather of ``nbytes`` per rank over ``group`` (``size`` ranks)."""
    part = torch.ones(nbytes, dtype=torch.uint8, device=device)
    whole = torch.empty(nbytes * size, dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(whole, part, group=group)  # warm-up: the connections are made here
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_gather_into_tensor(whole, part, group=group)
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
    return (time.perf_counter() - start) / repeats


def measure_links(topology: Topology, device: torch.device, nbytes: int = PROBE_BYTES,
                  repeats: int = 3) -> Links:
    """The rates of :class:`Links` on this world (every rank must call it together): an
    all-gather of ``nbytes`` per rank within each node (all nodes at once), then one among the
    ranks with the same local rank (all at once), each the slowest rank's mean over ``repeats``
    after one warm-up. The probe's process groups are destroyed afterwards.

    Args:
        topology: The world's ranks per node (ranks numbered node by node).
        device: Where the probe's buffers are (with NCCL, this rank's GPU).
        nbytes: Bytes each rank sends to each peer.
        repeats: Gathers timed per probe.
    """
    if topology.world_size == 1:
        return Links(None, None)
    groups = NodeGroups(topology, groups=RankSetGroups())
    d, n = topology.ranks_per_node, topology.nodes
    seconds = torch.zeros(2, dtype=torch.float64, device=device)
    if groups.intra is not None:
        seconds[0] = _timed_gather(groups.intra, d, device, nbytes, repeats)
    if groups.inter is not None:
        seconds[1] = _timed_gather(groups.inter, n, device, nbytes, repeats)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    intra_s, inter_s = seconds.tolist()
    for group in (groups.intra, groups.inter):
        if group is not None and group is not dist.group.WORLD:
            dist.destroy_process_group(group)
    # A rank sends its part to each other rank of the set; a node's d ranks send across at once.
    return Links(intra=(d - 1) * nbytes / intra_s if intra_s > 0 else None,
                 inter=d * (n - 1) * nbytes / inter_s if inter_s > 0 else None)


def measure_quantization(device: torch.device, numel: int = PROBE_ELEMENTS, repeats: int = 3) -> float:
    """Seconds per element of quantizing to INT8 blocks and dequantizing back on ``device`` (the
    Triton kernels on a GPU, their torch reference on the CPU), the mean of ``repeats`` after one
    warm-up (which compiles a kernel the first time)."""
    from triton_kernels import dequantize, quantize

    x = torch.randn(numel, device=device)

    def once() -> None:
        codes, scales = quantize(x, 8, 256)
        dequantize(codes, scales, numel, 8, 256)

    once()
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        once()
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
    return (time.perf_counter() - start) / (repeats * numel)


def _free_bytes(device: torch.device, ranks_per_node: int) -> Optional[int]:
    """Memory free for this rank's state: the accelerator's free memory, or on the CPU the host's
    available memory (``MemAvailable``) shared among the node's ranks; ``None`` where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                fields = dict(line.split(":", 1) for line in f)
            return int(fields["MemAvailable"].split()[0]) * 1024 // ranks_per_node
        except (OSError, KeyError, ValueError):
            return None
    return None


def auto_sharding(module: torch.nn.Module, *, world: int, ranks_per_node: int, device: torch.device,
                  block_classes: tuple, mixed_precision: "MixedPrecisionConfig", persistence_threshold: int,
                  bucket_size: int, placement: "Placement", compute: Optional[float] = None) -> ShardingChoice:
    """``sharding="auto"`` for ``module`` on this world. Collective: every rank measures the links
    and the quantization together, and all decide from the slowest rank's rates and rank 0's free
    memory, so that they choose alike.

    Args:
        module: The model (real or on the meta device).
        world: Ranks in all.
        ranks_per_node: Ranks per node.
        device: The compute device.
        block_classes: As the engine's.
        mixed_precision: As the engine's.
        persistence_threshold: As the engine's ``PrefetchConfig``.
        bucket_size: As the engine's ``PrefetchConfig``.
        placement: The offload tiers, for each candidate's predicted state.
        compute: Seconds of a step's forward and backward, from the example input (``None``: not known).

    Returns:
        The :class:`ShardingChoice` (:func:`choose_sharding`).
    """
    from lightning_zinf.planning.cost import predict

    accelerator = device.type != "cpu"
    inventory = Inventory.of(module, world=world, block_classes=block_classes, mixed_precision=mixed_precision,
                             persistence_threshold=persistence_threshold)
    if world // ranks_per_node <= 1:
        return choose_sharding(inventory, world, ranks_per_node, Links(None, None), state_bytes={}, free_bytes=None)
    links = measure_links(Topology(world, dist.get_rank(), ranks_per_node), device)
    slowest = torch.tensor([measure_quantization(device)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    free_here = torch.tensor([_free_bytes(device, ranks_per_node) or -1], dtype=torch.int64, device=device)
    dist.broadcast(free_here, src=0)
    quantization, free = slowest.item(), int(free_here.item())

    def state(shards: int, secondary: bool = False) -> int:
        counted = Inventory.of(module, world=shards, block_classes=block_classes, mixed_precision=mixed_precision,
                               persistence_threshold=persistence_threshold)
        total = predict(counted, placement, bucket_size=bucket_size, accelerator=accelerator).total(accelerator)
        # hpZ's secondary partitions: a node's share of every group, in the compute dtype.
        return total + (sum(g.numel * g.compute_bytes for g in counted.groups) // ranks_per_node if secondary else 0)

    states = {"full": state(world), "hybrid": state(ranks_per_node), "zero_pp": state(world, secondary=True)}
    return choose_sharding(inventory, world, ranks_per_node, links, state_bytes=states,
                           free_bytes=int(free) if free >= 0 else None, compute=compute, quantization=quantization,
                           accelerator=accelerator)
