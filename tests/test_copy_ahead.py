"""Host-tier shards copied to the device ahead of their gathers (issue 39 deliverable 3), observed
on a CPU build.

The engine's schedule, unit states and flat groups run a real forward and backward over a model
whose compute device is ``meta`` (shapes, no values) and whose shards live in host memory (the
``cpu`` tier), with recording streams (``tests/recording_streams.py``, vector clocks) in place of
the accelerator's. An observer outside the engine, a dispatch mode, sees every tensor allocated
while a copy stream is current (the device copies of shards: gather buffers are storages resized,
not dispatched) and which host shard each copy reads. From these the tests read off how far ahead
of compute the link works, that compute never reads a copy before waiting for it, that the memory
it reads is recorded for it, and that the ledger's ``staged`` bytes are the bytes of device copies
alive, now and at their peak.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_zinf import OffloadConfig, ZeroEngine
from lightning_zinf.comm.collectives import Collectives
from lightning_zinf.config import MixedPrecisionConfig, PrefetchConfig
from lightning_zinf.engine.agreement import RankAgreement
from lightning_zinf.engine.buffers import BufferPool
from lightning_zinf.engine.flat import FlatGroup
from lightning_zinf.engine.ledger import MemoryLedger
from lightning_zinf.engine.schedule import Schedule
from lightning_zinf.engine.trace import Tracer
from lightning_zinf.engine.transfer import Transfers
from lightning_zinf.engine.units import Unit, UnitStates
from tests.recording_streams import RecordingStreams

META, CPU = torch.device("meta"), torch.device("cpu")
LAYERS, WIDTH = 6, 16
UNIT_NUMEL = WIDTH * WIDTH + WIDTH  # a Linear's weight and bias: one unit, one flat group
# With one unit gathered ahead (the bucket), the last unit is used next by its backward and the one
# before it after only the last: both stay gathered from their forward to their backward
# (Schedule._acquire's reuse), so neither is copied again.
KEPT = {LAYERS - 2, LAYERS - 1}


class CopyObserver(TorchDispatchMode):
    """Every tensor an op allocates while a copy stream is current (not a view or an in-place
    result of its inputs): its bytes and liveness (weakly held), and, for a copy of a host tensor
    to the device, which host tensor it read and the copy stream's position after its block."""

    def __init__(self, streams: RecordingStreams, sources: dict[int, int], keep: bool = False) -> None:
        super().__init__()
        self.streams = streams
        self.sources = sources  # storage of a host shard -> its unit
        # Keep the copies alive (``keep``): their storages then stay distinct within a pass.
        self.kept: list[torch.Tensor] | None = [] if keep else None
        self.allocated: list[tuple[weakref.ref, int]] = []
        self.copies: list[tuple[int, tuple[str, int], int]] = []  # (unit, (stream, block), storage of the copy)
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        stream = self.streams.current(META)
        if stream is self.streams.compute or not isinstance(out, torch.Tensor):
            return out
        inputs = {a.untyped_storage()._cdata for a in args if isinstance(a, torch.Tensor)}
        storage = out.untyped_storage()
        if storage._cdata not in inputs:
            self.allocated.append((weakref.ref(out), storage.nbytes()))
            source = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if source is not None and source.device == CPU and out.device == META:
                unit = self.sources[source.untyped_storage()._cdata]
                self.copies.append((unit, (stream.name, stream.clock[stream.name]), storage._cdata))
                if self.kept is not None:
                    self.kept.append(out)
            self.peak = max(self.peak, self.live_bytes())
        return out

    def live_bytes(self) -> int:
        return sum(nbytes for ref, nbytes in self.allocated if ref() is not None)


