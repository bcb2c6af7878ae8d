"""Setup time of the process groups hpZ and qgZ build: ``Collectives(ranks_per_node=D,
hpz_partition_size=D, qgz_bits=8)`` (the partition a node, the usual setting) on a gloo world of
simulated nodes, with the world's own timeout passed (as the strategies do).

    python examples/benchmarks/group_setup.py [--world 4] [--ranks-per-node 2] [--repeats 5]

Each rank builds ``Collectives`` ``--repeats`` times (every build makes its groups anew), a barrier
between builds; printed: rank 0's seconds per build (median and all) and the
``torch.distributed.new_group`` calls one build made. On gloo a group costs its TCP connections; on
NCCL each group is also a communicator with its own GPU buffers, which this CPU run cannot show.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = timedelta(minutes=30)


def _rank(rank: int, world: int, port: int, ranks_per_node: int, repeats: int, out: "mp.Queue") -> None:
    from lightning_zinf.comm import Collectives

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)
    real_new_group, calls = dist.new_group, []

    def counting(*args: object, **kwargs: object) -> dist.ProcessGroup:
        calls.append(1)
        return real_new_group(*args, **kwargs)

    dist.new_group = counting
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        calls.clear()
        start = time.perf_counter()
        Collectives(ranks_per_node=ranks_per_node, hpz_partition_size=ranks_per_node, qgz_bits=8, timeout=TIMEOUT)
        seconds.append(time.perf_counter() - start)
    dist.barrier()
    if rank == 0:
        out.put((seconds, len(calls)))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, args.ranks_per_node, args.repeats, out))
             for r in range(args.world)]
    for p in procs:
        p.start()
    seconds, calls = out.get(timeout=600)
    for p in procs:
        p.join()
    print(f"world {args.world}, {args.ranks_per_node} ranks per node: {calls} new_group calls per build, "
          f"median {statistics.median(seconds) * 1e3:.1f} ms per build "
          f"({', '.join(f'{s * 1e3:.1f}' for s in seconds)})")


if __name__ == "__main__":
    main()
