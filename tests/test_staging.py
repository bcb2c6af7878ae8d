"""The staging pool and swap records: aligned buffers under a byte cap, reused by size; bound
tensors keep their identity across swaps and see exactly the bytes they had. Page-locked buffers
(CUDA) are mappings of their own, registered while the pool holds them and not inherited by forked
children; nothing empties torch's process-wide page-locked cache; a gather that fails after issuing
copies from staging buffers waits for them before the buffers can go back."""

from __future__ import annotations

import concurrent.futures.thread
import copy
import ctypes
import faulthandler
import gc
import mmap
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from lightning_zinf.offload import NvmeSwapper, SwapError, staging
from lightning_zinf.offload.aligned import aligned_empty
from lightning_zinf.offload.files import key_filename
from lightning_zinf.offload.staging import StagingPool
from lightning_zinf.offload.swapped import SwapRecord, SwapSpace
from tests.harness import run_distributed


def test_pool_aligns_reuses_and_respects_its_cap() -> None:
    pool = StagingPool(cap=3 * 8192)
    a = pool.take(5000)  # rounded up to whole 4 KiB blocks
    assert a.numel() == 8192 and a.data_ptr() % 4096 == 0
    b = pool.take(8192)
    assert pool.take(8193) is None  # 8192 + 8192 + 12288 > cap
    pool.give(a)
    assert pool.take(6000).data_ptr() == a.data_ptr()  # the same size comes back from the free list
    pool.give(b)
    c = pool.take(12288)  # frees the kept 8 KiB buffer to stay under the cap
    assert c is not None and pool.held <= pool.cap and pool.in_use == 8192 + 12288 == pool.peak


def test_held_records_are_written_only_when_staging_needs_their_room(tmp_path: Path) -> None:
    """Records held unwritten (gradient shards between backward and step) take at most half the cap;
    a take that needs their room writes the oldest one first and gets its buffer, and a later swap
    in reads its bytes back; a held record dropped is never written, and reads back as zeros (a
    consumed gradient holds nothing). The folder is the observer."""
    with NvmeSwapper(tmp_path / "swap") as swapper:
        space = SwapSpace(swapper, StagingPool(cap=4 * 8192))
        records = []
        for k in range(3):
            values = torch.full((2048,), float(k + 1))  # 8 KiB each
            record = SwapRecord(space, f"g{k}", [("grad", torch.float32, 2048)])
            record.bind(values, "grad")
            record.adopt()
            assert space.room_to_hold(record) == (k < 2)  # two of them fill half the cap
            if k < 2:
                record.hold()
            else:
                record.swap_out()
            records.append((record, values))
        records[2][0].settle()
        files = lambda: sorted(p.name for p in swapper.folder.iterdir() if p.name.endswith(".swp"))
        assert files() == ["k-g2.swp"]  # the one without room was written; the held ones not
        taken = [space.take(8192, "a"), space.take(8192, "b")]  # g2's buffer again, and the cap's last
        assert files() == ["k-g2.swp"]
        taken.append(space.take(8192, "c"))  # past the cap: g0, the oldest held, is written and goes out
        assert all(t is not None for t in taken) and files() == ["k-g0.swp", "k-g2.swp"]
        assert not records[0][0].resident and records[1][0].resident and records[1][0].dirty
        for t in taken:
            space.pool.give(t)
        records[0][0].swap_in()
        records[0][0].settle()
        assert torch.equal(records[0][1], torch.full((2048,), 1.0))
        records[1][0].drop()  # consumed in memory: never written
        records[1][0].swap_in()
        records[1][0].settle()
        assert files() == ["k-g0.swp", "k-g2.swp"] and torch.equal(records[1][1], torch.zeros(2048))


