"""The crash-point enumeration behind ``tests/test_crash_safety.py``, as a table for RESULTS.md.

For each kind of save (sharded, full, and a name that changes kind), a 2-rank GPT run saves
``last.ckpt`` after steps 2 and 4; an observer outside the library (audit hooks and an ``os.fsync``
wrapper) lists every filesystem step of the second save on every rank; then for each step a fresh
run is SIGKILLed just before it, and a resume from ``last.ckpt`` reports which checkpoint it found
(step 2: the previous one, step 4: the new one) and whether its next two losses equal the
uninterrupted run's bit for bit.

    python -m examples.benchmarks.crash_points [--kinds sharded full sharded-to-full full-to-sharded]
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path

KINDS = {"sharded": ("sharded", "sharded"), "full": ("full", "full"), "sharded-to-full": ("sharded", "full"),
         "full-to-sharded": ("full", "sharded")}


def main() -> None:
    from tests.harness import run_distributed
    from tests.test_crash_safety import _enumerate_and_kill, _resume

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS))
    args = parser.parse_args()
    for kind in args.kinds:
        kinds = KINDS[kind]
        with tempfile.TemporaryDirectory() as folder:
            start = time.perf_counter()
            reference, steps, folders = _enumerate_and_kill(Path(folder), kinds)
            resumed = run_distributed(_resume, 2, [str(f) for f in folders], kinds[1])
            print(f"\n{kind}: {len(steps)} filesystem steps in the second save ({time.perf_counter() - start:.0f} s)")
            print("| rank | killed before | resumed from | losses equal |")
            print("|---|---|---|---|")
            for (rank, _, text), *per_rank in zip(steps, *resumed):
                step = per_rank[0][0]
                exact = all(losses == reference[r]["losses"][step:step + 2] for r, (step, losses) in enumerate(per_rank))
                shown = re.sub(r"save-[0-9a-f]{12}", "save-<id>", text.replace(str(Path(folder) / "reference"), "<dir>"))
                print(f"| {rank} | `{shown}` | step {step} | {'yes' if exact else 'NO'} |")


if __name__ == "__main__":
    main()
