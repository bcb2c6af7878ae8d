"""The GPU suite (marker ``gpu``; ``pytest -m gpu tests``, or ``examples/benchmarks/gpu_check.py``
for the whole check). Skipped with the reason on a machine without CUDA.

- Every feature of the engine at one rank on CUDA, against the same run on the CPU: the copy
  streams, page-locked memory and CUDA kernels run for real. (At one rank the collectives are
  local copies and no control group exists; gpu_check.py's nccl step runs these tests again with
  ``ZINF_REAL_COLLECTIVES=1``, which keeps real NCCL collectives.)
- Two ranks sharing one GPU through gloo with CUDA tensors (NCCL refuses two ranks on one device):
  the copy streams, the collectives and compute run concurrently, against two CPU ranks. gloo's
  ``wait()`` blocks the host, NCCL's only the stream, so this does not check NCCL's semantics.
- Two ranks on two GPUs with NCCL, where a machine has them.
- The memory ledger against ``torch.cuda.max_memory_allocated()``.
- Fused and capturable AdamW resumed from a sharded checkpoint (``step`` stays on the GPU).
- ZeroMonitor through a Trainer: host-side figures, device-timed steps.
- ``strategy.generation()`` in a Trainer's training step (decode steps with the kept qwZ row on the
  device and host tiers, and with the whole model kept gathered), against the CPU run.

The Triton kernels on CUDA are tested in test_kernels.py (marked ``gpu`` as well).
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import pytest
import torch

from lightning_zinf import MixedPrecisionConfig, OffloadConfig, PrefetchConfig, TilingConfig, ZeroEngine, ZeroPPConfig
from lightning_zinf.planning.activations import ActivationPlan
from tests import models, optimizer_resume
from tests.harness import run_distributed

HAS_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]

STEPS = 4
BATCH = 8
FEATURES = ("fp32", "bf16", "offload_cpu", "offload_nvme", "offload_cpu_bf16", "offload_nvme_bf16", "zero_pp", "tiling",
            "checkpointing", "lora_frozen_int8", "activation_offload", "zero_offload_bf16", "param_cpu_device_optimizer_bf16",
            "offload_cpu_sync_step", "zero_offload_nvme_bf16", "activation_plan", "device_bytes_bf16", "grad_op_bf16",
            "grad_op_offload_cpu_bf16")
# Relative tolerance of the losses against the CPU run: reduction orders and attention kernels
# differ between devices; bf16 and INT8-quantized weights round far more than that.
TOLERANCE = {"fp32": 2e-3, "offload_cpu": 2e-3, "offload_nvme": 2e-3, "tiling": 2e-3, "checkpointing": 2e-3,
             "activation_offload": 2e-3, "bf16": 3e-2, "offload_cpu_bf16": 3e-2, "offload_nvme_bf16": 3e-2,
             "zero_pp": 3e-2, "qgz_two_nodes": 3e-2, "lora_frozen_int8": 3e-2, "zero_offload_bf16": 3e-2,
             "param_cpu_device_optimizer_bf16": 3e-2, "offload_cpu_sync_step": 2e-3, "zero_offload_nvme_bf16": 3e-2,
             "activation_plan": 2e-3, "device_bytes_bf16": 3e-2, "grad_op_bf16": 3e-2, "grad_op_offload_cpu_bf16": 3e-2,
             "hybrid": 2e-3, "hybrid_qgz": 3e-2}
#: Blocks of the GPT per feature (2 unless named): the per-block plan keeps one block's activations,
#: offloads the next two and checkpoints the last.
LAYERS = {"activation_plan": 4}
#: Optimizer state kept on the device under ``device_bytes`` (the first groups that fit, 16 B/elt).
DEVICE_BYTES = 300_000


def _engine_kwargs(feature: str, nvme_path: str) -> dict:
    return {
        "bf16": {"mixed_precision": MixedPrecisionConfig(param_dtype="bf16")},
        "offload_cpu": {"offload": OffloadConfig(param="cpu", optimizer="cpu")},
        "offload_nvme": {"offload": OffloadConfig(param="nvme", optimizer="nvme", nvme_path=nvme_path)},
        # Gathers read the shards' 16-bit compute copies (host memory; swap records).
        "offload_cpu_bf16": {"offload": OffloadConfig(param="cpu", optimizer="cpu"),
                             "mixed_precision": MixedPrecisionConfig(param_dtype="bf16")},
        "offload_nvme_bf16": {"offload": OffloadConfig(param="nvme", optimizer="nvme", nvme_path=nvme_path),
                              "mixed_precision": MixedPrecisionConfig(param_dtype="bf16")},
        "zero_pp": {"zero_pp": ZeroPPConfig(qwz=True, hpz=True, qgz=True)},
        # Each rank a node of its own: qgZ's inter-node leg, chained on a side stream.
        "qgz_two_nodes": {"zero_pp": ZeroPPConfig(qgz=True, ranks_per_node=1)},
        "tiling": {"tiling": TilingConfig(tile_numel=1024)},
        "checkpointing": {"activation_checkpointing": [models.Block]},
        "lora_frozen_int8": {"zero_pp": ZeroPPConfig(frozen_bits=8)},
        "activation_offload": {"offload": OffloadConfig(optimizer="cpu", activations=True)},
        # ZeRO-Offload's layout: 16-bit device copies, fp32 masters on the host, gradients up in bf16
        # (landing buffers), the step in the background.
        "zero_offload_bf16": {"offload": OffloadConfig(optimizer="cpu"),
                              "mixed_precision": MixedPrecisionConfig(param_dtype="bf16", reduce_dtype="bf16")},
        # The device master's values sent to the page-locked host shard and copy without a host wait.
        "param_cpu_device_optimizer_bf16": {"offload": OffloadConfig(param="cpu"),
                                            "mixed_precision": MixedPrecisionConfig(param_dtype="bf16")},
        "offload_cpu_sync_step": {"offload": OffloadConfig(param="cpu", optimizer="cpu", overlap_step=False)},
        # The same device side with the optimizer's state in swap files (the host shard follows each step).
        "zero_offload_nvme_bf16": {"offload": OffloadConfig(optimizer="nvme", nvme_path=nvme_path),
                                   "mixed_precision": MixedPrecisionConfig(param_dtype="bf16")},
        # ZeRO-Offload with the first groups' optimizer state on the device, stepped there (issue 40).
        "device_bytes_bf16": {"offload": OffloadConfig(optimizer="cpu", device_bytes=DEVICE_BYTES),
                              "mixed_precision": MixedPrecisionConfig(param_dtype="bf16")},
        # ZeRO-2 (issue 41): units held gathered from forward to backward.
        "grad_op_bf16": {"sharding": "grad_op", "mixed_precision": MixedPrecisionConfig(param_dtype="bf16")},
        "grad_op_offload_cpu_bf16": {"sharding": "grad_op", "offload": OffloadConfig(param="cpu", optimizer="cpu"),
                                     "mixed_precision": MixedPrecisionConfig(param_dtype="bf16")},
        # Hybrid sharding (issue 41) over two ranks: a shard group per rank, gradients all-reduced
        # across them (on NCCL on the side stream, behind the reduce-scatter).
        "hybrid": {"sharding": "hybrid", "shard_group_size": 1},
        # The same with qgZ: the all-reduce as INT8 codes (Triton's kernels on the device; on two
        # GPUs with NCCL the chain queued on the side stream, here with no reduce-scatter before it).
        "hybrid_qgz": {"sharding": "hybrid", "shard_group_size": 1, "zero_pp": ZeroPPConfig(qgz=True, qgz_bits=8)},
    }.get(feature, {})


def _train(rank: int, world: int, device: str, feature: str, nvme_path: str) -> dict:
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device).index or 0)
        torch.cuda.reset_peak_memory_stats()
    Path(nvme_path).mkdir(parents=True, exist_ok=True)  # nvme_path must exist (the swapper's rule)
    torch.manual_seed(0)
    model = models.GPT(lora_rank=4 if feature == "lora_frozen_int8" else 0, layers=LAYERS.get(feature, 2))
    engine = ZeroEngine(model, block_classes=["Block"], device=device, prefetch=PrefetchConfig(persistence_threshold=0),
                        **_engine_kwargs(feature, nvme_path))
    if feature == "activation_plan":  # as memory_budget's plan installs it (engine_setup.build_engine)
        engine.activation_plan = ActivationPlan(
            [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)], budget=1 << 40, planned=0,
            is_gathered=engine.states.holds_storage_of, kept=1, offloaded=2, offload=engine.offload_activations)
    # SGD: Adam would turn rounding noise in exactly-zero gradients (the key bias of attention)
    # into full-size steps that differ between devices.
    opt = engine.shard_optimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05,
                                                 momentum=0.9))
    losses, ledger_peaks, allocated_peaks = [], [], []
    for step in range(STEPS):
        engine.reset_memory_peaks()
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        x, y = models.make_batch("gpt", step, BATCH)
        per_rank = BATCH // world
        x, y = (t[rank * per_rank : (rank + 1) * per_rank].to(device) for t in (x, y))
        offloading = engine.offload_activations() if feature == "activation_offload" else contextlib.nullcontext()
        with offloading:
            loss = models.loss_fn(model, x, y)
        loss.backward()
        engine.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        ledger_peaks.append(engine.memory()["device_total"][1])
        if device.startswith("cuda"):
            allocated_peaks.append(torch.cuda.max_memory_allocated())
    with engine.gathered():
        weights = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    engine.release_all()
    copied = engine._activation_offload.copied_bytes if engine._activation_offload is not None else 0
    return {"losses": losses, "weights": weights, "ledger": ledger_peaks, "allocated": allocated_peaks,
            "activation_bytes_copied": copied, "optimizer_device": engine.memory()["optimizer_device"][1]}


@pytest.mark.parametrize("feature", FEATURES)
def test_every_feature_on_one_gpu_matches_the_cpu(feature: str, tmp_path: Path) -> None:
    """One rank, NCCL world group, CUDA compute device: losses and weights track the CPU run of the
    same configuration, and the ledger's device peak is at most what the allocator saw."""
    gpu = run_distributed(_train, 1, "cuda", feature, str(tmp_path / "gpu"), backend="nccl")[0]
    cpu = run_distributed(_train, 1, "cpu", feature, str(tmp_path / "cpu"))[0]
    rtol = TOLERANCE[feature]
    torch.testing.assert_close(torch.tensor(gpu["losses"]), torch.tensor(cpu["losses"]), rtol=rtol, atol=0)
    for name, value in cpu["weights"].items():
        torch.testing.assert_close(gpu["weights"][name], value, rtol=rtol, atol=rtol, msg=name)
    for ledger, allocated in zip(gpu["ledger"], gpu["allocated"]):
        assert 0 < ledger <= allocated
    if feature == "activation_offload":
        # What autograd saves differs between devices (CUDA's attention pads its logsumexp to a
        # multiple of 32): each run copies what plain PyTorch saves on its own device, every step.
        for result, device in ((gpu, "cuda"), (cpu, "cpu")):
            torch.manual_seed(0)
            want, _ = models.saved_by_autograd(models.GPT().to(device), models.make_batch("gpt", 0, BATCH))
            assert result["activation_bytes_copied"] == STEPS * want > 0, device
    if feature == "activation_plan":  # the two offloaded blocks copied something, every step
        assert gpu["activation_bytes_copied"] > 0 and cpu["activation_bytes_copied"] > 0
    if feature == "device_bytes_bf16":  # some optimizer state stepped on the device, within its bytes
        assert 0 < gpu["optimizer_device"] <= DEVICE_BYTES