def test_a_held_record_a_gather_reads_stays_in_memory_under_staging_pressure(tmp_path: Path) -> None:
    """A held record that a gather has acquired (pinned: the collective or the copy to the device
    reads its buffer) is not written out and given away when a take needs room: the take fails
    instead, and the bytes stay where the gather reads them. Once the gather drops it, the same
    take writes it and gets its buffer. (Before pins, a held compute copy was released under an
    open gather: the gather then read an empty tensor, or another record's bytes.)"""
    with NvmeSwapper(tmp_path / "swap") as swapper:
        space = SwapSpace(swapper, StagingPool(cap=2 * 8192))
        values = torch.full((2048,), 7.0)
        record = SwapRecord(space, "copy", [("copy", torch.float32, 2048)])
        record.bind(values, "copy")
        record.adopt()
        record.hold()
        record.pins += 1  # ParamOffload.acquire
        other = space.take(8192, "other")
        with pytest.raises(SwapError, match="staging_bytes"):
            space.take(8192, "more")
        assert record.resident and record.dirty and torch.equal(values, torch.full((2048,), 7.0))
        record.pins -= 1  # ParamOffload.drop
        assert space.take(8192, "more") is not None and not record.resident  # written, its buffer reused
        space.pool.give(other)
        record.swap_in()
        record.settle()
        assert torch.equal(values, torch.full((2048,), 7.0))


def test_record_round_trip_keeps_identity_and_bytes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    with NvmeSwapper(tmp_path / "swap") as swapper:
        space = SwapSpace(swapper, StagingPool(cap=None))
        master = torch.randn(1000, dtype=torch.float64)
        moments = torch.randn(1000, dtype=torch.bfloat16)
        fragment = master[100:300].view(20, 10)  # a parameter's slice, held by an optimizer
        want = (master.clone(), moments.clone())
        record = SwapRecord(space, "g0", [("master", torch.float64, 1000), ("moments", torch.bfloat16, 1000)])
        record.bind(master, "master")
        record.bind(fragment, "master", 100)
        record.bind(moments, "moments")
        record.adopt()
        fragment.add_(1)  # in place through one binding, seen through the other
        record.swap_out()
        record.settle()
        assert master.numel() == 0 and fragment.numel() == 0 and not record.resident
        record.swap_in()
        record.settle()
        assert torch.equal(master[:100], want[0][:100]) and torch.equal(master[300:], want[0][300:])
        assert torch.equal(master[100:300], want[0][100:300] + 1) and fragment.shape == (20, 10)
        assert torch.equal(moments, want[1])
        assert fragment.data_ptr() == master.data_ptr() + 100 * 8


def test_a_cap_too_small_for_one_record_names_the_option(tmp_path: Path) -> None:
    with NvmeSwapper(tmp_path / "swap") as swapper:
        space = SwapSpace(swapper, StagingPool(cap=4096))
        record = SwapRecord(space, "big", [("x", torch.float32, 2048)])
        record.bind(torch.zeros(2048), "x")
        with pytest.raises(SwapError, match="OffloadConfig.staging_bytes"):
            record.adopt()


def test_writes_in_flight_give_their_buffers_back_under_the_cap(tmp_path: Path) -> None:
    """Ten 64 KiB records through a 128 KiB cap: each swap in waits for older writes to finish."""
    with NvmeSwapper(tmp_path / "swap") as swapper:
        space = SwapSpace(swapper, StagingPool(cap=2 * 65536))
        tensors = [torch.full((16384,), float(k)) for k in range(10)]
        records = []
        for k, t in enumerate(tensors):
            record = SwapRecord(space, f"r{k}", [("x", torch.float32, 16384)])
            record.bind(t, "x")
            record.adopt()
            record.swap_out()
            records.append(record)
        for k, record in enumerate(records):
            record.swap_in()
            record.settle()
            assert torch.equal(tensors[k], torch.full((16384,), float(k)))
            record.swap_out(write=False)
        assert space.pool.peak <= 2 * 65536


class _FakeRuntime:
    """Stands in for the CUDA runtime's ``cudaHostRegister``/``cudaHostUnregister`` (``staging``'s
    ``_host_register``/``_host_unregister``) on a machine without one: the ranges registered now
    (address -> (bytes, device index)), the most bytes registered at once, the unregistrations."""

    def __init__(self) -> None:
        self.registered: dict[int, tuple[int, int]] = {}
        self.most = 0
        self.unregistered = 0

    def register(self, address: int, nbytes: int, device_index: int) -> None:
        assert address not in self.registered, "a range was registered twice (not unregistered when freed)"
        self.registered[address] = (nbytes, device_index)
        self.most = max(self.most, self.registered_bytes())

    def unregister(self, address: int, device_index: int) -> None:
        assert self.registered.pop(address)[1] == device_index, "unregistered on another device"
        self.unregistered += 1

    def registered_bytes(self) -> int:
        return sum(nbytes for nbytes, _ in self.registered.values())


