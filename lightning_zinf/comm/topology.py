"""Nodes and ranks per node of the data-parallel group, and their process groups.

ZeRO++ (Wang et al. 2023, arXiv:2306.10209, §3.2-3.3) keeps traffic inside a node where it can:
hpZ gathers from a secondary partition held by the node's ranks, and qgZ reduces inside the node
before anything crosses nodes. Both need to know which ranks share a node. Ranks are laid out node
by node, as launchers number them: rank ``r`` is on node ``r // D`` with local rank ``r % D``,
where ``D`` is the number of ranks per node.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable, Optional

import torch.distributed as dist

__all__ = ["Topology", "NodeGroups", "RankSetGroups", "require_divisor"]


def require_divisor(option: str, value: object, world_size: int, meaning: str, fix: str) -> None:
    """Check that the group size ``value``, set by ``option``, splits the world into equal groups.

    Args:
        option: The setting as the user wrote it (``"ZeroPPConfig.hpz_partition_size"``), for the message.
        value: Its value.
        world_size: Ranks in the world (or the engine's group).
        meaning: What the size means, why it must divide the world size.
        fix: What to set instead.

    Raises:
        ValueError: ``value`` is not a positive integer that divides ``world_size``; the message names
            ``option``, ``value``, the world size, the divisors allowed and the fix.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1 and world_size % value == 0:
        return
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    allowed = ", ".join(map(str, divisors[:-1])) + f" or {divisors[-1]}" if len(divisors) > 1 else str(divisors[0])
    raise ValueError(
        f"{option}={value!r} must be a positive divisor of the world size {world_size}: one of {allowed} "
        f"({meaning}). {fix}"
    )


@dataclass(frozen=True)
class Topology:
    """Where rank ``rank`` of ``world_size`` sits, with ``ranks_per_node`` ranks on each node.

    Raises:
        ValueError: ``ranks_per_node`` is not a positive divisor of ``world_size``, or ``rank`` is
            out of range.
    """

    world_size: int
    rank: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        w = self.world_size
        require_divisor("ranks_per_node", self.ranks_per_node, w,
                        "ranks are laid out node by node, the same number on each",
                        "Set it to the processes per machine, or leave it unset.")
        if not 0 <= self.rank < w:
            raise ValueError(f"rank {self.rank} is outside the world of {w} ranks.")

    @property
    def nodes(self) -> int:
        """How many nodes."""
        return self.world_size // self.ranks_per_node

    @property
    def node(self) -> int:
        """This rank's node."""
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        """This rank's index within its node."""
        return self.rank % self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        """The ranks on ``node``, in order."""
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    def peer_ranks(self, local_rank: int) -> list[int]:
        """The ranks with local rank ``local_rank``, one per node, in node order."""
        return list(range(local_rank, self.world_size, self.ranks_per_node))

    def split_bytes(self, peers: Iterable[int], per_peer: int) -> tuple[int, int]:
        """``(intra-node, inter-node)`` bytes when this rank exchanges ``per_peer`` bytes with each
        rank of ``peers`` (itself excluded)."""
        others = [r for r in peers if r != self.rank]
        same = sum(1 for r in others if r // self.ranks_per_node == self.node)
        other = len(others) - same
        return same * per_peer, other * per_peer


class RankSetGroups:
    """One process group per distinct set of world ranks, built when first asked for.

    hpZ's partition groups and qgZ's node groups are the same rank sets when the partition is a
    node (the usual setting), and a set may be the whole world (one node, or an hpZ partition of
    every rank). On NCCL each process group is a communicator of its own, with its own GPU buffers and
    setup, so every set gets one group, and the whole world is the world group itself when its
    timeout is the one asked for (:func:`_timeouts`); otherwise a group of its own carries it.

    Every rank must ask for the same sets in the same order, since ``torch.distributed.new_group``
    is collective over the whole world; a set asked for again is not built again, on every rank.

    Args:
        timeout: How long the groups' collectives wait for other ranks (``None``: torch's default
            for a new group, and the world group whatever its own).
    """

    def __init__(self, timeout: Optional[timedelta] = None) -> None:
        self.timeout = timeout
        world = dist.group.WORLD
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        if timeout is None or _timeouts(world) == {timeout}:
            self._groups[tuple(range(dist.get_world_size()))] = world

    def get(self, ranks: list[int]) -> dist.ProcessGroup:
        """The process group of the world ranks ``ranks`` (in order), built on the first request."""
        key = tuple(ranks)
        if key not in self._groups:
            self._groups[key] = dist.new_group(ranks, timeout=self.timeout)
        return self._groups[key]


def _timeouts(group: dist.ProcessGroup) -> set[Optional[timedelta]]:
    """The timeouts of ``group``'s backends, one per device type (``init_process_group`` gives them
    all its ``timeout``); ``None`` for a backend without options to read (a custom one), which then
    matches no timeout asked for."""
    # Backend.options._timeout is what init_process_group and new_group set (torch 2.11 to 2.15).
    return {getattr(getattr(group._get_backend(device), "options", None), "_timeout", None)
            for device in group._device_types}


class NodeGroups:
    """The process groups of a :class:`Topology`: ``intra`` (this rank's node) and ``inter`` (the
    ranks with this rank's local rank, one per node). Every rank must build it at the same point,
    since ``torch.distributed.new_group`` is collective over the whole world.

    With a single node ``inter`` is ``None``; with one rank per node ``intra`` is ``None``.

    Args:
        topology: Ranks and nodes; its ranks are ranks of the default (world) group.
        with_inter: Also build the ``inter`` groups (``False`` leaves ``inter`` ``None``).
        groups: Where the groups come from, shared with other users of the same rank sets
            (default: a :class:`RankSetGroups` of its own, with torch's default timeout).
    """

    def __init__(self, topology: Topology, with_inter: bool = True, groups: Optional[RankSetGroups] = None) -> None:
        groups = groups if groups is not None else RankSetGroups()
        self.topology = topology
        self.intra: Optional[dist.ProcessGroup] = None
        self.inter: Optional[dist.ProcessGroup] = None
        for node in range(topology.nodes):
            group = groups.get(topology.node_ranks(node)) if topology.ranks_per_node > 1 else None
            if node == topology.node:
                self.intra = group
        if not with_inter or topology.nodes == 1:
            return
        for local in range(topology.ranks_per_node):
            group = groups.get(topology.peer_ranks(local))
            if local == topology.local_rank:
                self.inter = group

    @classmethod
    def of_one_rank(cls, topology: Topology, group: dist.ProcessGroup) -> "NodeGroups":
        """The groups of a world of one rank whose collectives must run anyway (the debug switch
        ``ZINF_REAL_COLLECTIVES``): ``intra`` is ``group`` itself, ``inter`` is ``None``.

        Raises:
            ValueError: ``topology`` has more than one rank.
        """
        if topology.world_size != 1:
            raise ValueError(f"of_one_rank: the topology has {topology.world_size} ranks.")
        groups = cls.__new__(cls)
        groups.topology, groups.intra, groups.inter = topology, group, None
        return groups
