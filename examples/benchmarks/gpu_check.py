"""Everything that has to be seen running on a CUDA GPU, in one command, within a time budget,
with a JSON of results written after every step.

    python examples/benchmarks/gpu_check.py [--budget 450] [--out gpu_check.json] [--skip suite,kernels,...]

On a lent device machine (its image has python3 3.12, torch 2.11, triton 3.6, lightning 2.6.6 and no
package index): first, here, ``bash examples/benchmarks/gpu_wheels.sh`` puts the pure-Python wheels
the image lacks (jsonargparse and its helpers, for ``zinf fit``) in ``examples/benchmarks/gpu_wheels/``;
then run, there, with that folder carried along with the tree:

    PYTHONPATH=. python3 examples/benchmarks/gpu_check.py --skip offload --out $OUT/gpu_check.json

(docs/tests.md, "On a GPU", gives the whole plan for a lent machine's 15 minutes: this check, then
offload_gpu.py as a command of its own, and the steps' time budget.)

Nothing is installed into the image's environment: pip installs the carried wheels, offline, into a
temporary folder on the steps' ``PYTHONPATH``. The steps compile the Triton kernels into one cache,
``.triton_cache/`` in the checkout (``TRITON_CACHE_DIR``, unless it is set), so each kernel is
compiled once, by the first step that launches it; the folder is kept between runs (git ignores
it): copied to ``$OUT`` and carried back along with the wheels, it spares a later machine of the
same kind and image the compiling (the prerequisites count the kernels found in it); the check
copies it beside ``--out`` (``<stem>_triton_cache/``) after every step. The prerequisites are
checked first, in seconds, and written to the JSON; then the steps run, most valuable first, each
in its own process group with a timeout sized to what is left of ``--budget`` (a step that would get
less than ``MIN_STEP_S`` is recorded as skipped; at its timeout a step gets SIGINT, then SIGKILL
``GRACE_S`` later, so pytest writes the results of the tests that finished). Each step's own files
are kept beside ``--out``, named after it (``gpu_check_suite.xml``, ``gpu_check_kernels.json``...):

  suite     ``pytest -m gpu`` over the GPU test modules only (test_gpu.py, test_kernels.py): every
            engine feature at one rank on CUDA in an NCCL group, two ranks sharing the GPU through
            gloo, fused/capturable AdamW resume, ``strategy.generation()`` in a Trainer, the Triton
            kernels against their references (passed / failed / skipped, with the failures' names;
            the JUnit XML kept)
  main_job  the README's main job on one GPU (``zinf fit`` with ``--trainer.devices 1``): wall time,
            last logged losses, ZeroMonitor's ledger peak next to ``max_memory_allocated``
  nccl      the one-GPU feature tests again with ``ZINF_REAL_COLLECTIVES=1`` (those making distinct
            NCCL calls: fp32, bf16, CPU offload, qwZ/hpZ/qgZ, frozen INT8, the generation phase's
            kept qwZ row): the engine's features through real NCCL all-gathers, reduce-scatters
            and all-to-alls at world size 1
  kernels   ``kernels.py`` at 2**24 values, no ``torch.compile`` column: the quantization kernels'
            bandwidth against the device copy (its JSON)
  ledger    an engine over the examples' GPT (d_model 1024, 8 blocks) on CUDA, per configuration
            (plain, bf16, CPU offload): the ledger's device peak per step, the allocator's peak,
            and the difference (activations, autograd, allocator slack), each configuration saved
            as soon as it is measured; the allocator's history of the CPU-offload run, Python
            stacks only, dumped last (``--memory-snapshot``, for https://pytorch.org/memory_viz)
  overlap   a ``torch.profiler`` trace of three CPU-offload steps (parameters, optimizer and
            activations on the host): the Chrome trace file, and how much of the host<->device
            copy time runs while a compute kernel runs on another stream
  offload   ``offload_gpu.py`` at its defaults (``--offload-args`` adds arguments): lightning_zinf's
            CPU offload against FSDP2's and DeepSpeed's on one GPU under a memory cap (its JSON,
            rewritten after each arm)

Without CUDA it exits with status 2 and writes nothing (``--device cpu``, for the tests, runs the
same driver on the CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import gc
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable

import torch

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
sys.path.insert(0, str(REPO_ROOT))

STEPS = ("suite", "main_job", "nccl", "kernels", "ledger", "overlap", "offload")  # most valuable first
#: The most seconds each step may take (a step gets less when the budget has less left). The
#: default budget (450 s) runs the first six steps when each takes what it took on the H100 with a
#: cold Triton cache (docs/tests.md, "On a GPU": the budget of a lent machine's 15 minutes).
STEP_CAP_S = {"suite": 270, "main_job": 120, "nccl": 120, "kernels": 60, "ledger": 60, "overlap": 45,
              "offload": 240}
#: A step that would get fewer seconds than this is skipped rather than started.
MIN_STEP_S = 15
#: Seconds between the SIGINT that stops a step at its timeout and the SIGKILL of its process
#: group: pytest writes its per-test results (``--junitxml``) when interrupted.
GRACE_S = 15
GPU_TESTS = ("tests/test_gpu.py", "tests/test_kernels.py")
WHEELS = HERE / "gpu_wheels"
#: What the main job imports beyond the image's packages (the wheels gpu_wheels.sh prepares).
MAIN_JOB_NEEDS = ("jsonargparse", "docstring_parser", "typeshed_client")
#: lightning_zinf.comm.collectives.REAL_COLLECTIVES_ENV (not imported: this process stays light).
REAL_COLLECTIVES_ENV = "ZINF_REAL_COLLECTIVES"
#: The one-GPU feature tests that make distinct NCCL calls: gathers and reduce-scatters in fp32 and
#: bf16, from host memory, qwZ/hpZ/qgZ (codes, secondary gathers, all-to-alls), frozen INT8 codes.
NCCL_TESTS = ("-k", "(every_feature_on_one_gpu and (fp32 or bf16 or offload_cpu or zero_pp or lora_frozen_int8))"
                    " or generation_phase_on_one_gpu")
#: The steps' Triton cache (``TRITON_CACHE_DIR``, unless the caller set one): in the checkout, so it
#: outlives the run's temporary folder and can be carried to the next machine.
TRITON_CACHE = REPO_ROOT / ".triton_cache"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check.json",
                        help="the JSON of results (default gpu_check.json); the steps' own files (the pytest "
                             "steps' per-test XML, the benchmarks' JSON, a copy of the Triton cache) go beside "
                             "it, named after it (gpu_check_suite.xml, gpu_check_triton_cache/, ...)")
    parser.add_argument("--budget", type=float, default=450, help="seconds for the whole check (default 450)")
    parser.add_argument("--trace", default="gpu_check_trace.json", help="the Chrome trace of the overlap step")
    parser.add_argument("--memory-snapshot", default="gpu_check_memory.pickle",
                        help="the allocator's history over the ledger step's CPU-offload run (torch.cuda.memory)")
    parser.add_argument("--steps", type=int, default=50, help="training steps of the main job (default 50)")
    parser.add_argument("--skip", default="", help=f"comma-separated steps to leave out, among {','.join(STEPS)}")
    parser.add_argument("--offload-args", default="",
                        help="more arguments for offload_gpu.py in the offload step (e.g. \"--only zinf_offload\")")
    parser.add_argument("--d-model", type=int, default=1024, help="width of the GPT of the ledger and overlap steps")
    parser.add_argument("--layers", type=int, default=8, help="blocks of that GPT")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # "cpu": the tests' dry run of those steps
    parser.add_argument("--run-step", help=argparse.SUPPRESS)  # in a child process: run this in-process step
    parser.add_argument("--step-out", help=argparse.SUPPRESS)  # ... and write its result here
    return parser.parse_args(argv)


def _run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """Run ``cmd`` in the repository root in a process group of its own; return its exit status
    (None when it ran past ``timeout`` seconds) and its output's tail. At ``timeout - GRACE_S``
    seconds the group gets SIGINT (pytest then writes its per-test results), at ``timeout`` SIGKILL."""
    # SIGINT at its default in the child: a shell without job control starts background commands
    # with it ignored, and an ignored SIGINT is inherited, so pytest would die by SIGKILL unsaved.
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    grace = min(GRACE_S, timeout / 4)
    try:
        out, _ = proc.communicate(timeout=timeout - grace)
        return proc.returncode, out[-4000:]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)  # pytest's and torchrun's children too
    try:
        out, _ = proc.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    return None, out[-4000:]


def kept(args: argparse.Namespace, name: str) -> Path:
    """Where a step keeps its file ``name``: beside ``--out``, after its stem (``gpu_check_suite.xml``)."""
    out = Path(args.out).resolve()
    return out.with_name(f"{out.stem}_{name}")


def run_pytest(pytest_args: list[str], xml: Path, timeout: float, env: dict[str, str]) -> dict[str, Any]:
    """``pytest -q *pytest_args`` with its per-test results in ``xml`` (JUnit XML, kept even when the
    run is stopped at ``timeout``: see :func:`_run`); the counts and the failed tests' names."""
    code, tail = _run([sys.executable, "-m", "pytest", "-q", *pytest_args, f"--junitxml={xml}",
                       "-p", "no:cacheprovider"], timeout, env)
    timed_out = {"timed_out": True} if code is None else {}
    if not xml.exists():
        return {"ok": False, "error": "timed out" if code is None else f"pytest exited {code}", "tail": tail,
                **timed_out}
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"ok": code == 0, **counts, "passed": passed, "failed": failed, "junit_xml": str(xml),
            "tail": tail if code else "", **timed_out}


