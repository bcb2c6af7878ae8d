"""Units sized automatically: which modules are fetched as one unit when the user names no
``block_classes``.

A unit costs the same host work and collective latency whatever its size: its hooks, two gathers
(forward and backward) and a reduce-scatter a step. Many small units — a unit per module of a model
with thousands of small tensors (LayerNorms, biases, per-head projections, experts) — make ZeRO-3
slower than DDP (DeepSpeed #1069, #3349; Lightning #11901), where its bandwidth alone would not.
DeepSpeed's answer is a hand-set ``stage3_module_granularity_threshold``; FSDP2's is the user's
choice of the modules to wrap. Here the engine groups by size:

- the largest subtrees of at most ``unit_size`` elements become units (blocks), walking down from
  the model's children: a module whose subtree is larger is split into its children, and its own
  parameters form a unit of their own, as without grouping;
- only a module with a ``forward`` of its own can be a block (its forward pre-hook gathers the
  unit): a container (``nn.ModuleList``, ``nn.ModuleDict``) is always split;
- consecutive sibling blocks (the experts of a mixture, the blocks of a narrow stack) are packed
  into runs of at most ``unit_size`` elements, each run one unit that every member's forward
  gathers: while the trace says the next request is the same unit, it stays gathered from one
  member's forward to the next (:class:`~lightning_zinf.engine.schedule.Schedule`);
- the grouping reads only the module tree and the parameters' shapes, so every rank makes the
  same one from the same model and the same ``unit_size``.

``unit_size`` comes from the measured collective (:func:`measured_unit_size`): a unit large enough
that the fixed cost of each of its collectives is at most a tenth of their time, ``9 α β`` bytes
for a cost ``α`` (seconds) and bandwidth ``β`` (bytes per second) — α / (α + n / β) ≤ 0.1. ``α``
is the measured all-gather latency plus the engine's host work per collective of a unit
(:data:`HOST_SECONDS`), which on a CPU is the larger part. The size is at most the
prefetch bucket (``PrefetchConfig.bucket_size``, the elements the user lets be gathered ahead),
and never a size that depends on the model's: the working set stays a few units, flat in depth
(Rajbhandari et al., SC'20, §5).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from lightning_zinf.comm.collectives import Collectives
from lightning_zinf.tiling import LinearTile

__all__ = ["auto_blocks", "measured_unit_size", "unit_size_for", "HOST_SECONDS", "LATENCY_SHARE", "MIN_UNIT_SIZE"]

#: The most of a gather's time its latency may take in a unit of the measured size.
LATENCY_SHARE = 0.1
#: Elements below which a measured unit size is not taken.
MIN_UNIT_SIZE = 1 << 16
#: The engine's host work per collective of a unit (its hooks, the gather's and release's
#: bookkeeping), seconds: unit_cost.py measured 2.1-2.4 ms per unit per step over DDP on the CPU
#: machine (examples/benchmarks/RESULTS.md, 2026-11-26), three collectives a unit a step.
HOST_SECONDS = 7e-4
#: The probes: an all-gather of one element per rank (latency) and of this many bytes in all (bandwidth).
_PROBE_BYTES = 4 << 20
_REPEATS = 5


def _has_forward(module: nn.Module) -> bool:
    """Whether ``module``'s class defines a forward (containers inherit nn.Module's, which raises)."""
    return type(module).forward is not nn.Module.forward


def _subtree_numel(root: nn.Module) -> dict[int, int]:
    """Elements of every module's subtree (by module id), each parameter once per subtree."""
    return {id(m): sum(p.numel() for p in m.parameters()) for m in root.modules()}


def auto_blocks(root: nn.Module, unit_size: int) -> list[list[nn.Module]]:
    """The modules of ``root`` to fetch together (module docstring), in ``named_modules()``
    order: the largest subtrees of at most ``unit_size`` parameter elements whose module has a
    forward of its own, consecutive siblings among them packed into runs of at most
    ``unit_size`` elements in all (a run is one unit; the experts of a mixture, the blocks of a
    narrow stack). ``root`` itself is never one (its parameters stay gathered); a module holding
    a tile of a :class:`~lightning_zinf.TiledLinear` is never packed with its siblings.

    Args:
        root: The model (real or on the meta device: only shapes are read).
        unit_size: Most elements per run (> 0).

    Returns:
        The runs of sibling modules, for :func:`~lightning_zinf.engine.partition.plan_units`' ``blocks``.

    Raises:
        ValueError: ``unit_size`` is not positive.
    """
    if unit_size <= 0:
        raise ValueError(f"auto_blocks: unit_size must be > 0 elements, got {unit_size}")
    sizes = _subtree_numel(root)
    runs: list[list[nn.Module]] = []
    visited: set[int] = set()

    def visit(module: nn.Module) -> None:
        run: list[nn.Module] = []
        total = 0
        for child in module.children():
            if id(child) in visited:  # a module registered twice is planned at its first place
                continue
            visited.add(id(child))
            numel = sizes[id(child)]
            if numel == 0:  # an activation between two layers does not part them
                continue
            if numel > unit_size or not _has_forward(child):
                run, total = [], 0
                visit(child)
                continue
            tiled = any(isinstance(m, LinearTile) for m in child.modules())
            if run and (tiled or total + numel > unit_size):
                run, total = [], 0
            if not run:
                runs.append(run)
            run.append(child)
            total += numel
            if tiled:  # nothing joins it either
                run, total = [], 0

    visit(root)
    return runs


