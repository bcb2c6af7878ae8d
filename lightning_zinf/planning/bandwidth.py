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
import torch.distributed as dist

from lightning_zinf.comm.collectives import _all_gather_tensor as gather
from lightning_zinf.offload.aio import AioConfig
from lightning_zinf.offload.aligned import aligned_empty
from lightning_zinf.offload.errors import SwapError
from lightning_zinf.offload.staging import registered_empty
from lightning_zinf.offload.swapper import NvmeSwapper

__all__ = ["Bandwidths", "measure_bandwidths", "measure_collective"]

#: Bytes moved by each probe: large enough to pass the caches' and the queue's start-up.
PROBE_BYTES = 64 << 20


@dataclass(frozen=True)
class Bandwidths:
    """Measured bandwidths, bytes per second per rank (``None``: not measured, no such tier).

    Attributes:
        disk: NVMe, the mean of a write and a read through the swapper.
        link: Host to device and back (an accelerator's copy engine), page-locked.
        collective: All-gather among the run's ranks: bytes of the gathered whole per second
            (:func:`measure_collective`; ``None`` with one rank).
        host_step: Seconds per element of torch's AdamW step on the host (fp32, foreach).
        device_step: The same on an accelerator (``None`` on a CPU device).
    """

    disk: Optional[float] = None
    link: Optional[float] = None
    collective: Optional[float] = None
    host_step: Optional[float] = None
    device_step: Optional[float] = None

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


def _adamw_seconds(device: torch.device, numel: int, repeats: int) -> float:
    """Seconds of one AdamW step (torch's, its default implementation for the device) on ``numel``
    fp32 elements: the mean of ``repeats`` steps after one warm-up step."""
    parameter = torch.zeros(numel, device=device, requires_grad=True)
    parameter.grad = torch.ones(numel, device=device)
    optimizer = torch.optim.AdamW([parameter])
    optimizer.step()
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        optimizer.step()
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
    return (time.perf_counter() - start) / repeats


#: Elements of the AdamW probes: the host's rate from the small one alone; an accelerator's from
#: the difference between the two, since a step of the small one there is mostly kernel launches.
ADAMW_PROBE_NUMEL = (1 << 18, 1 << 22)


def _adamw(device: torch.device, repeats: int = 5) -> float:
    """Seconds per element of one AdamW step on ``device`` (fp32). On the host, one step's time
    over its elements. On an accelerator, the added time per added element between the two probe
    sizes: there a step of 2^18 elements is mostly launches (torch's foreach AdamW launches a few
    dozen kernels of a few microseconds each), and its time over its elements overstates a large
    model's step on the device (on the H200 run of 2026-11-30 the plans that stepped everything on
    the device predicted steps 30% and 12 times too long)."""
    small, large = ADAMW_PROBE_NUMEL
    if device.type == "cpu":
        return _adamw_seconds(device, small, repeats) / small
    rate = (_adamw_seconds(device, large, repeats) - _adamw_seconds(device, small, repeats)) / (large - small)
    torch.accelerator.empty_cache()  # the probe's 64 MiB of state, given back to the driver
    return max(rate, 0.0)


def measure_collective(device: torch.device, nbytes: int = 4 << 20, repeats: int = 3) -> Optional[float]:
    """The all-gather bandwidth among the default process group's ranks: bytes of the gathered
    whole (``nbytes``) per second, the slowest rank's mean over ``repeats`` gathers after one
    warm-up. Every rank must call it together. ``None`` without a process group of more than one rank.

    Args:
        device: Where the probe's buffers are: the rank's compute device (with NCCL, its GPU).
        nbytes: Bytes of the gathered whole (each rank sends ``nbytes // world``).
        repeats: Gathers timed.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    world = dist.get_world_size()
    part = torch.ones(nbytes // world, dtype=torch.uint8, device=device)
    whole = torch.empty(part.numel() * world, dtype=torch.uint8, device=device)
    seconds = torch.tensor([timed_all_gather(whole, part, None, device, repeats)], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return whole.numel() / seconds.item()


def timed_all_gather(whole: torch.Tensor, part: torch.Tensor, group: Optional[dist.ProcessGroup],
                     device: torch.device, repeats: int) -> float:
    """This rank's mean seconds of an all-gather of ``part`` (1-D, ``n`` elements) into ``whole``
    (``n`` times the group's ranks) over ``group`` (``None``: the default group), over ``repeats``
    gathers after one warm-up (which makes the connections), the device synchronized around them.
    Every rank of ``group`` must call it together."""
    gather(whole, part, group=group)
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        gather(whole, part, group=group)
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
    return (time.perf_counter() - start) / repeats


def measure_bandwidths(device: torch.device, nvme_path: Optional[str], aio: AioConfig = AioConfig(),
                       nbytes: int = PROBE_BYTES) -> Bandwidths:
    """This machine's disk bandwidth under ``nvme_path`` (if given) and host-link bandwidth to
    ``device`` (if an accelerator), each from one ``nbytes`` transfer each way, and AdamW's step
    rate on the host (and on ``device`` if an accelerator). The collective bandwidth needs every
    rank: :func:`measure_collective`.

    Raises:
        SwapError: ``nvme_path`` is not a folder this process can write, or the disk is full (the
            message names the path and the fix).
    """
    return Bandwidths(disk=_disk(nvme_path, aio, nbytes) if nvme_path else None,
                      link=_link(device, nbytes) if device.type != "cpu" else None,
                      host_step=_adamw(torch.device("cpu")),
                      device_step=_adamw(device) if device.type != "cpu" else None)
