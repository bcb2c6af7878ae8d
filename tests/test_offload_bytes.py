"""Bytes over the host link per optimizer step under ZeRO-Offload's layout (issue 39 item 1).

``OffloadConfig(param="none", optimizer="cpu")`` (or ``"nvme"``) under a 16-bit ``param_dtype``: ZeRO-Offload
(Ren et al., ATC'21, §4.1) keeps 16-bit parameters on the device and the fp32 master and moments on
the host, so a step sends each parameter's 2 bytes down and each gradient up in its reduce dtype.
The bytes are counted by an observer outside the engine: a torch dispatch mode that sees every copy
between the host and the compute device. The compute device is ``meta`` (shapes, no values), so
host and device are told apart on a CPU build; the observer fills what a copy from the device
would bring with known gradients, and the host-side step is checked against torch's AdamW on them.
"""

from __future__ import annotations

import contextlib
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_zinf import OffloadConfig
from lightning_zinf.comm.collectives import Collectives
from lightning_zinf.engine.flat import FlatGroup
from lightning_zinf.engine.transfer import Transfers
from lightning_zinf.offload import NvmeSwapper
from lightning_zinf.offload.optimizer import OptimizerOffload
from lightning_zinf.offload.staging import StagingPool
from lightning_zinf.offload.swapped import SwapSpace
from tests.recording_streams import RecordingStreams

META = torch.device("meta")
COPIES = {torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default}


class LinkObserver(TorchDispatchMode):
    """Counts the bytes of every copy between the host (``cpu``) and the device (``meta``), by
    direction; a copy from the device fills its host destination from ``incoming`` (the device
    holds no values)."""

    def __init__(self, incoming: torch.Tensor) -> None:
        super().__init__()
        self.down = self.up = 0
        self.incoming = incoming

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            if src.device == META and dst.device.type == "cpu":
                self.up += src.numel() * src.element_size()
                return dst.copy_(self.incoming[: dst.numel()].view(dst.shape).to(dst.dtype))
            if src.device.type == "cpu" and dst.device == META:
                self.down += src.numel() * src.element_size()
        elif func is torch.ops.aten._to_copy.default:
            src, target = args[0], kwargs.get("device", args[0].device)
            if src.device != torch.device(target):
                raise AssertionError(f"an unexpected {func} from {src.device} to {target}")
        return func(*args, **kwargs)


def _zero_offload_group(reduce_dtype: torch.dtype) -> FlatGroup:
    params = [nn.Parameter(torch.empty(64, 32, device=META)), nn.Parameter(torch.empty(32, device=META))]
    torch.manual_seed(0)
    return FlatGroup(["w", "b"], params, torch.randn(64 * 32 + 32), Collectives(), META,
                     compute_dtype=torch.bfloat16, reduce_dtype=reduce_dtype,
                     transfers=Transfers(META, streams=RecordingStreams()), device_copy=True)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16])
def test_a_zero_offload_step_moves_2_bytes_down_and_the_gradient_up_per_parameter(
        reduce_dtype: torch.dtype, tier: str, tmp_path: Path) -> None:
    """Per parameter and step: the gradient's bytes in ``reduce_dtype`` up (4 or 2) and 2 bytes of
    updated bf16 values down, which compute waits for on the device (after the compute queued
    before, which may read the old copy); the device holds the 2-byte copy only, the host the fp32
    values, stepped as torch's AdamW steps the same values over two steps (the second gradient
    replaces the first one, consumed). On the ``cpu`` tier the host shard is the master; on
    ``nvme`` the master and moments are swapped to files and the host shard (what exact reads
    read) follows each step. Fails on the code before: the device kept an fp32 shard the step
    sent 4 bytes per parameter into, and a bf16 gradient went up cast to fp32."""
    group = _zero_offload_group(reduce_dtype)
    streams = group.transfers.streams
    reference = nn.Parameter(group.shard.clone())
    with contextlib.ExitStack() as stack:
        space = None
        if tier == "nvme":
            space = SwapSpace(stack.enter_context(NvmeSwapper(tmp_path / "swap")), StagingPool(cap=None))
        offload = OptimizerOffload([group], OffloadConfig(optimizer=tier, nvme_path=str(tmp_path)), space)
        offload.place_masters(lambda g: nullcontext())
        _zero_offload_steps(group, offload, streams, reference, reduce_dtype)
        if tier == "nvme":
            assert space.swapper.bytes_written > 0 and group.master is not group.shard
            offload.settle_all()


