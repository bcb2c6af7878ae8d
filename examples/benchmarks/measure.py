"""What every contender's rank measures and how it reports it to the driver.

Each rank writes ``<result_dir>/rank<r>.json`` with:
  - ``step_times_s``: wall time of each optimizer step (forward + backward + step), seconds;
  - ``losses``: the training loss of each step (a sanity check that the model learns the same task);
  - ``peak_rss_mib``: the process's peak resident set size (``ru_maxrss``), MiB.
"""

import json
import resource
import time
from pathlib import Path

SEED = 0
LR = 1e-4
MICRO_BATCH = 1


class StepClock:
    """Collects per-step wall times (``time.perf_counter``, seconds) and losses."""

    def __init__(self) -> None:
        self.step_times_s: list[float] = []
        self.losses: list[float] = []
        self._t0 = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self, loss: float) -> None:
        self.step_times_s.append(time.perf_counter() - self._t0)
        self.losses.append(loss)


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, in MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_rank_result(result_dir: str, rank: int, clock: StepClock) -> None:
    result = {
        "rank": rank,
        "step_times_s": clock.step_times_s,
        "losses": clock.losses,
        "peak_rss_mib": peak_rss_mib(),
    }
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(result))
