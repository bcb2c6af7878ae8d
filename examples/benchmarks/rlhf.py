"""The RLHF benchmark in one command: both halves, one after the other.

    sudo python examples/benchmarks/rlhf.py [--rates 1000mbit 100mbit] [--steps 5] [--repeats 3]

1. ZeRO++ against ZeRO-3 on the RLHF example's GRPO step, as a 2-node job over a shaped link
   (``cluster/cluster.py --job rlhf``: generation tokens/s, the training phase's seconds per step,
   bytes across nodes per phase, peak memory per rank, at each rate and ``inference_budget``;
   needs root for the network namespaces, and says so and skips without it);
2. the actor's ``generate()`` under zinf against DeepSpeed ZeRO-3 as TRL runs it, on this machine
   (``rlhf_generation.py``; DeepSpeed from ``$ZINF_DEEPSPEED_PYTHON``).

Each half writes its JSON under ``results/`` and prints its table; ``RESULTS.md`` records them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import rlhf_generation  # noqa: E402
from cluster import cluster  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", nargs="+", default=["1000mbit", "100mbit"], help="inter-node bandwidths (tc syntax)")
    parser.add_argument("--steps", type=int, default=5, help="GRPO steps per cluster run (the first is left out)")
    parser.add_argument("--repeats", type=int, default=3, help="alternated repeats of each generate() contender")
    args = parser.parse_args(argv)
    print("== ZeRO++ vs ZeRO-3 on the GRPO step, 2 nodes ==", flush=True)
    cluster.main(["--job", "rlhf", "--rates", *args.rates, "--steps", str(args.steps),
                  "--out", str(HERE / "results" / "cluster_rlhf.json")])
    print("== generate(): zinf vs DeepSpeed ZeRO-3 ==", flush=True)
    rlhf_generation.main(["--width", "256", "--layers", "4", "--new-tokens", "24", "--repeats", str(args.repeats)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
