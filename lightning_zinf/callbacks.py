"""Lightning callbacks that show what the ``zero_infinity`` strategy is doing.

:class:`ZeroMonitor` logs, every training step, through the Trainer's loggers:

- ``zinf/gathered_bytes``: bytes this rank received in parameter all-gathers during the step;
- ``zinf/reduce_scattered_bytes``: bytes it sent in gradient reduce-scatters;
- ``zinf/all_reduced_bytes``: under hybrid sharding, bytes it sent in the all-reduces of its
  gradient shards across the shard groups (as a ring sends them, codes with qgZ; 0 in the other
  modes);
- ``zinf/intra_node_bytes`` and ``zinf/inter_node_bytes``: of those, the bytes exchanged with ranks
  on its own node and on other nodes (see :class:`~lightning_zinf.ZeroPPConfig`);
- ``zinf/resident_bytes_{device,cpu,nvme}``: training state it holds on each tier
  (see :meth:`~lightning_zinf.ZeroEngine.resident_bytes`);
- ``zinf/peak_<category>_bytes``: the memory ledger, each category's peak during the step
  (see :meth:`~lightning_zinf.ZeroEngine.memory`): ``gathered`` (units gathered, prefetched and in
  flight), ``secondary`` (hpZ), ``grad_buffers``, ``reduce_pending``, ``pooled``, ``gathers_kept``,
  ``shards_{device,cpu,nvme}``, ``grad_shards``, ``optimizer``, ``optimizer_nvme``, ``staging``,
  and ``device_total`` (the peak of their sum on the compute device);
- on an accelerator, ``zinf/device_max_allocated_bytes``: ``torch.accelerator.max_memory_allocated``
  during the step, everything the process allocated there (activations included), next to the
  ledger's ``device_total``;
- ``zinf/tokens_per_s``: tokens (or samples) of the global batch per second of step time; on an
  accelerator, the time between two events on the compute stream (from the start of the batch,
  after its copy to the device, to its end, including what the stream waited for on the copy and
  collective streams), reported once the device has finished the step (usually one step later), so
  that timing never waits for the device; a step whose device time is not known yet repeats the
  last rate reported (Lightning keeps on-step values within an epoch), and the summary's mean counts
  every step once;
- with NVMe offload, ``zinf/swap_read_bytes`` and ``zinf/swap_written_bytes`` (bytes this rank's
  swapper read and wrote during the step) and ``zinf/swap_read_gbps`` / ``zinf/swap_write_gbps``
  (those bytes over the time the swapper had a read or write running: the throughput the disk
  gave, in GB/s, 1e9 bytes per second; 0 when nothing moved).

At the end of ``fit`` rank 0 prints a summary table (means over the steps after the first, whose
time includes recording the prefetch trace).

The figures are host numbers: they go to ``self.log`` as one float64 tensor in host memory per
step (Lightning keeps a logged tensor on its own device), never as device tensors, each of which
would cost a copy and a wait for the device's queue (the host could never run a step ahead).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torchmetrics.aggregation import MeanMetric
from typing_extensions import override

from lightning_zinf.strategy import ZeroInfinityStrategy

__all__ = ["ZeroMonitor"]

_TIERS = ("device", "cpu", "nvme")


def _default_tokens(batch: Any) -> int:
    """Elements of the first tensor of the batch: tokens for ``(token ids, targets)`` batches."""
    first = batch[0] if isinstance(batch, (list, tuple)) else batch
    return int(first.numel()) if hasattr(first, "numel") else 0


class ZeroMonitor(Callback):
    """Per-step communication, memory and throughput of the ``zero_infinity`` strategy.

    Args:
        tokens_in_batch: Counts the tokens (or samples) in one rank's batch; the default takes the
            number of elements of the batch's first tensor. Multiplied by the world size for the
            global rate.

    Raises:
        TypeError: the Trainer's strategy is not ``zero_infinity`` (at ``setup``).
    """

    def __init__(self, tokens_in_batch: Optional[Callable[[Any], int]] = None) -> None:
        self.tokens_in_batch = tokens_in_batch or _default_tokens
        self._start = 0.0
        self._tokens = 0
        self._swap_start: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)
        self._means: dict[str, MeanMetric] = {}
        self._begin: Optional[torch.Event] = None
        self._timed: list[tuple[int, torch.Event, torch.Event, int]] = []  # (step, begin, end, tokens) on the device

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if not isinstance(trainer.strategy, ZeroInfinityStrategy):
            raise TypeError(f"ZeroMonitor needs strategy='zero_infinity', got {type(trainer.strategy).__name__}.")

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int) -> None:
        engine = trainer.strategy.engine
        engine.comm.bytes.reset()
        engine.reset_memory_peaks()
        if engine.device.type != "cpu":
            _device_memory(engine.device).reset_peak_memory_stats(engine.device)
        self._swap_start = _swap_counters(engine.swapper)
        self._tokens = self.tokens_in_batch(batch) * trainer.world_size
        self._start = time.perf_counter()
        if engine.device.type != "cpu":
            self._begin = torch.Event(device=engine.device, enable_timing=True)
            self._begin.record(torch.accelerator.current_stream(engine.device))

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        elapsed = time.perf_counter() - self._start
        engine = trainer.strategy.engine
        metrics = {
            "zinf/gathered_bytes": float(engine.comm.bytes.gathered),
            "zinf/reduce_scattered_bytes": float(engine.comm.bytes.reduce_scattered),
            "zinf/all_reduced_bytes": float(engine.comm.bytes.all_reduced),
            "zinf/intra_node_bytes": float(engine.comm.bytes.intra_node),
            "zinf/inter_node_bytes": float(engine.comm.bytes.inter_node),
            **{f"zinf/resident_bytes_{tier}": float(n) for tier, n in engine.resident_bytes().items()},
            **{f"zinf/peak_{category}_bytes": float(peak) for category, (_, peak) in engine.memory().items()},
        }
        if engine.device.type == "cpu":
            metrics["zinf/tokens_per_s"] = self._tokens / elapsed if elapsed > 0 else 0.0
        else:
            end = torch.Event(device=engine.device, enable_timing=True)
            end.record(torch.accelerator.current_stream(engine.device))  # the stream of begin: one timeline
            self._timed.append((trainer.global_step, self._begin, end, self._tokens))
            rate = self._device_rates(wait=False)
            if rate is not None:
                metrics["zinf/tokens_per_s"] = rate
        if engine.device.type != "cpu":
            metrics["zinf/device_max_allocated_bytes"] = float(_device_memory(engine.device).max_memory_allocated(engine.device))
        if engine.swapper is not None:
            read, written, read_s, write_s = (b - a for a, b in zip(self._swap_start, _swap_counters(engine.swapper)))
            metrics["zinf/swap_read_bytes"] = float(read)
            metrics["zinf/swap_written_bytes"] = float(written)
            metrics["zinf/swap_read_gbps"] = read / read_s / 1e9 if read_s > 0 else 0.0
            metrics["zinf/swap_write_gbps"] = written / write_s / 1e9 if write_s > 0 else 0.0
        host = torch.tensor(list(metrics.values()), dtype=torch.float64)  # one tensor, in host memory
        pl_module.log_dict(dict(zip(metrics, host.unbind())), on_step=True, on_epoch=False, sync_dist=False)
        if trainer.global_step > 1:  # the first step also records the prefetch trace
            for name, value in metrics.items():
                if name != "zinf/tokens_per_s" or engine.device.type == "cpu":  # device rates: _device_rates
                    self._mean(name, value)

    def _mean(self, name: str, value: float) -> None:
        # This rank's own means: compute() must not sync CPU states over an NCCL world group.
        if name not in self._means:
            self._means[name] = MeanMetric(sync_on_compute=False).set_dtype(torch.float64)
        self._means[name].update(value)

    def _device_rates(self, wait: bool) -> Optional[float]:
        """Tokens per second of the timed steps the device has finished (all of them if ``wait``,
        which waits for the last one): each goes into the summary's mean (after the first
        step); returns the latest, or None when none has finished yet."""
        latest = None
        while self._timed and (wait or self._timed[0][2].query()):
            step, begin, end, tokens = self._timed.pop(0)
            end.synchronize()
            seconds = begin.elapsed_time(end) / 1000
            latest = tokens / seconds if seconds > 0 else 0.0
            if step > 1:
                self._mean("zinf/tokens_per_s", latest)
        return latest

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._device_rates(wait=True)  # the steps still being timed on the device: one wait, at the end
        if not self._means:
            return
        rows = [(name.removeprefix("zinf/"), metric.compute().item()) for name, metric in self._means.items()]
        width = max(len(name) for name, _ in rows)
        lines = [f"{name.ljust(width)}  {_human(name, value)}" for name, value in rows]
        rank_zero_info("zero_infinity, per step on rank 0 (mean after the first step):\n  " + "\n  ".join(lines))


def _device_memory(device: torch.device) -> Any:
    """The module with ``max_memory_allocated``/``reset_peak_memory_stats`` for ``device``:
    ``torch.accelerator`` (torch >= 2.9), else the device's own (``torch.cuda``, ``torch.xpu``...)."""
    if hasattr(torch.accelerator, "max_memory_allocated"):
        return torch.accelerator
    return getattr(torch, device.type)


def _swap_counters(swapper: Any) -> tuple[float, ...]:
    """(bytes read, bytes written, seconds reading, seconds writing) so far; zeros without a swapper."""
    if swapper is None:
        return (0.0, 0.0, 0.0, 0.0)
    return (swapper.bytes_read, swapper.bytes_written, swapper.read_seconds, swapper.write_seconds)


def _human(name: str, value: float) -> str:
    if name.endswith("bytes") or "bytes_" in name:
        for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
            if value < 1024 or unit == "TiB":
                return f"{value:,.1f} {unit}"
            value /= 1024
    return f"{value:,.1f}"
