"""Everything that has to be seen running on a CUDA GPU, in one command, with one JSON of results.

    python examples/benchmarks/gpu_check.py [--out gpu_check.json] [--steps 50] [--skip suite,kernels,...]

Steps (each recorded with its status, seconds and figures; a failing step does not stop the others):

  suite     ``pytest -m gpu tests``: the Triton kernels against their references, every engine
            feature at one rank on CUDA in an NCCL group, two ranks sharing the GPU through gloo
            (passed / failed / skipped, with the failures' names)
  kernels   ``kernels.py``: the quantization kernels' bandwidth against the device copy (its JSON)
  main_job  the README's main job on one GPU (``zinf fit`` with ``--trainer.devices 1``): wall time,
            last logged losses, ZeroMonitor's ledger peak next to ``max_memory_allocated``
  ledger    an engine over the examples' GPT (d_model 1024, 8 blocks) on CUDA, per configuration
            (plain, bf16, CPU offload): the ledger's device peak per step, the allocator's peak,
            and the difference (activations, autograd, allocator slack)
  overlap   a ``torch.profiler`` trace of three CPU-offload steps (parameters, optimizer and
            activations on the host): the Chrome trace file, and how much of the host<->device
            copy time runs while a compute kernel runs on another stream

Without CUDA it exits with status 2 and writes nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
sys.path.insert(0, str(REPO_ROOT))

STEPS = ("suite", "kernels", "main_job", "ledger", "overlap")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_check.json", help="the JSON of results (default gpu_check.json)")
    parser.add_argument("--trace", default="gpu_check_trace.json", help="the Chrome trace of the overlap step")
    parser.add_argument("--steps", type=int, default=50, help="training steps of the main job (default 50)")
    parser.add_argument("--skip", default="", help=f"comma-separated steps to leave out, among {','.join(STEPS)}")
    parser.add_argument("--d-model", type=int, default=1024, help="width of the GPT of the ledger and overlap steps")
    parser.add_argument("--layers", type=int, default=8, help="blocks of that GPT")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # "cpu": the tests' dry run of those steps
    return parser.parse_args(argv)


def _run(cmd: list[str], timeout: float) -> tuple[int, str]:
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, (proc.stdout + proc.stderr)[-4000:]


def step_suite(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    report = work / "suite.xml"
    code, tail = _run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests", f"--junitxml={report}",
                       "-p", "no:cacheprovider"], timeout=3600)
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {"ok": code == 0, **counts, "failed": failed, "tail": tail if code else ""}


def step_kernels(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    out = work / "kernels.json"
    code, tail = _run([sys.executable, str(HERE / "kernels.py"), "--out", str(out)], timeout=1800)
    return {"ok": code == 0, "results": json.loads(out.read_text()) if out.exists() else None,
            "tail": tail if code else ""}


def step_main_job(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    logs = work / "main_job"
    cmd = [sys.executable, "-m", "lightning_zinf.cli", "fit", "--config", "examples/configs/gpt_stdlib.yaml", "--trainer.accelerator", "gpu",
           "--trainer.devices", "1", "--trainer.max_steps", str(args.steps), "--trainer.default_root_dir", str(logs)]
    start = time.perf_counter()
    code, tail = _run(cmd, timeout=3600)
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
    ``args.device``; per step the ledger's device peak, the allocator's peak (bytes; 0 on the
    CPU) and the step's seconds. ``watch`` (a profiler) is entered after the first step, which
    records the prefetch trace, and left after the last."""
    from examples.gpt import GPT, GPTConfig
    from lightning_zinf import ZeroEngine

    torch.manual_seed(0)
    vocab, seq = 8192, 256
    model = GPT(GPTConfig(vocab_size=vocab, d_model=args.d_model, n_layers=args.layers, n_heads=16, seq_len=seq))
    engine = ZeroEngine(model, block_classes=["Block"], device=args.device, **config)
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    gen = torch.Generator().manual_seed(0)
    cuda = args.device != "cpu"
    ledger, allocated, seconds = [], [], []
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
        allocated.append(torch.cuda.max_memory_allocated() if cuda else 0)
    watching.close()
    engine.release_all()
    return {"ledger_peak_bytes": ledger, "max_allocated_bytes": allocated, "step_seconds": seconds}


