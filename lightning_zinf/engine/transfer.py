"""Host <-> device copies that overlap compute: one copy stream, page-locked host memory, events.

ZeRO-Offload (Ren et al., ATC'21, §4.2) and ZeRO-Infinity (Rajbhandari et al., SC'21, §6.2,
"overlap-centric design") move offloaded shards, gradients and activations over PCIe while the
device computes. That needs three things a plain ``tensor.to(device)`` lacks: the host side in
page-locked memory (a copy from pageable memory is staged by the driver and blocks the host), the
copy queued on a stream of its own, and an event that orders the consumer after the copy without
blocking the host.

Device-agnostic (``torch.Stream``, ``torch.Event``, ``torch.accelerator``). With a CPU compute
device there is nothing to overlap: every method makes the same calls synchronously, with no
stream and no events, so the call sites run in CI exactly as they do on an accelerator.

Two copy streams, one per direction (PCIe is full duplex): activations and gradients going to the
host do not queue in front of the shards that the next units need.

Memory safety, as the caching allocators see it:

- a copy stream first waits for the work queued so far on the compute stream. That protects
  destinations the compute stream allocated (a gather buffer, a device shard, an activation coming
  back), and makes it safe to reuse a copy-stream block freed after a compute-side ``wait()``
  (NCCL holds the tensors of an asynchronous collective until ``wait()``, then the compute stream,
  not the copy stream, is ordered after it);
- a device tensor read by a copy stream is recorded on it (``record_stream``), so the allocator
  does not hand its memory out again before the copy is done;
- a page-locked host tensor used by a non-blocking copy is kept by torch's caching host allocator
  until that copy's event completes, so a transient staging buffer may be dropped right away. That
  allocator rounds every block up to a power of two: page-locked host memory can be up to twice
  the bytes asked for (DeepSpeed's and FSDP2's ``pin_memory()`` buffers come from it too);
- the host writes into a page-locked buffer that a copy may still read (a host-tier shard) only
  after :meth:`Transfers.host_wait_h2d`.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from torch import Tensor

__all__ = ["HeldUntilWait", "Transfers", "local_device_index", "resolve_device"]


def resolve_device(device: "torch.device | str") -> torch.device:
    """``device`` with its index, so that comparisons with tensors' devices (``cuda:0``) hold: an
    accelerator given without one (``"cuda"``) is this process's device of that type, decided by
    :func:`local_device_index` from the current device and ``LOCAL_RANK`` (torchrun's).

    Raises:
        ValueError: ``LOCAL_RANK`` names another device than the current one and either could be
            meant (see :func:`local_device_index`).
    """
    device = torch.device(device)
    if device.type == "cpu" or device.index is not None:
        return device
    index = local_device_index(torch.accelerator.current_device_index(), os.environ.get("LOCAL_RANK"),
                               torch.accelerator.device_count(), device.type)
    return torch.device(device.type, index)


def local_device_index(current: int, local_rank: Optional[str], count: int, kind: str = "cuda") -> int:
    """The device index of a process asked for ``kind`` without an index.

    Several ranks on one machine all start with device 0 current; a rank that never called
    ``torch.cuda.set_device`` would put its shards and collectives on another rank's device (NCCL
    then hangs or fails, and memory runs out on device 0). So: without ``LOCAL_RANK``, or when the
    current device is the local rank's, or when there are fewer devices than local ranks (ranks
    share devices by choice), the current device; otherwise this is ambiguous, and refused.

    Args:
        current: The current device index of ``kind``.
        local_rank: ``LOCAL_RANK`` from the environment, or None.
        count: Devices of ``kind`` on the machine.
        kind: The device type, for the message.

    Raises:
        ValueError: ``local_rank`` names an existing device other than ``current`` (the message
            names both fixes: ``torch.cuda.set_device(LOCAL_RANK)`` or an explicit index), or is not
            an integer.
    """
    if local_rank is None:
        return current
    try:
        rank = int(local_rank)
    except ValueError:
        raise ValueError(f"LOCAL_RANK={local_rank!r} is not an integer; unset it or set it to this process's "
                         "rank on its machine (torchrun sets it).") from None
    if rank == current or rank >= count:
        return current
    raise ValueError(
        f"device={kind!r} has no index, and this process (LOCAL_RANK={rank}) has {kind}:{current} current "
        f"while the machine has {count} {kind} devices: every rank would use {kind}:{current}. Call "
        f"torch.cuda.set_device({rank}) (torch.accelerator.set_device_index({rank})) before building the engine, "
        f"or pass device='{kind}:{rank}' (or '{kind}:{current}' to share that device on purpose)."
    )


class Transfers:
    """The copy streams of one compute device, and the copies that run on them.

    Args:
        device: The compute device. On ``cpu`` copies are synchronous and no stream exists.

    Attributes:
        overlapped: Whether copies run on copy streams (an accelerator device).
        h2d: The stream of copies to the device (and collectives that read them), ``None`` on the CPU.
        d2h: The stream of copies to the host, ``None`` on the CPU.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = resolve_device(device)
        self.overlapped = self.device.type != "cpu"
        self.h2d: Optional[torch.Stream] = torch.Stream(device=self.device) if self.overlapped else None
        self.d2h: Optional[torch.Stream] = torch.Stream(device=self.device) if self.overlapped else None

    def host_empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        """A 1-D host tensor of ``numel`` elements of ``dtype``, page-locked when copies overlap."""
        return torch.empty(numel, dtype=dtype, pin_memory=self.overlapped)

    def host_zeros(self, numel: int, dtype: torch.dtype) -> Tensor:
        """Like :meth:`host_empty`, zero-filled."""
        return self.host_empty(numel, dtype).zero_()

    @contextmanager
    def on_copy_stream(self, stream: Optional[torch.Stream] = None) -> Iterator[None]:
        """Queue the block's device work (copies, and collectives that read what they copied) on
        ``stream`` (default :attr:`h2d`), after the work queued on the compute stream so far.
        Memory allocated inside belongs to that stream: keep such tensors alive until a consumer
        has waited for them."""
        stream = stream or self.h2d
        if stream is None:
            yield
            return
        stream.wait_stream(torch.accelerator.current_stream(self.device))
        with stream:
            yield

    def record(self, stream: Optional[torch.Stream] = None) -> Optional[torch.Event]:
        """An event after everything queued so far on ``stream`` (default :attr:`h2d`); ``None``
        on the CPU."""
        stream = stream or self.h2d
        if stream is None:
            return None
        event = torch.Event(device=self.device)
        event.record(stream)
        return event

    def host_wait_h2d(self) -> None:
        """Block the host until every copy to the device has completed: before the host writes
        into page-locked memory such a copy may read (host-tier shards: a step, a load, an edit)."""
        if self.h2d is not None:
            self.h2d.synchronize()

    def wait_on_device(self, event: Optional[torch.Event]) -> None:
        """Make the compute stream wait for ``event`` (the host does not wait)."""
        if event is not None:
            torch.accelerator.current_stream(self.device).wait_event(event)

    @staticmethod
    def wait_on_host(event: Optional[torch.Event]) -> None:
        """Block the host until ``event`` has completed."""
        if event is not None:
            event.synchronize()

    def hold(self, handle: Any, *staged: Tensor) -> HeldUntilWait:
        """Wrap the handle of work just issued inside :meth:`on_copy_stream` (a collective, or one
        rank's local copy): its ``wait()`` orders the compute stream after the copy stream first,
        and ``staged`` stays alive until then."""
        return HeldUntilWait(handle, staged, self.record(), self)

    def to_device(self, host: Tensor) -> Tensor:
        """``host`` copied to the device; call inside :meth:`on_copy_stream`. Non-blocking when
        ``host`` is page-locked; the result belongs to the copy stream."""
        return host.to(self.device, non_blocking=self.overlapped and host.is_pinned())

    def copy_to_device(self, dst: Tensor, src: Tensor) -> Optional[torch.Event]:
        """Copy the host tensor ``src`` into ``dst`` (any dtypes, same numel). Into a device tensor
        without blocking the host: ``src`` is first cast into page-locked memory in ``dst``'s dtype,
        so it may change as soon as this returns. Into a host tensor: a plain copy.

        Returns:
            The copy's event (``None`` for a plain copy). The compute stream must wait for it, or
            for a later event of the same stream, before reading ``dst`` (:meth:`wait_on_device`).
        """
        if not self.overlapped or dst.device.type == "cpu":
            dst.copy_(src)
            return None
        staged = self.host_empty(src.numel(), dst.dtype).copy_(src.reshape(-1))
        with self.on_copy_stream():
            dst.copy_(staged.view(dst.shape), non_blocking=True)
        return self.record()

    def copy_to_host(self, dst: Tensor, src: Tensor) -> Optional[torch.Event]:
        """Copy the device tensor ``src`` into the host tensor ``dst`` (page-locked, same shape) on
        the :attr:`d2h` stream, after the compute stream's work so far; ``src`` may be freed as soon
        as this returns. From a host tensor: a plain copy.

        Returns:
            The copy's event: the host must :meth:`wait_on_host` it before reading ``dst``, and a
            copy of ``dst`` back to the device must wait for it (:meth:`to_device_after`).
        """
        if not self.overlapped or src.device.type == "cpu":
            dst.copy_(src)
            return None
        with self.on_copy_stream(self.d2h):
            dst.copy_(src, non_blocking=True)
        src.record_stream(self.d2h)
        return self.record(self.d2h)

    def to_device_after(self, host: Tensor, event: Optional[torch.Event]) -> Tensor:
        """``host`` (page-locked, written by the copy ``event`` ends) back on the device, in memory of
        the compute stream, which waits for the copy on the device (the host does not wait)."""
        out = torch.empty(host.size(), dtype=host.dtype, device=self.device)
        with self.on_copy_stream():
            if event is not None:
                self.h2d.wait_event(event)
            out.copy_(host, non_blocking=True)
        self.wait_on_device(self.record())
        return out


class HeldUntilWait:
    """The handle of work issued on the copy stream (:meth:`Transfers.hold`): ``wait()`` orders the
    compute stream after the copy stream's work up to the issue (on the device), then waits on the
    collective's own handle; the tensors staged for it stay alive until then."""

    def __init__(self, handle: Any, tensors: tuple[Tensor, ...], event: Optional[torch.Event],
                 transfers: Transfers) -> None:
        self.handle = handle
        self.tensors = tensors
        self.event = event
        self.transfers = transfers

    def wait(self) -> bool:
        self.transfers.wait_on_device(self.event)
        self.handle.wait()
        self.tensors = ()
        return True

    def wait_on_host(self) -> None:
        """Block the host until the copy stream's work up to the issue is done (before memory the
        copies read, such as an NVMe staging buffer, is reused)."""
        self.transfers.wait_on_host(self.event)
