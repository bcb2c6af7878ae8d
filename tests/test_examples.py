"""The main example's data: the Python stdlib's own sources, split deterministically by package."""

from __future__ import annotations

import os
import signal
import sys
import sysconfig
from pathlib import Path

import pytest

from examples.pretrain import stdlib_sources


def test_split_is_deterministic_and_holds_out_the_package(tmp_path: Path) -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val = stdlib_sources(root, held_out="json")
    assert (train, val) == stdlib_sources(root, held_out="json")
    expected_val = b"".join((p.read_bytes() + b"\n\n") for p in sorted((root / "json").rglob("*.py")))
    assert val == expected_val
    assert (root / "json" / "decoder.py").read_bytes() not in train
    assert (root / "textwrap.py").read_bytes() in train
    assert len(train) > 10 * len(val)


def test_unknown_held_out_package(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="No stdlib file under package 'nope'"):
        stdlib_sources(tmp_path, held_out="nope")


def test_gpu_check_refuses_without_cuda_and_its_steps_run_on_the_cpu(tmp_path: Path, capsys) -> None:
    """``gpu_check.py`` exits 2 without CUDA; its ledger and overlap steps run their code on the
    CPU (a small GPT), and the overlap arithmetic is right on a hand-made trace."""
    import json

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "benchmarks"))
    import gpu_check

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: run gpu_check.py itself")
    assert gpu_check.main(["--out", str(tmp_path / "x.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err and not (tmp_path / "x.json").exists()
    args = gpu_check.parse_args(["--device", "cpu", "--d-model", "32", "--layers", "2",
                                 "--trace", str(tmp_path / "trace.json")])
    saved = []
    ledger = gpu_check.step_ledger(args, tmp_path, lambda got: saved.append(json.loads(json.dumps(got))))
    assert ledger["ok"] and all(len(ledger[c]["ledger_peak_bytes"]) == 4 for c in ("plain", "bf16", "cpu_offload"))
    # Each configuration is saved as soon as it is measured (a timeout keeps the finished ones).
    assert [sorted(s) for s in saved] == [["ok", "plain"], ["bf16", "ok", "plain"], ["bf16", "cpu_offload", "ok", "plain"]]
    assert ledger["cpu_offload"]["ledger_peak_bytes"][-1] < ledger["plain"]["ledger_peak_bytes"][-1]
    overlap = gpu_check.step_overlap(args, tmp_path)
    assert (tmp_path / "trace.json").exists() and overlap["copy_us"] == 0 and not overlap["ok"]  # no device on a CPU
    copy = {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "args": {"stream": 9}}
    kernel = {"ph": "X", "cat": "kernel", "name": "gemm"}
    # Copies on stream 9 at [0, 10) and [20, 30); compute on stream 7 at [5, 25): 10 µs overlap.
    # The kernel on stream 9 (a copy stream's own cast) is not compute; the default stream's tiny
    # pageable copy (a scalar moved to the device, as on the H100) leaves it a compute stream.
    events = [{**copy, "ts": 0, "dur": 10}, {**copy, "ts": 20, "dur": 10},
              {**copy, "ts": 40, "dur": 1, "args": {"stream": 7}},
              {**kernel, "ts": 5, "dur": 20, "args": {"stream": 7}}, {**kernel, "ts": 0, "dur": 3, "args": {"stream": 9}}]
    got = gpu_check.copy_overlap(events)
    assert (got["copy_us"], got["copy_us_overlapping_compute"]) == (21.0, 10.0)
    assert got["compute_streams"] == ["7"] and got["copy_streams"] == ["9"]
    assert (got["HtoD_us"], got["HtoD_overlap_fraction"], got["DtoH_us"]) == (21.0, 10.0 / 21.0, 0.0)


def test_gpu_check_keeps_to_its_budget_and_writes_after_every_step(tmp_path: Path) -> None:
    """The driver, on the CPU: the prerequisites and each step land in the JSON as they finish
    (steps in child processes; the offload benchmark's JSON beside it, the Triton cache copied
    there); a budget too small for any step records every step as skipped instead of starting it; a
    step past its timeout is killed with its whole process group."""
    import json
    import os
    import time

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "benchmarks"))
    import gpu_check

    out = tmp_path / "check.json"
    small = ["--device", "cpu", "--d-model", "32", "--layers", "2", "--trace", str(tmp_path / "trace.json"),
             "--skip", "suite,main_job,nccl,kernels", "--out", str(out),
             "--offload-args", "--only deepspeed_offload"]  # its arms run in test_offload_gpu_benchmark_dry_run...
    assert gpu_check.main(small) == 1  # the overlap step finds no device copies on a CPU
    got = json.loads(out.read_text())
    assert got["prerequisites"]["ok"] and got["prerequisites"]["pytest"]
    assert got["ledger"]["ok"] and got["ledger"]["seconds_total"] > 0
    assert not got["overlap"]["ok"] and got["overlap"]["copy_us"] == 0 and "suite" not in got
    assert got["offload"]["ok"] and got["offload"]["results"]["arms"]["deepspeed_offload"]["status"] == "not run"
    assert json.loads((tmp_path / "check_offload_gpu.json").read_text()) == got["offload"]["results"]
    assert got["triton_cache"]["dir"] == str(tmp_path / "check_triton_cache")

    assert gpu_check.main([*small, "--budget", "10"]) == 1
    got = json.loads(out.read_text())
    assert all(got[name]["skipped"].startswith("out of time") for name in ("ledger", "overlap", "offload"))

    start = time.monotonic()
    code, _ = gpu_check._run(["bash", "-c", f"sleep 60 & echo $! > {tmp_path / 'child'}; wait"], timeout=2)
    assert code is None and time.monotonic() - start < 30
    child = int((tmp_path / "child").read_text())
    time.sleep(0.5)
    assert not os.path.exists(f"/proc/{child}") or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]