class OffloadedLayers:
    """The engine's parts (flat groups, units, unit states, trace, schedule) over ``LAYERS``
    linear layers on ``meta`` whose shards live in host memory, each layer a unit, with
    recording streams; ``bucket_size`` one unit (one unit gathered ahead)."""

    def __init__(self, copy_ahead: int, compute_dtype: torch.dtype, keep_copies: bool = False) -> None:
        self.streams = RecordingStreams()
        transfers = Transfers(META, streams=self.streams)
        comm = Collectives()
        self.ledger = MemoryLedger(("gathered", "staged"))
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH, device=META) for _ in range(LAYERS))
        self.units, self.sources = [], {}
        torch.manual_seed(0)
        for i, layer in enumerate(self.layers):
            params = list(layer.parameters())
            group = FlatGroup([f"{i}.weight", f"{i}.bias"], params, torch.randn(UNIT_NUMEL), comm, META,
                              shard_device=CPU, compute_dtype=compute_dtype, ledger=self.ledger,
                              transfers=transfers, host_copy=True)
            host = group.compute_shard if group.compute_shard is not None else group.shard
            self.sources[host.untyped_storage()._cdata] = i
            self.units.append(Unit(i, f"layers.{i}", [group], False, layer))
        groups = [g for u in self.units for g in u.groups]
        tracer = Tracer(comm)
        self.agreement = RankAgreement(comm, tracer, self.units, groups)
        pool = BufferPool(META, self.ledger)
        prefetch = PrefetchConfig(bucket_size=UNIT_NUMEL)
        self.states = UnitStates(self.units, comm=comm, ledger=self.ledger, pool=pool, agreement=self.agreement,
                                 prefetch=prefetch, param_offload=None, offload=None, transfers=transfers)
        self.schedule = Schedule(self.layers, self.units, {layer: [u] for layer, u in zip(self.layers, self.units)},
                                 states=self.states, tracer=tracer, comm=comm, pool=pool, prefetch=prefetch,
                                 mixed_precision=MixedPrecisionConfig(), param_offload=None, read_ahead=0,
                                 begin_pass=None, meet=self.agreement.waypoint_with, copy_ahead=copy_ahead)
        self.observer = CopyObserver(self.streams, self.sources, keep=keep_copies)
        # (pass, unit, compute clock, copies queued, record_stream calls so far)
        self.work: list[tuple[str, int, dict[str, int], int, int]] = []
        for i, layer in enumerate(self.layers):
            # Registered after the schedule's hooks, so they run after them: the unit's kernels,
            # queued once its gather was waited for (in backward: a gradient hook on the outputs,
            # after the one that re-gathers the unit).
            layer.register_forward_pre_hook(lambda m, a, i=i: self._compute("forward", i))
            layer.register_forward_hook(lambda m, a, out, i=i: self._hook_backward(out, i))

    def _hook_backward(self, output: torch.Tensor, unit: int) -> None:
        torch.autograd.graph.register_multi_grad_hook([output], lambda grads: self._compute("backward", unit), mode="any")

    def _compute(self, kind: str, unit: int) -> None:
        self.streams.compute_work()
        self.work.append((kind, unit, dict(self.streams.compute.clock), len(self.observer.copies),
                          len(self.streams.recorded)))
        if self.observer.kept is None:
            assert self.observer.live_bytes() == self.ledger.now["staged"], (kind, unit)

    def step(self, checkpointed: bool = False) -> None:
        """One training pass (forward and backward), starting as the engine starts a pass; with
        ``checkpointed`` each layer under activation checkpointing (recomputed in backward)."""
        self.schedule.reset()
        self.states.settle(boundary=True)
        self.agreement.begin_pass("train", True, None)
        self.work.clear()
        self.observer.copies.clear()
        self.streams.recorded.clear()
        if self.observer.kept is not None:
            self.observer.kept.clear()
        x = torch.randn(4, WIDTH, device=META, requires_grad=True)
        with self.observer:
            for layer in self.layers:
                x = torch.tanh(torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) if checkpointed
                               else layer(x))
            x.sum().backward()


def _staged_bytes(compute_dtype: torch.dtype, units: int) -> int:
    return units * UNIT_NUMEL * compute_dtype.itemsize


