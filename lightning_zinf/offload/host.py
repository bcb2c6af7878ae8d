"""Which flat groups keep their NVMe-tier state in host memory (``OffloadConfig.host_bytes``).

ZeRO-Infinity (Rajbhandari et al., SC'21, §5.1) puts every parameter shard and all optimizer state
of the ``nvme`` tier in swap files. Each step then moves the whole state through the disk, which
bounds the step by the disk's bandwidth: 24 bytes per parameter under AdamW (the fp32 master and two
moments, read and written), 2.2 GB a step for a 91M-parameter GPT on 2 ranks, about as much as this
machine's disk moves in 1.6 s while forward and backward compute for 0.85 s
(examples/benchmarks/RESULTS.md, issue 39). Host memory that the run can spare takes that traffic off
the disk: a group whose records stay in host memory costs no reads and no writes, which is what
DeepSpeed's ``offload_optimizer.ratio`` does between the device and the CPU (Twin-Flow), here between
the CPU and NVMe.

The groups chosen are the first ones in the engine's order (modules in registration order, which
is the forward's for most models), whole groups, until the next one does not fit: the step in the
background runs in that order (:mod:`lightning_zinf.offload.stepping`), so the next forward's first
units find their step done without waiting for the disk, and the disk has the rest of the forward
for the others. With the optimizer on NVMe the first sharding chooses, with its states counted
(:meth:`OptimizerOffload.plan_host <lightning_zinf.offload.optimizer.OptimizerOffload.plan_host>`);
with parameters alone on NVMe each shard is kept as it is made, never written
(:meth:`ParamOffload.add <lightning_zinf.offload.params.ParamOffload.add>`).
"""

from __future__ import annotations

__all__ = ["DEVICE_STATE_BYTES", "first_that_fit"]

#: Bytes per shard element ``OffloadConfig.device_bytes`` counts for a group stepped on the device
#: beside ZeRO-Offload: an fp32 master, an fp32 gradient shard and two fp32 moments (AdamW's).
DEVICE_STATE_BYTES = 16


def first_that_fit(costs: list[int], budget: int) -> int:
    """How many of the first ``costs`` (bytes per group, in order) fit in ``budget`` bytes together:
    the longest prefix whose sum is at most ``budget`` (0 when the first alone exceeds it)."""
    total = 0
    for count, cost in enumerate(costs):
        total += cost
        if total > budget:
            return count
    return len(costs)