def _zero_offload_steps(group: FlatGroup, offload: OptimizerOffload, streams: RecordingStreams,
                        reference: nn.Parameter, reduce_dtype: torch.dtype) -> None:
    assert group.shard.device.type == "cpu"  # the fp32 values: on the host
    if not offload.nvme:
        assert group.master is group.shard  # one fp32 copy: the master
    assert group.compute_shard.device == META and group.compute_shard.dtype == torch.bfloat16
    optimizer = torch.optim.AdamW(group.fragments, lr=1e-2)
    expected = torch.optim.AdamW([reference], lr=1e-2)
    numel = group.shard_numel
    for step in range(2):
        grads = torch.randn(numel).to(reduce_dtype)
        with LinkObserver(grads) as link:
            reduced = torch.empty(numel, dtype=reduce_dtype, device=META)
            offload.before_accumulate(0)  # what the engine does around each accumulation
            group.accumulate(reduced, [True, True])
            group.finish_host_grads()
            offload.after_accumulate(0)
            group.expose_grads([True, True])
            queued = streams.compute_work()  # compute that may still read the old copy
            offload.step(optimizer)
            offload.wait_all()  # the step runs in the background (overlap_step)
            group.after_step()  # the engine's step hook: the gradients are consumed
        assert link.up == numel * reduce_dtype.itemsize
        assert link.down == numel * 2
        stream, clock = streams.blocks[-1]
        assert stream == "copy0" and clock["compute"] == queued  # the copy waited for that compute
        assert streams.compute.clock["copy0"] == clock["copy0"]  # and compute waits for the copy
        reference.grad = grads.float()
        expected.step()
        assert torch.equal(group.shard, reference.detach()), step


def test_a_device_master_reaches_its_host_tier_shard_without_blocking_the_host() -> None:
    """``param="cpu"`` with the optimizer on the device: after a step the master's values go to
    the host-tier shard (4 bytes per parameter) and, cast on the device, to its host bf16 copy
    (2 bytes), on the device-to-host copy stream after the step's compute, without the host
    waiting (the code before made one blocking copy per group). The next gather's copy to the
    device waits for them on the device; a host reader waits for them on the host."""
    streams = RecordingStreams()
    params = [nn.Parameter(torch.empty(64, 32, device=META)), nn.Parameter(torch.empty(32, device=META))]
    group = FlatGroup(["w", "b"], params, torch.zeros(64 * 32 + 32), Collectives(), META,
                      shard_device=torch.device("cpu"), compute_dtype=torch.bfloat16,
                      transfers=Transfers(META, streams=streams), host_copy=True)
    group.make_master()
    assert group.master.device == META
    numel = group.shard_numel
    stepped = torch.randn(numel)
    step = streams.compute_work()  # the optimizer's step on the device
    with LinkObserver(stepped) as link:
        group.after_step()
    assert streams.host_waits == []
    assert link.up == numel * (4 + 2)
    d2h = [clock for stream, clock in streams.blocks if stream == "copy1"]
    assert len(d2h) == 2 and all(clock["compute"] == step for clock in d2h)
    group.start_gather()
    gather = [clock for stream, clock in streams.blocks if stream == "copy0"][-1]
    assert gather["copy1"] == d2h[-1]["copy1"]  # the copy to the device waited for both, on the device
    assert streams.host_waits == []
    group.settle_host_shard()
    (waited, clock), = streams.host_waits
    assert waited == "copy1" and clock["copy1"] == d2h[-1]["copy1"]
    assert torch.equal(group.shard, stepped) and torch.equal(group.compute_shard, stepped.bfloat16())
