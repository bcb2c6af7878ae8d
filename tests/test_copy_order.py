"""The order of host<->device copies against compute, observed on a CPU build (issue 30 item 5).

On an accelerator the engine's copies run on copy streams (ZeRO-Infinity §6.2, overlap-centric
design). What matters there is which stream waits for which: a copy that waits for all compute
queued before it cannot overlap that compute, and a host that waits for such a copy waits for the
device. These tests give :class:`~lightning_zinf.engine.transfer.Transfers` recording streams
(``tests/recording_streams.py``, vector clocks) and read off the waits: a copy waits for compute
only where it depends on it, compute waits for a copy only where it consumes it, memory the copy
stream allocated is recorded for the compute stream that reads it, and the host never waits for
compute before it reuses a staging buffer. The gathers run on the ``meta`` device (shapes, no
values), the activation reloads on the CPU (values, checked against plain autograd).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_zinf.comm.collectives import Collectives
from lightning_zinf.engine.flat import FlatGroup
from lightning_zinf.engine.transfer import Transfers
from lightning_zinf.offload.activations import ActivationOffload
from lightning_zinf.planning.activations import ActivationPlan
from tests.recording_streams import RecordingStreams

META = torch.device("meta")


def _offloaded_group(streams: RecordingStreams) -> tuple[FlatGroup, list[nn.Parameter]]:
    """A group whose shard lives in host memory (the ``cpu`` tier) for a ``meta`` compute device."""
    params = [nn.Parameter(torch.empty(8, 4, device=META)), nn.Parameter(torch.empty(4, device=META))]
    group = FlatGroup(["w", "b"], params, torch.randn(36), Collectives(), META, shard_device=torch.device("cpu"),
                      transfers=Transfers(META, streams=streams), compute_dtype=torch.bfloat16)
    return group, params


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def test_a_gather_into_a_fresh_buffer_waits_for_no_compute() -> None:
    """The gather of an offloaded shard into a released buffer runs ahead of every compute queued
    before it: the shard's copy (on the stream of copies to the device made ahead, ``copy2``: the
    link's queue) and the gather (on ``copy0``, after that copy) are ordered after no compute, its
    buffer is the copy stream's memory recorded for the compute stream, compute waits for the
    copy only when it waits on the handle, and the host's wait before reusing the staging buffer
    (NVMe) waits for no compute either."""
    streams = RecordingStreams()
    group, params = _offloaded_group(streams)
    for _ in range(5):
        streams.compute_work()  # the forward of the units before this one, queued and not run
    handle = group.start_gather()
    (link, copied), (stream, clock) = streams.blocks
    assert link == "copy2" and copied.get("compute", 0) == 0, copied
    assert stream == "copy0" and clock.get("compute", 0) == 0 and clock["copy2"] == copied["copy2"], clock
    assert (_storage(group.full), "compute") in streams.recorded
    assert streams.compute.clock.get("copy0", 0) == 0  # nothing consumed yet: compute has not waited
    streams.compute_work()
    handle.wait_on_host()  # what wait_gather does before an NVMe staging buffer goes back to the pool
    (waited, host_clock), = streams.host_waits
    assert waited == "copy0" and host_clock.get("compute", 0) == 0, host_clock
    handle.wait()
    group.finish_gather()
    assert streams.compute.clock["copy0"] == clock["copy0"]  # compute waited for the copy here
    assert params[0].shape == (8, 4) and params[0].dtype == torch.bfloat16


def test_refilling_a_gathered_buffer_waits_for_the_compute_that_reads_it() -> None:
    """Re-gathering a unit that is still gathered (persistent units after a step) overwrites a
    buffer that compute queued earlier may still read: that copy waits for all of it."""
    streams = RecordingStreams()
    group, _ = _offloaded_group(streams)
    group.start_gather().wait()
    group.finish_gather()
    queued = streams.compute_work()  # compute reading the gathered values
    group.start_gather().wait()
    assert streams.blocks[-1][1]["compute"] == queued


def test_the_host_runs_at_most_two_gather_buffers_ahead_of_the_device() -> None:
    """Gathers no longer wait for compute, so the host could queue gathers of the whole model into
    new memory while the device is far behind. It waits for compute, as FSDP's rate limiter does,
    only for memory the device has not reached the release of yet beyond two buffers' worth: here,
    with the device never catching up, the fourth gather waits for the first release, the fifth
    for the second, and none for a release after that."""
    streams = RecordingStreams()
    group, _ = _offloaded_group(streams)
    releases = []
    for _ in range(6):
        group.start_gather().wait()
        group.finish_gather()
        streams.compute_work()  # the unit's forward
        group.release()
        releases.append(streams.compute.clock["compute"])
    waited = [clock["compute"] for stream, clock in streams.host_waits if stream == "compute"]
    assert waited == releases[:3], (waited, releases)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().sum()


def test_activation_reloads_run_one_saved_tensor_ahead_without_waiting_for_compute() -> None:
    """In backward each saved tensor comes back from the host on the copy stream: the copy waits for
    the copy that took it to the host, never for backward's compute; when backward asks for one
    tensor, the copy of the one saved before it starts too (backward asks for it next), and compute
    waits only for the copy of the tensor it asked for. The gradients equal plain autograd's."""
    torch.manual_seed(0)
    model, x = _Mlp(), torch.randn(8, 16, requires_grad=True)
    model(x).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    streams = RecordingStreams()
    transfers = Transfers(torch.device("cpu"), streams=streams)
    offload = ActivationOffload(transfers, lambda tensor: False)

    def work(*args) -> None:
        streams.compute_work()

    for layer in model.layers:  # each layer's kernels: one block of compute work, forward and backward
        layer.register_forward_pre_hook(work)
        layer.register_full_backward_pre_hook(work)
    unpack, seen = offload._unpack, []

    def observed(packed):
        was_ahead = packed.ahead is not None
        before = sum(1 for s, _ in streams.blocks if s == "copy0")
        tensor = unpack(packed)
        following = [saved() for saved in packed.order.saved]
        started = [saved for saved in following if saved is not None and saved.ahead is not None]
        after = sum(1 for s, _ in streams.blocks if s == "copy0")
        seen.append((was_ahead, streams.compute.clock.get("copy0", 0), len(started), after - before - (not was_ahead), after))
        return tensor

    offload._unpack = observed  # before the hooks are installed, which read it then
    with offload():
        loss = model(x)
    forward_end = streams.compute.clock["compute"]
    saved = len(offload._order.saved)
    assert saved >= 8 and offload.copied_bytes > 0
    loss.backward()
    assert len(seen) == saved

    reloads = [clock for s, clock in streams.blocks if s == "copy0"]
    assert len(reloads) == saved  # each saved tensor copied back exactly once
    assert all(clock.get("compute", 0) <= forward_end for clock in reloads), (forward_end, reloads)
    assert all(clock.get("copy1", 0) > 0 for clock in reloads)  # after the copy to the host
    # Backward asks for the tanh output and the linear input of a layer out of saving order once;
    # every other request finds its copy under way.
    assert sum(ahead for ahead, *_ in seen) >= saved - 2, seen
    for ahead, compute_waited, in_flight, started_ahead, copies in seen:
        assert in_flight <= 2 and started_ahead <= 1, seen  # one copy ahead (two after an out-of-order request)
        if started_ahead:
            assert compute_waited < copies, seen  # compute did not wait for the copy started ahead
    for p, g in zip(model.parameters(), want):
        assert torch.equal(p.grad, g)