def step_suite(args: argparse.Namespace, work: Path, timeout: float, env: dict[str, str]) -> dict[str, Any]:
    """The GPU test modules' tests marked ``gpu``."""
    return run_pytest(["-m", "gpu", *GPU_TESTS], kept(args, "suite.xml"), timeout, env)


def step_nccl(args: argparse.Namespace, work: Path, timeout: float, env: dict[str, str]) -> dict[str, Any]:
    """Every engine feature at one rank through real NCCL collectives: the one-GPU tests of the
    suite again under ``ZINF_REAL_COLLECTIVES=1`` (at world size 1 the engine otherwise moves its
    data-plane bytes as local copies, and no NCCL collective would run on a single GPU)."""
    return run_pytest(["-m", "gpu", *GPU_TESTS, *NCCL_TESTS], kept(args, "nccl.xml"), timeout,
                      {**env, REAL_COLLECTIVES_ENV: "1"})


def _script_step(cmd: list[str], out: Path, timeout: float, env: dict[str, str]) -> dict[str, Any]:
    """Run a benchmark script that writes the JSON ``out`` (as it goes); its exit and what it wrote."""
    code, tail = _run(cmd, timeout, env)
    return {"ok": code == 0, "results": json.loads(out.read_text()) if out.exists() else None,
            "tail": tail if code else "", **({"timed_out": True} if code is None else {})}


