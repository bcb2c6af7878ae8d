"""ZeroMonitor's numbers against byte counts worked out by hand for a known model."""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch

from lightning_zinf import PrefetchConfig, ZeroInfinityStrategy
from lightning_zinf.callbacks import ZeroMonitor
from tests.harness import run_distributed
from tests.test_cli import TinyLit

# TinyLit's MLP: fc1 16->48, fc2 48->48, fc3 48->8, one unit each (weight + bias), fp32.
UNIT_NUMEL = [16 * 48 + 48, 48 * 48 + 48, 48 * 8 + 8]  # 816, 2352, 392
# Elements of one rank's shard of each unit at W=2: half, padded to whole runs of SHARD_ALIGN (16).
SHARD_NUMEL = [-(-n // 32) * 16 for n in UNIT_NUMEL]  # 416, 1184, 208


class _KeptAtLog(L.Callback):
    """The gather memory the CPU keeps when ZeroMonitor (the callback before it) logs the step."""

    kept = 0

    def on_train_batch_end(self, trainer, *args) -> None:
        self.kept = trainer.strategy.engine.gathers.kept


def _fit(rank: int, world: int, persistence: int, bucket: int = PrefetchConfig.bucket_size) -> dict:
    lit = TinyLit()
    kept = _KeptAtLog()
    trainer = L.Trainer(
        strategy=ZeroInfinityStrategy(prefetch={"persistence_threshold": persistence, "unit_size": 0,  # per module, as counted
                                                "bucket_size": bucket}),
        accelerator="cpu", devices=world, max_steps=3, callbacks=[ZeroMonitor(), kept],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(lit)
    engine = trainer.strategy.engine
    return {**{k: float(v) for k, v in trainer.logged_metrics.items()}, "pooled": engine.pool.pooled_bytes,
            "gathers_kept": kept.kept}


@pytest.mark.parametrize("persistence, bucket", [(0, PrefetchConfig.bucket_size), (0, 0), (100_000, 0)],
                         ids=["gathered-kept-into-backward", "gathered-again-in-backward", "persistent"])
def test_monitor_counts_match_hand_computed_bytes(persistence: int, bucket: int) -> None:
    metrics = run_distributed(_fit, 2, persistence, bucket)[0]
    half = [4 * n for n in SHARD_NUMEL]  # bytes of one rank's fp32 shard of each unit
    # Each gather receives the other rank's shard. Without persistence a step gathers every unit
    # in forward; within the default prefetch bucket the model (3,560 elements) stays gathered
    # into its backward, with one unit ahead (bucket 0) backward gathers every unit again but the
    # last (used next: it stays). With every unit persistent only the re-gather after the
    # optimizer step remains.
    gathers = [1, 1, 1] if persistence or bucket else [2, 2, 1]
    assert metrics["zinf/gathered_bytes"] == sum(g * h for g, h in zip(gathers, half))
    assert metrics["zinf/reduce_scattered_bytes"] == sum(half)  # each flat gradient once
    assert metrics["zinf/all_reduced_bytes"] == 0  # no replicas: ZeRO-3 over every rank
    # Resident: fp32 shards (also the masters) + fp32 gradient shards (SGD keeps no state) +
    # pooled gradient buffers + persistent units' gathered buffers + released units' gather memory
    # the CPU keeps for the next gathers (at most every unit's: the most gathered at once).
    gathered = 2 * sum(half) if persistence else 0  # the padded gather buffers
    assert metrics["gathers_kept"] <= 2 * sum(half) - gathered
    assert metrics["zinf/resident_bytes_device"] == 2 * sum(half) + metrics["pooled"] + gathered + metrics["gathers_kept"]
    assert metrics["zinf/resident_bytes_cpu"] == metrics["zinf/resident_bytes_nvme"] == 0
    assert metrics["zinf/tokens_per_s"] > 0


def _fit_nvme(rank: int, world: int, nvme: str, overlap_step: bool = False,
              bucket: int = PrefetchConfig.bucket_size) -> dict:
    lit = TinyLit()
    trainer = L.Trainer(
        strategy=ZeroInfinityStrategy(
            prefetch={"persistence_threshold": 0, "unit_size": 0, "bucket_size": bucket},  # a unit per module, as counted
            offload={"param": "nvme", "optimizer": "nvme", "nvme_path": nvme, "overlap_step": overlap_step},
        ),
        accelerator="cpu", devices=world, max_steps=3, callbacks=[ZeroMonitor()],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(lit)
    return {k: float(v) for k, v in trainer.logged_metrics.items()}


def test_monitor_counts_swapped_bytes(tmp_path) -> None:
    """NVMe offload, fp32, SGD (no optimizer state): a step reads each parameter shard once (the
    forward's gather: the model is within the prefetch bucket, so each unit stays gathered into
    its backward; with one unit gathered ahead, backward reads all but the last again) and the fp32
    master once (the step); it writes the master,
    which in fp32 is the parameter shard's own record (after the step). The gradient shard is
    neither written nor read: backward leaves it in staging memory, where the step consumes it.
    The synchronous step (``overlap_step=False``), whose bytes all fall within its own step; in
    the background the step's writes fall in the next step's window and the next forward gathers
    shards still in memory, so it reads no more."""
    metrics = run_distributed(_fit_nvme, 2, str(tmp_path))[0]
    # One rank's fp32 shard of each unit, in bytes, as swapped: whole 4 KiB O_DIRECT blocks.
    swapped = [-(-(4 * n) // 4096) * 4096 for n in SHARD_NUMEL]
    shards = sum(swapped)
    assert metrics["zinf/swap_read_bytes"] == 2 * shards
    assert metrics["zinf/swap_written_bytes"] == shards
    assert metrics["zinf/swap_read_gbps"] > 0 and metrics["zinf/swap_write_gbps"] > 0
    assert metrics["zinf/resident_bytes_nvme"] > 0
    (tmp_path / "overlapped").mkdir()
    overlapped = run_distributed(_fit_nvme, 2, str(tmp_path / "overlapped"), True)[0]
    assert 0 < overlapped["zinf/swap_read_bytes"] <= 2 * shards
    # One unit gathered ahead (bucket 0): backward reads every shard again but the last unit's
    # (used next, it stays gathered).
    (tmp_path / "shallow").mkdir()
    shallow = run_distributed(_fit_nvme, 2, str(tmp_path / "shallow"), False, 0)[0]
    assert shallow["zinf/swap_read_bytes"] == 3 * shards - swapped[-1]
    assert shallow["zinf/swap_written_bytes"] == shards


def _logged_types(rank: int, world: int) -> dict:
    trainer = L.Trainer(strategy=ZeroInfinityStrategy(), accelerator="cpu", devices=world, max_steps=2,
                        callbacks=[ZeroMonitor()], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(TinyLit())
    return {k: (str(v.device), v.dtype) for k, v in trainer.callback_metrics.items() if k.startswith("zinf/")}


def test_monitor_logs_host_float64_tensors() -> None:
    """The figures reach Lightning as float64 tensors in host memory, never converted into tensors
    on the module's device (each a copy and a wait on an accelerator; test_gpu.py checks the device
    there), and byte counts above 2**24 stay exact (float32 would round them)."""
    got = run_distributed(_logged_types, 1, init_pg=False)[0]
    assert got and all(v == ("cpu", torch.float64) for v in got.values()), got