@pytest.mark.parametrize("feature", ["fp32", "bf16", "offload_cpu", "offload_cpu_bf16", "activation_offload", "zero_pp",
                                     "qgz_two_nodes", "activation_plan", "grad_op_bf16", "hybrid", "hybrid_qgz"])
def test_two_ranks_sharing_one_gpu_through_gloo_match_two_cpu_ranks(feature: str, tmp_path: Path) -> None:
    """Two processes on one GPU, joined by gloo with CUDA tensors: real concurrency between each
    rank's copy stream, the collectives and compute, with gathers prefetched along the trace."""
    gpu = run_distributed(_train, 2, "cuda:0", feature, str(tmp_path / "gpu"))  # one device on purpose
    _assert_two_ranks_match_the_cpu(gpu, feature, tmp_path)


def _assert_two_ranks_match_the_cpu(gpu: list[dict], feature: str, tmp_path: Path) -> None:
    cpu = run_distributed(_train, 2, "cpu", feature, str(tmp_path / "cpu"))
    rtol = TOLERANCE[feature]
    for g, c in zip(gpu, cpu):
        torch.testing.assert_close(torch.tensor(g["losses"]), torch.tensor(c["losses"]), rtol=rtol, atol=0)
    for name, value in gpu[0]["weights"].items():
        assert torch.equal(gpu[1]["weights"][name], value), f"ranks disagree on {name}"
        torch.testing.assert_close(value, cpu[0]["weights"][name], rtol=rtol, atol=rtol, msg=name)