def step_kernels(args: argparse.Namespace, work: Path, timeout: float, env: dict[str, str]) -> dict[str, Any]:
    out = kept(args, "kernels.json")
    return _script_step([sys.executable, str(HERE / "kernels.py"), "--numel", str(1 << 24), "--no-compile",
                         "--warmup", "2", "--out", str(out)], out, timeout, env)


def step_offload(args: argparse.Namespace, work: Path, timeout: float, env: dict[str, str]) -> dict[str, Any]:
    """``offload_gpu.py`` at its defaults within this step's time (its JSON is written after each arm)."""
    out = kept(args, "offload_gpu.json")
    return _script_step([sys.executable, str(HERE / "offload_gpu.py"), "--budget", str(int(timeout - GRACE_S - 5)),
                         "--device", args.device, *args.offload_args.split(), "--out", str(out)], out, timeout, env)


def step_main_job(args: argparse.Namespace, work: Path, timeout: float, env: dict[str, str]) -> dict[str, Any]:
    missing = [m for m in MAIN_JOB_NEEDS if not _importable(m, env)]
    if missing:
        return {"ok": False, "skipped": f"{', '.join(missing)} not importable: prepare the wheels with "
                                         "`bash examples/benchmarks/gpu_wheels.sh` and carry examples/benchmarks/gpu_wheels"}
    logs = work / "main_job"
    cmd = [sys.executable, "-m", "lightning_zinf.cli", "fit", "--config", "examples/configs/gpt_stdlib.yaml", "--trainer.accelerator", "gpu",
           "--trainer.devices", "1", "--trainer.max_steps", str(args.steps), "--trainer.default_root_dir", str(logs)]
    start = time.perf_counter()
    code, tail = _run(cmd, timeout, env)
    seconds = time.perf_counter() - start
    found = sorted((REPO_ROOT / "lightning_logs" / "gpt_stdlib").glob("version_*/metrics.csv"), key=os.path.getmtime)
    last: dict[str, float] = {}
    if found and os.path.getmtime(found[-1]) >= time.time() - seconds - 5:
        with open(found[-1]) as f:
            for row in csv.DictReader(f):
                last.update({k: float(v) for k, v in row.items() if v not in ("", None)})
    keep = ("train_loss", "val_loss", "zinf/peak_device_total_bytes", "zinf/device_max_allocated_bytes",
            "zinf/tokens_per_s")
    return {"ok": code == 0, "seconds": seconds, "last_logged": {k: v for k, v in last.items() if k in keep},
            "metrics_csv": str(found[-1]) if found else None, "tail": tail if code else ""}


