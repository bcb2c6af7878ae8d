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
from tests.harness import buffers_made, run_distributed


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


def _data_plane(rank: int, world: int, n: int, dtype: torch.dtype, ranks_per_node: int) -> dict:
    comm = Collectives(ranks_per_node=ranks_per_node, timeout=timedelta(seconds=60))
    shard = torch.arange(n, dtype=torch.float64).mul_(world).add_(rank).to(dtype)  # rank r: r, r+W, ...
    gathered = torch.full((world * n,), -1.0, dtype=dtype)
    comm.all_gather(gathered, shard, async_op=True).wait()
    full = torch.linspace(-1, 1, world * n, dtype=torch.float64).mul_(rank + 1).to(dtype)
    mine = torch.empty(n, dtype=dtype)
    comm.reduce_scatter_mean(mine, full.clone(), async_op=True).wait()
    # What this rank wrote to its sockets for one reduce-scatter (the kernel's count, outside torch).
    comm.barrier()
    before, made, full = _bytes_written(), [], full.clone()
    with buffers_made(made):
        comm.reduce_scatter_mean(torch.empty(n, dtype=dtype), full)
    sent = _bytes_written() - before
    comm.barrier()
    return {"gathered": gathered, "mine": mine, "sent": sent, "made": sum(made),
            "accounted": comm.reduce_transient_nbytes(n, dtype)}


def _bytes_written() -> int:
    """Bytes this process has passed to write-like system calls (sockets included): /proc/self/io."""
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("wchar:"))


@pytest.mark.parametrize("world, n, dtype, ranks_per_node",
                         [(2, 300_000, torch.float32, 2), (3, 400_000, torch.bfloat16, 3), (3, 1000, torch.float32, 3),
                          (4, 300_000, torch.float32, 2)],
                         ids=["large-2", "large-3-bf16", "small-3", "large-2x2-nodes"])
def test_gather_and_reduce_scatter_on_gloo_against_the_definition(world: int, n: int, dtype: torch.dtype,
                                                                   ranks_per_node: int) -> None:
    """Above 1 MiB gloo gathers by in-place broadcasts and reduce-scatters by point-to-point
    messages (one node) or in-place reduces (several); below, with its flat collectives: all must
    give what the definitions say, rank by rank. Above 1 MiB on one node a reduce-scatter sends
    each rank's peers their slices and nothing more, ``(W - 1) * n`` elements (gloo's own sends
    twice that, W in-place reduces 2.2 times), and receives its peers' copies of its slice into
    ``(W - 1) * n`` elements of its own: what the memory ledger counts for the reduce
    (``reduce_transient_nbytes``) equals what an observer of the buffers made counts."""
    out = run_distributed(_data_plane, world, n, dtype, ranks_per_node)
    expected_gather = torch.cat([torch.arange(n, dtype=torch.float64).mul_(world).add_(r) for r in range(world)])
    full = torch.linspace(-1, 1, world * n, dtype=torch.float64)
    mean = sum(full.mul(r + 1).to(dtype).double() for r in range(world)) / world
    for rank, result in enumerate(out):
        assert torch.equal(result["gathered"].double(), expected_gather.to(dtype).double())
        torch.testing.assert_close(result["mine"].double(), mean[rank * n:(rank + 1) * n],
                                   rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)
        assert result["made"] == result["accounted"], (rank, result["made"], result["accounted"])
        if n * dtype.itemsize >= 1 << 20 and ranks_per_node == world:
            least = (world - 1) * n * dtype.itemsize
            assert least <= result["sent"] <= 1.05 * least, (result["sent"], least)
            assert result["made"] == least


def _one_rank_run(rank: int, world: int, forced: bool, feature: str) -> dict:
    """Two training steps of the tests' GPT at one rank with ``feature``; with ``forced``, under the
    debug switch that keeps real collectives. torch's profiler counts the collectives that ran."""
    import os

    from torch.profiler import profile

    from lightning_zinf import PrefetchConfig, ZeroEngine, ZeroPPConfig
    from tests import models

    os.environ["ZINF_REAL_COLLECTIVES"] = "1" if forced else "0"
    zero_pp = {"plain": ZeroPPConfig(), "zero_pp": ZeroPPConfig(qwz=True, hpz=True, qgz=True),
               "frozen_int8": ZeroPPConfig(frozen_bits=8)}[feature]
    torch.manual_seed(0)
    model = models.GPT(lora_rank=4 if feature == "frozen_int8" else 0)
    engine = ZeroEngine(model, block_classes=["Block"], prefetch=PrefetchConfig(persistence_threshold=0), zero_pp=zero_pp)
    opt = engine.shard_optimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05))
    losses = []
    with profile() as prof:
        for step in range(2):
            loss = models.loss_fn(model, *models.make_batch("gpt", step, 4))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    ran: dict[str, int] = {}
    for event in prof.events():
        if event.name.startswith("gloo:"):
            ran[event.name] = ran.get(event.name, 0) + 1
    return {"losses": losses, "ran": ran}


@pytest.mark.parametrize("feature", ["plain", "zero_pp", "frozen_int8"])
def test_the_debug_switch_runs_real_collectives_at_one_rank(feature: str) -> None:
    """``ZINF_REAL_COLLECTIVES=1`` at world size 1: gathers, reduce-scatters (and qgZ's all-to-alls)
    go through torch.distributed (counted by torch's profiler, an observer outside the engine)
    where they are otherwise local copies, and training gives the same losses bit for bit. On one
    GPU this runs every engine feature through NCCL (gpu_check.py's nccl step)."""
    local = run_distributed(_one_rank_run, 1, False, feature)[0]
    real = run_distributed(_one_rank_run, 1, True, feature)[0]
    assert real["losses"] == local["losses"]
    assert not any(name in local["ran"] for name in ("gloo:all_gather", "gloo:all_to_all"))
    assert real["ran"].get("gloo:all_gather", 0) > 0
    if feature == "zero_pp":
        assert real["ran"].get("gloo:all_to_all", 0) > 0  # qgZ's legs
    else:
        assert real["ran"].get("gloo:all_reduce", 0) > local["ran"].get("gloo:all_reduce", 0)  # gloo's reduce-scatter


def _one_rank_large(rank: int, world: int) -> list[bool]:
    import os

    os.environ["ZINF_REAL_COLLECTIVES"] = "1"
    comm = Collectives()
    full = torch.arange(1 << 19, dtype=torch.float32)  # 2 MiB: gloo's in-place forms start at 1 MiB
    out, gathered = torch.empty_like(full), torch.empty_like(full)
    comm.reduce_scatter_mean(out, full.clone())
    comm.all_gather(gathered, full)
    return [comm.local, torch.equal(out, full), torch.equal(gathered, full)]


def test_the_debug_switch_at_one_rank_with_large_tensors() -> None:
    """At one rank with the switch, gloo's flat collectives serve tensors of 1 MiB and more (its
    in-place forms are for several ranks), and the mean over one rank is the tensor itself."""
    assert run_distributed(_one_rank_large, 1)[0] == [False, True, True]


def test_the_device_check_names_the_switch_as_the_engine_does() -> None:
    import sys
    from pathlib import Path

    from lightning_zinf.comm.collectives import REAL_COLLECTIVES_ENV

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "benchmarks"))
    import gpu_check

    assert gpu_check.REAL_COLLECTIVES_ENV == REAL_COLLECTIVES_ENV
