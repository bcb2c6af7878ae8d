"""The memory ledger: the bytes the engine holds, by category, now and at their peak.

ZeRO-3's promise (ZeRO §5.3, ZeRO-Infinity §4) is that a rank holds its shards plus the few units
in flight, whatever the model's depth. The ledger makes that visible: every buffer whose size
changes during a step (gathered units, hpZ secondary partitions, gradient buffers, reduce-scatters
in flight) is added and removed where the engine allocates and frees it, and the peak of each
category since :meth:`MemoryLedger.reset_peaks` is kept. State whose size changes only at setup or
at the optimizer step (shards, fp32 gradient shards, optimizer state, NVMe staging) is counted by
:meth:`lightning_zinf.ZeroEngine.memory` when asked.
"""

from __future__ import annotations

__all__ = ["MemoryLedger", "CATEGORIES"]

#: What each category holds, in the order reports list them.
CATEGORIES = {
    "gathered": "full parameter buffers of gathered units, prefetched and in-flight ones included",
    "secondary": "hpZ secondary partitions, and the qwZ-quantized rows of shards a generation phase keeps",
    "grad_buffers": "full flat gradients that autograd is accumulating into (one per unit in backward); for "
                    "gradients cast for the reduce-scatter, autograd's own per-parameter gradients until then",
    "reduce_pending": "buffers of gradient reduce-scatters in flight (the cast to reduce dtype and the output; "
                      "qgZ's codes, those of hybrid sharding's quantized all-reduce, and on gloo the peers' copies of "
                      "this rank's slice that a reduce-scatter of 1 MiB and more receives within a node)",
    "staged": "device copies of host-side shards (and frozen codes) that gathers read: copied ahead of the gather "
              "(OffloadConfig.copy_ahead_bytes) or by it, alive until the gather is waited for",
    "pooled": "free gradient buffers kept for reuse (CPU only; the caching allocator pools on accelerators)",
    "gathers_kept": "memory of released gather buffers kept for the next gathers (CPU only; at most the most "
                    "bytes gathered at once, engine/buffers.py GatherPool)",
    "shards_device": "parameter shards (or frozen codes) on the compute device",
    "shards_cpu": "parameter shards (or frozen codes) and their 16-bit compute copies in CPU memory",
    "shards_nvme": "parameter shards in NVMe swap files",
    "grad_shards": "fp32 gradient shards accumulated over micro-batches (resident bytes)",
    "optimizer": "fp32 master shards separate from the parameter shards, and optimizer states (resident bytes)",
    "optimizer_device": "fp32 master shards, gradient shards and optimizer states of the groups stepped on the "
                        "device beside an offloaded optimizer (OffloadConfig.device_bytes)",
    "optimizer_nvme": "fp32 masters, gradient shards and optimizer states in NVMe swap files",
    "staging": "host staging buffers holding records swapped in from or out to NVMe (the resident part of "
               "shards_cpu, grad_shards and optimizer under NVMe offload lives in them: they overlap; not the "
               "records OffloadConfig.host_bytes keeps in host memory, which have buffers of their own)",
    "device_total": "all of the above that lives on the compute device (the peak of the sum)",
}


class MemoryLedger:
    """Bytes per category: the current value and the largest since the last :meth:`reset_peaks`.

    Args:
        device_categories: The categories that live on the compute device; their sum is tracked
            as ``"device_total"`` (its peak is the peak of the sum, not the sum of the peaks).

    Attributes:
        now: Category -> bytes held now (``"device_total"`` included).
        peak: Category -> the most bytes held at once since the last reset.
    """

    def __init__(self, device_categories: tuple[str, ...] = ()) -> None:
        self.device_categories = frozenset(device_categories)
        self.now: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.peak: dict[str, int] = dict(self.now)

    def add(self, category: str, nbytes: int) -> None:
        """Add ``nbytes`` (negative to remove) to ``category`` and update its peak.

        Raises:
            KeyError: an unknown category.
        """
        value = self.now[category] + nbytes
        self.now[category] = value
        if value > self.peak[category]:
            self.peak[category] = value
        if category in self.device_categories:
            total = self.now["device_total"] + nbytes
            self.now["device_total"] = total
            if total > self.peak["device_total"]:
                self.peak["device_total"] = total

    def set(self, category: str, nbytes: int) -> None:
        """Record a category counted from the state itself (shards, optimizer state)."""
        self.add(category, nbytes - self.now[category])

    def reset_peaks(self) -> None:
        """Start a new peak window (a training step): every peak becomes the current value."""
        self.peak = dict(self.now)
