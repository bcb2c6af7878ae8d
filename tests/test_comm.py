"""The control plane of :class:`~lightning_zinf.comm.Collectives` on a world group that refuses
host tensors, as NCCL does.

A process group initialised as ``"cuda:gloo"`` has a backend for CUDA tensors only: a CPU tensor
in any of its collectives raises "No backend type associated with device type cpu", NCCL's own
error for the same mistake. So a CPU-only machine can check what the GPU run would hit first: that
no rank-agreement, trace check, gradient-flag exchange, object gather, barrier or host-tensor
broadcast goes over the world group.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_zinf.comm import Collectives
from tests.harness import run_distributed


def _control_plane(rank: int, world: int) -> dict:
    dist.init_process_group("cuda:gloo", rank=rank, world_size=world)
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.ones(1))  # the premise: this world group refuses host tensors
    comm = Collectives(timeout=timedelta(seconds=60))
    rng = comm.broadcast(torch.get_rng_state() if rank == 0 else torch.zeros_like(torch.get_rng_state()))
    comm.barrier()
    return {
        "backend": dist.get_backend(comm.control_group),
        "equal": comm.all_equal(7),
        "unequal": comm.all_equal(rank),
        "any": comm.any_rank([rank == 0, False, True, rank == world - 1]),
        "objects": comm.all_gather_object({"rank": rank}),
        "sum": comm.all_reduce_sum(torch.tensor([float(rank + 1)], dtype=torch.float64)).item(),
        "rng": rng,
    }


def test_control_plane_runs_where_the_world_group_refuses_host_tensors() -> None:
    """Every control collective works and agrees on all ranks over a world group with no CPU
    backend (fails on the engine before the control group existed: ``all_equal`` raised)."""
    world = 3
    results = run_distributed(_control_plane, world, init_pg=False)
    for got in results:
        assert got["backend"] == "gloo"
        assert got["equal"] is True and got["unequal"] is False
        assert got["any"] == [True, False, True, True]
        assert got["objects"] == [{"rank": r} for r in range(world)]
        assert got["sum"] == sum(range(1, world + 1))
        assert torch.equal(got["rng"], results[0]["rng"]) and got["rng"].any()
