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

Memory safety, as the caching allocators see it:

- the copy stream first waits for the work queued so far on the compute stream, so a device buffer
  the compute stream freed (a released unit) is never overwritten under its pending kernels;
- a device tensor read by the copy stream is recorded on it (``record_stream``), so the allocator
  does not hand its memory out again before the copy is done;
- a page-locked host tensor used by a non-blocking copy is kept by torch's caching host allocator
  until that copy's event completes, so a transient staging buffer may be dropped right away.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import Tensor

__all__ = ["HeldUntilWait", "Transfers"]


class Transfers:
    """The copy stream of one compute device, and the copies that run on it.

    Args:
        device: The compute device. On ``cpu`` copies are synchronous and no stream exists.

    Attributes:
        overlapped: Whether copies run on a copy stream (an accelerator device).
        stream: The copy stream, ``None`` on the CPU.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.overlapped = self.device.type != "cpu"
        self.stream: Optional[torch.Stream] = torch.Stream(device=self.device) if self.overlapped else None

    def host_empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        """A 1-D host tensor of ``numel`` elements of ``dtype``, page-locked when copies overlap."""
        return torch.empty(numel, dtype=dtype, pin_memory=self.overlapped)

    def host_zeros(self, numel: int, dtype: torch.dtype) -> Tensor:
        """Like :meth:`host_empty`, zero-filled."""
        return self.host_empty(numel, dtype).zero_()

    @contextmanager
    def on_copy_stream(self) -> Iterator[None]:
        """Queue the block's device work (copies, and collectives that read what they copied) on
        the copy stream, after the work queued on the compute stream so far. Memory allocated inside
        belongs to the copy stream: keep such tensors alive until a consumer has waited for them."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.accelerator.current_stream(self.device))
        with self.stream:
            yield

    def record(self) -> Optional[torch.Event]:
        """An event after everything queued on the copy stream so far (``None`` on the CPU)."""
        if self.stream is None:
            return None
        event = torch.Event(device=self.device)
        event.record(self.stream)
        return event

    def wait_on_device(self, event: Optional[torch.Event]) -> None:
        """Make the compute stream wait for ``event`` (the host does not wait)."""
        if event is not None:
            torch.accelerator.current_stream(self.device).wait_event(event)

    @staticmethod
    def wait_on_host(event: Optional[torch.Event]) -> None:
        """Block the host until ``event`` has completed."""
        if event is not None:
            event.synchronize()

    def to_device(self, host: Tensor) -> Tensor:
        """``host`` copied to the device; call inside :meth:`on_copy_stream`. Non-blocking when
        ``host`` is page-locked; the result belongs to the copy stream."""
        return host.to(self.device, non_blocking=self.overlapped and host.is_pinned())

    def copy_to_device(self, dst: Tensor, src: Tensor) -> Optional[torch.Event]:
        """Copy the host tensor ``src`` into ``dst`` (any dtypes, same numel). Into a device tensor
        without blocking the host: ``src`` is first cast into page-locked memory in ``dst``'s dtype,
        so it may change as soon as this returns. Into a host tensor: a plain copy.

        Returns:
            The copy's event: the compute stream must :meth:`wait_on_device` it before reading ``dst``.
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
        the copy stream, after the compute stream's work so far; ``src`` may be freed as soon as
        this returns. From a host tensor: a plain copy.

        Returns:
            The copy's event: the host must :meth:`wait_on_host` it before reading ``dst``.
        """
        if not self.overlapped or src.device.type == "cpu":
            dst.copy_(src)
            return None
        with self.on_copy_stream():
            dst.copy_(src, non_blocking=True)
        src.record_stream(self.stream)
        return self.record()


class HeldUntilWait:
    """A collective's handle that also keeps tensors alive (staged on the copy stream) until its
    ``wait()``, after which the compute stream is ordered after the collective."""

    def __init__(self, handle, *tensors: Tensor) -> None:
        self.handle = handle
        self.tensors: tuple[Tensor, ...] = tensors

    def wait(self) -> bool:
        self.handle.wait()
        self.tensors = ()
        return True
