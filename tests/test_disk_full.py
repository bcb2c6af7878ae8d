"""A checkpoint save on a disk without room: refused before writing, or cleaned up when the disk
fills during the write, on every rank, with the path and the bytes; the previous checkpoint stays
loadable and the next save in the folder succeeds once there is room.

The disk is a real one of known size: a tmpfs mounted in a user and mount namespace, where both
ranks run (as in ``test_nvme_preflight``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_zinf import ZeroEngine, checkpoint
from lightning_zinf.checkpoint import CheckpointWriteError, load_sharded, save_sharded
from tests import models
from tests.harness import fill_disk, run_distributed


def _setup(seed: int = 0) -> tuple[torch.nn.Module, ZeroEngine, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = models.GPT()
    engine = ZeroEngine(model)
    optimizer = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step in range(2):
        models.loss_fn(model, *models.make_batch("gpt", step, 4)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, engine, optimizer


def _full(rank: int, world: int, disk: str, measure: bool) -> dict:
    """Save a full checkpoint file twice (the second refused on a small disk); load what is there."""
    from tests.test_crash_safety import _load, _save

    model, engine, optimizer = _setup()
    path = Path(disk) / "full.ckpt"
    _save("full", model, engine, optimizer, path, 1)
    if measure:
        return {"bytes": path.stat().st_size}
    error = ""
    try:
        _save("full", model, engine, optimizer, path, 2)
    except CheckpointWriteError as caught:
        error = str(caught)
    other, other_engine, other_optimizer = _setup(seed=1)
    return {"error": error, "listing": sorted(os.listdir(disk)), "step": _load(other, other_engine, other_optimizer, path)}


def _scenario(rank: int, world: int, disk: str, mode: str) -> dict:
    """Save ``ckpt`` once, change the shards, save again (``mode="fill"``: another writer fills the
    disk just after the space check); then load the folder and save once more."""
    if mode.startswith("full"):
        return _full(rank, world, disk, mode == "full-measure")
    _, engine, optimizer = _setup()
    path = Path(disk) / "ckpt"
    save_sharded(engine, [optimizer], path, {"step": 1})
    saved = [g.shard.clone() for g in engine.groups]
    sizes = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    for group in engine.groups:
        group.shard.add_(1.0)
    if mode == "fill":
        check = checkpoint.save.shortfall

        def check_then_fill(*args, **kwargs):
            answer = check(*args, **kwargs)
            if rank == 0:
                fill_disk(disk)
            engine.comm.barrier()
            return answer

        checkpoint.save.shortfall = check_then_fill
    error = ""
    try:
        save_sharded(engine, [optimizer], path, {"step": 2})
    except CheckpointWriteError as caught:
        error = str(caught)
    if mode == "fill":
        checkpoint.save.shortfall = check
    listing = sorted(os.listdir(disk))
    _, other, other_optimizer = _setup(seed=1)
    step = load_sharded(other, [other_optimizer], path)["step"]
    kept = all(torch.equal(a.shard, b) for a, b in zip(other.groups, saved))
    engine.comm.barrier()
    if rank == 0 and mode == "fill":
        os.remove(os.path.join(disk, "filler"))
    engine.comm.barrier()
    again = ""
    if mode == "fill":
        save_sharded(engine, [optimizer], path, {"step": 3})
        again = str(load_sharded(other, [other_optimizer], path)["step"])
    return {"error": error, "listing": listing, "step": step, "kept": kept, "bytes": sizes, "again": again,
            "after": sorted(os.listdir(disk))}


_MAIN = textwrap.dedent("""
    import json, sys
    from tests.harness import fill_disk, run_distributed
    from tests.test_disk_full import _scenario

    if __name__ == "__main__":
        print("RESULT", json.dumps(run_distributed(_scenario, 2, sys.argv[1], sys.argv[2])))
