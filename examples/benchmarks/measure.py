"""What every contender's rank measures and how it reports it to the driver.

Each rank writes ``<result_dir>/rank<r>.json`` with:
  - ``step_times_s``: wall time of each optimizer step (forward + backward + step), seconds;
  - ``losses``: the training loss of each step (a sanity check that the model learns the same task);
  - ``peak_rss_mib``: the process's peak resident set size (``ru_maxrss``), MiB;
  - ``io``: snapshots of the process's I/O counters, one before the first step and one after each
    step: ``read_bytes``/``write_bytes`` from ``/proc/self/io`` (bytes this process, all of its
    threads, made the block layer read or write, ``O_DIRECT`` and kernel AIO included; the same
    measure for every contender), plus whatever ``StepClock.extra_counters`` returns (e.g. a
    swapper's own byte counts). The difference between two snapshots is what moved in between.
"""

import json
import os
import re
import resource
import subprocess
import time
from pathlib import Path
from typing import Callable

SEED = 0
LR = 1e-4
MICRO_BATCH = 1


class StepClock:
    """Collects per-step wall times (``time.perf_counter``, seconds), losses and I/O counters.

    ``extra_counters``, if set, returns more cumulative counters (name -> number) to snapshot with
    ``/proc/self/io``'s. :meth:`mark` splits a step into phases: ``phases_s`` holds, per step, the
    seconds from the step's start (or the previous mark) to each named mark, and ``"rest"`` from the
    last mark to the end.
    """

    def __init__(self) -> None:
        self.step_times_s: list[float] = []
        self.phases_s: list[dict[str, float]] = []
        self._last = 0.0
        self.losses: list[float] = []
        self.io: list[dict[str, int]] = []
        self.extra_counters: Callable[[], dict[str, int]] | None = None
        self._t0 = 0.0

    def start(self) -> None:
        if not self.io:
            self.io.append(self._counters())
        self._t0 = self._last = time.perf_counter()
        self.phases_s.append({})

    def mark(self, phase: str) -> None:
        """The step's phase ``phase`` ends now (e.g. ``"forward"`` before backward starts)."""
        now = time.perf_counter()
        self.phases_s[-1][phase] = now - self._last
        self._last = now

    def stop(self, loss: float) -> None:
        now = time.perf_counter()
        self.step_times_s.append(now - self._t0)
        if self.phases_s[-1]:
            self.phases_s[-1]["rest"] = now - self._last
        self.losses.append(loss)
        self.io.append(self._counters())

    def _counters(self) -> dict[str, int]:
        return {**proc_io(), **(self.extra_counters() if self.extra_counters else {})}


def proc_io() -> dict[str, int]:
    """``read_bytes`` and ``write_bytes`` of ``/proc/self/io`` (what reached the block layer), and
    ``wchar`` (bytes passed to ``write()``, page cache included); zeros where it does not exist."""
    names = ("read_bytes", "write_bytes", "wchar")
    try:
        lines = Path("/proc/self/io").read_text().splitlines()
    except OSError:
        return dict.fromkeys(names, 0)
    fields = dict(line.split(": ") for line in lines)
    return {name: int(fields[name]) for name in names}


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, in MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def swap_files(root: str) -> dict[str, int]:
    """Bytes of the files under ``root`` by kind: summed over paths (relative to ``root``) that differ
    only in their digits (``#``), e.g. one total per rank folder and file suffix."""
    sizes: dict[str, int] = {}
    for folder, _, files in os.walk(root):
        for name in files:
            kind = re.sub(r"\d+", "#", os.path.relpath(os.path.join(folder, name), root))
            sizes[kind] = sizes.get(kind, 0) + os.path.getsize(os.path.join(folder, name))
    return sizes


def write_rank_result(result_dir: str, rank: int, clock: StepClock) -> None:
    result = {
        "rank": rank,
        "step_times_s": clock.step_times_s,
        "phases_s": clock.phases_s,
        "losses": clock.losses,
        "peak_rss_mib": peak_rss_mib(),
        "io": clock.io,
    }
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(result))


def run_killable(cmd: list[str], env: dict[str, str], log_path: Path, timeout: float) -> int:
    """Driver side: run a contender's ``torchrun`` with its output in ``log_path``, in a new session,
    so that on timeout the whole process tree is killed at once. Returns its exit code (-9 when
    killed)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            return proc.wait()


def self_launched_rank(script: str, contender: str, script_args: list[str], timeout: float, python: str | None = None,
                       env: dict[str, str] | None = None) -> tuple[dict | None, str]:
    """Driver side of a benchmark script that is also its own rank program: run
    ``torchrun --nproc_per_node 2 script --rank-of contender *script_args --result FILE`` with one
    thread per rank and this checkout on ``PYTHONPATH``, under ``python`` (default: this
    interpreter; another venv's, DeepSpeed's) with ``env`` added to this process's environment;
    returns what rank 0 wrote to FILE (JSON),
    or ``None`` and the tail of the job's stderr when it wrote nothing. Rank programs write FILE once
    every rank is done with its work: a job that fails after that (a rank aborting in gloo's
    teardown with "terminate called without an active exception", seen here under DDP as well)
    returns its data with an ``exit_note`` saying so."""
    import sys
    import tempfile

    repo = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])), **(env or {}))
        cmd = [python or sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script,
               "--rank-of", contender, *script_args, "--result", str(out)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if not out.exists():
            return None, done.stderr[-3000:]
        data = json.loads(out.read_text())
        if done.returncode:
            data["exit_note"] = f"torchrun exited {done.returncode} after rank 0 wrote its result: {done.stderr[-300:]}"
        return data, ""


def add_self_launch_options(parser, contenders, default_out: Path, timeout: float = 900) -> None:
    """The options of a driver that is also its own rank program (:func:`self_launched_rank`):
    ``--only`` (among ``contenders``), ``--out`` (the JSON results path), ``--timeout`` (seconds per
    contender), and the hidden ``--rank-of``/``--result`` its torchrun jobs are started with."""
    import argparse

    parser.add_argument("--only", default=",".join(contenders),
                        help="comma-separated contenders to run (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=default_out,
                        help=f"JSON results path (default: results/{default_out.name} beside this script)")
    parser.add_argument("--timeout", type=float, default=timeout,
                        help="seconds before a contender is killed (default: %(default)s)")
    parser.add_argument("--rank-of", choices=contenders, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)


def chosen_contenders(parser, args, contenders) -> None:
    """Turn ``args.only`` into a list of contender names; ``parser.error`` on an empty or unknown one."""
    args.only = [name.strip() for name in args.only.split(",") if name.strip()]
    if not args.only or set(args.only) - set(contenders):
        parser.error(f"--only must name some of {tuple(contenders)}")


def run_record(**fields) -> dict:
    """What was run, where and when (command, UTC date, machine), with ``fields``, for a results file."""
    import datetime
    import platform
    import sys

    import torch

    return {"command": " ".join([sys.executable, *sys.argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
            **fields}