def _four_blocks() -> tuple[nn.Module, torch.Tensor, list[torch.Tensor]]:
    """Four blocks (a linear layer and a tanh each), an input, and plain autograd's gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)))
    x = torch.randn(8, 16, requires_grad=True)
    model(x).square().sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return model, x, want


def _count_reloads_found_ahead(fresh_every_block: bool) -> tuple[int, int, list[torch.Tensor], list[torch.Tensor]]:
    """Blocks 1-3 of four offloaded through :class:`ActivationPlan` (block 0 keeps its own): how
    many of backward's requests for an offloaded tensor found its copy under way, of how many."""
    model, x, want = _four_blocks()
    streams = RecordingStreams()
    offload = ActivationOffload(Transfers(torch.device("cpu"), streams=streams), lambda tensor: False)
    unpack, found = offload._unpack, []

    def observed(packed):
        found.append(packed.ahead is not None)
        return unpack(packed)

    offload._unpack = observed
    context = (lambda first: offload(True)) if fresh_every_block else offload
    plan = ActivationPlan([(str(i), block) for i, block in enumerate(model)], budget=0, planned=0,
                          is_gathered=lambda tensor: False, kept=1, offloaded=3, offload=context)
    assert plan.kept == ["0"] and plan.offloaded == ["1", "2", "3"] and not plan.checkpointed
    model(x).square().sum().backward()
    return sum(found), len(found), [p.grad for p in model.parameters()], want


