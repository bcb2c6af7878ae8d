"""Activation offload: the tensors autograd saves for backward wait in host memory
(ZeRO-Infinity, Rajbhandari et al. SC'21, §5.1.2, which offloads activation checkpoints to CPU).

Unlike ``torch.autograd.graph.save_on_cpu``, which moves every saved tensor, tensors that are
parameters or views of a gathered parameter buffer stay where they are: under ZeRO their unit is
released after forward and gathered again for backward, so the saved view is valid again when
backward reads it, and copying it would move every weight of the model to the host and back each
step. The copies run on the copy stream (:class:`~lightning_zinf.engine.transfer.Transfers`) into
page-locked memory, so forward does not wait for them; a tensor comes back in backward through the
same stream, and compute waits for it on the device, not on the host.
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
            or (self.transfers.overlapped and tensor.device.type == "cpu")
            or self.is_gathered(tensor)
        )
        if keep:
            self.kept += 1
            return tensor
        host = torch.empty(tensor.size(), dtype=tensor.dtype, pin_memory=self.transfers.overlapped)
        self.transfers.copy_to_host(host, tensor)
        self.copied_bytes += host.numel() * host.element_size()
        return tensor.device, host

    def _unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        device, host = packed
        if device.type == "cpu":
            return host
        # Allocated on the compute stream, which reads it; the copy stream writes it after the
        # compute stream's work so far, and the compute stream waits for the copy.
        out = torch.empty(host.size(), dtype=host.dtype, device=device)
        with self.transfers.on_copy_stream():
            out.copy_(host, non_blocking=True)
        self.transfers.wait_on_device(self.transfers.record())
        return out
