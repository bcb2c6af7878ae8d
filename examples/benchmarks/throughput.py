"""Training throughput and peak memory of lightning_zinf against its peers, side by side.

Trains the same ~91M-parameter GPT (examples/gpt.py) on the same random tokens with AdamW (lr 1e-4),
fp32, micro-batch 1 x 128 tokens per rank, 2 ranks on CPU with gloo, under each contender:

  zinf       Lightning + lightning_zinf's ZeroInfinityStrategy (ZeRO-3, blocks gathered as units;
             ``--zinf-units auto``: no block_classes, the modules grouped by the engine)
  fsdp2      Lightning ModelParallelStrategy with fully_shard per block and on the root
  ddp        Lightning strategy="ddp" (full replicas; the speed reference)
  deepspeed  a raw DeepSpeed ZeRO-3 engine, run with the interpreter of a separate venv

Each contender runs as its own ``torchrun --nproc_per_node 2`` job, one after another, with
OMP_NUM_THREADS=1 per rank. Measured per contender:
  - s/step: mean wall time of one optimizer step (forward + backward + step) on rank 0, in
    seconds, over the steps after the first WARMUP_STEPS;
  - tokens/s: global tokens per step (ranks x micro-batch x sequence length) / s/step;
  - peak RSS: ru_maxrss of each rank at the end of training, in MiB.
The ratio columns compare zinf with each peer: throughput as zinf tokens/s / peer tokens/s
(above 1: zinf faster) and memory as zinf's / the peer's largest per-rank peak RSS (below 1:
zinf leaner). A contender that fails is reported with the tail of its log; the others still run.
The note column flags a contender whose loss went non-finite or whose torchrun exited non-zero
after every rank had reported all its steps.

    python examples/benchmarks/throughput.py [--steps 7] [--only zinf,ddp] [--zinf-units blocks|auto] [--out PATH]

DeepSpeed JIT-compiles its CPU ops (fused_adam takes minutes) the first time they are used;
step times exclude it, but run the deepspeed contender once beforehand to keep wall time short.
"""

import argparse
import datetime
import json
import math
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
sys.path.insert(0, str(REPO_ROOT))  # the examples' GPT, as the contenders import it

from examples.gpt import GPT, GPTConfig  # noqa: E402
from measure import MICRO_BATCH, run_killable  # noqa: E402
CONTENDERS = ("zinf", "fsdp2", "ddp", "deepspeed")
RANKS = 2
WARMUP_STEPS = 2


def benchmark_parser(description: str, contenders: Sequence[str], default_out: Path) -> argparse.ArgumentParser:
    """The options every side-by-side benchmark driver has (``--only`` chooses among ``contenders``)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=7,
                        help=f"steps per contender; the first {WARMUP_STEPS} are warm-up (default: %(default)s)")
    parser.add_argument("--only", default=",".join(contenders),
                        help="comma-separated contenders to run (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=default_out, help="JSON results path")
    parser.add_argument(
        "--python-deepspeed",
        default=os.environ.get("ZINF_DEEPSPEED_PYTHON", sys.executable),
        help="interpreter of a venv with DeepSpeed, for the deepspeed contender (default: $ZINF_DEEPSPEED_PYTHON, "
        "else this interpreter)",
    )
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds before a contender is killed (default: %(default)s)")
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace, contenders: Sequence[str]) -> None:
    """Validates ``--steps`` and turns ``--only`` into a list of contender names."""
    args.only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = set(args.only) - set(contenders)
    if not args.only or unknown:
        parser.error(f"--only must name one or more of {tuple(contenders)}, got {args.only}")
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must exceed the {WARMUP_STEPS} warm-up steps")


def parse_args() -> argparse.Namespace:
    parser = benchmark_parser(__doc__, CONTENDERS, HERE / "results" / "throughput.json")
    parser.add_argument("--zinf-units", choices=["blocks", "auto"], default="blocks",
                        help="zinf's units: a GPT block each (block_classes, the default) or grouped by the engine "
                             "(no block_classes, as a user who names none)")
    args = parser.parse_args()
    check_args(parser, args, CONTENDERS)
    return args


def launch_command(
    name: str, args: argparse.Namespace, result_dir: str, script_args: Sequence[str] = ()
) -> tuple[list[str], dict[str, str]]:
    """The torchrun command line and environment of one contender.

    A contender whose name starts with ``deepspeed`` runs run_deepspeed.py in the DeepSpeed venv;
    any other runs run_lightning.py with its name as the mode (up to a ``+``: ``zinf+blocks`` is a
    variant of ``zinf`` that its ``script_args`` set). ``script_args`` go to the script.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # lightning_zinf is imported from this checkout whether or not it is installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    if name.startswith("deepspeed"):
        python, script, mode = args.python_deepspeed, "run_deepspeed.py", []
        env["DS_ACCELERATOR"] = "cpu"
        # As if that venv were activated: DeepSpeed JIT-builds its ops with the first `ninja` on
        # PATH, and a different ninja version than the one that built the cached ops (pip's 1.13
        # vs Debian's 1.11) rejects the build log and recompiles them (minutes) on every run.
        env["PATH"] = os.pathsep.join([str(Path(python).parent), env.get("PATH", "")])
        # torch deprecation warnings from DeepSpeed's collectives flood the log on every step.
        env["PYTHONWARNINGS"] = "ignore::FutureWarning"
    else:
        python, script, mode = sys.executable, "run_lightning.py", [name.partition("+")[0]]
    torchrun = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}"]
    rest = ["--steps", str(args.steps), "--result-dir", result_dir, *script_args]
    return [*torchrun, str(HERE / script), *mode, *rest], env


