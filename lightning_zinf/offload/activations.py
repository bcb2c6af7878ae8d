"""Activation offload: the tensors autograd saves for backward wait in host memory
(ZeRO-Infinity, Rajbhandari et al. SC'21, §5.1.2, which offloads activation checkpoints to CPU).

Unlike ``torch.autograd.graph.save_on_cpu``, which moves every saved tensor, tensors that are
parameters or views of a gathered parameter buffer stay where they are: under ZeRO their unit is
released after forward and gathered again for backward, so the saved view is valid again when
backward reads it, and copying it would move every weight of the model to the host and back each
step. The copies to the host run on the device-to-host copy stream
(:class:`~lightning_zinf.engine.transfer.Transfers`) into page-locked memory, so forward neither
waits for them nor delays the parameter copies going the other way. A tensor comes back when
backward asks for it, through the host-to-device stream, and compute waits for it on the device,
not on the host; that copy is not started ahead of backward (as with ``save_on_cpu``), so its time
is exposed. A non-contiguous saved tensor is copied dense, and views of one tensor saved twice are
copied twice (as with ``save_on_cpu``). Under a user's own ``autocast`` over fp32 weights the weight
casts are new tensors, so they are copied; the strategy gathers weights in the compute dtype, so
autocast makes no such casts there.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn

from lightning_zinf.engine.transfer import Transfers

__all__ = ["ActivationOffload"]


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

    @contextmanager
    def __call__(self) -> Iterator[None]:
        """Offload what autograd saves inside the block."""
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
        host = torch.empty(tensor.size(), dtype=tensor.dtype, pin_memory=self.transfers.overlapped)
        copied = self.transfers.copy_to_host(host, tensor)
        self.copied_bytes += host.numel() * host.element_size()
        return host, copied

    def _unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        host, copied = packed
        if not self.transfers.overlapped:
            return host
        return self.transfers.to_device_after(host, copied)
