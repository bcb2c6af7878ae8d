"""The distributed plumbing both strategies need: the rank topology, joining the process group, and
barrier, broadcast and all-reduce that work without ``torch.distributed`` too."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    ReduceOp,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utilities_rank_zero_only
from torch import Tensor

from lightning_zinf.comm.exit import install as release_groups_at_exit
from lightning_zinf.comm.watch import RankWatch

__all__ = ["RankLayout", "init_distributed", "barrier", "broadcast", "all_reduce"]


class RankLayout:
    """One process per device of ``parallel_devices`` on each of ``num_nodes`` nodes, ranks numbered
    node by node: the topology properties both strategies derive from that (a mixin placed before
    the Lightning base class, which provides ``parallel_devices``, ``local_rank``, ``node_rank``,
    ``global_rank`` and ``cluster_environment``)."""

    parallel_devices: Optional[list[torch.device]]
    cluster_environment: Optional[ClusterEnvironment]
    local_rank: int
    node_rank: int
    global_rank: int
    _num_nodes: int = 1

    @property
    def root_device(self) -> torch.device:
        """This rank's device."""
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        """Nodes in the run (the connectors set it from ``num_nodes=``)."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Processes per node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Each rank reads its own slice of the data (``DistributedSampler``)."""
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        """Tell the cluster environment this rank's global rank and the world size (the Trainer's
        and Fabric's connectors call this, under these two names, before launching)."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utilities_rank_zero_only.rank = self.global_rank

    _set_world_ranks = set_world_ranks


def init_distributed(environment: ClusterEnvironment, device: torch.device, backend: Optional[str],
                     timeout: timedelta) -> None:
    """Join the default process group (a no-op when it exists): ``backend`` or the device's default
    (gloo on CPU, NCCL on CUDA), bound to ``device`` on an accelerator so NCCL connects eagerly.
    At a normal exit the process groups are released while the interpreter is whole
    (:mod:`lightning_zinf.comm.exit`)."""
    kwargs: dict[str, Any] = {"timeout": timeout}
    if device.type != "cpu":
        kwargs["device_id"] = device
    _init_dist_connection(environment, backend or _get_default_process_group_backend_for_device(device), **kwargs)
    release_groups_at_exit()


def barrier(watch: Optional[RankWatch] = None) -> None:
    """Wait for every rank (nothing without ``torch.distributed``); while it waits, ``watch``
    publishes it (a rank that meanwhile waits elsewhere, in the model's forward say, is a deadlock
    the watch reports)."""
    if not _distributed_is_initialized():
        return
    if watch is not None:
        watch.blocked_in = "a barrier (trainer.strategy.barrier / fabric.barrier)"
    try:
        torch.distributed.barrier()
    finally:
        if watch is not None:
            watch.blocked_in = None


def broadcast(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank."""
    if not _distributed_is_initialized():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src)
    return box[0]


def all_reduce(tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Any:
    """``tensor`` reduced over ranks (mean by default, as Lightning's ``reduce``); non-tensors as they are."""
    if isinstance(tensor, Tensor):
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
    return tensor