def run_contender(name: str, args: argparse.Namespace, log_dir: Path, script_args: Sequence[str] = ()) -> dict:
    """Runs one contender to completion and returns its raw per-rank results and status."""
    log_path = log_dir / f"{name}.log"
    with tempfile.TemporaryDirectory(prefix=f"zinf_bench_{name}_") as result_dir:
        cmd, env = launch_command(name, args, result_dir, script_args)
        start = time.perf_counter()
        returncode = run_killable(cmd, env, log_path, args.timeout)
        ranks = [read_rank_result(Path(result_dir, f"rank{r}.json")) for r in range(RANKS)]
    result = {"command": cmd, "returncode": returncode, "wall_s": time.perf_counter() - start, "log": str(log_path)}
    # Success is judged by the steps each rank reported, not by torchrun's exit code: DeepSpeed
    # has been seen to abort at interpreter exit after training finished.
    if all(rank and len(rank["step_times_s"]) == args.steps for rank in ranks):
        return {**result, "status": "ok", **summarize(ranks)}
    return {**result, "status": "failed", "error": error_line(log_path), "error_tail": log_tail(log_path)}


def read_rank_result(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def summarize(ranks: list[dict]) -> dict:
    """s/step and tokens/s from rank 0's timed steps; peak RSS and I/O bytes per timed step of every rank."""
    timed = ranks[0]["step_times_s"][WARMUP_STEPS:]
    mean_step_s = sum(timed) / len(timed)
    tokens_per_step = RANKS * MICRO_BATCH * GPTConfig().seq_len
    return {
        "step_times_s": ranks[0]["step_times_s"],
        "mean_step_s": mean_step_s,
        "tokens_per_s": tokens_per_step / mean_step_s,
        "peak_rss_mib": [rank["peak_rss_mib"] for rank in ranks],
        "bytes_per_step": bytes_per_step(ranks),
        "losses": ranks[0]["losses"],
        **mean_phases(ranks[0].get("phases_s", [])[WARMUP_STEPS:]),
    }


def mean_phases(phases: list[dict[str, float]]) -> dict:
    """Rank 0's mean seconds per timed step in each recorded phase (``mean_forward_s``,
    ``mean_backward_s``, ``mean_rest_s``: see run_lightning.py), where the contender records them."""
    if not phases or not all(phases):
        return {}
    return {f"mean_{name}_s": sum(p[name] for p in phases) / len(phases) for name in phases[0]}


def bytes_per_step(ranks: list[dict]) -> dict[str, list[float]]:
    """For each I/O counter (``read_bytes``, ``write_bytes``, ...): each rank's mean per timed step.

    Taken between the snapshot after the last warm-up step and the one after the last step, so
    I/O that runs on between steps (write-behind) counts too.
    """
    if not all(rank.get("io") for rank in ranks):
        return {}
    timed = len(ranks[0]["step_times_s"]) - WARMUP_STEPS
    return {
        key: [(rank["io"][-1][key] - rank["io"][WARMUP_STEPS][key]) / timed for rank in ranks]
        for key in ranks[0]["io"][0]
    }


def log_tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def error_line(path: Path) -> str:
    """The most telling line of a failed log: the last exception raised by a rank, else the last line."""
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    # torchrun's own ChildFailedError only says that a rank failed, not why.
    errors = [line for line in lines if re.match(r"[\w.]*(Error|Exception)\b", line) and "ChildFailedError" not in line]
    return (errors or lines or ["(no output)"])[-1][:160]


def zinf_ratios(results: dict, ours: str = "zinf") -> dict:
    """For each peer: our tokens/s / peer tokens/s, and our max-rank RSS / peer max-rank RSS."""
    zinf = results.get(ours, {})
    if zinf.get("status") != "ok":
        return {}
    return {
        name: {
            "throughput": zinf["tokens_per_s"] / peer["tokens_per_s"],
            "memory": max(zinf["peak_rss_mib"]) / max(peer["peak_rss_mib"]),
        }
        for name, peer in results.items()
        if name != ours and peer["status"] == "ok"
    }


# An extra table column: its header and a function of a finished contender's results.
Column = tuple[str, Callable[[dict], str]]


def format_table(results: dict, ratios: dict, extra_columns: Sequence[Column] = ()) -> str:
    header = (
        "contender", "s/step", "tokens/s", "RSS r0 MiB", "RSS r1 MiB",
        *(title for title, _ in extra_columns), "zinf/peer tok/s", "zinf/peer RSS", "note",
    )
    rows = [header]
    for name, res in results.items():
        if res["status"] != "ok":
            rows.append((name, "FAILED", *["-"] * (len(header) - 3), res["error"]))
            continue
        ratio = ratios.get(name)
        rows.append((
            name,
            f"{res['mean_step_s']:.3f}",
            f"{res['tokens_per_s']:.1f}",
            *(f"{rss:.0f}" for rss in res["peak_rss_mib"]),
            *(cell(res) for _, cell in extra_columns),
            f"{ratio['throughput']:.2f}" if ratio else "-",
            f"{ratio['memory']:.2f}" if ratio else "-",
            "; ".join(notes(res)),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(" | ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def notes(res: dict) -> list[str]:
    """Warnings about a contender that finished: a fast step is worthless if the loss is not finite."""
    found = []
    if not all(math.isfinite(loss) for loss in res["losses"]):
        found.append("non-finite loss")
    if res["returncode"]:
        found.append(f"torchrun rc={res['returncode']} after all steps")
    return found


def setup_record(args: argparse.Namespace) -> dict:
    """What was run, where and when, stored next to the results."""
    with torch.device("meta"):
        num_params = sum(p.numel() for p in GPT().parameters())
    return {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "model": {**GPTConfig().__dict__, "parameters": num_params},
        "ranks": RANKS,
        "micro_batch": MICRO_BATCH,
        "steps": args.steps,
        "warmup_steps": WARMUP_STEPS,
    }


def fastest(res: dict) -> float:
    """The quickest timed step of a finished contender (rank 0), seconds: on a shared machine other
    jobs only ever add time, so drivers that compare contenders use it."""
    return min(res["step_times_s"][WARMUP_STEPS:])


def fastest_ratio(numerator: dict | None, denominator: dict | None) -> str:
    """``numerator``'s fastest step over ``denominator``'s, for a table (``-`` unless both finished)."""
    if not numerator or not denominator or "ok" != numerator["status"] or "ok" != denominator["status"]:
        return "-"
    return f"{fastest(numerator) / fastest(denominator):.2f}"


def run_variants(doc: str, contenders: Sequence[str], tag: str, option: str, default: str,
                 columns: Callable[[dict], list], plain: Sequence[str] = ()) -> None:
    """A driver whose contenders are ``system+variant`` names: parses ``--steps``/``--only``, runs
    each with ``option <variant>`` (``default`` without a ``+``; none for the ``plain`` ones), and
    prints the table with ``columns(results)`` (its own ratio columns, not format_table's)."""
    parser = benchmark_parser(doc, contenders, HERE / "results" / f"{tag}.json")
    args = parser.parse_args()
    check_args(parser, args, contenders)
    script_args = {name: [option, name.partition("+")[2] or default] for name in args.only if name not in plain}
    results, _ = run_all(args, setup_record(args), tag, script_args=script_args)
    print()
    print(format_table(results, {}, columns(results)))
    print(f"\nresults: {args.out}")


def run_all(
    args: argparse.Namespace, record: dict, tag: str, ours: str = "zinf", script_args: dict[str, list[str]] | None = None
) -> tuple[dict, dict]:
    """Runs the contenders of ``args.only`` one after another (``script_args[name]`` passed to each
    one's script), writing ``args.out`` after each; returns the results and ``ours``'s ratios."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="zinf_bench_logs_"))
    results: dict[str, dict] = {}
    ratios: dict = {}
    for name in args.only:
        print(f"[{tag}] running {name} ...", flush=True)
        results[name] = run_contender(name, args, log_dir, (script_args or {}).get(name, ()))
        res = results[name]
        print(f"[{tag}] {name}: {res['status']} in {res['wall_s']:.0f} s (log {res['log']})", flush=True)
        # Written after every contender so that an interrupted run keeps what it measured.
        ratios = zinf_ratios(results, ours)
        args.out.write_text(json.dumps({**record, "results": results, "zinf_ratios": ratios}, indent=2))
    return results, ratios


def main() -> None:
    args = parse_args()
    results, ratios = run_all(args, setup_record(args), "throughput", script_args={"zinf": ["--units", args.zinf_units]})
    print()
    print(format_table(results, ratios))
    print(f"\nresults: {args.out}")


if __name__ == "__main__":
    main()
