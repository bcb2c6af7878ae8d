"""The one place where the engine talks to other ranks.

Every gather and reduce-scatter of the engine goes through :class:`Collectives`, so quantized
(qwZ/qgZ) and hierarchical (hpZ) variants can replace these methods later without touching the
engine, and every byte sent is counted for the monitoring callbacks.

Without an initialised process group (or with world size 1) the collectives become local copies,
so the engine runs in a plain single-process script too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist

__all__ = ["Collectives", "CommBytes", "Handle"]

# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Handle(Protocol):
    """What an asynchronous collective returns: ``wait()`` blocks until its output is ready."""

    def wait(self) -> Any: ...


class _Done:
    """A handle for work that finished synchronously."""

    def wait(self) -> bool:
        return True


@dataclass
class CommBytes:
    """Bytes this rank moved through collectives since the last :meth:`reset`.

    Attributes:
        gathered: Bytes received by all-gathers of parameter shards (the full buffer minus this
            rank's own shard).
        reduce_scattered: Bytes sent by gradient reduce-scatters (the full flat gradient minus
            this rank's own shard).
    """

    gathered: int = 0
    reduce_scattered: int = 0

    def reset(self) -> None:
        self.gathered = 0
        self.reduce_scattered = 0


class Collectives:
    """Collectives over one data-parallel process group.

    Args:
        group: The process group; ``None`` means the default (world) group when
            ``torch.distributed`` is initialised, and a single local rank when it is not.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group if group is not None or not self.distributed else dist.group.WORLD
        self.rank = dist.get_rank(self.group) if self.distributed else 0
        self.world_size = dist.get_world_size(self.group) if self.distributed else 1
        self.bytes = CommBytes()

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, async_op: bool = False) -> Handle:
        """Gather every rank's ``shard`` into ``out``, rank r's at ``out[r*n:(r+1)*n]``.

        Args:
            out: 1-D tensor of ``world_size * n`` elements, same dtype and device as ``shard``.
            shard: 1-D tensor of ``n`` elements.
            async_op: Return before the data has arrived; call ``wait()`` on the handle.

        Returns:
            A handle whose ``wait()`` returns when ``out`` is filled.
        """
        self.bytes.gathered += (out.numel() - shard.numel()) * out.element_size()
        if self.world_size == 1:
            out.copy_(shard)
            return _Done()
        work = _all_gather_flat(out, shard, group=self.group, async_op=async_op)
        return work if async_op else _Done()

    def reduce_scatter_mean(self, out: torch.Tensor, full: torch.Tensor, async_op: bool = False) -> Handle:
        """Average ``full`` over ranks and keep this rank's slice in ``out``.

        Args:
            out: 1-D tensor of ``n`` elements: receives ``mean_over_ranks(full)[r*n:(r+1)*n]``.
            full: 1-D tensor of ``world_size * n`` elements, same dtype and device as ``out``.
            async_op: Return before the result has arrived; call ``wait()`` on the handle.

        Returns:
            A handle whose ``wait()`` returns when ``out`` is filled.
        """
        self.bytes.reduce_scattered += (full.numel() - out.numel()) * full.element_size()
        if self.world_size == 1:
            out.copy_(full)
            return _Done()
        work = _reduce_scatter_flat(out, full, op=dist.ReduceOp.AVG, group=self.group, async_op=async_op)
        return work if async_op else _Done()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks in place and return it (used for global norms)."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def barrier(self) -> None:
        """Wait until every rank of the group has reached this call."""
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def all_equal(self, value: int) -> bool:
        """Whether every rank passed the same ``value`` (a signed 64-bit integer): one all-reduce
        (MAX) of ``[value, -value]``, equal everywhere exactly when max == min."""
        if self.world_size == 1:
            return True
        pair = torch.tensor([value, -value], dtype=torch.int64)
        dist.all_reduce(pair, op=dist.ReduceOp.MAX, group=self.group)
        return int(pair[0]) == -int(pair[1])

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, indexed by rank (small control data: trace hashes, RNG states)."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with rank ``src``'s values (group rank) and return it."""
        if self.world_size > 1:
            dist.broadcast(tensor, src=dist.get_global_rank(self.group, src), group=self.group)
        return tensor