def _synchronize(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def _engine_steps(args: argparse.Namespace, config: dict, steps: int, activations: bool = False,
                  watch: contextlib.AbstractContextManager = contextlib.nullcontext()) -> dict[str, Any]:
    """Train the examples' GPT (``--d-model``, ``--layers``) on random tokens with an engine on
    ``args.device``; per step the ledger's device peak, the allocator's peak above what was allocated
    before the model was built (``baseline_bytes``; bytes, 0 on the CPU) and the step's seconds. ``watch`` (a profiler) is entered after the first step, which
    records the prefetch trace, and left after the last."""
    from examples.gpt import GPT, GPTConfig
    from lightning_zinf import ZeroEngine

    # An engine and its module reference each other, so an earlier configuration's device memory
    # lives until the cycle collector runs: the H200 run of 2026-11-30 found 3.57 GB of the plain
    # and bf16 runs still allocated under CPU offload's peak. Collect it, and count from what is
    # allocated before this configuration's model is built.
    gc.collect()
    cuda = args.device != "cpu"
    if cuda:
        torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated() if cuda else 0
    torch.manual_seed(0)
    vocab, seq = 8192, 256
    model = GPT(GPTConfig(vocab_size=vocab, d_model=args.d_model, n_layers=args.layers, n_heads=16, seq_len=seq))
    engine = ZeroEngine(model, block_classes=["Block"], device=args.device, **config)
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    gen = torch.Generator().manual_seed(0)
    ledger, allocated, reserved, active, seconds = [], [], [], [], []
    watching = contextlib.ExitStack()
    for step in range(steps):
        if step == 1:
            watching.enter_context(watch)
        tokens = torch.randint(0, vocab, (8, seq + 1), generator=gen).to(args.device)
        _synchronize(args.device)
        engine.reset_memory_peaks()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with engine.offload_activations() if activations else contextlib.nullcontext():
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        _synchronize(args.device)
        seconds.append(time.perf_counter() - start)
        ledger.append(engine.memory()["device_total"][1])
        allocated.append(torch.cuda.max_memory_allocated() - baseline if cuda else 0)
        reserved.append(torch.cuda.max_memory_reserved() if cuda else 0)
        # Freed blocks a stream still uses (record_stream) leave "allocated" at free() but stay
        # "active" until the stream passes them: the two peaks apart say how much that holds.
        active.append(torch.cuda.memory_stats().get("active_bytes.all.peak", 0) - baseline if cuda else 0)
    watching.close()
    engine.release_all()
    return {"ledger_peak_bytes": ledger, "max_allocated_bytes": allocated, "max_reserved_bytes": reserved,
            "active_peak_bytes": active, "step_seconds": seconds, "baseline_bytes": baseline}


def _keep_nothing(result: dict[str, Any]) -> None:
    """The ``save`` of an in-process step called in this process (the tests)."""


def step_ledger(args: argparse.Namespace, work: Path, save: Callable[[dict], None] = _keep_nothing) -> dict[str, Any]:
    """The ledger's device peak against the allocator's per configuration; ``save`` gets the result
    so far after each configuration and after the allocator history's dump (the last thing done)."""
    from lightning_zinf import MixedPrecisionConfig, OffloadConfig

    configs = {"plain": {}, "bf16": {"mixed_precision": MixedPrecisionConfig(param_dtype="bf16")},
               "cpu_offload": {"offload": OffloadConfig(param="cpu", optimizer="cpu")}}
    out: dict[str, Any] = {"ok": True}
    for name, config in configs.items():
        # The first H100 run (RESULTS.md) found CPU offload's allocator peak 2 GB above plain's
        # unaccounted bytes: the allocator's history says which allocations those are. Python
        # frames only: symbolising C++ frames can take minutes (pytorch/torchtitan#3628).
        history = name == "cpu_offload" and args.device != "cpu"
        if history:
            torch.cuda.memory._record_memory_history(max_entries=50_000, stacks="python")
        run = _engine_steps(args, config, steps=4)
        run["unaccounted_bytes"] = [a - b for a, b in zip(run["max_allocated_bytes"], run["ledger_peak_bytes"])]
        run["ledger_within_allocator"] = all(0 < b <= a or args.device == "cpu"
                                             for a, b in zip(run["max_allocated_bytes"], run["ledger_peak_bytes"]))
        out["ok"] &= run["ledger_within_allocator"]
        out[name] = run
        save(out)
        if history:
            torch.cuda.memory._dump_snapshot(str(Path(args.memory_snapshot).resolve()))
            torch.cuda.memory._record_memory_history(enabled=None)
            run["memory_snapshot"] = str(Path(args.memory_snapshot).resolve())
            save(out)
    return out


def intervals_overlap(copies: list[tuple[float, float]], compute: list[tuple[float, float]]) -> float:
    """Total length of the copy intervals covered by the union of the compute intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(compute):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    total = 0.0
    for start, end in copies:
        for m_start, m_end in merged:
            total += max(0.0, min(end, m_end) - max(start, m_start))
    return total


def step_overlap(args: argparse.Namespace, work: Path, save: Callable[[dict], None] = _keep_nothing) -> dict[str, Any]:
    """How much host<->device copy time overlaps compute over three profiled CPU-offload steps;
    ``save`` gets the steps' times before the trace is exported and read."""
    from torch.profiler import ProfilerActivity, profile

    from lightning_zinf import OffloadConfig

    config = {"offload": OffloadConfig(param="cpu", optimizer="cpu", activations=True)}
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (args.device != "cpu")
    prof = profile(activities=activities)
    run = _engine_steps(args, config, steps=4, activations=True, watch=prof)  # steps 2-4 profiled
    save({"ok": False, "error": "the trace was not exported", "step_seconds": run["step_seconds"]})
    trace = Path(args.trace).resolve()
    prof.export_chrome_trace(str(trace))
    overlap = copy_overlap(json.loads(trace.read_text()).get("traceEvents", []))
    return {"ok": overlap["copy_us_overlapping_compute"] > 0, "trace": str(trace), **overlap,
            "step_seconds": run["step_seconds"]}


def copy_overlap(events: list[dict]) -> dict[str, Any]:
    """From a Chrome trace's events: the host<->device copy time (µs), how much of it runs while
    a compute kernel runs (a kernel on a stream that spends less time copying than computing: the
    copy streams' own casts are not compute), the same per direction (``HtoD``: parameter shards and activation reloads;
    ``DtoH``: gradients and activations going out), and the streams of each."""
    copies: dict[Any, list[tuple[float, float]]] = {}
    by_direction: dict[str, list[tuple[float, float]]] = {"HtoD": [], "DtoH": []}
    kernels: dict[Any, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        stream = (e.get("args") or {}).get("stream", e.get("tid"))
        direction = next((d for d in by_direction if d in e.get("name", "")), None)
        if e.get("cat") == "gpu_memcpy" and direction is not None:
            copies.setdefault(stream, []).append(span)
            by_direction[direction].append(span)
        elif e.get("cat") == "kernel":
            kernels.setdefault(stream, []).append(span)
    copy_time = sum(end - start for spans in copies.values() for start, end in spans)
    # A copy stream is one busier copying than computing: the default stream's few pageable copies
    # (a scalar moved to the device) leave it a compute stream, the copy streams' casts do not make
    # them compute streams.
    busy = {s: sum(end - start for start, end in spans) for s, spans in copies.items()}
    copy_streams = {s for s in copies if busy[s] > sum(end - start for start, end in kernels.get(s, []))}
    compute = [span for stream, spans in kernels.items() if stream not in copy_streams for span in spans]
    overlapped = sum(intervals_overlap(spans, compute) for spans in copies.values())
    out = {
        "copy_streams": sorted(map(str, copy_streams)),
        "compute_streams": sorted(map(str, set(kernels) - copy_streams)),
        "copy_us": copy_time,
        "copy_us_overlapping_compute": overlapped,
        "overlap_fraction": overlapped / copy_time if copy_time else 0.0,
    }
    for direction, spans in by_direction.items():
        total = sum(end - start for start, end in spans)
        out[f"{direction}_us"] = total
        out[f"{direction}_overlap_fraction"] = intervals_overlap(spans, compute) / total if total else 0.0
    return out


def _importable(module: str, env: dict[str, str]) -> bool:
    """Whether ``module`` imports under ``env``'s ``PYTHONPATH`` (the carried wheels included)."""
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    saved = list(sys.path)
    sys.path[:0] = paths
    try:
        return importlib.util.find_spec(module) is not None
    finally:
        sys.path[:] = saved


def unpack_wheels(folder: Path, into: Path) -> list[str]:
    """Install the wheels in ``folder`` (gpu_wheels.sh's) into the folder ``into`` with pip, offline
    (``--no-index --no-deps --target``): nothing in the environment changes, and ``into`` then goes
    on the steps' ``PYTHONPATH``. Returns the wheels' file names.

    Raises:
        subprocess.CalledProcessError: pip refused a wheel.
    """
    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                        "--target", str(into), *map(str, wheels)], check=True)
    return [w.name for w in wheels]