def _run_example(*args: str) -> str:
    import subprocess

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "examples" / "peft_lora.py"), *args], cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _losses(out: str) -> tuple[float, float]:
    line = next(line for line in out.splitlines() if line.startswith("loss over the first 5 steps"))
    words = line.replace(",", "").split()
    return float(words[6]), float(words[-1])


def test_peft_lora_example_end_to_end(tmp_path: Path) -> None:
    """examples/peft_lora.py at 2 ranks: a sharded Hugging Face checkpoint loaded into a PEFT
    model built on the meta device, LoRA fine-tuning that lowers the loss, generate() in
    predict_step, adapters exported and reloaded with PeftModel.from_pretrained generating the
    same bytes; and with the frozen base stored as INT8 codes (frozen_bits=8)."""
    out = _run_example("--out", str(tmp_path / "fp32"), "--steps", "12")
    first, last = _losses(out)
    assert last < first
    assert "PeftModel.from_pretrained generates the same bytes: True" in out
    assert (tmp_path / "fp32" / "adapters" / "adapter_model.safetensors").is_file()
    first, last = _losses(_run_example("--out", str(tmp_path / "int8"), "--steps", "12", "--frozen-bits", "8"))
    assert last < first


def test_unit_cost_contenders_train_alike(tmp_path: Path) -> None:
    """``unit_cost.py`` times each contender on the same updates: every contender's losses must
    equal DDP's step for step (the benchmark once timed a zinf engine whose optimizer stepped the
    empty parameters instead of the shards: its loss never moved, and its time was no unit cost)."""
    import json
    import subprocess

    out = tmp_path / "unit_cost.json"
    script = Path(__file__).resolve().parents[1] / "examples" / "benchmarks" / "unit_cost.py"
    subprocess.run([sys.executable, str(script), "--layers", "3", "--steps", "5", "--lr", "0.5", "--out", str(out)],
                   check=True, capture_output=True, timeout=600)
    results = json.loads(out.read_text())["results"]
    ddp = results["ddp"]["losses"]
    assert ddp[0] - ddp[-1] > 1e-3  # the updates move the loss well past the tolerance below
    for name in ("zinf", "fsdp2"):
        assert results[name]["status"] == "ok", results[name].get("error")
        assert results[name]["loss_gap_to_ddp"] <= 1e-5, (name, results[name]["losses"], ddp)


