"""Time qwZ's quantized all-gather and qgZ's quantized reduce-scatter over 2 gloo ranks on this
machine (ZeRO++ §3.1, §3.3): median milliseconds per call, for a few per-rank sizes.

    python examples/benchmarks/quantized_collectives.py [--reps 30] [--sizes 16384,262144,2097152]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, sizes: list[int], reps: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from lightning_zinf.comm import Collectives

    # One rank per "node": qgZ's inter-node leg runs, and the gather crosses it.
    comm = Collectives(ranks_per_node=1, qwz_block=256, qgz_bits=4, block=256)
    rows = []
    for n in sizes:
        shard = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        out, full, mine = torch.empty(world * n), torch.randn(world * n), torch.empty(n)
        for name, call in (("qwZ gather", lambda: comm.all_gather_quantized(out, shard)),
                           ("qgZ reduce-scatter", lambda: comm.reduce_scatter_mean_quantized(mine, full))):
            times = []
            for i in range(reps + 3):
                dist.barrier()
                start = time.perf_counter()
                call()
                if i >= 3:
                    times.append(time.perf_counter() - start)
            rows.append((name, n, 1e3 * statistics.median(times)))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--sizes", default="16384,262144,2097152", help="elements per rank, comma-separated")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, 2, port, sizes, args.reps, queue)) for r in range(2)]
    for p in procs:
        p.start()
    rows = queue.get()
    for p in procs:
        p.join()
    for name, n, ms in rows:
        print(f"{name:20s} {n:>9d} elements/rank  {ms:8.3f} ms")


if __name__ == "__main__":
    main()
