"""The async NVMe swapper against real files: data read back equals data written, under O_DIRECT
(ext4), on tmpfs, on a filesystem without O_DIRECT (ramfs), on a full disk, with bad paths and with
files changed underneath. Expected bytes come from the tensors written and from the files read with
plain ``open()``, never from the swapper itself.

Mount-based cases (ramfs, a 1 MiB tmpfs, a read-only tmpfs) need root; elsewhere they are skipped
with the reason.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
import torch

from lightning_zinf.offload import AioConfig, NvmeSwapper, SwapError, aligned_empty
from lightning_zinf.offload.files import filesystem_type, pread_full

WAIT_S = 60  # generous bound: a request that takes this long has hung
SMALL_BLOCKS = AioConfig(block_size=64 * 1024, queue_depth=2, threads=4)
DTYPES = [torch.uint8, torch.int16, torch.float16, torch.bfloat16, torch.float32, torch.float64,
          torch.complex64, torch.bool, torch.int64]


def _random_tensor(numel: int, dtype: torch.dtype, gen: torch.Generator, *, aligned: bool) -> torch.Tensor:
    """Random values of ``dtype``; ``aligned=False`` gives a tensor whose address is not 4096-aligned."""
    if aligned:
        t = aligned_empty(numel, dtype)
    else:
        t = torch.empty(numel + 1, dtype=dtype)[1:]  # one element past a 64-byte aligned start
        assert t.data_ptr() % 4096 != 0
    itemsize = t.element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), generator=gen, dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw % 2
    t.view(torch.uint8).copy_(raw) if numel else None
    return t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (random bits make NaNs, which torch.equal on floats calls unequal)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _wait(handles) -> None:
    for h in handles:
        h.wait(timeout=WAIT_S)


@contextlib.contextmanager
def _mount(where: Path, fstype: str, options: str) -> Iterator[Path]:
    """Mount a fresh ``fstype`` at ``where/mnt-<fstype>``; skip the test when that is not permitted."""
    if os.geteuid() != 0:
        pytest.skip(f"mounting a {fstype} needs root; this test runs as uid {os.geteuid()}")
    point = where / f"mnt-{fstype}"
    point.mkdir()
    done = subprocess.run(["mount", "-t", fstype, "-o", options, fstype, str(point)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a {fstype} here: {done.stderr.strip() or done.returncode}")
    try:
        yield point
    finally:
        if subprocess.run(["umount", str(point)]).returncode != 0:
            subprocess.run(["umount", "-l", str(point)], check=True)


def _o_direct_works(folder: Path) -> bool:
    """An independent check: can a file in ``folder`` be opened with O_DIRECT and take an aligned write?"""
    path = folder / "independent-probe"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as err:
        assert err.errno == errno.EINVAL
        return False
    try:
        buf = aligned_empty(4096, torch.uint8).fill_(7)
        os.pwrite(fd, buf.numpy(), 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        path.unlink()


def _round_trip(sw: NvmeSwapper, seed: int, keys: int = 48) -> None:
    """Write ``keys`` random tensors without waiting, read them all back, compare with the originals
    and with the files' bytes on disk; then overwrite half of them with new sizes and check again."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    block = sw.config.block_size
    edge = [1, 2, 4095, 4096, 4097, block - 1, block, block + 1, 3 * block + 17, 5 * block]
    written: dict[str, torch.Tensor] = {}

    def write_all(names):
        handles = []
        for name in names:
            dtype = rng.choice(DTYPES)
            itemsize = torch.empty((), dtype=dtype).element_size()
            nbytes = rng.choice(edge) if rng.random() < 0.5 else rng.randrange(1, 6 * block)
            numel = max(1, nbytes // itemsize)
            written[name] = _random_tensor(numel, dtype, gen, aligned=rng.random() < 0.5)
            handles.append(sw.write(name, written[name]))
        return handles

    names = [f"param/{i}" for i in range(keys)]
    writes = write_all(names)  # all in flight at once
    outs = {n: _random_tensor(t.numel(), t.dtype, gen, aligned=rng.random() < 0.5) for n, t in written.items()}
    reads = [sw.read(n, outs[n]) for n in names]  # ordered after each key's write
    _wait(writes + reads)
    sw.wait_all()
    for n in names:
        assert _same(outs[n], written[n]), n
        on_disk = sw._path(n).read_bytes()
        data = _bytes(written[n])
        assert on_disk[: len(data)] == data, n
        expected_size = -(-len(data) // 4096) * 4096 if sw.direct else len(data)
        assert len(on_disk) == expected_size, n

    again = names[::2]
    _wait(write_all(again))
    for n in again:
        out = torch.empty_like(written[n])
        sw.read(n, out).wait(timeout=WAIT_S)
        assert _same(out, written[n]), n


def test_aio_config_validation() -> None:
    assert AioConfig() == AioConfig(block_size=1 << 20, queue_depth=8, threads=4, o_direct=True)
    for field, bad in [("block_size", 1000), ("block_size", 0), ("queue_depth", 0), ("threads", -1),
                       ("threads", 2.0), ("queue_depth", True), ("block_size", 1 << 31)]:
        with pytest.raises(ValueError, match=f"AioConfig.{field}="):
            AioConfig(**{field: bad})
    with pytest.raises(ValueError, match="multiple of 4096"):
        AioConfig(block_size=4096 + 512)
    with pytest.raises(TypeError):
        AioConfig(1 << 20)  # keyword-only


def test_aligned_empty() -> None:
    for dtype in DTYPES:
        for numel in (0, 1, 3, 1000, 4097):
            t = aligned_empty(numel, dtype)
            assert t.shape == (numel,) and t.dtype == dtype and t.is_contiguous()
            assert t.data_ptr() % 4096 == 0
            padded = -(-numel * t.element_size() // 4096) * 4096
            storage_end = t.untyped_storage().data_ptr() + t.untyped_storage().nbytes()
            assert t.data_ptr() + padded <= storage_end
    assert aligned_empty(10, torch.float32, alignment=512).data_ptr() % 512 == 0
    with pytest.raises(ValueError, match="alignment"):
        aligned_empty(10, torch.float32, alignment=3000)
    with pytest.raises(ValueError, match="numel"):
        aligned_empty(-1, torch.float32)


def test_round_trip_o_direct_on_disk(tmp_path: Path) -> None:
    """Under tmp_path (ext4 on this project's machines) O_DIRECT is used."""
    with NvmeSwapper(tmp_path / "swap", SMALL_BLOCKS) as sw:
        assert sw.direct == _o_direct_works(tmp_path)
        if filesystem_type(tmp_path) in ("ext4", "xfs"):
            assert sw.direct, "local ext4 and xfs support O_DIRECT"
        _round_trip(sw, seed=0)
        assert sw.bytes_written > 0 and sw.bytes_read > 0
    assert not (tmp_path / "swap").exists()


def test_small_pool_many_keys_default_blocks(tmp_path: Path) -> None:
    """One thread and a window of one block: queued blocks still all complete, in any order of keys."""
    with NvmeSwapper(tmp_path / "swap", AioConfig(threads=1, queue_depth=1)) as sw:
        _round_trip(sw, seed=1, keys=24)


def test_ordering_on_one_key(tmp_path: Path) -> None:
    """Requests on one key run in issue order, none of them waited for before the next is issued."""
    gen = torch.Generator().manual_seed(2)
    a = _random_tensor(300_001, torch.float32, gen, aligned=False)
    b = _random_tensor(70_000, torch.float32, gen, aligned=True)
    with NvmeSwapper(tmp_path / "swap", SMALL_BLOCKS) as sw:
        out_a1, out_a2, out_b = torch.empty_like(a), torch.empty_like(a), torch.empty_like(b)
        handles = [sw.write("k", a), sw.read("k", out_a1), sw.read("k", out_a2), sw.write("k", b), sw.read("k", out_b)]
        _wait(handles)
        assert _same(out_a1, a) and _same(out_a2, a) and _same(out_b, b)
        assert sw.bytes_written == a.nbytes + b.nbytes
        assert sw.bytes_read == 2 * a.nbytes + b.nbytes
        with pytest.raises(SwapError, match="written with"):
            sw.read("k", out_a1)  # the last write issued was b's size


def test_requests_chained_on_one_key_finish_while_the_interpreter_exits(tmp_path: Path) -> None:
    """At a script's end the interpreter stops concurrent.futures' executors (they refuse new work)
    before the swapper's close() waits for its requests; a request chained behind one that
    finishes then must still run (it used to be dropped, and close() waited for it forever: a
    script that caught a full disk's SwapError hung at exit). The executor is shut down here as
    the interpreter does, while the first of three requests on one key is in flight."""
    import threading

    data = torch.arange(16 << 20, dtype=torch.float32)  # 64 MiB: in flight when the executor stops
    out = torch.empty_like(data)
    sw = NvmeSwapper(tmp_path / "swap", SMALL_BLOCKS)
    handles = [sw.write("k", data), sw.read("k", out), sw.write("k", data)]
    sw._pool._executor.shutdown(wait=False)  # what the interpreter's exit does to every executor
    waiter = threading.Thread(target=_wait, args=(handles,), daemon=True)
    waiter.start()
    waiter.join(timeout=60)
    assert not waiter.is_alive(), [str(h) for h in handles]  # (not closed then: close() would wait too)
    assert _same(out, data)
    sw.close()


def test_dev_shm_tmpfs(tmp_path: Path) -> None:
    """/dev/shm is tmpfs. Linux >= 6.6 gives tmpfs O_DIRECT, older kernels refuse it: either way the
    swapper agrees with an independent probe and the data round-trips."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm on this machine")
    with NvmeSwapper(Path("/dev/shm") / f"zinf-test-{os.getpid()}-{tmp_path.name}", SMALL_BLOCKS) as sw:
        assert sw.direct == _o_direct_works(sw.folder)
        _round_trip(sw, seed=3, keys=12)


def test_buffered_fallback_without_o_direct(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """ramfs refuses O_DIRECT (EINVAL): one log line, buffered I/O, same data, files not padded."""
    with _mount(tmp_path, "ramfs", "mode=0700") as mnt:
        with caplog.at_level(logging.INFO, logger="lightning_zinf"):
            with NvmeSwapper(mnt / "swap", SMALL_BLOCKS) as sw:
                assert sw.direct is False
                _round_trip(sw, seed=4, keys=12)
        lines = [r for r in caplog.records if r.name.startswith("lightning_zinf")]
        assert len(lines) == 1, [r.getMessage() for r in lines]
        assert "O_DIRECT" in lines[0].getMessage() and "ramfs" in lines[0].getMessage()
        assert list(mnt.iterdir()) == []


def test_buffered_when_configured(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="lightning_zinf"):
        with NvmeSwapper(tmp_path / "swap", AioConfig(block_size=64 * 1024, o_direct=False)) as sw:
            assert sw.direct is False
            _round_trip(sw, seed=5, keys=12)
    assert not [r for r in caplog.records if r.name.startswith("lightning_zinf")]


@pytest.mark.parametrize("o_direct", [True, False])
def test_disk_full(tmp_path: Path, o_direct: bool) -> None:
    """A 1 MiB tmpfs: a 3 MiB write fails with a clear error (no hang), the key reads as failed,
    smaller writes still work, and close() leaves the mount empty."""
    gen = torch.Generator().manual_seed(6)
    with _mount(tmp_path, "tmpfs", "size=1m,mode=0700") as mnt:
        with NvmeSwapper(mnt / "swap", AioConfig(block_size=64 * 1024, o_direct=o_direct)) as sw:
            big = _random_tensor(3 << 20, torch.uint8, gen, aligned=True)
            handle = sw.write("big", big)
            with pytest.raises(SwapError, match=r"is full: \d+ bytes free, \d+ more needed") as info:
                handle.wait(timeout=WAIT_S)
            assert str(mnt) in str(info.value) and "free space or point nvme_path elsewhere" in str(info.value)
            with pytest.raises(SwapError, match="is full"):
                handle.wait(timeout=WAIT_S)  # idempotent
            with pytest.raises(SwapError, match="last write failed"):
                sw.read("big", torch.empty_like(big)).wait(timeout=WAIT_S)
            sw.remove("big")
            small = _random_tensor(100_000, torch.uint8, gen, aligned=False)
            out = torch.empty_like(small)
            sw.write("small", small).wait(timeout=WAIT_S)
            sw.read("small", out).wait(timeout=WAIT_S)
            assert _same(out, small)
            # Several writes in flight that together do not fit: at least one fails; wait_all
            # reports it once.
            handles = [sw.write(f"part{i}", _random_tensor(300_000, torch.uint8, gen, aligned=True)) for i in range(6)]
            outcomes = []
            for h in handles:
                try:
                    h.wait(timeout=WAIT_S)
                    outcomes.append("ok")
                except SwapError as err:
                    assert "is full" in str(err)
                    outcomes.append("full")
            assert "full" in outcomes
            sw.wait_all()  # every failure already reached a wait()
        assert list(mnt.iterdir()) == []


def test_nvme_path_errors(tmp_path: Path) -> None:
    with pytest.raises(SwapError, match="does not exist.*create it or point nvme_path"):
        NvmeSwapper(tmp_path / "missing" / "swap")
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(SwapError, match="is not a directory"):
        NvmeSwapper(tmp_path / "a-file" / "swap")
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "theirs.bin").write_bytes(b"keep me")
    with pytest.raises(SwapError, match="already exists.*never reuses or deletes"):
        NvmeSwapper(existing)
    assert (existing / "theirs.bin").read_bytes() == b"keep me"


def test_unwritable_nvme_path(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        # chmod does not stop root: use a read-only mount.
        with _mount(tmp_path, "tmpfs", "ro,size=1m") as mnt:
            with pytest.raises(SwapError, match=f"{mnt}.*make nvme_path {mnt} writable"):
                NvmeSwapper(mnt / "swap")
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            with pytest.raises(SwapError, match=f"make nvme_path {ro} writable"):
                NvmeSwapper(ro / "swap")
        finally:
            ro.chmod(0o700)


@pytest.mark.parametrize("change", ["truncated", "rewritten", "deleted", "replaced"])
def test_file_changed_underneath(tmp_path: Path, change: str) -> None:
    gen = torch.Generator().manual_seed(7)
    data = _random_tensor(50_000, torch.float32, gen, aligned=True)
    with NvmeSwapper(tmp_path / "swap", SMALL_BLOCKS) as sw:
        sw.write("k", data).wait(timeout=WAIT_S)
        path = sw._path("k")
        before = os.stat(path)
        if change == "truncated":
            os.truncate(path, 4096)
        elif change == "rewritten":
            with open(path, "r+b") as f:
                f.write(b"\x00" * 4096)
            if os.stat(path).st_mtime_ns == before.st_mtime_ns:
                # A kernel with coarse timestamps can give the same tick; a real rewrite comes later.
                os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1))
        elif change == "deleted":
            path.unlink()
        else:
            other = tmp_path / "other"
            other.write_bytes(path.read_bytes())
            os.utime(other, ns=(before.st_atime_ns, before.st_mtime_ns))  # same size and mtime
            os.replace(other, path)
        with pytest.raises(SwapError, match="deleted by something outside" if change == "deleted" else "changed underneath"):
            sw.read("k", torch.empty_like(data)).wait(timeout=WAIT_S)
    if change == "replaced":
        assert path.exists(), "the swapper must not delete a file it did not create"
        path.unlink()
        (tmp_path / "swap").rmdir()


def test_short_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file truncated after the check and before the blocks are read: SwapError, not garbage."""
    data = torch.arange(10_000, dtype=torch.int64)
    with NvmeSwapper(tmp_path / "swap", SMALL_BLOCKS) as sw:
        sw.write("k", data).wait(timeout=WAIT_S)
        os.truncate(sw._path("k"), 8192)
        monkeypatch.setattr(sw, "_check_unchanged", lambda *args: None)  # the truncation "races" the check
        with pytest.raises(SwapError, match=r"short read of .*k-k.swp.*got \d+ of \d+ bytes at offset \d+; the file was truncated"):
            sw.read("k", torch.empty_like(data)).wait(timeout=WAIT_S)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, b"abc")
        assert pread_full(fd, memoryview(bytearray(10)), 0) == 3
    finally:
        os.close(fd)


def test_bad_arguments(tmp_path: Path) -> None:
    with NvmeSwapper(tmp_path / "swap") as sw:
        sw.write("k", torch.ones(10)).wait(timeout=WAIT_S)
        with pytest.raises(SwapError, match="written with 40 bytes"):
            sw.read("k", torch.empty(11))
        with pytest.raises(SwapError, match="never written"):
            sw.read("nope", torch.empty(10))
        with pytest.raises(ValueError, match="non-contiguous"):
            sw.write("k", torch.ones(4, 4).t())
        with pytest.raises(ValueError, match="CPU tensor"):
            sw.write("k", torch.ones(4, device="meta"))
        with pytest.raises(ValueError, match="non-empty string"):
            sw.write("", torch.ones(4))
        # Keys are quoted: none escapes the folder.
        sw.write("../../escape", torch.ones(3)).wait(timeout=WAIT_S)
        sw.write("x" * 500, torch.ones(3)).wait(timeout=WAIT_S)
        assert len([p for p in sw.folder.iterdir() if p.name != ".lock"]) == 3
        assert not (tmp_path / "escape").exists()
        sw.write("empty", torch.ones(0)).wait(timeout=WAIT_S)
        sw.read("empty", torch.ones(0)).wait(timeout=WAIT_S)
    with pytest.raises(SwapError, match="is closed"):
        sw.write("k", torch.ones(10))


def test_close_removes_only_its_own(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "neighbour.bin").write_bytes(b"not ours")
    sw = NvmeSwapper(tmp_path / "swap")
    for i in range(5):
        sw.write(f"k{i}", torch.full((1000,), i))
    sw.remove("k0")
    sw.remove("never-written")
    sw.close()
    sw.close()  # idempotent
    assert sorted(p.name for p in tmp_path.iterdir()) == ["neighbour.bin"]

    sw = NvmeSwapper(tmp_path / "swap2")
    sw.write("k", torch.ones(100)).wait(timeout=WAIT_S)
    (sw.folder / "dropped-in.txt").write_text("someone else's")
    with caplog.at_level(logging.WARNING, logger="lightning_zinf"):
        sw.close()
    assert sorted(p.name for p in (tmp_path / "swap2").iterdir()) == ["dropped-in.txt"]
    assert any("dropped-in.txt" in r.getMessage() for r in caplog.records)


def test_unreported_failure_surfaces_in_wait_all_and_close(tmp_path: Path) -> None:
    with NvmeSwapper(tmp_path / "swap") as sw:
        sw.write("k", torch.ones(10)).wait(timeout=WAIT_S)
        sw._path("k").unlink()
        sw.read("k", torch.empty(10))  # not waited for
        sw.read("k", torch.empty(10))
        with pytest.raises(SwapError, match=r"deleted by something outside.*\(1 more requests failed\)"):
            sw.wait_all()
        sw.wait_all()  # reported once
        sw.read("k", torch.empty(10))
        with pytest.raises(SwapError, match="deleted by something outside"):
            sw.close()
    assert not (tmp_path / "swap").exists()


def test_bandwidth_benchmark_runs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """examples/benchmarks/nvme_bandwidth.py end to end on 8 MiB (a smoke test; no speed is checked)."""
    import json
    import shutil
    import sys

    if shutil.which("dd") is None:
        pytest.skip("dd is not installed")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "benchmarks"))
    try:
        import nvme_bandwidth
    finally:
        sys.path.pop(0)
    out = tmp_path / "result.json"
    args = ["--dir", str(tmp_path), "--size-gib", str(8 / 1024), "--repeats", "1", "--keys", "3", "--out", str(out)]
    assert nvme_bandwidth.main(args) == 0
    result = json.loads(out.read_text())
    assert result["bytes"] == 8 << 20 and set(result["summary"]) == {"write", "read"}
    assert "| read |" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]
