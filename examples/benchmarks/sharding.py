"""ZeRO-2 (``sharding="grad_op"``) against ZeRO-3 (``"full"``), for lightning_zinf and for FSDP2,
with DDP as the speed reference, in one run.

Trains the throughput benchmark's GPT (examples/gpt.py, 91M parameters, fp32, AdamW, micro-batch
1 x 128 tokens per rank, 2 ranks on CPU with gloo, one thread per rank) under each contender, each
its own ``torchrun`` job, one after another (throughput.py's drivers and run_lightning.py):

  zinf            ZeroInfinityStrategy, blocks gathered as units, sharding="full" (ZeRO-3)
  zinf+grad_op    the same with sharding="grad_op": each block gathered once a step, kept from
                  its forward to its backward
  fsdp2           Lightning's ModelParallelStrategy, fully_shard per block and on the root
  fsdp2+grad_op   the same with reshard_after_forward=False (FSDP2's ZeRO-2)
  ddp             Lightning strategy="ddp" (full replicas)

s/step is rank 0's mean over the steps after the first WARMUP_STEPS; on a shared machine other
jobs only add time, so the ratios use each contender's fastest step: grad_op's speed-up over the
same system's full sharding (above 1: keeping the weights helps), and zinf's speed against FSDP2
in the same mode (FSDP2's fastest s/step over zinf's; above 1: zinf faster). Peak RSS per rank is
what holding every block's weights through backward costs.

    python examples/benchmarks/sharding.py [--steps 7] [--only zinf,zinf+grad_op,fsdp2,fsdp2+grad_op,ddp]
"""

from __future__ import annotations

from throughput import fastest, fastest_ratio, run_variants

CONTENDERS = ("zinf", "zinf+grad_op", "fsdp2", "fsdp2+grad_op", "ddp")



def ratio_columns(results: dict) -> list:
    """Table columns: the fastest step, grad_op's speed-up over the same system's full sharding,
    and FSDP2's fastest step over zinf's in the same mode (where both contenders finished)."""

    def name_of(res: dict) -> str:
        return next(n for n, r in results.items() if r is res)

    def over_full(res: dict) -> str:
        system, plus, mode = name_of(res).partition("+")
        return fastest_ratio(results.get(system), res) if mode else "-"

    def versus_fsdp2(res: dict) -> str:
        system, plus, mode = name_of(res).partition("+")
        return fastest_ratio(results.get("fsdp2" + plus + mode), res) if system == "zinf" else "-"

    return [("fastest s/step", lambda res: f"{fastest(res):.3f}"), ("grad_op vs full", over_full),
            ("zinf vs fsdp2", versus_fsdp2)]


def main() -> None:
    run_variants(__doc__, CONTENDERS, "sharding", "--sharding", "full", ratio_columns, plain=("ddp",))


if __name__ == "__main__":
    main()