def _queued_at_each_use(run: OffloadedLayers) -> list[tuple[str, int, list[int]]]:
    """Per unit's compute, in order: how many copies of each unit's shard were queued before it."""
    out = []
    for kind, unit, _, copies, _ in run.work:
        counts = [0] * LAYERS
        for source, _, _ in run.observer.copies[:copies]:
            counts[source] += 1
        out.append((kind, unit, counts))
    return out


@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, torch.float32], ids=["bf16-mixed", "fp32"])
def test_the_link_works_units_ahead_of_compute(compute_dtype: torch.dtype) -> None:
    """With one unit gathered ahead (the bucket) and two more units' shards within
    ``copy_ahead``, when the compute of unit k waits for its gather the shards of units k+1..k+3
    are already queued on the copy stream, forward and backward (each unit is copied again for
    its backward, after its release, except the last two: their backward comes within one bucket
    of their forward, so they stay gathered); without copying ahead only unit k+1's is (the old
    code's distance: the link worked one unit ahead). Every copy is queued once per use of a
    released unit, and no copy waits for compute."""
    distance = 3
    kept = KEPT
    for copy_ahead, reach in ((_staged_bytes(compute_dtype, 2), distance), (0, 1)):
        run = OffloadedLayers(copy_ahead, compute_dtype)
        for _ in range(3):  # the first pass records the trace; the next replay it
            run.step()
        uses = _queued_at_each_use(run)
        assert [(kind, unit) for kind, unit, _ in uses] == (
            [("forward", k) for k in range(LAYERS)] + [("backward", k) for k in reversed(range(LAYERS))])
        for kind, unit, counts in uses:
            if kind == "forward":
                ahead = range(unit + 1, min(unit + reach, LAYERS - 1) + 1)
                assert all(counts[j] >= 1 for j in ahead), (copy_ahead, kind, unit, counts)
                if unit in kept:  # no second copy: it stays gathered for its backward
                    assert counts[unit] == 1, (copy_ahead, counts)
                # Not further: the budget holds.
                assert all(counts[j] == 0 for j in range(unit + reach + 1, LAYERS)), (copy_ahead, kind, unit, counts)
            else:
                ahead = range(max(unit - reach, 0), unit)
                # Every other unit is released after its forward, so copied again for its backward.
                assert all(counts[j] == (1 if j in kept else 2) for j in ahead), (copy_ahead, kind, unit, counts)
        copied = [source for source, _, _ in run.observer.copies]
        assert sorted(copied) == sorted(
            [*range(LAYERS), *(set(range(LAYERS)) - kept)]), copied
        assert all(clock.get("compute", 0) == 0 for _, clock in run.streams.blocks)


@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, torch.float32], ids=["bf16-mixed", "fp32"])
def test_compute_reads_a_copy_only_after_waiting_for_it_and_records_it(compute_dtype: torch.dtype) -> None:
    """The n-th use of unit k in a pass that gathers it reads the n-th copy of its shard (one copy
    per gather; from the first pass that replays the trace, the units of :data:`KEPT` are
    gathered once): that
    copy was queued before the use, the compute is ordered after the copy-stream block that made it
    (it waited for the copy's event), and the copy was recorded for the compute stream before the
    compute (its memory is not reused before compute is done with it). A copy queued ahead of a
    later use is neither waited for by compute nor recorded for it yet: until its gather is
    waited for, only the copy streams use it."""
    run = OffloadedLayers(_staged_bytes(compute_dtype, 2), compute_dtype, keep_copies=True)
    for replaying in (False, True, True):  # the first pass records the trace
        run.step()
        uses = [0] * LAYERS
        for kind, unit, clock, copies, recorded in run.work:
            queued = run.observer.copies[:copies]
            mine = [(block, storage) for source, block, storage in queued if source == unit]
            if kind == "backward" and unit in KEPT and replaying:
                assert len(mine) == uses[unit] == 1, (kind, unit)  # reads its forward's gather
                continue
            uses[unit] += 1
            assert len(mine) >= uses[unit], (kind, unit)
            (stream, block), storage = mine[uses[unit] - 1]
            assert clock.get(stream, 0) >= block, (kind, unit, clock, stream, block)
            assert (storage, "compute") in run.streams.recorded[:recorded], (kind, unit)
            for source, (stream, block), storage in queued:
                later = [s for u, _, s in queued if u == source][uses[source]:]
                if storage in later:
                    assert (storage, "compute") not in run.streams.recorded[:recorded], (kind, unit, source)
                    # Nor does compute wait for it: a gather waits for the copy it reads, not for
                    # the later units' copies queued before it was issued.
                    assert clock.get(stream, 0) < block, (kind, unit, source, clock, stream, block)


