"""The bandwidths a plan's traffic is timed with, measured on this machine at setup.

The disk's comes from the swapper itself (:class:`~lightning_zinf.offload.NvmeSwapper`, with the
run's ``aio`` settings and ``O_DIRECT``): one record written and read back in a folder of its own
under ``nvme_path``, removed afterwards. The host link's (an accelerator's) from one copy of a
page-locked buffer to the device and back. ZeRO-Infinity sizes its offload by these two
(Rajbhandari et al., SC'21, §4.2: the bandwidth each tier needs to keep the device busy).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

import torch

from lightning_zinf.offload.aio import AioConfig
from lightning_zinf.offload.aligned import aligned_empty
from lightning_zinf.offload.errors import SwapError
from lightning_zinf.offload.staging import registered_empty
from lightning_zinf.offload.swapper import NvmeSwapper

__all__ = ["Bandwidths", "measure_bandwidths"]

#: Bytes moved by each probe: large enough to pass the caches' and the queue's start-up.
PROBE_BYTES = 64 << 20


@dataclass(frozen=True)
class Bandwidths:
    """Measured bandwidths, bytes per second per rank (``None``: not measured, no such tier).

    Attributes:
        disk: NVMe, the mean of a write and a read through the swapper.
        link: Host to device and back (an accelerator's copy engine), page-locked.
    """

    disk: Optional[float] = None
    link: Optional[float] = None

    def seconds(self, disk_bytes: int, link_bytes: int) -> float:
        """Seconds the traffic of a step takes at these bandwidths (0 for a tier not measured)."""
        return (disk_bytes / self.disk if self.disk else 0.0) + (link_bytes / self.link if self.link else 0.0)


def _disk(nvme_path: str, aio: AioConfig, nbytes: int) -> float:
    buffer = aligned_empty(nbytes, torch.uint8)
    buffer.fill_(1)
    try:
        probe = tempfile.TemporaryDirectory(prefix=".zinf-probe-", dir=nvme_path)
    except OSError as error:
        raise SwapError(
            f"memory_budget measures the disk under offload.nvme_path={nvme_path!r}, but making a folder there "
            f"failed: {error.strerror or error}. Point nvme_path at an existing folder this process may write, on "
            "a local disk."
        ) from error
    with probe as folder:
        with NvmeSwapper(os.path.join(folder, "swap"), aio) as swapper:
            start = time.perf_counter()
            swapper.write("probe", buffer).wait()
            middle = time.perf_counter()
            swapper.read("probe", buffer).wait()
            end = time.perf_counter()
    return 2 * nbytes / ((middle - start) + (end - middle))


def _link(device: torch.device, nbytes: int) -> float:
    # On CUDA page-locked memory of its own, freed with the tensor (torch's caching host allocator
    # would keep the probe's pages locked for the rest of the run); torch's pinned memory elsewhere.
    if device.type == "cuda":
        host = registered_empty(nbytes, device.index if device.index is not None else torch.cuda.current_device())
    else:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    on_device.copy_(host, non_blocking=True)  # the first copy pays the driver's set-up
    torch.accelerator.synchronize(device)  # ``device``'s queues, whichever device is current
    start = time.perf_counter()
    on_device.copy_(host, non_blocking=True)
    host.copy_(on_device, non_blocking=True)
    torch.accelerator.synchronize(device)  # and no copy reads ``host`` once it is dropped
    return 2 * nbytes / (time.perf_counter() - start)


def measure_bandwidths(device: torch.device, nvme_path: Optional[str], aio: AioConfig = AioConfig(),
                       nbytes: int = PROBE_BYTES) -> Bandwidths:
    """This machine's disk bandwidth under ``nvme_path`` (if given) and host-link bandwidth to
    ``device`` (if an accelerator), each from one ``nbytes`` transfer each way.

    Raises:
        SwapError: ``nvme_path`` is not a folder this process can write, or the disk is full (the
            message names the path and the fix).
    """
    return Bandwidths(disk=_disk(nvme_path, aio, nbytes) if nvme_path else None,
                      link=_link(device, nbytes) if device.type != "cpu" else None)
