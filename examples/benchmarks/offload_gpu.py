"""One GPU, a GPT too large for it under a memory cap, trained in bf16 with CPU offload: the
benchmark a user would compare, lightning_zinf against FSDP2's and DeepSpeed's CPU offload.

Arms (each in a process of its own, in this order; the JSON is rewritten as soon as each finishes,
so a run cut short keeps the arms it finished):

  zinf_offload       ZeroEngine(offload=OffloadConfig(param="none", optimizer="cpu")), bf16 gathers
                     (MixedPrecisionConfig(param_dtype="bf16"), what Lightning's "bf16-mixed" gives
                     the strategy): ZeRO-Offload's layout (parameters on the device, fp32 masters,
                     gradients and AdamW state in host memory, the step on the CPU)
  fsdp2_offload      torch's fully_shard at world size 1 on every block and the root with
                     CPUOffloadPolicy() and MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32):
                     parameters, gradients and AdamW state in page-locked host memory, the step on the CPU
  zinf_param_cpu     ZeroEngine(offload=OffloadConfig(param="cpu", optimizer="cpu")), bf16 gathers:
                     FSDP2's layout (parameter shards on the host too)
  zinf_planned       the options a user writes instead of tiers: memory_budget at the cap (less
                     ALLOCATOR_SLACK), bf16 gathers, one micro-batch as example_input_array: the
                     plan chooses the tiers, the optimizer state kept on the device (device_bytes)
                     and each block's activations (kept, offloaded or checkpointed); its plan is
                     recorded
  deepspeed_offload  DeepSpeed ZeRO-Offload: ZeRO stage 2, "offload_optimizer": {"device": "cpu"},
                     "bf16": {"enabled": true}, its DeepSpeedCPUAdam (JIT-built with the host's
                     compiler on first use). Recorded as not run, with the reason, where DeepSpeed
                     does not import or there is no CUDA device; its log tail where it fails.

Every arm: the examples' GPT (--d-model, --layers, --vocab, --seq-len), the same seeded initial
values and random tokens, micro-batch --batch, forward and loss under bf16 autocast, AdamW
(lr 1e-4, weight decay 0.01; torch's fused CPU AdamW where torch runs the step, its for-loop
form where fused is refused, as each arm's "optimizer" says). Before anything
else each arm caps its allocator at --cap-gib (``torch.cuda.set_per_process_memory_fraction``);
plain bf16-mixed training would need 16 bytes per parameter of states alone (bf16 weights and
gradients, fp32 masters, two AdamW moments) plus activations, recorded next to the cap.

Measured per arm (the first 2 steps are warm-up):
  - tokens/s: batch x seq-len / mean wall time of the timed steps (each ends with a device sync);
  - model TFLOPS: (6 N + 12 L d s) FLOPs per token x tokens/s, N every parameter counted once, the
    second term the attention score and value products of PaLM's appendix B (Chowdhery et al. 2022;
    not halved for the causal mask); MFU: that over the device's dense bf16 peak, looked up by
    ``torch.cuda.get_device_name()`` (H100 SXM and H200 989, H100 PCIe 756, H100/H200 NVL 835,
    A100 312 TFLOPS; null for another device);
  - ``max_memory_allocated`` and ``max_memory_reserved`` over the training steps (bytes);
  - host RSS: the arm process's peak resident set size (MiB);
  - device idle fraction: one more step under ``torch.profiler``: 1 - (the union of the device's
    kernel, memcpy and memset intervals within the step) / the step's wall time; and the compute-busy
    fraction (kernels only). Null on a CPU run, with the reason.

Goals (issue 39): zinf >= 1.5x fsdp2_offload's tokens/s at <= its max_memory_allocated, and
>= 1.0x deepspeed_offload's tokens/s; ``ratios`` in the JSON gives both for each zinf arm.

    python examples/benchmarks/offload_gpu.py [--only zinf_offload,fsdp2_offload] [--budget 230]
        [--cap-gib 16] [--d-model 2048 --layers 16 --batch 4 --seq-len 1024] [--out PATH]

The defaults (875M parameters) are sized for one H100/H200 and about 4 minutes of device time in
all. ``--device cpu`` is the tests' dry run (tiny model, no cap, no device figures).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gpu_check import intervals_overlap  # noqa: E402
from measure import LR, SEED, peak_rss_mib, run_killable, run_record  # noqa: E402
from throughput import REPO_ROOT, WARMUP_STEPS, benchmark_parser, check_args, error_line, log_tail  # noqa: E402

ARMS = ("zinf_offload", "fsdp2_offload", "zinf_param_cpu", "deepspeed_offload", "zinf_planned")  # most valuable first
OURS = ("zinf_offload", "zinf_param_cpu", "zinf_planned")
#: What zinf_planned's budget leaves below the allocator's cap: cuBLAS's workspace (up to 32 MiB on
#: sm_90) and kernels' scratch, which the plan does not count.
ALLOCATOR_SLACK = 256 << 20
PEERS = ("fsdp2_offload", "deepspeed_offload")
#: Dense bf16 tensor-core peaks (TFLOPS, no sparsity) from NVIDIA's data sheets, by a substring of
#: ``torch.cuda.get_device_name()``, the more specific names first.
PEAK_BF16_TFLOPS = (("H200 NVL", 835.0), ("H200", 989.0), ("H100 NVL", 835.0), ("H100 PCIe", 756.0),
                    ("H100", 989.0), ("A100", 312.0))
#: Bytes per parameter that plain bf16-mixed AdamW training keeps on the device besides activations.
PLAIN_STATE_BYTES = 16
#: Device activity in a Chrome trace of ``torch.profiler`` (the device's own annotations excluded).
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
STEP_ANNOTATION = "offload_gpu.step"
GOALS = {"fsdp2_offload": {"tokens_per_s": 1.5, "max_memory_allocated": 1.0}, "deepspeed_offload": {"tokens_per_s": 1.0}}


def parse_args(argv: list[str] | None = None):
    """The driver's options (throughput.py's, with this benchmark's model, cap and budget)."""
    parser = benchmark_parser(__doc__, ARMS, HERE / "results" / "offload_gpu.json")
    parser.set_defaults(steps=5, timeout=150)
    parser.add_argument("--budget", type=float, default=230, help="seconds for every arm together (default: %(default)s)")
    parser.add_argument("--cap-gib", type=float, default=16.0,
                        help="the allocator's cap per arm, GiB (set_per_process_memory_fraction; default: %(default)s)")
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (default: %(default)s)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the tests' dry run (no cap, no device figures)")
    parser.add_argument("--arm", choices=ARMS, help="(internal) run this arm in this process")
    parser.add_argument("--result", type=Path, help="(internal) where the arm writes its result")
    args = parser.parse_args(argv)
    if args.arm is None:
        check_args(parser, args, ARMS)
    return args


