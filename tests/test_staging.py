"""The staging pool and swap records: aligned buffers under a byte cap, reused by size; bound
tensors keep their identity across swaps and see exactly the bytes they had."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_zinf.offload import NvmeSwapper, SwapError
from lightning_zinf.offload.staging import StagingPool
from lightning_zinf.offload.swapped import SwapRecord, SwapSpace


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