def test_blocks_offloaded_by_the_plan_copy_back_ahead_across_blocks() -> None:
    """Blocks a memory plan offloads (``ActivationPlan(offloaded=...)``) share one forward's saving
    order: backward finds the copy of an earlier block's first tensor under way when it reaches
    that block, as it does within a block. A fresh order per block (what the whole-step offload
    context does at each entry) would miss one copy at every block boundary. Gradients equal
    plain autograd's, bit for bit."""
    ahead, requests, grads, want = _count_reloads_found_ahead(fresh_every_block=False)
    assert requests == 3 * 3  # per block: the linear's input and weight, the tanh's output
    assert ahead >= requests - 2, (ahead, requests)
    for g, w in zip(grads, want):
        assert torch.equal(g, w)
    apart, _, _, _ = _count_reloads_found_ahead(fresh_every_block=True)
    assert apart <= ahead - 2, (apart, ahead)  # the observer tells the two apart


def test_a_forward_that_skips_the_first_offloaded_block_starts_its_own_saving_order() -> None:
    """A forward that skips the first offloaded block (LayerDrop) starts a saving order of its own
    at the first offloaded block it reaches, as one that runs them all does: the copies back ahead
    follow that forward's tensors alone, and no order grows with every step."""
    model, x, _ = _four_blocks()
    offload = ActivationOffload(Transfers(torch.device("cpu"), streams=RecordingStreams()), lambda tensor: False)
    ActivationPlan([(str(i), block) for i, block in enumerate(model)], budget=0, planned=0,
                   is_gathered=lambda tensor: False, kept=1, offloaded=3, offload=offload)
    lengths = []
    for skipped in (None, 1, 1, None):
        h = x
        for i, block in enumerate(model):
            if i != skipped:
                h = block(h)
        h.square().sum().backward()
        lengths.append(len(offload._order.saved))
    assert lengths == [9, 6, 6, 9]  # three saved tensors per offloaded block run


def test_copies_of_offloaded_blocks_to_the_host_trail_the_forward_by_one_block_at_most() -> None:
    """The plan counts one offloaded block's saved tensors on the device at a time: the forward's
    copies to the host run on their own stream, and the device memory of a tensor being copied is
    not reused until its copy is done, so a forward that outruns the link would hold every earlier
    block's tensors too. So when an offloaded block starts, the host has waited for the copies of
    the blocks before it. Gradients equal plain autograd's, bit for bit."""
    model, x, want = _four_blocks()
    streams = RecordingStreams()
    offload = ActivationOffload(Transfers(torch.device("cpu"), streams=streams), lambda tensor: False)
    plan = ActivationPlan([(str(i), block) for i, block in enumerate(model)], budget=0, planned=0,
                          is_gathered=lambda tensor: False, kept=1, offloaded=3, offload=offload)
    assert plan.offloaded == ["1", "2", "3"]
    seen = []  # per offloaded block, at its start: copies to the host queued, how far the host waited for them

    def started(*_) -> None:
        streams.compute_work()
        queued = sum(1 for stream, _ in streams.blocks if stream == "copy1")
        waited = max((clock.get("copy1", 0) for stream, clock in streams.host_waits if stream == "copy1"), default=0)
        seen.append((queued, waited))

    for block in list(model)[1:]:  # inside the block's offload context: its first layer
        block[0].register_forward_pre_hook(started)
    model(x).square().sum().backward()
    assert [queued for queued, _ in seen] == [0, 3, 6], seen  # a block saves three tensors
    assert all(waited == queued for queued, waited in seen), seen
    for p, g in zip(model.parameters(), want):
        assert torch.equal(p.grad, g)
