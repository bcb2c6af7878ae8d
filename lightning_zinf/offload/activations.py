"""Activation offload: the tensors autograd saves for backward wait in host memory
(ZeRO-Infinity, Rajbhandari et al. SC'21, §5.1.2, which offloads activation checkpoints to CPU).

Unlike ``torch.autograd.graph.save_on_cpu``, which moves every saved tensor, tensors that are
parameters or views of a gathered parameter buffer stay where they are: under ZeRO their unit is
released after forward and gathered again for backward, so the saved view is valid again when
backward reads it, and copying it would move every weight of the model to the host and back each
step. The copies to the host run on the device-to-host copy stream
(:class:`~lightning_zinf.engine.transfer.Transfers`) into page-locked memory, so forward neither
waits for them nor delays the parameter copies going the other way; each entry of the context
(a block the memory plan offloads) first waits for the copies of the one before, so the forward runs at most one block
ahead of the link. In backward a tensor comes
back through the host-to-device stream without waiting for compute, and compute waits for it on the
device, not on the host. When backward asks for one tensor, the copy of the latest saved tensor not
yet asked for starts too (backward mostly asks in reverse order of saving), so that copy overlaps
the compute in between (``save_on_cpu`` copies each only when it is asked for); at most one such copy
is started per request, so about one saved tensor waits on the device ahead of its use. A non-contiguous saved tensor is copied dense, and views of one tensor saved twice are
copied twice (as with ``save_on_cpu``). Under a user's own ``autocast`` over fp32 weights the weight
casts are new tensors, so they are copied; the strategy gathers weights in the compute dtype, so
autocast makes no such casts there.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor, nn

from lightning_zinf.engine.transfer import Transfers

__all__ = ["ActivationOffload"]


class _Saved:
    """One offloaded saved tensor: its host copy, the event of the copy there, and a copy back to
    the device started ahead of the request (tensor, event)."""

    __slots__ = ("host", "copied", "order", "ahead", "unpacked", "__weakref__")

    def __init__(self, host: Tensor, copied: Any, order: "_Order") -> None:
        self.host, self.copied, self.order = host, copied, order
        self.ahead: Optional[tuple[Tensor, Any]] = None
        self.unpacked = False
        order.add(self)


class _Order:
    """One forward's offloaded tensors in the order they were saved (weakly: a freed graph takes
    its host copies with it), and which to copy back ahead: the latest saved that is neither asked
    for yet nor on its way (backward mostly asks for them in reverse; one out of order costs one
    copy that was not started ahead, and the next request catches up)."""

    __slots__ = ("saved", "cursor")

    def __init__(self) -> None:
        self.saved: list[weakref.ref[_Saved]] = []
        self.cursor = -1

    def add(self, saved: _Saved) -> None:
        self.saved.append(weakref.ref(saved))
        self.cursor = len(self.saved) - 1

    def next_ahead(self) -> Optional[_Saved]:
        """The latest saved tensor not asked for and not copied back ahead, or ``None``. Entries
        passed over stay passed over (they are asked for, on their way, or freed), so the whole
        backward scans the list once."""
        while self.cursor >= 0:
            saved = self.saved[self.cursor]()
            if saved is not None and not saved.unpacked and saved.ahead is None:
                return saved
            self.cursor -= 1
        return None


class ActivationOffload:
    """Saved-tensor hooks that keep activations in host memory between forward and backward.

    Args:
        transfers: The compute device's copy stream.
        is_gathered: Whether a tensor's storage is a parameter buffer the engine gathers (such a
            tensor is kept as it is).

    Attributes:
        copied_bytes: Bytes of saved tensors copied to the host so far.
        kept: Saved tensors left in place so far (parameters and views of gathered buffers, empty
            or non-strided tensors, and tensors already in host memory).
    """

    def __init__(self, transfers: Transfers, is_gathered: Callable[[Tensor], bool]) -> None:
        self.transfers = transfers
        self.is_gathered = is_gathered
        self.copied_bytes = 0
        self.kept = 0
        self._order = _Order()
        self._copied: Optional[Any] = None  # the event of the latest copy to the host

    @contextmanager
    def __call__(self, fresh: bool = True) -> Iterator[None]:
        """Offload what autograd saves inside the block. ``fresh``: a new forward starts (the
        copies back ahead follow the saving order of one forward); ``False`` continues the order of
        the last one (the next offloaded block of the same forward).

        The host first waits for the copies to the host made so far (the block before's): the
        device memory of a tensor being copied is not reused until its copy is done, so a forward
        that outran the link would hold every earlier block's saved tensors on the device, where
        the plan counts one block's (:meth:`ForwardProfile.activation_bytes
        <lightning_zinf.planning.profile.ForwardProfile.activation_bytes>`). A link that keeps up
        has finished them by then."""
        self.transfers.wait_on_host(self._copied)
        self._copied = None
        if fresh:
            self._order = _Order()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, tensor: Tensor) -> Any:
        keep = (
            isinstance(tensor, nn.Parameter)
            or tensor.layout != torch.strided
            or tensor.numel() == 0
            or (self.transfers.overlapped and tensor.device != self.transfers.device)  # host, or another device
            or self.is_gathered(tensor)
        )
        if keep:
            self.kept += 1
            return tensor
        host = self.transfers.host_empty(tensor.numel(), tensor.dtype).view(tensor.size())
        copied = self.transfers.copy_to_host(host, tensor)
        self.copied_bytes += host.numel() * host.element_size()
        if not self.transfers.overlapped:
            return host
        self._copied = copied
        return _Saved(host, copied, self._order)

    def _unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        tensor, event = packed.ahead or self.transfers.reload(packed.host, packed.copied)
        packed.ahead, packed.unpacked = None, True
        following = packed.order.next_ahead()
        if following is not None:
            following.ahead = self.transfers.reload(following.host, following.copied)
        self.transfers.wait_on_device(event)
        self.transfers.for_compute(tensor)  # the stream of the backward node asking for it
        # When autograd drops it, the node that read it has been queued (on the stream current
        # then): the rate limiter counts its memory from there. Not at exit: no device calls then.
        weakref.finalize(tensor, self.transfers.done_with, tensor.numel() * tensor.element_size()).atexit = False
        return tensor