def step_ledger(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from lightning_zinf import MixedPrecisionConfig, OffloadConfig

    configs = {"plain": {}, "bf16": {"mixed_precision": MixedPrecisionConfig(param_dtype="bf16")},
               "cpu_offload": {"offload": OffloadConfig(param="cpu", optimizer="cpu")}}
    out: dict[str, Any] = {"ok": True}
    for name, config in configs.items():
        run = _engine_steps(args, config, steps=4)
        run["unaccounted_bytes"] = [a - b for a, b in zip(run["max_allocated_bytes"], run["ledger_peak_bytes"])]
        run["ledger_within_allocator"] = all(0 < b <= a or args.device == "cpu"
                                             for a, b in zip(run["max_allocated_bytes"], run["ledger_peak_bytes"]))
        out["ok"] &= run["ledger_within_allocator"]
        out[name] = run
    return out


def _intervals_overlap(copies: list[tuple[float, float]], compute: list[tuple[float, float]]) -> float:
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


def step_overlap(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from lightning_zinf import OffloadConfig

    config = {"offload": OffloadConfig(param="cpu", optimizer="cpu", activations=True)}
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (args.device != "cpu")
    prof = profile(activities=activities)
    run = _engine_steps(args, config, steps=4, activations=True, watch=prof)  # steps 2-4 profiled
    trace = Path(args.trace).resolve()
    prof.export_chrome_trace(str(trace))
    overlap = copy_overlap(json.loads(trace.read_text()).get("traceEvents", []))
    return {"ok": overlap["copy_us_overlapping_compute"] > 0, "trace": str(trace), **overlap,
            "step_seconds": run["step_seconds"]}


def copy_overlap(events: list[dict]) -> dict[str, Any]:
    """From a Chrome trace's events: the host<->device copy time (µs), how much of it runs while
    a compute kernel runs (a kernel on a stream that carries no copy: the copy streams' own casts
    are not compute), and the streams of each."""
    copies: dict[Any, list[tuple[float, float]]] = {}
    kernels: dict[Any, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        stream = (e.get("args") or {}).get("stream", e.get("tid"))
        if e.get("cat") == "gpu_memcpy" and ("HtoD" in e.get("name", "") or "DtoH" in e.get("name", "")):
            copies.setdefault(stream, []).append(span)
        elif e.get("cat") == "kernel":
            kernels.setdefault(stream, []).append(span)
    copy_time = sum(end - start for spans in copies.values() for start, end in spans)
    compute = [span for stream, spans in kernels.items() if stream not in copies for span in spans]
    overlapped = sum(_intervals_overlap(spans, compute) for spans in copies.values())
    return {
        "copy_streams": sorted(map(str, copies)),
        "compute_streams": sorted(map(str, kernels)),
        "copy_us": copy_time,
        "copy_us_overlapping_compute": overlapped,
        "overlap_fraction": overlapped / copy_time if copy_time else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check.py needs a CUDA GPU; none is visible.", file=sys.stderr)
        return 2
    skip = {s for s in args.skip.split(",") if s}
    unknown = skip - set(STEPS)
    if unknown:
        print(f"--skip: unknown step(s) {sorted(unknown)}; choose among {', '.join(STEPS)}.", file=sys.stderr)
        return 2
    results: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "host": platform.node(),
    }
    steps = {"suite": step_suite, "kernels": step_kernels, "main_job": step_main_job, "ledger": step_ledger,
             "overlap": step_overlap}
    with tempfile.TemporaryDirectory() as tmp:
        for name, run in steps.items():
            if name in skip:
                continue
            start = time.perf_counter()
            try:
                results[name] = run(args, Path(tmp))
            except Exception as exc:  # a step's failure is a result; the next steps still run
                results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            results[name]["seconds_total"] = time.perf_counter() - start
            print(f"{name}: {'ok' if results[name].get('ok') else 'FAILED'} ({results[name]['seconds_total']:.0f} s)", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")
    return 0 if all(results[n].get("ok") for n in steps if n not in skip) else 1


if __name__ == "__main__":
    raise SystemExit(main())
