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
- ``hybrid`` with qgZ (``hybrid_qgz8``, ``hybrid_qgz``): ``hybrid``, its all-reduce across the
  nodes moving INT8 or INT4 codes (a reduce-scatter and an all-gather of codes).

What shows of the collectives (the timing model of
:mod:`~lightning_zinf.planning.timing`): on a CPU device all of them (gloo shares the cores with
the compute); on an accelerator what exceeds the step's compute, when an example input gave the
compute (``example_input_array``), else all. The quantization's kernels run with the compute and
show in full. A candidate that costs more than ``full`` must earn it:

- ``hybrid`` holds a node's share of the state instead of the world's: taken only where that fits
  in 60% of the free memory every rank sees (device, and host where tiers are offloaded) and it
  saves at least 3% of the predicted step;
- ZeRO++'s quantization changes the values that cross the link (weights to about 0.7% relative
  error, gradients to about 18% relative L2 per reduction with INT4 codes, 1% with INT8): a
  quantized candidate (the fastest that fits) is taken only where it saves at least 10% of the
  best unquantized candidate's predicted step, never on a link fast enough that the step hides
  the collectives, and not without the step's compute (against the collectives alone, probe
  noise clears the bar). INT4 gradient codes (``hybrid_qgz``, and ZeRO++'s) likewise must save
  10% of the step of hybrid's INT8 codes, where those fit: on the main job
  (``zero_pp_quality.py``) INT8 left the final validation loss within 0.33% of ZeRO-3's, INT4
  2.4% below it.

The byte model counts what a rank sends each peer (the engine's counts, gloo's in-place forms);
with NCCL, gathers and reduce-scatters over every rank go round a ring, which crosses a node's
link once (:func:`step_bytes`' ``ring``). A choice near a threshold may differ between runs: pin
the mode where a run must keep its numerics.

``grad_op`` (ZeRO-2) is not a candidate: it trades memory for one gather of the two, and the
activations it competes with are not known at setup. Choose it yourself.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from lightning_zinf.comm.topology import NodeGroups, RankSetGroups, Topology
from lightning_zinf.config import PrefetchConfig, ZeroPPConfig
from lightning_zinf.planning.bandwidth import timed_all_gather
from lightning_zinf.planning.inventory import Inventory
from lightning_zinf.planning.timing import unit_gathers

if TYPE_CHECKING:
    from lightning_zinf.config import MixedPrecisionConfig
    from lightning_zinf.planning.cost import Placement

log = logging.getLogger(__name__)

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
CANDIDATES = ("full", "hybrid", "zero_pp", "hybrid_qgz8", "hybrid_qgz")
#: Each quantized candidate's sharding mode and ZeRO++ switches.
QUANTIZED = {"zero_pp": ("full", ZERO_PP), "hybrid_qgz8": ("hybrid", ZeroPPConfig(qgz=True, qgz_bits=8)),
             "hybrid_qgz": ("hybrid", ZeroPPConfig(qgz=True))}
#: A quantized candidate whose codes round more than another's (INT4 gradients against INT8):
#: taken over it, where the other fits, only where it saves ``QUANTIZATION_GAIN`` of its step.
COARSER = {"hybrid_qgz": "hybrid_qgz8", "zero_pp": "hybrid_qgz8"}


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
        zero_pp: The ZeRO++ switches to run with (all off; hpZ, qwZ and qgZ with ``"full"``; qgZ
            with ``"hybrid"``).
        links: The measured rates.
        steps: Per candidate weighed (:data:`CANDIDATES`), the predicted
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
        mode = self.sharding + ("" if not self.zero_pp.qgz else " with ZeRO++ (hpZ, qwZ, qgZ)" if self.zero_pp.hpz
                                else f" with qgZ (the all-reduce across nodes as INT{self.zero_pp.qgz_bits} codes)")
        rates = ", ".join(f"{name} {rate / 1e6:.0f} MB/s" for name, rate in
                          (("within a node", self.links.intra), ("between nodes", self.links.inter)) if rate)
        steps = ", ".join(f"{name} {t * 1e3:.0f} ms" + ("" if self.fits.get(name, True) else " (does not fit)")
                          for name, t in self.steps.items())
        return (f"sharding='auto' chose {mode}: {self.reason}" + (f" (links: {rates}; " if rates else " (")
                + (f"predicted steps: {steps})" if steps else "nothing to weigh)"))


def step_bytes(inventory: Inventory, world: int, ranks_per_node: int, candidate: str,
               block: int = 256, ring: bool = False,
               bucket_size: Optional[int] = PrefetchConfig.bucket_size) -> tuple[float, float]:
    """Bytes one training step's collectives move under ``candidate``: ``(sent by one rank to
    its node's ranks, sent by one node across its link)``.

    Args:
        inventory: The model's flat groups (at any world size: only elements and dtypes are read).
        world: Ranks in all.
        ranks_per_node: Ranks per node (D); ``world // D`` nodes (N).
        candidate: One of :data:`CANDIDATES` (module docstring).
        block: Elements per quantization scale (ZeRO++).
        ring: Gathers and reduce-scatters over every rank go round a ring (NCCL), which crosses a
            node's link once with ``(W - 1) / W`` of the buffer, instead of each rank sending each
            peer its part (gloo's in-place forms, and what the engine's counts say).
        bucket_size: The engine's prefetch bucket (units used again within it stay gathered;
            ``None``: prefetch off, nothing kept for reuse).

    Returns:
        ``(intra, inter)`` in bytes. A gather of a group of ``B`` bytes sends each peer this
        rank's ``B / shards``; a persistent unit is gathered once a step, others as often as
        :func:`~lightning_zinf.planning.timing.unit_gathers` says (forward and backward, but
        units used again within ``bucket_size``); a reduce-scatter sends each peer its slice; a
        ring all-reduce of ``R`` ranks sends ``2 (R - 1) / R`` of the buffer; qwZ and qgZ codes
        carry an fp32 scale per block.

    Raises:
        ValueError: an unknown ``candidate``.
    """
    d, n = ranks_per_node, world // ranks_per_node
    # What one node sends across its link per byte of a collective over every rank.
    across = (world - 1) / world if ring else d * (world - d) / world
    intra = inter = 0.0
    per_unit = unit_gathers(inventory, "full", bucket_size)
    for g in inventory.groups:
        gathers = 1 if g.persistent else per_unit[g.unit]
        params = g.numel * g.compute_bytes
        grads = g.numel * inventory.reduce_bytes if g.trainable else 0
        if candidate == "full":
            intra += (d - 1) / world * (gathers * params + grads)
            inter += across * (gathers * params + grads)
        elif candidate in ("hybrid", "hybrid_qgz8", "hybrid_qgz"):
            intra += (d - 1) / d * (gathers * params + grads)
            # d ranks, each all-reducing its 1/d shard (under qgZ INT8 or INT4 codes, a scale per block)
            code = {"hybrid_qgz8": 1, "hybrid_qgz": 0.5}.get(candidate)
            inter += 2 * (n - 1) / n * (grads if code is None or not g.trainable else g.numel * (code + 4 / block))
        elif candidate == "zero_pp":
            codes = g.numel * (1 + 4 / block)  # INT8 and a scale per block
            # The forward gather as codes over every rank; backward's from the node's secondary.
            intra += (d - 1) / world * codes + (gathers - 1) * (d - 1) / d * params
            inter += across * codes
            if g.trainable:
                grad_codes = g.numel * (0.5 + 4 / block)  # INT4 and a scale per block
                intra += (d - 1) / d * grad_codes
                inter += (n - 1) / n * grad_codes
        else:
            raise ValueError(f"step_bytes: unknown candidate {candidate!r}; one of {CANDIDATES}")
    return intra, inter


def choose_sharding(inventory: Inventory, world: int, ranks_per_node: int, links: Links, *,
                    state_bytes: dict[str, int], free_bytes: Optional[int], compute: Optional[float] = None,
                    quantization: float = 0.0, accelerator: bool = False, ring: bool = False,
                    host_bytes: Optional[dict[str, int]] = None, free_host: Optional[int] = None,
                    bucket_size: Optional[int] = PrefetchConfig.bucket_size) -> ShardingChoice:
    """The sharding mode and ZeRO++ switches for ``links`` (module docstring).

    Args:
        inventory: The model's flat groups.
        world: Ranks in all.
        ranks_per_node: Ranks per node.
        links: The measured rates.
        state_bytes: Predicted bytes of this rank's state on the compute device (with host and
            device apart, an accelerator's) per candidate; one without an entry counts as
            ``"full"``'s, but hybrid's quantized candidates, which hold ``"hybrid"``'s.
        free_bytes: Memory free for it on every rank (``None``: not known; then only candidates
            no larger than ``"full"`` are taken).
        compute: Seconds of a step's forward and backward (``None``: not known, counted as 0;
            then ZeRO++ is not taken: against the collectives alone its bar is noise).
        quantization: Seconds per element of quantizing and dequantizing once
            (:func:`measure_quantization`).
        accelerator: The compute device is an accelerator (the collectives run beside the compute).
        ring: As :func:`step_bytes`'s (NCCL).
        host_bytes: On an accelerator, predicted bytes of this rank's state in host memory per
            candidate (offloaded tiers), checked as ``state_bytes`` against ``free_host``.
        free_host: Host memory free for it on every rank.
        bucket_size: As :func:`step_bytes`'s.

    Returns:
        The :class:`ShardingChoice`.
    """
    if world // ranks_per_node <= 1 or links.inter is None:
        return ShardingChoice("full", ZeroPPConfig(), links, reason="one node: no link between nodes to spare")
    work = compute or 0.0
    steps, fits = {}, {}
    for candidate in CANDIDATES:
        intra, inter = step_bytes(inventory, world, ranks_per_node, candidate, ring=ring, bucket_size=bucket_size)
        seconds = intra / (links.intra or float("inf")) + inter / links.inter
        if accelerator:
            seconds = max(0.0, seconds - work)
        if candidate == "zero_pp":
            # qwZ's forward gathers dequantize every element, qgZ quantizes and dequantizes each
            # trainable one: about two passes of both per element a step.
            seconds += 2 * quantization * sum(g.numel for g in inventory.groups)
        elif candidate in ("hybrid_qgz8", "hybrid_qgz"):
            # Each rank quantizes its 1/d shard and dequantizes it twice (the n operands of its
            # partition, then every partition), and requantizes its 1/n partition: counted as
            # 2 + 1/n passes of both.
            nodes = world // ranks_per_node
            seconds += ((2 + 1 / nodes) * quantization * sum(g.numel for g in inventory.groups if g.trainable)
                        / ranks_per_node)
        steps[candidate] = work + seconds
        fits[candidate] = (fits["hybrid"] if candidate.startswith("hybrid_qgz")  # the same state
                           else _fits(candidate, state_bytes, free_bytes) and _fits(candidate, host_bytes or {}, free_host))
    best = "full"
    if not fits["hybrid"]:
        reason = "hybrid sharding's state (a node's share of the model) does not fit the free memory"
    elif steps["hybrid"] <= (1 - MORE_MEMORY_GAIN) * steps["full"]:
        best = "hybrid"
        reason = (f"full sharding's predicted step is {steps['full'] / steps['hybrid']:.2f}x its own, and its state "
                  "fits")
    else:
        reason = f"hybrid sharding would save less than {MORE_MEMORY_GAIN:.0%} of the step"
    if compute is None:
        return ShardingChoice(best, ZeroPPConfig(), links, steps, fits,
                              reason + "; ZeRO++'s quantization is not weighed without the step's compute (give the "
                              "LightningModule an example_input_array): against the collectives alone, its 10% bar "
                              "would be cleared by probe noise")
    # The fastest quantized candidate that fits (ZeRO++ on a tie: it holds less), but the finer
    # codes where the coarser save too little over them.
    quantized = min((c for c in QUANTIZED if fits[c]), key=lambda c: steps[c], default=None)
    finer = COARSER.get(quantized or "")
    coarser = ""
    if finer is not None and fits[finer] and steps[quantized] > (1 - QUANTIZATION_GAIN) * steps[finer]:
        coarser = (f"; {quantized}'s coarser codes would save {1 - steps[quantized] / steps[finer]:.0%} of its step, "
                   f"under the {QUANTIZATION_GAIN:.0%} they must")
        quantized = finer
    saved = 0.0 if quantized is None else 1 - steps[quantized] / steps[best]
    if quantized is not None and saved >= QUANTIZATION_GAIN:
        what = ("ZeRO++'s quantized collectives" if quantized == "zero_pp"
                else "hybrid sharding with qgZ's quantized all-reduce across nodes")
        return ShardingChoice(*QUANTIZED[quantized], links, steps, fits,
                              f"{what} save {saved:.0%} of {best} sharding's predicted step "
                              f"(at least {QUANTIZATION_GAIN:.0%} must, for their rounding){coarser}")
    return ShardingChoice(best, ZeroPPConfig(), links, steps, fits,
                          reason + f"; ZeRO++'s quantization would save {max(0.0, saved):.0%} of the step, under the "
                          f"{QUANTIZATION_GAIN:.0%} it must")


def _fits(candidate: str, need: dict[str, int], free: Optional[int]) -> bool:
    """Whether ``candidate``'s predicted bytes fit ``MEMORY_SHARE`` of ``free`` (or are no more
    than ``"full"``'s, which is always taken)."""
    mine = need.get(candidate, need.get("full", 0))
    return mine <= need.get("full", 0) or (free is not None and mine <= MEMORY_SHARE * free)


def _probe_buffers(size: int, device: torch.device, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A probe's part (``nbytes``) and gathered whole (``size`` parts) on ``device``."""
    return torch.ones(nbytes, dtype=torch.uint8, device=device), torch.empty(nbytes * size, dtype=torch.uint8,
                                                                              device=device)


def measure_links(topology: Topology, device: torch.device, nbytes: int = PROBE_BYTES,
                  repeats: int = 3, timeout: Optional[timedelta] = None) -> Links:
    """The rates of :class:`Links` on this world (every rank must call it together): an
    all-gather of ``nbytes`` per rank within each node (all nodes at once), then one among the
    ranks with the same local rank (all at once), each the slowest rank's mean over ``repeats``
    after one warm-up. The probe's process groups are destroyed afterwards.

    Args:
        topology: The world's ranks per node (ranks numbered node by node).
        device: Where the probe's buffers are (with NCCL, this rank's GPU).
        nbytes: Bytes each rank sends to each peer, at most; with many nodes less, so that the
            gathered buffer stays within ``8 * PROBE_BYTES``.
        repeats: Gathers timed per probe.
        timeout: The probe groups' (the strategy's); ``None``: torch's default.

    Returns:
        The rates; both ``None`` where some rank could not allocate a probe's buffers (out of
        memory): the ranks agree on that before any probe runs, so none waits for another.
    """
    if topology.world_size == 1:
        return Links(None, None)
    groups = NodeGroups(topology, groups=RankSetGroups(timeout))
    d, n = topology.ranks_per_node, topology.nodes
    nbytes = min(nbytes, 8 * PROBE_BYTES // max(d, n))
    probes = [(groups.intra, d), (groups.inter, n)]
    try:
        buffers = [_probe_buffers(size, device, nbytes) if group is not None else None for group, size in probes]
    except RuntimeError as error:  # out of memory on this rank: the others learn it below
        log.info("lightning_zinf: the link probes' buffers could not be allocated on this rank (%s)", error)
        buffers = None
    ready = torch.tensor([buffers is not None], dtype=torch.float64, device=device)
    dist.all_reduce(ready, op=dist.ReduceOp.MIN)
    seconds = torch.zeros(2, dtype=torch.float64, device=device)
    if ready.item():
        assert buffers is not None
        for i, ((group, _), bufs) in enumerate(zip(probes, buffers)):
            if bufs is not None:
                part, whole = bufs
                seconds[i] = timed_all_gather(whole, part, group, device, repeats)
        del buffers
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank's time
    intra_s, inter_s = seconds.tolist()
    for group in (groups.intra, groups.inter):
        if group is not None and group is not dist.group.WORLD:
            dist.destroy_process_group(group)
    # A rank sends its part to each other rank of the set; a node's d ranks send across at once.
    return Links(intra=(d - 1) * nbytes / intra_s if intra_s > 0 else None,
                 inter=d * (n - 1) * nbytes / inter_s if inter_s > 0 else None)


def measure_quantization(device: torch.device, numel: Optional[int] = None, repeats: int = 3) -> float:
    """Seconds per element of quantizing to INT8 blocks and dequantizing back on ``device`` (the
    Triton kernels on a GPU, their torch reference on the CPU), as the engine calls them
    (non-finite values propagated, no check), the mean of ``repeats`` after one warm-up (which
    compiles a kernel the first time). ``numel``: default ``PROBE_ELEMENTS`` on the CPU, 16 times
    that on an accelerator, where fewer would time launches more than elements."""
    from triton_kernels import dequantize, quantize

    numel = numel or PROBE_ELEMENTS * (16 if device.type != "cpu" else 1)
    # A generator of its own: the probe leaves the run's random state as it found it.
    x = torch.randn(numel, device=device, generator=torch.Generator(device).manual_seed(0))

    def once() -> None:
        codes, scales = quantize(x, 8, 256, nonfinite="propagate")
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
                  bucket_size: int, placement: "Placement", compute: Optional[float] = None,
                  timeout: Optional[timedelta] = None, unit_size: int = 0,
                  persistence_limit: int = PrefetchConfig.persistence_limit,
                  prefetch_enabled: bool = True) -> ShardingChoice:
    """``sharding="auto"`` for ``module`` on this world. Collective: every rank measures the links
    and the quantization together, and all decide from the slowest rank's rates and rank 0's free
    memory (the least any rank has), so that they choose alike. A probe that fails on some rank
    leaves ``"full"`` (its rate unknown), with the reason logged.

    Args:
        module: The model (real or on the meta device).
        world: Ranks in all.
        ranks_per_node: Ranks per node.
        device: The compute device.
        block_classes: As the engine's.
        mixed_precision: As the engine's.
        persistence_threshold: As the engine's ``PrefetchConfig``.
        persistence_limit: As the engine's ``PrefetchConfig``.
        bucket_size: As the engine's ``PrefetchConfig``.
        prefetch_enabled: As the engine's ``PrefetchConfig.enabled`` (off: no unit kept for reuse).
        placement: The offload tiers, for each candidate's predicted state.
        compute: Seconds of a step's forward and backward, from the example input (``None``: not known).
        timeout: The probe groups' (the strategy's).
        unit_size: As the engine's, resolved (:meth:`Inventory.of <lightning_zinf.planning.inventory.Inventory.of>`).

    Returns:
        The :class:`ShardingChoice` (:func:`choose_sharding`).
    """
    from lightning_zinf.planning.cost import predict

    accelerator = device.type != "cpu"
    inventory = Inventory.of(module, world=world, block_classes=block_classes, mixed_precision=mixed_precision,
                             persistence_threshold=persistence_threshold, unit_size=unit_size,
                             persistence_limit=persistence_limit)
    if world // ranks_per_node <= 1:
        return choose_sharding(inventory, world, ranks_per_node, Links(None, None), state_bytes={}, free_bytes=None)
    links = measure_links(Topology(world, dist.get_rank(), ranks_per_node), device, timeout=timeout)
    if links.inter is None:
        return ShardingChoice("full", ZeroPPConfig(), links, reason="the link probe between nodes failed on some rank")
    try:
        quantization = measure_quantization(device)
    except RuntimeError as error:  # no kernel here: ZeRO++ is not weighed (an infinite cost)
        log.info("lightning_zinf: the quantization probe failed on this rank (%s)", error)
        quantization = float("inf")
    unknown = 1 << 62  # free memory not known on a rank: the minimum ignores it
    host_free = _free_bytes(torch.device("cpu"), ranks_per_node)
    agreed = torch.tensor([-quantization, _free_bytes(device, ranks_per_node) or unknown, host_free or unknown],
                          dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    quantization = -agreed[0].item()
    free, free_host = (int(v) if v < unknown else None for v in agreed[1:].tolist())

    def state(shards: int, secondary: bool = False) -> tuple[int, int]:
        counted = Inventory.of(module, world=shards, block_classes=block_classes, mixed_precision=mixed_precision,
                               persistence_threshold=persistence_threshold, unit_size=unit_size,
                               persistence_limit=persistence_limit)
        predicted = predict(counted, placement, bucket_size=bucket_size, accelerator=accelerator)
        # hpZ's secondary partitions: a node's share of every group, in the compute dtype.
        extra = sum(g.numel * g.compute_bytes for g in counted.groups) // ranks_per_node if secondary else 0
        return predicted.total(accelerator) + extra, predicted.host if accelerator else 0

    states = {"full": state(world), "hybrid": state(ranks_per_node), "zero_pp": state(world, secondary=True)}
    ring = dist.get_backend() == "nccl"
    return choose_sharding(inventory, world, ranks_per_node, links,
                           bucket_size=bucket_size if prefetch_enabled else None,
                           state_bytes={k: v[0] for k, v in states.items()}, free_bytes=free, compute=compute,
                           quantization=quantization, accelerator=accelerator, ring=ring,
                           host_bytes={k: v[1] for k, v in states.items()} if accelerator else None,
                           free_host=free_host)