def step_env(site: Path) -> dict[str, str]:
    """The environment of every step: this one, with the repository and the wheels installed in
    ``site`` on ``PYTHONPATH`` (their programs on ``PATH``), and one Triton cache that the steps
    (separate processes) share."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), str(site),
                                                                   os.environ.get("PYTHONPATH")])),
               # The wheels' programs (ninja, which DeepSpeed's JIT build of its CPU Adam runs).
               PATH=os.pathsep.join(filter(None, [str(site / "bin"), os.environ.get("PATH")])))
    env.setdefault("TRITON_CACHE_DIR", str(TRITON_CACHE))
    return env


def prerequisites(args: argparse.Namespace, env: dict[str, str], wheels: list[str]) -> dict[str, Any]:
    """What the steps rely on, found in seconds: versions, the device, which packages import."""
    found: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "wheels": wheels}
    for module in ("triton", "lightning", "transformers", "peft", "pytest", "deepspeed", *MAIN_JOB_NEEDS):
        found[module] = _importable(module, env)
    if args.device != "cpu":
        # Properties only: mem_get_info would create a CUDA context that this process then holds
        # through every step.
        props = torch.cuda.get_device_properties(0)
        found.update(device=props.name, capability=f"{props.major}.{props.minor}", gpu_total_bytes=props.total_memory)
    cache = Path(env["TRITON_CACHE_DIR"])
    found["triton_cache"] = {"dir": str(cache), "kernels_before": sum(1 for _ in cache.glob("*/__grp__*.json"))}
    found["ok"] = bool(found["pytest"] and found["lightning"] and (args.device == "cpu" or found["triton"]))
    return found


def _child_step(name: str, args: argparse.Namespace, argv: list[str], work: Path, timeout: float,
                env: dict[str, str]) -> dict[str, Any]:
    """Run an in-process step (ledger, overlap) in a child process of this script, so that the
    budget's timeout can stop it; what it saved before a timeout is kept (``"partial": true``)."""
    out = work / f"{name}.json"
    code, tail = _run([sys.executable, str(Path(__file__).resolve()), *argv, "--run-step", name,
                       "--step-out", str(out)], timeout, env)
    saved = json.loads(out.read_text()) if out.exists() else {}
    if code is None:
        return {**saved, "ok": False, "error": f"timed out after {timeout:.0f} s", "partial": bool(saved),
                "tail": tail}
    if code or not saved:
        return {**saved, "ok": False, "error": f"exited {code}" + ("" if saved else " without a result"), "tail": tail}
    return saved