def _nccl_two_gpus(rank: int, world: int, feature: str, nvme_path: str) -> dict:
    torch.cuda.set_device(rank)
    return _train(rank, world, f"cuda:{rank}", feature, nvme_path)


@pytest.mark.parametrize("flags", [{"fused": True}, {"capturable": True}], ids=["fused", "capturable"])
def test_fused_and_capturable_adamw_resume_on_the_gpu(tmp_path: Path, flags: dict) -> None:
    """Fused and capturable AdamW keep ``step`` on the GPU: after a sharded load every state tensor
    sits where torch's own ``Optimizer.load_state_dict`` puts it for those flags, and the first
    steps after the resume run (a ``step`` on the CPU crashes them) and equal the uninterrupted run."""
    run = optimizer_resume.resumed_run(flags, "cuda", tmp_path / "ckpt")
    assert run["placed"] == optimizer_resume.torch_placement(flags, "cuda")
    assert run["resumed"] == run["straight"]


def _monitored_fit(rank: int, world: int) -> dict:
    import lightning.pytorch as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zinf import ZeroInfinityStrategy
    from lightning_zinf.callbacks import ZeroMonitor

    class Lit(L.LightningModule):
        def configure_model(self) -> None:
            self.model = models.GPT()

        def training_step(self, batch, batch_idx):
            return models.loss_fn(self.model, *batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.model.parameters(), lr=0.05)

    class Seen(L.Callback):
        """Reads the logged figures before fit's teardown moves them to the CPU; waits for the
        device before each step from the second on, so an earlier step's time is known."""

        metrics: dict = {}

        def on_train_batch_start(self, trainer, *args) -> None:
            if trainer.global_step:
                torch.cuda.synchronize()

        def on_train_end(self, trainer, pl_module) -> None:
            Seen.metrics = {k: (str(v.device), str(v.dtype), float(v))
                            for k, v in trainer.callback_metrics.items() if k.startswith("zinf/")}

    x, y = models.make_batch("gpt", 0, 4 * BATCH)
    trainer = L.Trainer(strategy=ZeroInfinityStrategy(block_classes=["Block"]), accelerator="gpu", devices=1,
                        max_steps=4, callbacks=[ZeroMonitor(), Seen()], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Lit(), DataLoader(TensorDataset(x, y), batch_size=BATCH))
    return Seen.metrics