def peak_bf16_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of the device called ``device_name``, TFLOPS; None when not listed."""
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in device_name), None)


def flops_per_token(parameters: int, layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 N for the weights' products forward and backward, plus
    12 L d s for attention's score and value products (PaLM, appendix B; causal mask not halved)."""
    return 6 * parameters + 12 * layers * d_model * seq_len


def not_runnable(arm: str, args) -> str | None:
    """Why ``arm`` cannot run here, or None: DeepSpeed's ZeRO-Offload needs CUDA, and DeepSpeed
    importable by ``--python-deepspeed`` with this checkout's ``PYTHONPATH``."""
    if arm != "deepspeed_offload":
        return None
    if args.device != "cuda":
        return "DeepSpeed ZeRO-Offload moves its partitions to a CUDA device; this is a CPU run"
    cmd, env = _arm_command(args, arm, Path(os.devnull))
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('deepspeed') is None)"
    if subprocess.run([cmd[0], "-c", probe], env=env).returncode:
        return (f"deepspeed is not importable by {cmd[0]} (carry its wheels: "
                "`bash examples/benchmarks/gpu_wheels.sh --deepspeed`, docs/tests.md)")
    return None


# --- one arm, in its own process ------------------------------------------------------------------

def _model(args):
    from examples.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                    seq_len=args.seq_len)
    torch.manual_seed(SEED)
    return GPT(cfg)


#: Which AdamW each arm got (``_adamw``), reported with its figures.
OPTIMIZER: dict[str, str] = {}


def _adamw(params) -> torch.optim.Optimizer:
    """torch's fused AdamW (lr 1e-4, weight decay 0.01); its for-loop form where fused is refused
    for these parameters (recorded in ``OPTIMIZER``: a one-shot GPU run should not lose the arm)."""
    params = list(params)
    try:
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.01, fused=True)
        OPTIMIZER["optimizer"] = "AdamW(fused=True)"
    except RuntimeError as err:
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.01, foreach=False)
        OPTIMIZER["optimizer"] = f"AdamW(foreach=False): fused refused ({str(err).splitlines()[0][:160]})"
    return opt


