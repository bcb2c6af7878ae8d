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
host do not queue in front of the shards that the next units need. A third stream carries the
copies of shards to the device (:meth:`Transfers.copy_ahead`, made ahead of their gathers or by
them), in the order the gathers need them: a gather, on the first stream, and the compute that
waits for it, wait for the copy of its own shard only, not for the later units' copies queued
before it.

Memory safety, as the caching allocators see it (FSDP's copy-stream rules):

- a copy to the device does not wait for the compute queued before it unless it depends on it:
  only a copy that overwrites device memory compute may still read (a refilled gather buffer, a
  device shard rewritten after a step) first waits for the compute stream's work so far
  (:meth:`Transfers.on_copy_stream` with ``after_compute``), and so do copies to the host, which
  read what compute wrote;
- every other copy writes memory allocated on the copy stream inside the block, so no compute
  work can still be using it; what compute then reads of it is recorded on the compute stream
  (:meth:`Transfers.for_compute`, ``record_stream``), so the allocator does not hand it to the copy
  stream again before compute is done with it. The same holds for tensors a collective read (NCCL
  holds them until ``wait()``, which orders the compute stream after it: they are recorded there
  when :class:`HeldUntilWait` is waited for). The cost: the copy stream's blocks are a pool of
  their own in the caching allocator (as FSDP1's all-gather stream's);
- a device tensor read by a copy stream is recorded on it (``record_stream``), so the allocator
  does not hand its memory out again before the copy is done;
- a shard's copy (:meth:`Transfers.copy_ahead`) is memory of the :attr:`~Transfers.ahead` stream;
  the gather's stream waits for the copy's event and records it (:meth:`Transfers.take_ahead`), and
  the gather holds it until it is waited for, when it is recorded on the compute stream as above;
  one made ahead and dropped unread (a pass ended) was used by the ahead stream alone, so its
  memory is that stream's again at once;
- a page-locked host tensor used by a non-blocking copy is kept by torch's caching host allocator
  until that copy's event completes, so a transient staging buffer may be dropped right away. That
  allocator rounds every block up to a power of two: page-locked host memory can be up to twice
  the bytes asked for (DeepSpeed's and FSDP2's ``pin_memory()`` buffers come from it too);
- the host writes into a page-locked buffer that a copy may still read (a host-tier shard) only
  after :meth:`Transfers.host_wait_h2d`; the host waits only for copies, never for compute, before
  it reuses a staging buffer (:meth:`HeldUntilWait.wait_on_host`).
"""

from __future__ import annotations

import os
from collections import deque
from contextlib import contextmanager
from typing import Any, Iterator, NamedTuple, Optional

import torch
from torch import Tensor

__all__ = ["CopiedAhead", "HeldUntilWait", "Streams", "Transfers", "is_accelerator", "local_device_index",
           "resolve_device"]


def resolve_device(device: "torch.device | str") -> torch.device:
    """``device`` with its index, so that comparisons with tensors' devices (``cuda:0``) hold: an
    accelerator given without one (``"cuda"``) is this process's device of that type, decided by
    :func:`local_device_index` from the current device and ``LOCAL_RANK`` (torchrun's).

    Raises:
        ValueError: ``LOCAL_RANK`` names another device than the current one and either could be
            meant (see :func:`local_device_index`).
    """
    device = torch.device(device)
    if not is_accelerator(device) or device.index is not None:
        return device
    index = local_device_index(torch.accelerator.current_device_index(), os.environ.get("LOCAL_RANK"),
                               torch.accelerator.device_count(), device.type)
    return torch.device(device.type, index)


def is_accelerator(device: torch.device) -> bool:
    """Whether ``device`` is of this machine's accelerator type (``cuda`` on an NVIDIA machine):
    not ``cpu``, nor ``meta``, nor a type that has no devices here."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator is not None and device.type == accelerator.type


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


class Streams:
    """Where :class:`Transfers` gets its streams and events: the accelerator's, through torch's
    device-agnostic API (``torch.Stream``, ``torch.Event``, ``torch.accelerator``). A test passes
    its own object with these methods to observe, on a CPU build, which stream waits for which and
    which memory is recorded for which stream."""

    def current(self, device: torch.device) -> Any:
        """The compute stream: the stream current on ``device``."""
        return torch.accelerator.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        """A new stream on ``device`` (a copy stream)."""
        return torch.Stream(device=device)

    def new_event(self, device: torch.device) -> Any:
        """A new event on ``device``."""
        return torch.Event(device=device)

    @staticmethod
    def use(stream: Any) -> Any:
        """A context manager: device work inside it is queued on ``stream``, and memory allocated
        inside it belongs to ``stream``."""
        return stream

    @staticmethod
    def record_stream(tensor: Tensor, stream: Any) -> None:
        """``tensor``'s memory is not reused before the work queued on ``stream`` so far is done."""
        tensor.record_stream(stream)


class Transfers:
    """The copy streams of one compute device, and the copies that run on them.

    Args:
        device: The compute device. On ``cpu`` copies are synchronous and no stream exists.
        streams: Where streams and events come from (default :class:`Streams`, the accelerator's;
            none on the CPU). Given with a CPU device, copies run on its streams as they would on an
            accelerator, but host memory is not page-locked (tests of the ordering).

    Attributes:
        overlapped: Whether copies run on copy streams (an accelerator device).
        h2d: The stream of copies to the device (and collectives that read them), ``None`` on the CPU.
        d2h: The stream of copies to the host, ``None`` on the CPU.
        ahead: The stream of the copies of shards to the device (made ahead of their gathers or by
            them), ``None`` on the CPU.
    """

    def __init__(self, device: torch.device, streams: Optional[Streams] = None) -> None:
        self.device = resolve_device(device)
        self._pinned = is_accelerator(self.device)
        self.streams = streams if streams is not None else (Streams() if self._pinned else None)
        self.overlapped = self.streams is not None
        self.h2d: Optional[Any] = self.streams.new_stream(self.device) if self.streams else None
        self.d2h: Optional[Any] = self.streams.new_stream(self.device) if self.streams else None
        self.ahead: Optional[Any] = self.streams.new_stream(self.device) if self.streams else None
        # Copy-stream memory compute has queued its last use of: (compute event, bytes), oldest first.
        self._awaiting: deque[tuple[Any, int]] = deque()
        self._awaiting_bytes = 0
        self._largest = 0

    def host_empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        """A 1-D host tensor of ``numel`` elements of ``dtype``, page-locked with an accelerator."""
        return torch.empty(numel, dtype=dtype, pin_memory=self._pinned)

    def host_zeros(self, numel: int, dtype: torch.dtype) -> Tensor:
        """Like :meth:`host_empty`, zero-filled."""
        return self.host_empty(numel, dtype).zero_()

    def host_copy(self, tensor: Tensor) -> Tensor:
        """``tensor`` (a host tensor) page-locked with an accelerator, else itself."""
        return tensor.pin_memory() if self._pinned else tensor

    def compute_stream(self) -> Any:
        """The stream compute runs on (``None`` on the CPU)."""
        return self.streams.current(self.device) if self.streams else None

    @contextmanager
    def on_copy_stream(self, stream: Optional[Any] = None, after_compute: bool = False) -> Iterator[None]:
        """Queue the block's device work (copies, and collectives that read what they copied) on
        ``stream`` (default :attr:`h2d`); memory allocated inside belongs to that stream.

        Without ``after_compute`` the block does not wait for the compute queued so far, so it
        must not write device memory compute may still read: it writes only memory it allocates
        (pass what compute will read of it to :meth:`for_compute`) and reads host memory or device
        memory compute no longer writes. ``after_compute``: the block first waits for the compute
        stream's work so far (it overwrites memory compute reads, or reads what compute wrote)."""
        stream = stream or self.h2d
        if stream is None:
            yield
            return
        if after_compute:
            stream.wait_stream(self.compute_stream())
        with self.streams.use(stream):
            yield

    def for_compute(self, *tensors: Tensor) -> None:
        """Tensors allocated on a copy stream that the compute stream reads: their memory is not
        reused before the compute queued when they are freed is done (``record_stream``)."""
        if self.streams is None:
            return
        compute = self.compute_stream()
        for tensor in tensors:
            self.streams.record_stream(tensor, compute)

    def done_with(self, nbytes: int) -> None:
        """Compute has queued its last use of ``nbytes`` of copy-stream memory recorded for it (a
        released gather buffer, a reloaded activation consumed); the memory is freed now and
        reusable once compute gets there (an event on the compute stream marks the point)."""
        if self.streams is None or nbytes == 0:
            return
        self._awaiting.append((self.record(self.compute_stream()), nbytes))
        self._awaiting_bytes += nbytes

    def limit_ahead(self, nbytes: int) -> None:
        """Call before allocating ``nbytes`` on a copy stream for compute: the host's rate limiter.

        Copies no longer wait for compute, so nothing else stops the host from queuing gathers
        (and activation reloads) many units ahead of the device, each into new memory, while the
        memory compute is done with only becomes reusable when the device gets there: reserved
        memory would grow towards the whole model's. So, as FSDP's ``limit_all_gathers``, the
        host waits for compute when more than twice the largest such allocation is freed but not
        yet reached by the device, oldest first; a host at most about two allocations ahead never
        waits. Gathers and activation reloads share the budget, which follows the largest
        allocation seen so far (one large reload, fp32 logits say, loosens it for the run)."""
        if self.streams is None:
            return
        self._largest = max(self._largest, nbytes)
        while self._awaiting and (self._awaiting_bytes > 2 * self._largest or self._awaiting[0][0].query()):
            event, freed = self._awaiting.popleft()
            event.synchronize()
            self._awaiting_bytes -= freed

    def record(self, stream: Optional[Any] = None) -> Optional[Any]:
        """An event after everything queued so far on ``stream`` (default :attr:`h2d`); ``None``
        on the CPU."""
        stream = stream or self.h2d
        if stream is None:
            return None
        event = self.streams.new_event(self.device)
        event.record(stream)
        return event

    def host_wait_h2d(self) -> None:
        """Block the host until every copy to the device has completed (those made ahead too):
        before the host writes into page-locked memory such a copy may read (host-tier shards: a
        step, a load, an edit)."""
        if self.h2d is not None:
            self.h2d.synchronize()
            self.ahead.synchronize()

    def wait_on_device(self, event: Optional[Any]) -> None:
        """Make the compute stream wait for ``event`` (the host does not wait)."""
        if event is not None:
            self.compute_stream().wait_event(event)

    @staticmethod
    def wait_on_host(event: Optional[Any]) -> None:
        """Block the host until ``event`` has completed."""
        if event is not None:
            event.synchronize()

    def hold(self, handle: Any, *staged: Tensor) -> HeldUntilWait:
        """Wrap the handle of work just issued inside :meth:`on_copy_stream` (a collective, or one
        rank's local copy): its ``wait()`` orders the compute stream after the copy stream first,
        and ``staged`` (allocated on the copy stream) stays alive until then."""
        return HeldUntilWait(handle, staged, self.record(), self)

    def copy_ahead(self, hosts: tuple[Tensor, ...]) -> CopiedAhead:
        """Start copying the host tensors ``hosts`` to the device on the :attr:`ahead` stream,
        waiting for nothing (the result is new memory of that stream): a shard copied for the
        gather that reads it, ahead of it or when it is issued. The copies queue in the order they
        are asked for, apart from the gathers, which wait only for the copies they read
        (:meth:`take_ahead`)."""
        with self.on_copy_stream(self.ahead):
            copies = tuple(self.to_device(host) for host in hosts)
        return CopiedAhead(copies, self.record(self.ahead))

    def take_ahead(self, copied: CopiedAhead) -> tuple[Tensor, ...]:
        """Inside :meth:`on_copy_stream` (the stream of the work that reads them): order that
        stream after ``copied``'s copies and record their memory on it. Returns the device tensors."""
        stream = self.streams.current(self.device) if self.streams else None
        if stream is not None and copied.event is not None:
            stream.wait_event(copied.event)
            for tensor in copied.tensors:
                self.streams.record_stream(tensor, stream)
        return copied.tensors

    def to_device(self, host: Tensor) -> Tensor:
        """``host`` copied to the device; call inside :meth:`on_copy_stream`. Non-blocking when
        ``host`` is page-locked; the result belongs to the copy stream."""
        return host.to(self.device, non_blocking=self.overlapped and host.is_pinned())

    def copy_to_device(self, dst: Tensor, src: Tensor) -> Optional[Any]:
        """Copy the host tensor ``src`` into ``dst`` (any dtypes, same numel). Into a device tensor
        without blocking the host: ``src`` is first cast into page-locked memory in ``dst``'s dtype,
        so it may change as soon as this returns; the copy waits for the compute queued so far
        (which may still read ``dst``). Into a host tensor: a plain copy.

        Returns:
            The copy's event (``None`` for a plain copy). The compute stream must wait for it, or
            for a later event of the same stream, before reading ``dst`` (:meth:`wait_on_device`).
        """
        if not self.overlapped or dst.device != self.device:
            dst.copy_(src)
            return None
        staged = self.host_empty(src.numel(), dst.dtype).copy_(src.reshape(-1))
        with self.on_copy_stream(after_compute=True):
            dst.copy_(staged.view(dst.shape), non_blocking=True)
        return self.record()

    def copy_to_host(self, dst: Tensor, src: Tensor) -> Optional[Any]:
        """Copy the device tensor ``src`` into the host tensor ``dst`` (page-locked, same shape) on
        the :attr:`d2h` stream, after the compute stream's work so far (which wrote ``src``);
        ``src`` may be freed as soon as this returns. From a host tensor: a plain copy.

        Returns:
            The copy's event: the host must :meth:`wait_on_host` it before reading ``dst``, and a
            copy of ``dst`` back to the device must wait for it (:meth:`reload`).
        """
        if not self.overlapped or src.device != self.device:
            dst.copy_(src)
            return None
        with self.on_copy_stream(self.d2h, after_compute=True):
            dst.copy_(src, non_blocking=True)
        self.streams.record_stream(src, self.d2h)
        return self.record(self.d2h)

    def reload(self, host: Tensor, event: Optional[Any]) -> tuple[Tensor, Optional[Any]]:
        """Start copying ``host`` (page-locked, written by the copy that ``event`` ends) back to
        the device, without waiting for compute: into memory of the copy stream (after
        :meth:`limit_ahead`).

        Returns:
            The device tensor and the copy's event: the stream that reads the tensor must wait for
            the event (:meth:`wait_on_device`) and record the tensor (:meth:`for_compute`) before
            reading it, and report it with :meth:`done_with` when done; nothing waits until then.
        """
        self.limit_ahead(host.numel() * host.element_size())
        with self.on_copy_stream():
            if event is not None:
                self.h2d.wait_event(event)
            out = torch.empty(host.size(), dtype=host.dtype, device=self.device)
            out.copy_(host, non_blocking=True)
        return out, self.record()


class CopiedAhead(NamedTuple):
    """Device copies of host tensors made ahead of their use (:meth:`Transfers.copy_ahead`).

    Attributes:
        tensors: The device tensors (memory of the ahead stream).
        event: The copies' event on the ahead stream (``None`` on the CPU).
    """

    tensors: tuple[Tensor, ...]
    event: Optional[Any]


class HeldUntilWait:
    """The handle of work issued on the copy stream (:meth:`Transfers.hold`): ``wait()`` orders the
    compute stream after the copy stream's work up to the issue (on the device), then waits on the
    collective's own handle; the tensors staged for it stay alive until then, and are recorded on
    the compute stream (which the collective's ``wait()`` ordered after every stream that read them)."""

    def __init__(self, handle: Any, tensors: tuple[Tensor, ...], event: Optional[Any],
                 transfers: Transfers) -> None:
        self.handle = handle
        self.tensors = tensors
        self.event = event
        self.transfers = transfers

    def wait(self) -> bool:
        self.transfers.wait_on_device(self.event)
        self.handle.wait()
        self.transfers.for_compute(*self.tensors)
        self.tensors = ()
        return True

    def wait_on_host(self) -> None:
        """Block the host until the copy stream's work up to the issue is done (before memory the
        copies read, such as an NVMe staging buffer, is reused); the copies never waited for
        compute, so neither does the host."""
        self.transfers.wait_on_host(self.event)