def keep_triton_cache(args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    """Copy the steps' Triton cache beside ``--out`` (``<stem>_triton_cache/``), so a later run on a
    machine of the same kind and image, given it back as ``.triton_cache/``, compiles nothing."""
    cache, copy = Path(env["TRITON_CACHE_DIR"]), kept(args, "triton_cache")
    if cache.is_dir():
        shutil.copytree(cache, copy, dirs_exist_ok=True)
    return {"dir": str(copy), "kernels": sum(1 for _ in copy.glob("*/__grp__*.json"))}


def _write_step_result(path: str, result: dict[str, Any]) -> None:
    """Replace ``path`` with ``result`` at once (a reader never sees half a file)."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)


IN_PROCESS = {"ledger": step_ledger, "overlap": step_overlap}
SUBPROCESS = {"suite": step_suite, "main_job": step_main_job, "nccl": step_nccl, "kernels": step_kernels,
              "offload": step_offload}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.run_step:  # a child process running one in-process step
        with tempfile.TemporaryDirectory() as tmp:
            result = IN_PROCESS[args.run_step](args, Path(tmp), lambda got: _write_step_result(args.step_out, got))
        _write_step_result(args.step_out, result)
        return 0
    deadline = time.monotonic() + args.budget
    if args.device != "cpu" and not torch.cuda.is_available():
        print("gpu_check.py needs a CUDA GPU; none is visible.", file=sys.stderr)
        return 2
    skip = {s for s in args.skip.split(",") if s}
    unknown = skip - set(STEPS)
    if unknown:
        print(f"--skip: unknown step(s) {sorted(unknown)}; choose among {', '.join(STEPS)}.", file=sys.stderr)
        return 2
    out = Path(args.out)
    results: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "budget_s": args.budget,
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        site = work / "site"
        wheels = unpack_wheels(WHEELS, site)
        env = step_env(site)
        results["prerequisites"] = prerequisites(args, env, wheels)
        out.write_text(json.dumps(results, indent=1))
        print(f"prerequisites: {'ok' if results['prerequisites']['ok'] else 'MISSING'} "
              f"({json.dumps(results['prerequisites'])})", flush=True)
        for name in STEPS:
            if name in skip:
                continue
            left = deadline - time.monotonic()
            timeout = min(STEP_CAP_S[name], left - 5)
            if timeout < MIN_STEP_S:
                results[name] = {"ok": False, "skipped": f"out of time ({left:.0f} s of the budget left)"}
            else:
                start = time.perf_counter()
                try:
                    if name in SUBPROCESS:
                        results[name] = SUBPROCESS[name](args, work, timeout, env)
                    else:
                        results[name] = _child_step(name, args, argv, work, timeout, env)
                except Exception as exc:  # a step's failure is a result; the next steps still run
                    results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                results[name]["seconds_total"] = time.perf_counter() - start
            results["triton_cache"] = keep_triton_cache(args, env)
            out.write_text(json.dumps(results, indent=1))  # whatever happens next, this much is kept
            # A string "skipped" is a step not run; a pytest step's "skipped" is a count of tests.
            not_run = isinstance(results[name].get("skipped"), str)
            state = "ok" if results[name].get("ok") else ("skipped" if not_run else "FAILED")
            print(f"{name}: {state} ({results[name].get('seconds_total', 0):.0f} s)", flush=True)
    print(f"wrote {out}")
    return 0 if all(results[n].get("ok") for n in STEPS if n not in skip) else 1


if __name__ == "__main__":
    raise SystemExit(main())