def _train_step(model, opt: torch.optim.Optimizer, device: str,
                unfused: Optional[Callable[[], torch.optim.Optimizer]] = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """Forward and loss under bf16 autocast, backward, ``opt`` steps: a step of ``tokens``
    (batch, seq + 1), returning the loss. ``unfused``: builds the for-loop AdamW that replaces
    ``opt`` if its first step refuses the parameters (the fused kernel is checked only there for
    some parameter kinds, e.g. FSDP2's CPU-offloaded DTensors)."""
    from examples.gpt import lm_loss

    current = [opt]

    def step(tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        try:
            current[0].step()
        except RuntimeError as err:
            if unfused is None or current[0] is not opt or not opt.defaults.get("fused"):
                raise
            current[0] = unfused()
            OPTIMIZER["optimizer"] = f"AdamW(foreach=False): fused refused at its first step ({str(err).splitlines()[0][:160]})"
            current[0].step()
        current[0].zero_grad()
        return loss

    return step


def _zinf(model, args, param: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A train step of ``model`` under a ZeroEngine with the optimizer on the CPU, parameters on ``param``."""
    from lightning_zinf import MixedPrecisionConfig, OffloadConfig, ZeroEngine

    engine = ZeroEngine(model, block_classes=["Block"], device=args.device,
                        offload=OffloadConfig(param=param, optimizer="cpu"),
                        mixed_precision=MixedPrecisionConfig(param_dtype="bf16"))
    return _train_step(model, engine.shard_optimizer(_adamw(model.parameters())), args.device)


def _zinf_planned(model, args, plan: dict) -> Callable[[torch.Tensor], torch.Tensor]:
    """A train step of ``model`` under the engine ``memory_budget`` plans (as the strategies build
    it); ``plan`` gets the plan's summary."""
    from lightning_zinf import MixedPrecisionConfig
    from lightning_zinf.engine_setup import build_engine
    from lightning_zinf.options import ZeroOptions

    budget = int(args.cap_gib * (1 << 30)) - ALLOCATOR_SLACK
    model.example_input_array = torch.zeros(args.batch, args.seq_len, dtype=torch.long)
    options = ZeroOptions(block_classes=["Block"], memory_budget=budget,
                          mixed_precision=MixedPrecisionConfig(param_dtype="bf16"))
    engine = build_engine(model, options, device=torch.device(args.device), ranks_per_node=1,
                          precision=MixedPrecisionConfig(), loss_scaling=False, timeout=None, auto_pass=True)
    memory_plan = engine.memory_plan
    plan.update(budget=budget, placement=memory_plan.placement.describe(), kept_blocks=memory_plan.kept_blocks,
                offloaded_blocks=memory_plan.offloaded_blocks, predicted_device=memory_plan.prediction.device,
                predicted_activations=memory_plan.activations,
                predicted_step_s=memory_plan.step.total if memory_plan.step is not None else None,
                predicted_terms=memory_plan.step.describe() if memory_plan.step is not None else None,
                bandwidths=dataclasses.asdict(memory_plan.bandwidths))
    return _train_step(model, engine.shard_optimizer(_adamw(model.parameters())), args.device)


def _init_world(backend: str) -> None:
    """A one-process group (what fully_shard and DeepSpeed need at world size 1)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group(backend)


def _fsdp2(model, args) -> Callable[[torch.Tensor], torch.Tensor]:
    """A train step of ``model`` under fully_shard with CPUOffloadPolicy at world size 1."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    cuda = args.device == "cuda"
    _init_world("nccl" if cuda else "gloo")
    mesh = init_device_mesh(args.device, (1,))
    policy = {"mesh": mesh, "offload_policy": CPUOffloadPolicy(pin_memory=cuda),
              "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    for block in model.blocks:
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    params = list(model.parameters())
    return _train_step(model, _adamw(params), args.device,
                       unfused=lambda: torch.optim.AdamW(params, lr=LR, weight_decay=0.01, foreach=False))


def _deepspeed(model, args) -> Callable[[torch.Tensor], torch.Tensor]:
    """A train step of ``model`` under DeepSpeed ZeRO-Offload (stage 2, optimizer on the CPU, bf16)."""
    import deepspeed

    from examples.gpt import lm_loss

    _init_world("nccl" if args.device == "cuda" else "gloo")
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "steps_per_print": 1_000_000,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast(args.device, dtype=torch.bfloat16):
            loss = lm_loss(engine(tokens[:, :-1]), tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        return loss

    return step


def device_busy(events: list[dict]) -> dict[str, float]:
    """From a Chrome trace of profiled steps (each inside a ``STEP_ANNOTATION`` range that ends with
    a device sync): the steps' wall time (µs), and the fractions of it the device spent idle (no
    kernel, memcpy or memset running) and running kernels."""
    steps = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
             if e.get("ph") == "X" and e.get("name") == STEP_ANNOTATION and e.get("cat") == "user_annotation"]
    spans = {cat: [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                   if e.get("ph") == "X" and e.get("cat") == cat and "dur" in e] for cat in DEVICE_CATEGORIES}
    wall = sum(end - start for start, end in steps)
    busy = intervals_overlap(steps, [s for cat in DEVICE_CATEGORIES for s in spans[cat]])
    computing = intervals_overlap(steps, spans["kernel"])
    return {"profiled_step_us": wall, "device_idle_fraction": 1 - busy / wall if wall else None,
            "compute_busy_fraction": computing / wall if wall else None}


def _profiled_step(step: Callable[[], Any], device: str, trace: Path) -> dict[str, Any]:
    """One more step under ``torch.profiler`` (host and device activity), reduced by :func:`device_busy`."""
    if device != "cuda":
        step()
        return {"device_idle_fraction": None, "compute_busy_fraction": None,
                "device_idle_reason": "CPU run: there is no device activity to profile"}
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function(STEP_ANNOTATION):
            step()
    prof.export_chrome_trace(str(trace))
    return device_busy(json.loads(trace.read_text()).get("traceEvents", []))


def run_arm(args) -> dict[str, Any]:
    """Train ``args.arm`` for ``args.steps`` steps plus one profiled step; its figures (module docstring)."""
    cuda = args.device == "cuda"
    cap = int(args.cap_gib * (1 << 30))
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    model = _model(args)
    parameters = sum(p.numel() for p in model.parameters())
    plan: dict[str, Any] = {}
    build = {"zinf_offload": lambda: _zinf(model, args, "none"), "zinf_param_cpu": lambda: _zinf(model, args, "cpu"),
             "zinf_planned": lambda: _zinf_planned(model, args, plan), "fsdp2_offload": lambda: _fsdp2(model, args), "deepspeed_offload": lambda: _deepspeed(model, args)}
    train_step = build[args.arm]()
    gen = torch.Generator().manual_seed(SEED + 1)
    losses, times = [], []

    def step() -> None:
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=gen).to(args.device)
        start = time.perf_counter()
        loss = train_step(tokens)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())

    for i in range(args.steps):
        if cuda and i == WARMUP_STEPS:
            torch.cuda.reset_peak_memory_stats()
        step()
    memory = {"max_memory_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
              "max_memory_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None}
    with tempfile.TemporaryDirectory() as tmp:
        busy = _profiled_step(step, args.device, Path(tmp) / "trace.json")
    timed = times[WARMUP_STEPS:args.steps]
    mean_step_s = sum(timed) / len(timed)
    tokens_per_s = args.batch * args.seq_len / mean_step_s
    tflops = flops_per_token(parameters, args.layers, args.d_model, args.seq_len) * tokens_per_s / 1e12
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = peak_bf16_tflops(name) if cuda else None
    return {"status": "ok", "device": name, "parameters": parameters, "step_times_s": times[:args.steps],
            "profiled_step_s": times[-1], "mean_step_s": mean_step_s, "tokens_per_s": tokens_per_s,
            "model_tflops": tflops, "peak_bf16_tflops": peak, "mfu": tflops / peak if peak else None,
            **memory, "peak_rss_mib": peak_rss_mib(), **busy,
            "optimizer": OPTIMIZER.get("optimizer", "DeepSpeed's AdamW (DeepSpeedCPUAdam)"), "losses": losses,
            **({"plan": plan} if plan else {})}


# --- the driver -----------------------------------------------------------------------------------

def ratios(arms: dict[str, dict]) -> dict[str, dict]:
    """For each finished zinf arm against each finished peer: tokens/s and max_memory_allocated
    ratios (ours / the peer's) and whether each goal of ``GOALS`` is met."""
    out: dict[str, dict] = {}
    for ours in OURS:
        for peer in PEERS:
            a, b = arms.get(ours, {}), arms.get(peer, {})
            if a.get("status") != "ok" or b.get("status") != "ok":
                continue
            got = {"tokens_per_s": a["tokens_per_s"] / b["tokens_per_s"]}
            if a["max_memory_allocated_bytes"] and b["max_memory_allocated_bytes"]:
                got["max_memory_allocated"] = a["max_memory_allocated_bytes"] / b["max_memory_allocated_bytes"]
            goal = GOALS[peer]
            met = [got["tokens_per_s"] >= goal["tokens_per_s"]]
            if "max_memory_allocated" in goal:
                met.append(got.get("max_memory_allocated", math.inf) <= goal["max_memory_allocated"])
            out[f"{ours}/{peer}"] = {**got, "goal": goal, "meets_goal": all(met)}
    return out


def _arm_command(args, arm: str, result: Path) -> tuple[list[str], dict[str, str]]:
    argv = [str(Path(__file__).resolve()), "--arm", arm, "--result", str(result), "--device", args.device,
            "--steps", str(args.steps), "--cap-gib", str(args.cap_gib), "--d-model", str(args.d_model),
            "--layers", str(args.layers), "--heads", str(args.heads), "--vocab", str(args.vocab),
            "--seq-len", str(args.seq_len), "--batch", str(args.batch)]
    python = args.python_deepspeed if arm == "deepspeed_offload" else sys.executable
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    # DeepSpeed's JIT-built CPU Adam (about a minute) in the checkout, where it can be kept and carried.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO_ROOT / ".torch_extensions"))
    return [python, *argv], env


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.arm:  # a child: one arm
        args.result.write_text(json.dumps(run_arm(args)))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("offload_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); --device cpu is a dry run.",
              file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.budget
    with torch.device("meta"):
        parameters = sum(p.numel() for p in _model(args).parameters())
    record = run_record(
        model={"d_model": args.d_model, "layers": args.layers, "heads": args.heads, "vocab": args.vocab,
               "seq_len": args.seq_len, "parameters": parameters},
        batch=args.batch, steps=args.steps, warmup_steps=WARMUP_STEPS, device=args.device,
        cap_bytes=int(args.cap_gib * (1 << 30)) if args.device == "cuda" else None,
        plain_state_bytes=PLAIN_STATE_BYTES * parameters,
        flops_per_token=flops_per_token(parameters, args.layers, args.d_model, args.seq_len),
        flops_formula="6 N + 12 L d s (PaLM appendix B, causal mask not halved)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    arms: dict[str, dict] = {}
    logs = Path(tempfile.mkdtemp(prefix="zinf_offload_gpu_"))
    for arm in args.only:
        left = deadline - time.monotonic()
        reason = not_runnable(arm, args)
        if reason is None and left < 10:
            reason = f"out of time ({left:.0f} s of the budget left)"
        if reason is not None:
            arms[arm] = {"status": "not run", "reason": reason}
        else:
            result, log = logs / f"{arm}.json", logs / f"{arm}.log"
            cmd, env = _arm_command(args, arm, result)
            start = time.perf_counter()
            limit = min(args.timeout, left)
            code = run_killable(cmd, env, log, limit)
            wall = {"wall_s": time.perf_counter() - start, "returncode": code, "log": str(log)}
            if result.exists():
                arms[arm] = {**json.loads(result.read_text()), **wall}
            elif limit < args.timeout and wall["wall_s"] >= limit - 1:
                # Stopped by the benchmark's own budget, not failed (a first-run JIT build, say).
                arms[arm] = {"status": "not run", "reason": f"out of time: stopped after {limit:.0f} s, "
                             "the budget's remainder", **wall}
            else:
                arms[arm] = {"status": "failed", "error": error_line(log), "error_tail": log_tail(log), **wall}
        print(f"[offload_gpu] {arm}: {arms[arm]['status']} "
              f"{arms[arm].get('tokens_per_s', arms[arm].get('reason', arms[arm].get('error', '')))}", flush=True)
        # Rewritten after every arm: a run cut short keeps what it finished.
        args.out.write_text(json.dumps({**record, "arms": arms, "ratios": ratios(arms)}, indent=2))
    print(json.dumps(ratios(arms), indent=1))
    print(f"results: {args.out}")
    return 0 if all(a["status"] != "failed" for a in arms.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