def measured_unit_size(gather_group: Optional[dist.ProcessGroup], agree_group: Optional[dist.ProcessGroup],
                       device: torch.device, compute_bytes: int, most: int,
                       agree_on: torch.device = torch.device("cpu")) -> int:
    """The unit size from the all-gather latency and bandwidth of ``gather_group`` (module
    docstring): ``9 α β / compute_bytes`` elements with ``α`` the latency plus
    :data:`HOST_SECONDS`, rounded down to a power of two, at least :data:`MIN_UNIT_SIZE` and at
    most ``most`` (which wins when smaller; 0: :data:`MIN_UNIT_SIZE`). Each probe is the
    fastest of a few (the least disturbed by a busy host: the figures decide the model's units
    and should not follow a momentary load). Every rank of ``agree_group`` must call it together. The slowest rank's figures
    decide, so every rank gets the same size: the grouping must be the same everywhere, or the
    ranks' collectives would not pair. Where nothing is gathered (one rank, or groups of one under
    hybrid sharding) no latency is to be hidden: ``most``.

    Args:
        gather_group: The ranks that gather parameters together (the engine's
            :attr:`~lightning_zinf.comm.Collectives.gather_group`: under hybrid sharding each shard
            group measures its own); ``None``: nothing is gathered.
        agree_group: Every rank that must get the same size; ``None``: this rank alone.
        device: Where the probes' buffers are (the compute device: with NCCL, its GPU).
        compute_bytes: Bytes per element of the gathered parameters (their compute dtype's).
        most: The largest size taken (the prefetch bucket, ``PrefetchConfig.bucket_size``; 0:
            only the next unit is gathered ahead, and :data:`MIN_UNIT_SIZE` is the largest).
        agree_on: Where ``agree_group`` takes its tensors (the host for gloo, the engine's
            control group; the GPU for NCCL).

    Returns:
        Elements per unit, > 0.
    """
    most = most if most > 0 else MIN_UNIT_SIZE
    if agree_group is None or dist.get_world_size(agree_group) < 2:
        return most
    # Imported here: the planning package reads the grouping (Inventory.of) when it is imported.
    from lightning_zinf.planning.bandwidth import timed_all_gather

    latency = seconds = 0.0
    if gather_group is not None and dist.get_world_size(gather_group) > 1:
        world = dist.get_world_size(gather_group)
        small = torch.ones(1, dtype=torch.uint8, device=device)
        small_whole = torch.empty(world, dtype=torch.uint8, device=device)
        part = torch.ones(_PROBE_BYTES // world, dtype=torch.uint8, device=device)
        whole = torch.empty(part.numel() * world, dtype=torch.uint8, device=device)
        latency = min(timed_all_gather(small_whole, small, gather_group, device, 1) for _ in range(_REPEATS))
        seconds = min(timed_all_gather(whole, part, gather_group, device, 1) for _ in range(_REPEATS))
        del part, whole
    # Every rank takes part, also one that gathers nothing, and every rank gets the slowest figures.
    slowest = torch.tensor([latency, seconds], dtype=torch.float64, device=agree_on)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=agree_group)
    latency, seconds = slowest.tolist()
    if seconds == 0.0:  # no rank gathers anything
        return most
    bandwidth = _PROBE_BYTES / max(seconds - latency, 1e-9)
    target = int((1 - LATENCY_SHARE) / LATENCY_SHARE * (latency + HOST_SECONDS) * bandwidth) // compute_bytes
    # Rounded down to a power of two: a figure that moves a little from run to run (a busy host)
    # mostly gives the same units, and with them the same flat groups and checkpoint layout.
    target = 1 << (max(target, 1).bit_length() - 1)
    return min(most, max(MIN_UNIT_SIZE, target))


def unit_size_for(block_classes: Sequence[Union[str, type]], unit_size: Optional[int], bucket_size: int,
                  comm: Collectives, device: torch.device, compute_bytes: int) -> int:
    """The engine's unit size: 0 (no grouping: the user's blocks) with ``block_classes``, else
    ``unit_size`` (:class:`~lightning_zinf.PrefetchConfig`'s), measured over the engine's gather
    group (:func:`measured_unit_size`, at most ``bucket_size``) where it is ``None``. Collective
    where it measures."""
    if block_classes:
        return 0
    if unit_size is not None:
        return unit_size
    return measured_unit_size(comm.gather_group, comm.control_group, device, compute_bytes, bucket_size)