def _refuse_flush() -> None:
    raise AssertionError("torch's process-wide page-locked host cache was emptied")


def _dontfork_bytes() -> int:
    """Bytes of this process's memory mapped with MADV_DONTFORK (the ``dc`` VmFlag, "do not copy on
    fork", of /proc/self/smaps; the kernel merges adjacent such mappings, so only the total counts)."""
    total, size = 0, 0
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if line.startswith("Size:"):
                size = int(line.split()[1]) * 1024
            elif line.startswith("VmFlags:") and "dc" in line.split()[1:]:
                total += size
    return total


def _child_reads(address: int) -> int:
    """Fork a child that reads the byte at ``address`` and exits 0; the signal that ended it, or 0."""
    pid = os.fork()
    if pid == 0:
        faulthandler.disable()  # the fault is expected: no traceback
        ctypes.string_at(address, 1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0


def test_registered_buffers_are_page_locked_mappings_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA pool's buffer is a mapping of its own: its storage starts at the page-aligned address
    registered (so ``is_pinned()`` holds on CUDA), on the pool's device; forked children do not get
    its pages; kept for reuse it stays registered, and freed (to make room, or after an uncapped
    take) it is unregistered and unmapped at once. The registered bytes are the pool's ``held``,
    under its cap, and torch's host cache is never emptied."""
    runtime = _FakeRuntime()
    monkeypatch.setattr(staging, "_host_register", runtime.register)
    monkeypatch.setattr(staging, "_host_unregister", runtime.unregister)
    monkeypatch.setattr(torch._C, "_host_emptyCache", _refuse_flush, raising=False)
    before = _dontfork_bytes()
    pool = StagingPool(cap=3 * 8192, pin_memory=True, device=torch.device("cuda", 1))
    a = pool.take(5000)
    assert a.numel() == 8192 and a.data_ptr() % mmap.PAGESIZE == 0
    assert a.untyped_storage().data_ptr() == a.data_ptr() and a.untyped_storage().nbytes() == 8192
    assert runtime.registered == {a.data_ptr(): (8192, 1)}
    assert _dontfork_bytes() - before == 8192
    a.fill_(7)
    assert _child_reads(a.data_ptr()) == signal.SIGSEGV  # not inherited: the child has no such page
    plain = aligned_empty(8192, torch.uint8).fill_(7)
    assert _child_reads(plain.data_ptr()) == 0  # the observer works: ordinary memory is inherited
    b = pool.take(8192)
    pool.give(a)
    assert pool.take(8192).data_ptr() == a.data_ptr() and len(runtime.registered) == 2  # reused, not re-registered
    pool.give(a)
    pool.give(b)
    del a, b  # the pool keeps them, registered
    assert runtime.unregistered == 0 and runtime.registered_bytes() == pool.held == 2 * 8192
    c = pool.take(3 * 8192)  # both kept buffers are freed to make room: unregistered and unmapped
    assert runtime.unregistered == 2 and runtime.registered == {c.data_ptr(): (3 * 8192, 1)}
    assert runtime.registered_bytes() == pool.held == 3 * 8192 == _dontfork_bytes() - before
    d = pool.take(8192, capped=False)  # past the cap (a checkpoint) ...
    pool.give(d)  # ... and freed when it comes back
    del d
    assert runtime.unregistered == 3 and runtime.most <= 4 * 8192
    assert runtime.registered_bytes() == pool.held == _dontfork_bytes() - before
    del pool, c
    assert runtime.registered == {} and _dontfork_bytes() == before


def test_a_pinned_pool_needs_an_accelerator() -> None:
    with pytest.raises(ValueError, match="accelerator"):
        StagingPool(cap=None, pin_memory=True, device=torch.device("cpu"))


def _nvme_training(rank: int, world: int, nvme_path: str, cap: int, pinned: bool) -> dict:
    """Three steps of NVMe parameter and optimizer offload under ``staging_bytes=cap``; with
    ``pinned``, the staging pool is a CUDA one whose registrations go to a stand-in runtime (this
    machine has no accelerator). torch's host cache refuses to be emptied in both."""
    from lightning_zinf.engine import build

    torch._C._host_emptyCache = _refuse_flush
    runtime = _FakeRuntime()
    if pinned:
        staging._host_register, staging._host_unregister = runtime.register, runtime.unregister
        build.StagingPool = lambda cap, pin_memory, device: StagingPool(cap, pin_memory=True, device=torch.device("cuda", 0))
    _late_to_let_go("zinf-step")
    before = _dontfork_bytes()
    out = _train_three_steps(rank, world, nvme_path, cap)
    out.update(registered=runtime.registered_bytes(), most=runtime.most, unregistered=runtime.unregistered,
               dontfork=out.pop("dontfork") - before)
    gc.collect()  # the engine is gone: every buffer of its pool too
    out["left"] = runtime.registered_bytes()
    return out


def _late_to_let_go(prefix: str) -> None:
    """Threads named ``prefix...`` keep each finished task (its function and arguments) 30 ms after
    its future resolved, as a thread pool does until its worker loop drops the task: the caller
    of a finished step must not depend on when that happens."""
    run = concurrent.futures.thread._WorkItem.run

    def late(item) -> None:
        run(item)
        if threading.current_thread().name.startswith(prefix):
            time.sleep(0.03)

    concurrent.futures.thread._WorkItem.run = late


def _train_three_steps(rank: int, world: int, nvme_path: str, cap: int) -> dict:
    from lightning_zinf import OffloadConfig, PrefetchConfig, ZeroEngine
    from tests import models

    torch.manual_seed(0)
    model = models.GPT()
    engine = ZeroEngine(model, block_classes=["Block"], prefetch=PrefetchConfig(persistence_threshold=0),
                        offload=OffloadConfig(param="nvme", optimizer="nvme", nvme_path=nvme_path,
                                              sub_group_size=5_000, staging_bytes=cap))
    opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    mine, losses = slice(rank * 8 // world, (rank + 1) * 8 // world), []
    for step in range(3):
        x, y = models.make_batch("gpt", step, 8)
        loss = models.loss_fn(model, x[mine], y[mine])
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    engine.release_all()
    with engine.gathered():
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "weights": weights, "held": engine.space.pool.held, "dontfork": _dontfork_bytes()}


def test_nvme_offload_through_registered_staging_under_a_cap(tmp_path: Path) -> None:
    """NVMe offload whose staging pool registers its own page-locked buffers, under a cap that
    forces it to free some: training is bit for bit the pageable pool's, the registered bytes are
    the pool's own (never above the cap, all of them DONTFORK mappings), buffers are unregistered
    as they are freed and all of them once the engine is gone, and torch's host cache is never
    emptied."""
    cap = 140_000  # between the largest record (108 KiB) and what the run stages uncapped
    pinned = run_distributed(_nvme_training, 2, str(tmp_path), cap, True)
    plain = run_distributed(_nvme_training, 2, str(tmp_path), cap, False)
    for got, want in zip(pinned, plain):
        assert got["losses"] == want["losses"]
        for name, value in want["weights"].items():
            assert torch.equal(got["weights"][name], value), name
        assert got["unregistered"] > 0, "the cap freed no buffer: the run was not under pressure"
        assert 0 < got["most"] <= cap and got["registered"] == got["held"] == got["dontfork"] <= cap
        assert got["left"] == 0 and want["dontfork"] == 0


def _failed_gather(rank: int, world: int, nvme_path: str) -> dict:
    """A forward whose first offloaded gather fails after its copy was issued (the collective
    raising, say); then the same forward again. The order of host waits for the copies to the
    device and of buffers given back to the staging pool, and both losses."""
    from lightning_zinf import OffloadConfig, PrefetchConfig, ZeroEngine
    from tests import models

    torch.manual_seed(0)
    model = models.GPT()
    reference = copy.deepcopy(model)
    engine = ZeroEngine(model, block_classes=["Block"], prefetch=PrefetchConfig(persistence_threshold=0),
                        offload=OffloadConfig(param="nvme", nvme_path=nvme_path))
    events: list[str] = []
    engine.transfers.host_wait_h2d = lambda: events.append("wait")
    pool = engine.space.pool
    give = pool.give
    pool.give = lambda buffer: (events.append("give"), give(buffer))[1]
    group = next(u for u in engine.units if not u.persistent).groups[0]
    start = group.start_gather

    def issue_then_fail(*args, **kwargs):
        start(*args, **kwargs)
        raise RuntimeError("injected failure after the copy was issued")

    group.start_gather = issue_then_fail
    x, y = models.make_batch("gpt", 0, 4)
    with pytest.raises(RuntimeError, match="injected"):
        models.loss_fn(model, x, y)
    at_failure = list(events)
    group.start_gather = start
    with torch.no_grad():
        return {"at_failure": at_failure, "events": events, "loss": models.loss_fn(model, x, y).item(),
                "want": models.loss_fn(reference, x, y).item()}


def test_a_gather_that_fails_waits_for_its_copies_before_buffers_go_back(tmp_path: Path) -> None:
    """With NVMe parameter offload, a gather that raises after issuing copies from staging buffers
    waits on the host for the copies before the exception leaves (their handles are lost, and the
    next pass gives the buffers back to a pool that may reuse or unmap them); the next forward
    then runs as if nothing had failed."""
    got = run_distributed(_failed_gather, 1, str(tmp_path))[0]
    assert got["at_failure"] and got["at_failure"][-1] == "wait", got["at_failure"]
    assert "give" in got["events"][len(got["at_failure"]):]  # the next pass gave the buffers back
    assert got["loss"] == pytest.approx(got["want"], rel=1e-6)


def test_a_record_kept_in_host_memory_leaves_the_disk_and_the_cap(tmp_path: Path) -> None:
    """``SwapRecord.keep_in_host``: the record's bytes move to a buffer outside the staging cap,
    its file is deleted, and swaps and staging pressure leave it in memory, unwritten, with its
    tensors' identity and values; a record created kept never touches the disk."""
    with NvmeSwapper(tmp_path / "swap") as swapper:
        space = SwapSpace(swapper, StagingPool(cap=2 * 4096))
        weights = torch.arange(1000, dtype=torch.float32)
        kept = SwapRecord(space, "kept", [("w", torch.float32, 1000)])
        kept.bind(weights, "w")
        kept.adopt()
        kept.swap_out()
        kept.settle()
        assert weights.numel() == 0 and (tmp_path / "swap" / key_filename("kept")).exists()
        kept.keep_in_host()  # read back, then kept
        assert kept.in_host and space.pool.in_use == 0 and space.pool.held == 4096  # its staging buffer kept for reuse
        assert not (tmp_path / "swap" / key_filename("kept")).exists()
        assert torch.equal(weights, torch.arange(1000, dtype=torch.float32))
        weights.add_(1)
        others = []
        for k in range(2):  # the whole cap for others: nothing can make room by moving the kept record
            other = SwapRecord(space, f"o{k}", [("x", torch.float32, 1000)])
            other.bind(torch.zeros(1000), "x")
            other.adopt()
            others.append(other)
        for op in (kept.swap_out, kept.hold, kept.keep_ahead, kept.drop, lambda: kept.swap_in(ahead=True)):
            op()
            kept.settle()
            assert kept.resident and not kept.dirty and not kept.ahead
        assert torch.equal(weights, torch.arange(1000, dtype=torch.float32) + 1)
        assert swapper.bytes_written == 4096  # its one write before it was kept
        fresh = SwapRecord(space, "fresh", [("v", torch.float32, 10)], in_host=True)
        fresh.bind(torch.ones(10), "v")
        fresh.adopt()  # the cap is full: a kept record's buffer is not staging
        fresh.swap_out()
        assert fresh.resident and space.pool.in_use == 2 * 4096 and swapper.bytes_written == 4096
        fresh.discard()  # its buffer is its own: not given to the pool
        assert not fresh.resident and space.pool.held == 2 * 4096 and space.pool.in_use == 2 * 4096
        assert sum(len(kept) for kept in space.pool._free.values()) == 0