def test_monitor_logs_host_numbers_and_times_steps_on_the_device() -> None:
    """ZeroMonitor on a GPU run: every figure it logs is a host tensor (a device tensor per figure
    would be a copy and a wait for the device's queue each), and tokens/s comes from device events
    of steps the device has finished."""
    got = run_distributed(_monitored_fit, 1, init_pg=False)[0]
    assert got and all(v[:2] == ("cpu", "torch.float64") for v in got.values()), got
    assert got.get("zinf/tokens_per_s", (0, 0, 0))[2] > 0, got
    assert got["zinf/device_max_allocated_bytes"][2] > 0


#: Configurations of the generation-phase test: the kept qwZ row on the device tier and on the
#: host tier (re-gathered at every decode step, budget 0), and the whole model kept gathered.
GENERATION = {
    "qwz": ({"zero_pp": ZeroPPConfig(qwz=True)}, 0, "zero_pp"),
    "offload_cpu_qwz": ({"zero_pp": ZeroPPConfig(qwz=True), "offload": OffloadConfig(param="cpu", optimizer="cpu")},
                        0, "zero_pp"),
    "whole": ({}, 1 << 40, "fp32"),
}


def _generation_fit(rank: int, world: int, accelerator: str, feature: str) -> dict:
    """A Trainer fit whose ``training_step`` decodes under ``strategy.generation()`` (9 decode steps
    of a growing prefix of the batch, teacher-forced so every device feeds the same tokens), then
    trains on the batch; the last-position logits of every decode step and the losses."""
    import lightning.pytorch as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zinf import ZeroInfinityStrategy

    options, budget, _ = GENERATION[feature]

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = models.GPT()  # on the CPU, so both devices start from the same values
            self.decoded: list[torch.Tensor] = []
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            with torch.no_grad(), self.trainer.strategy.generation():
                for n in range(8, x.shape[1] + 1):
                    self.decoded.append(self.model(x[:, :n])[:, -1].float().cpu())
            loss = models.loss_fn(self.model, x, y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)

    x, y = models.make_batch("gpt", 0, 3 * BATCH)
    strategy = ZeroInfinityStrategy(block_classes=["Block"], **options,
                                    prefetch=PrefetchConfig(persistence_threshold=0, inference_budget=budget))
    trainer = L.Trainer(strategy=strategy, accelerator=accelerator, devices=1, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    lit = Lit()
    trainer.fit(lit, DataLoader(TensorDataset(x, y), batch_size=BATCH))
    return {"decoded": torch.stack(lit.decoded), "losses": lit.losses}


@pytest.mark.parametrize("feature", list(GENERATION))
def test_generation_phase_on_one_gpu_matches_the_cpu(feature: str) -> None:
    """``strategy.generation()`` inside a training step on CUDA (issue 39; gpu_check's nccl step
    runs it again through real NCCL gathers): decode steps and the training steps after them give
    the CPU run's logits and losses, with the kept qwZ row on the device and the host tier and with
    the whole model kept gathered."""
    gpu = run_distributed(_generation_fit, 1, "gpu", feature, init_pg=False)[0]
    cpu = run_distributed(_generation_fit, 1, "cpu", feature, init_pg=False)[0]
    rtol = TOLERANCE[GENERATION[feature][2]]
    assert gpu["decoded"].shape == (3 * 9, BATCH, 64)
    torch.testing.assert_close(gpu["decoded"], cpu["decoded"], rtol=rtol, atol=rtol)
    torch.testing.assert_close(torch.tensor(gpu["losses"]), torch.tensor(cpu["losses"]), rtol=rtol, atol=0)


def _refuse_flush() -> None:
    raise AssertionError("torch's process-wide page-locked host cache was emptied")


def test_nvme_staging_is_page_locked_memory_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       recwarn: pytest.WarningsRecorder) -> None:
    """The NVMe staging pool on CUDA: its buffers are page-locked (``is_pinned()``, views too) without
    torch's caching host allocator creating a block for them, copy to the device without blocking
    and arrive intact; buffers freed under the cap are unregistered without an error; and NVMe
    offload training under a small staging cap never empties torch's process-wide host cache."""
    from lightning_zinf.offload.staging import StagingPool

    monkeypatch.setattr(torch._C, "_host_emptyCache", _refuse_flush, raising=False)
    device = torch.device("cuda", torch.cuda.current_device())
    host_blocks = torch.cuda.host_memory_stats().get("num_host_alloc", 0)
    pool = StagingPool(cap=3 << 20, pin_memory=True, device=device)
    a = pool.take(1 << 20)
    assert a.is_pinned() and a[4096:].is_pinned() and a.untyped_storage().data_ptr() == a.data_ptr()
    a.copy_(torch.arange(1 << 20) % 251)
    on_device = a.to(device, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(on_device.cpu(), a)
    pool.give(a)
    del a
    b = pool.take(3 << 20)  # frees the first buffer: unregistered and unmapped
    assert b.is_pinned() and pool.held == 3 << 20
    assert torch.cuda.host_memory_stats().get("num_host_alloc", 0) == host_blocks
    del pool, b
    assert not [w for w in recwarn if "cudaHostUnregister" in str(w.message)]
    torch.manual_seed(0)
    model = models.GPT()
    engine = ZeroEngine(model, block_classes=["Block"], device=device, prefetch=PrefetchConfig(persistence_threshold=0),
                        offload=OffloadConfig(param="nvme", optimizer="nvme", nvme_path=str(tmp_path),
                                              sub_group_size=5_000, staging_bytes=300_000))
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step in range(2):
        x, y = models.make_batch("gpt", step, BATCH)
        models.loss_fn(model, x.to(device), y.to(device)).backward()
        opt.step()
        opt.zero_grad()
    engine.release_all()
    assert engine.space.pool.pin_memory and 0 < engine.space.pool.held <= 300_000


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("feature", ["fp32", "bf16", "offload_cpu", "zero_pp", "qgz_two_nodes", "hybrid",
                                     "hybrid_qgz"])
def test_two_gpus_with_nccl_match_two_cpu_ranks(feature: str, tmp_path: Path) -> None:
    """Two ranks on two GPUs in an NCCL group: NCCL's stream semantics (``wait()`` orders the
    stream, not the host), the gloo control group beside it."""
    gpu = run_distributed(_nccl_two_gpus, 2, feature, str(tmp_path / "gpu"), backend="nccl")
    _assert_two_ranks_match_the_cpu(gpu, feature, tmp_path)


def test_an_offloaded_gather_copies_while_earlier_compute_still_runs() -> None:
    """Issue 30 item 5 on the hardware: with the compute stream busy for a while (matmuls queued
    first), the gather of a cpu-tier shard into a released buffer is copied over before that
    compute ends; its event completes while the compute stream's does not. Compute then waits for
    it only at the handle, and the values arrive intact."""
    from lightning_zinf.comm.collectives import Collectives
    from lightning_zinf.engine.flat import FlatGroup
    from lightning_zinf.engine.transfer import Transfers

    device = torch.device("cuda", torch.cuda.current_device())
    transfers = Transfers(device)
    values = torch.randn(1 << 20)
    params = [torch.nn.Parameter(torch.empty(1 << 20, device=device))]
    group = FlatGroup(["w"], params, values, Collectives(), device, shard_device=torch.device("cpu"),
                      transfers=transfers)
    a = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize()
    busy = a
    for _ in range(40):  # about 5 TFLOP: tens of milliseconds on an H100
        busy = busy @ a
        busy = busy / busy.norm()
    compute_done = torch.cuda.Event()
    compute_done.record()
    handle = group.start_gather()
    copy_done = handle.event
    copy_done.synchronize()  # the host waits for the copy alone
    assert not compute_done.query(), "the copy waited for the compute queued before it"
    handle.wait()
    group.finish_gather()
    torch.cuda.synchronize()
    assert torch.equal(params[0].detach().cpu(), values)


#: The budget test's GPT: 8 blocks of width 512 (25M parameters: 403 MB with fp32 AdamW state), one
#: micro-batch of 8 x 128 tokens.
BUDGET_GPT = dict(vocab=1024, d=512, layers=8, heads=8, seq=128)
#: What the allocator may hold beyond the plan's device prediction: cuBLAS's workspace (up to 32
#: MiB on sm_90) and the kernels' own scratch, which the ledger does not count.
ALLOCATOR_SLACK = 64 << 20


def _budget_on_the_gpu(rank: int, world: int, shares: tuple[float, ...], nvme_path: str) -> list[dict]:
    """Per budget (a share of the unplanned peak: the state and the example's activations with
    everything on the device): the plan's choices and prediction, the allocator's peak over 3
    AdamW steps beyond what was allocated before the engine was built, and the losses."""
    from lightning_zinf import meta_parameters
    from lightning_zinf.engine_setup import build_engine, memory_plan
    from lightning_zinf.options import ZeroOptions
    from lightning_zinf.planning import BudgetError

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    Path(nvme_path).mkdir(parents=True, exist_ok=True)
    tokens = torch.randint(0, BUDGET_GPT["vocab"], (8, BUDGET_GPT["seq"] + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]
    with meta_parameters():
        model = models.GPT(**BUDGET_GPT)
    model.example_input_array = x
    everything = memory_plan(model, ZeroOptions(block_classes=["Block"], memory_budget=1 << 40), device=device,
                             precision=MixedPrecisionConfig(), world=world)
    unplanned = everything.prediction.device + everything.activations
    runs = []
    for share in shares:
        budget = int(share * unplanned)
        torch.manual_seed(0)
        with meta_parameters():
            model = models.GPT(**BUDGET_GPT)
        model.example_input_array = x
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        options = ZeroOptions(block_classes=["Block"], offload=OffloadConfig(nvme_path=nvme_path), memory_budget=budget)
        try:
            engine = build_engine(model, options, device=device, ranks_per_node=world,
                                  precision=MixedPrecisionConfig(), loss_scaling=False, timeout=None, auto_pass=True)
        except BudgetError as error:
            runs.append({"share": share, "budget": budget, "refused": str(error)})
            continue
        plan = engine.memory_plan
        opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        losses, times = [], []
        for step in range(3):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            loss = models.loss_fn(model, x.to(device), y.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            end.record()
            losses.append(loss.item())
            times.append(start.elapsed_time(end) / 1e3)
        torch.cuda.synchronize()
        runs.append({"share": share, "budget": budget, "placement": plan.placement.describe(),
                     "kept": plan.kept_blocks, "offloaded": plan.offloaded_blocks,
                     "predicted_device": plan.prediction.device, "predicted_activations": plan.activations,
                     "predicted_step_s": plan.step.total if plan.step is not None else None,
                     "predicted_terms": plan.step.describe() if plan.step is not None else None,
                     "bandwidths": dataclasses.asdict(plan.bandwidths),
                     "measured_step_s": times[-1], "peak": torch.cuda.max_memory_allocated() - base,
                     "ledger_device": engine.memory()["device_total"][1], "losses": losses})
        engine.release_all()
        del engine, opt, model, plan
        torch.cuda.empty_cache()
    return runs


def test_a_memory_budget_on_the_gpu_keeps_the_allocator_within_it(tmp_path: Path, record_property) -> None:
    """``memory_budget`` on an accelerator (issue 40), where the plan weighs host and device apart,
    times the host link and may offload activations per block: at 100%, 50% and 30% of the
    unplanned peak, the allocator's own peak (``max_memory_allocated``, outside the engine) stays
    within the budget plus cuBLAS's workspace, falls with the budget, and the losses are the
    roomy run's; the plan's predicted step is within 35% of the last step's. The plans and the measured against predicted step times go to the JUnit XML
    (``budgets``)."""
    import json

    runs = run_distributed(_budget_on_the_gpu, 1, (1.0, 0.5, 0.3), str(tmp_path), backend="nccl")[0]
    record_property("budgets", json.dumps(runs))
    assert "refused" not in runs[0] and "refused" not in runs[1], runs
    runs = [run for run in runs if "refused" not in run]
    for run in runs:
        assert run["peak"] <= run["budget"] + ALLOCATOR_SLACK, run
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(runs[0]["losses"]), rtol=2e-3, atol=0)
    assert runs[-1]["peak"] < runs[0]["peak"], [r["peak"] for r in runs]
    for run in runs:  # the cost model's step against the device's (issue 40's goal is 20% on the CPU)
        assert 0.65 <= run["predicted_step_s"] / run["measured_step_s"] <= 1.35, run