@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, torch.float32], ids=["bf16-mixed", "fp32"])
@pytest.mark.parametrize("units_ahead", [0, 2])
def test_the_ledger_counts_every_device_copy_of_a_shard(compute_dtype: torch.dtype, units_ahead: int) -> None:
    """The ledger's ``staged`` bytes equal the bytes of the device copies alive as the observer
    sees them, at every unit's compute (checked there) and at their peak, with and without
    copying ahead; after the pass none is left, in either. Copying two units ahead raises the
    peak by two units' shards, no more."""
    run = OffloadedLayers(_staged_bytes(compute_dtype, units_ahead), compute_dtype)
    for _ in range(3):
        run.ledger.reset_peaks()
        run.observer.peak = 0
        run.step()
        assert run.ledger.peak["staged"] == run.observer.peak > 0
        run.states.settle(boundary=True)
        assert run.ledger.now["staged"] == run.observer.live_bytes() == 0
    # Held by the gather in flight and the one ahead, plus the copies ahead.
    assert run.ledger.peak["staged"] == _staged_bytes(compute_dtype, 2 + units_ahead)


def test_under_activation_checkpointing_every_copy_made_ahead_is_read() -> None:
    """Each layer checkpointed: a unit is gathered for its forward and again for its recomputation
    in backward, then held through its backward. Its shard is copied once per gather, and every
    copy made ahead is read by a gather (none left at the end of backward): a recomputed unit
    counts as held from its acquisition on, so no use of it while held gets a copy (a copy no
    gather takes would hold copy_ahead_bytes until the pass ends). The units of :data:`KEPT` stay
    gathered from their forward to their recomputation once the trace is replayed: copied once."""
    run = OffloadedLayers(_staged_bytes(torch.bfloat16, 2), torch.bfloat16)
    for kept in (set(), KEPT, KEPT):  # the first pass records the trace
        run.step(checkpointed=True)
        copied = [source for source, _, _ in run.observer.copies]
        assert sorted(copied) == sorted([*range(LAYERS), *(set(range(LAYERS)) - kept)]), copied
        assert run.states.copies.ahead_bytes == 0


def test_copy_ahead_bytes_is_validated() -> None:
    """A negative or non-integer budget is refused, naming the option and what it takes."""
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="copy_ahead_bytes"):
            OffloadConfig(param="cpu", copy_ahead_bytes=bad)
    assert OffloadConfig(param="cpu", copy_ahead_bytes=0).copy_ahead_bytes == 0


def test_the_engine_copies_ahead_only_host_tier_shards() -> None:
    """The budget reaches the schedule with ``param="cpu"``, and is 0 for the other tiers (NVMe
    shards are read ahead by ``read_ahead`` instead; device shards need no copy)."""
    for param, want in (("cpu", 12345), ("none", 0)):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        engine = ZeroEngine(model, block_classes=[nn.Linear], device="cpu",
                            offload=OffloadConfig(param=param, copy_ahead_bytes=12345))
        assert engine.schedule.copy_ahead == want
        engine.release_all()