def test_engine_loop_example_gives_ddp_losses(tmp_path: Path) -> None:
    """``torchrun -m examples.engine_loop``, the loop without Lightning of docs/engine-loop.md, as a user runs it:
    its losses equal the same loop's under DDP (the reference), the loss falls, and the sharded
    checkpoint it ends with is on disk."""
    import re
    import subprocess

    root = Path(__file__).resolve().parents[1]

    def run(*extra: str) -> list[float]:
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "examples.engine_loop",
             "--steps", "5", "--d-model", "32", "--layers", "1", "--seq-len", "32",
             "--checkpoint", str(tmp_path / "ckpt"), *extra],
            cwd=root, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        return [float(x) for x in re.findall(r"^step +\d+ +loss (\S+)", done.stdout, re.M)]

    zinf, ddp = run(), run("--ddp")
    assert len(zinf) == len(ddp) == 2  # steps 1 and 5
    assert zinf == pytest.approx(ddp, abs=1e-5)
    assert zinf[1] < zinf[0] - 0.1
    assert sorted(p.name for p in (tmp_path / "ckpt").rglob("*") if p.is_file()) == [
        "meta.pt", "rank_00000.safetensors", "rank_00001.safetensors"]


def test_gpu_check_steps_share_one_triton_cache_that_outlives_the_run(tmp_path: Path, monkeypatch) -> None:
    """Every step of ``gpu_check.py`` (a process of its own) gets the same ``TRITON_CACHE_DIR``:
    a folder of the checkout, not the run's temporary folder, so a kernel compiled by one step is
    found by the next (``test_kernel_compile.py`` checks that a second process finds it), and by
    a later run; a cache the caller chose is kept; the cache is copied beside the check's JSON."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "benchmarks"))
    import gpu_check

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    env = gpu_check.step_env(tmp_path / "site")
    assert env["TRITON_CACHE_DIR"] == str(gpu_check.REPO_ROOT / ".triton_cache")
    assert str(tmp_path / "site") in env["PYTHONPATH"].split(os.pathsep)
    assert env["PATH"].split(os.pathsep)[0] == str(tmp_path / "site" / "bin")
    (tmp_path / "mine" / "0123").mkdir(parents=True)
    (tmp_path / "mine" / "0123" / "__grp___quantize_kernel.json").write_text("{}")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    env = gpu_check.step_env(tmp_path / "site")
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
    found = gpu_check.prerequisites(gpu_check.parse_args(["--device", "cpu"]), env, [])
    assert found["triton_cache"] == {"dir": str(tmp_path / "mine"), "kernels_before": 1}
    # After every step the cache is copied beside the check's JSON, to be carried to the next run.
    copied = gpu_check.keep_triton_cache(gpu_check.parse_args(["--out", str(tmp_path / "out" / "gc.json")]), env)
    assert copied == {"dir": str(tmp_path / "out" / "gc_triton_cache"), "kernels": 1}
    assert (tmp_path / "out" / "gc_triton_cache" / "0123" / "__grp___quantize_kernel.json").read_text() == "{}"


def test_offload_gpu_benchmark_dry_run_on_the_cpu(tmp_path: Path) -> None:
    """``offload_gpu.py`` end to end on the CPU (tiny GPT, no cap), as a user runs it: every arm is
    in its JSON, those that ran with finite figures and the losses of FSDP2's CPU offload (the
    reference: the same seeded model and tokens), the device figures null with the reason, and
    DeepSpeed recorded as not run with the reason rather than dropped. Its device-time and peak
    arithmetic on hand-made input."""
    import json
    import math
    import subprocess

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "offload_gpu.json"
    done = subprocess.run(
        [sys.executable, str(root / "examples" / "benchmarks" / "offload_gpu.py"), "--device", "cpu", "--d-model", "32",
         "--layers", "2", "--heads", "2", "--vocab", "64", "--seq-len", "16", "--batch", "2", "--steps", "3",
         "--out", str(out)],
        cwd=root, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(root)))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert list(got["arms"]) == ["zinf_offload", "fsdp2_offload", "zinf_param_cpu", "deepspeed_offload", "zinf_planned"]
    reference = got["arms"]["fsdp2_offload"]["losses"]
    for name in ("zinf_offload", "fsdp2_offload", "zinf_param_cpu", "zinf_planned"):
        arm = got["arms"][name]
        assert arm["status"] == "ok", arm
        assert len(arm["step_times_s"]) == 3 and len(arm["losses"]) == 4  # 3 steps and the profiled one
        for key in ("mean_step_s", "tokens_per_s", "model_tflops", "peak_rss_mib"):
            assert math.isfinite(arm[key]) and arm[key] > 0, (name, key, arm[key])
        assert arm["device_idle_fraction"] is None and "CPU run" in arm["device_idle_reason"]
        assert arm["mfu"] is None and arm["parameters"] == got["model"]["parameters"]
        assert arm["optimizer"] == "AdamW(fused=True)"
        assert arm["losses"] == pytest.approx(reference, rel=1e-3), name
    assert got["arms"]["deepspeed_offload"] == {
        "status": "not run", "reason": "DeepSpeed ZeRO-Offload moves its partitions to a CUDA device; this is a CPU run"}
    assert set(got["ratios"]) == {"zinf_offload/fsdp2_offload", "zinf_param_cpu/fsdp2_offload",
                                  "zinf_planned/fsdp2_offload"}
    # The planned arm records its plan: on the CPU, with room for everything, nothing is offloaded.
    assert got["arms"]["zinf_planned"]["plan"]["placement"] == "param=none, optimizer=none"

    sys.path.insert(0, str(root / "examples" / "benchmarks"))
    import offload_gpu

    assert [offload_gpu.peak_bf16_tflops(n) for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200",
                                                      "NVIDIA A100-SXM4-80GB", "Tesla T4")] == [989, 756, 989, 312, None]
    step = {"ph": "X", "cat": "user_annotation", "name": offload_gpu.STEP_ANNOTATION, "ts": 0, "dur": 100}
    # Device busy over [10, 50) (a kernel, and a copy on another stream overlapping it) and
    # [90, 100) (a kernel running past the step's end): idle half of the step, computing 30%.
    events = [step, {"ph": "X", "cat": "kernel", "ts": 10, "dur": 20}, {"ph": "X", "cat": "gpu_memcpy", "ts": 20, "dur": 30},
              {"ph": "X", "cat": "kernel", "ts": 90, "dur": 30}, {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 100}]
    assert offload_gpu.device_busy(events) == {"profiled_step_us": 100.0, "device_idle_fraction": 0.5,
                                               "compute_busy_fraction": 0.3}


def test_gpu_check_stops_pytest_so_that_it_keeps_the_finished_tests(tmp_path: Path, monkeypatch) -> None:
    """A pytest step past its timeout gets SIGINT before SIGKILL: pytest writes the JUnit XML of
    the tests that finished (kept beside the check's JSON), and the step says it timed out. With
    SIGKILL alone (the old harness) no XML is written and every test's result is lost. Also when
    the harness itself runs with SIGINT ignored (started in the background by a shell without job
    control, which the child would inherit)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "benchmarks"))
    import gpu_check

    (tmp_path / "test_slow.py").write_text(
        "import time\n\ndef test_a():\n    pass\n\ndef test_b():\n    pass\n\n"
        "def test_c():\n    time.sleep(120)\n")
    monkeypatch.setattr(gpu_check, "GRACE_S", 5)
    xml = tmp_path / "check_suite.xml"
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a background job starts
    try:
        got = gpu_check.run_pytest([str(tmp_path / "test_slow.py")], xml, timeout=25, env=dict(os.environ))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert got["timed_out"] and not got["ok"] and xml.exists()
    assert got["passed"] == 2 and got["failed"] == []
