"""torch.compile under lightning_zinf against torch.compile under DDP, compiled vs eager, in one run.

Trains the throughput benchmark's GPT (examples/gpt.py, 91M parameters, fp32, AdamW, micro-batch
1 x 128 tokens per rank, 2 ranks on CPU with gloo, one thread per rank) under each contender, each
its own ``torchrun`` job, one after another (throughput.py's drivers and run_lightning.py):

  zinf           ZeroInfinityStrategy, blocks gathered as units, eager
  zinf+blocks    the same with each block compiled in configure_model (``block.compile()``)
  zinf+model     the same with the whole GPT compiled (``model.compile()``): graph breaks at every
                 unit's module, where the engine's hooks run eagerly
  ddp            Lightning strategy="ddp", eager
  ddp+blocks     DDP with each block compiled
  ddp+model      DDP with the whole GPT compiled

s/step is rank 0's mean over the steps after the first WARMUP_STEPS (compilation happens in the
first one); "fastest" is the quickest of those steps. On a shared machine other jobs only ever add
time, and they come and go within a run, so the ratios use the fastest step: each contender's
speed-up over its own eager run (eager / its fastest s/step; above 1: compiling helps), and zinf's
speed against DDP compiled the same way (DDP / zinf fastest s/step; the ZeRO-3 cost of gathering
and reduce-scattering every block).

    python examples/benchmarks/compile.py [--steps 7] [--only zinf,zinf+blocks,ddp,ddp+blocks]
"""

from __future__ import annotations

from throughput import fastest, fastest_ratio, run_variants

SYSTEMS = ("zinf", "ddp")
MODES = ("", "+blocks", "+model")
CONTENDERS = tuple(system + mode for system in SYSTEMS for mode in MODES)


def ratio_columns(results: dict) -> list:
    """Table columns: the fastest step, the speed-up over the same system's eager run, and DDP's
    fastest step over zinf's for the same compilation (where both contenders finished)."""

    def speedup(res: dict) -> str:
        name = next(n for n, r in results.items() if r is res)
        return fastest_ratio(results.get(name.partition("+")[0]), res)

    def versus_ddp(res: dict) -> str:
        name = next(n for n, r in results.items() if r is res)
        system, plus, mode = name.partition("+")
        return fastest_ratio(results.get("ddp" + plus + mode), res) if system == "zinf" else "-"

    return [("fastest s/step", lambda res: f"{fastest(res):.3f}"), ("vs own eager", speedup), ("zinf vs ddp", versus_ddp)]



def main() -> None:
    run_variants(__doc__, CONTENDERS, "compile", "--compile", "none", ratio_columns)


if __name__ == "__main__":
    main()