""")


def _on_tmpfs(tmp_path: Path, size: int, mode: str) -> list[dict]:
    disk = tmp_path / f"disk-{mode}"
    disk.mkdir()
    script = tmp_path / "main.py"
    script.write_text(_MAIN)
    inner = f"mount -t tmpfs -o size={size} none {disk} && exec {sys.executable} {script} {disk} {mode}"
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", inner], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.split("RESULT ", 1)[1])


@pytest.fixture(scope="module")
def checkpoint_bytes(tmp_path_factory) -> int:
    """Bytes of one checkpoint of _scenario's model, on an ordinary disk (both ranks' files)."""
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    assert probe.returncode == 0, f"user and mount namespaces are needed: {probe.stderr.decode().strip()}"
    folder = tmp_path_factory.mktemp("sizes")
    return run_distributed(_scenario, 2, str(folder), "plain")[0]["bytes"]


def test_a_save_without_room_is_refused_before_writing_on_every_rank(tmp_path: Path, checkpoint_bytes: int) -> None:
    """A disk with room for one checkpoint, not two (the previous one stays until the new one is
    complete): the second save is refused on both ranks with the bytes needed and free, writes
    nothing, and the first checkpoint still loads."""
    results = _on_tmpfs(tmp_path, int(checkpoint_bytes * 1.5), "refuse")
    for result in results:
        assert re.search(r"Saving the checkpoint \S+/ckpt needs [\d.]+ GB \([\d,]+ bytes\) at \S+ \(2 ranks of \S+ "
                         r"write there\), but only [\d.]+ GB \([\d,]+ bytes\) are free there\. Nothing was written",
                         result["error"]), result["error"]
        needed = int(re.search(r"needs [\d.]+ GB \(([\d,]+) bytes\)", result["error"])[1].replace(",", ""))
        assert checkpoint_bytes <= needed <= checkpoint_bytes * 1.3  # the estimate: the real size, a little more
        assert result["listing"] == ["ckpt"]  # no staging left behind
        assert result["step"] == 1 and result["kept"]


def test_a_disk_that_fills_during_a_save_keeps_the_previous_checkpoint(tmp_path: Path, checkpoint_bytes: int) -> None:
    """The space check passes, then another writer fills the disk: the write fails on the ranks it
    hits, every rank raises the same error naming the file and the full disk, the partial save is
    removed, the previous checkpoint loads, and once there is room again the next save succeeds."""
    results = _on_tmpfs(tmp_path, checkpoint_bytes * 4, "fill")
    assert results[0]["error"] == results[1]["error"]
    for result in results:
        assert re.search(r"^ranks? [01](, 1)?: Saving the checkpoint \S+/ckpt failed: writing \S+rank_0000[01]\.safetensors "
                         r"raised 'No space left on device' \(the disk is full; [\d.]+ GB \([\d,]+ bytes\) free there "
                         r"now\)\. The partial save was removed; the previous checkpoint at \S+/ckpt, if any, is untouched",
                         result["error"]), result["error"]
        assert result["listing"] == ["ckpt", "filler"]
        assert result["step"] == 1 and result["kept"]
        assert result["again"] == "3" and result["after"] == ["ckpt"]


def test_a_full_checkpoint_without_room_is_refused_on_every_rank(tmp_path: Path, checkpoint_bytes: int) -> None:
    """The same for a full (one-file) checkpoint, written by rank 0 alone: both ranks raise."""
    (tmp_path / "measure").mkdir()
    size = run_distributed(_scenario, 2, str(tmp_path / "measure"), "full-measure")[0]["bytes"]
    results = _on_tmpfs(tmp_path, int(size * 1.5), "full")
    for result in results:
        assert re.search(r"Saving the checkpoint \S+/full.ckpt needs [\d.]+ GB \([\d,]+ bytes\) at \S+, but only "
                         r"[\d.]+ GB \([\d,]+ bytes\) are free there\. Nothing was written", result["error"]), result
        assert result["listing"] == ["full.ckpt"] and result["step"] == 1
