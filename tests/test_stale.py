"""Swap folders of killed runs are removed at the next start; live, foreign and other hosts'
folders are not.

The killed runs are real processes ended with SIGKILL (nothing of theirs runs at exit), one of
them in the middle of training with NVMe offload. Folder ages are set with ``os.utime`` instead of
waiting out the few seconds a new folder is protected.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_zinf import OffloadConfig, ZeroEngine
from lightning_zinf.offload import NvmeSwapper
from lightning_zinf.offload.stale import reclaim_stale_folders, swap_folder_name
from tests import models

REPO = Path(__file__).resolve().parents[1]

_TRAIN_THEN_DIE = """
import os, signal, sys, torch
from lightning_zinf import OffloadConfig, ZeroEngine
from tests import models
torch.manual_seed(0)
model = models.GPT()
engine = ZeroEngine(model, block_classes=["Block"],
                    offload=OffloadConfig(param="nvme", optimizer="nvme", nvme_path=sys.argv[1]))
opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
models.loss_fn(model, *models.make_batch("gpt", 0, 4)).backward()
opt.step()
engine.release_all()
os.kill(os.getpid(), signal.SIGKILL)
"""


def _age(folder: Path, seconds: float = 60.0) -> None:
    past = time.time() - seconds
    os.utime(folder, (past, past))


def _usage(folder: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in folder.iterdir())


def test_killed_training_run_is_reclaimed_by_the_next_engine(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    done = subprocess.run([sys.executable, "-c", _TRAIN_THEN_DIE, str(tmp_path)], cwd=REPO, timeout=300)
    assert done.returncode == -signal.SIGKILL
    (left,) = tmp_path.iterdir()  # the dead run's folder, with its swap files
    assert _usage(left) > 100_000
    _age(left)

    with caplog.at_level(logging.WARNING, logger="lightning_zinf"):
        engine = ZeroEngine(models.MLP(), offload=OffloadConfig(param="nvme", nvme_path=str(tmp_path)))
    assert not left.exists()
    assert [p.name for p in tmp_path.iterdir()] == [engine.swapper.folder.name]
    assert any("Removed stale NVMe swap folder" in r.getMessage() and left.name in r.getMessage() for r in caplog.records)
    engine.swapper.close()
    assert list(tmp_path.iterdir()) == []


def test_killed_swapper_process_is_reclaimed(tmp_path: Path) -> None:
    script = (
        "import sys, time, torch\n"
        "from lightning_zinf.offload import NvmeSwapper\n"
        "from lightning_zinf.offload.stale import swap_folder_name\n"
        "sw = NvmeSwapper(sys.argv[1] + '/' + swap_folder_name(0))\n"
        "sw.write('shard', torch.ones(1 << 20)).wait()\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        (folder,) = tmp_path.iterdir()
        _age(folder)
        assert reclaim_stale_folders(tmp_path) == []  # alive: its lock is held
        assert folder.exists()
    finally:
        proc.kill()
        proc.wait()
    ((path, freed),) = reclaim_stale_folders(tmp_path)
    assert path == folder and not folder.exists()
    assert freed >= 4 << 20  # the 4 MiB swap file


def test_live_young_foreign_and_other_hosts_folders_are_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    live = NvmeSwapper(tmp_path / swap_folder_name(0))
    live.write("k", torch.ones(1000)).wait()
    _age(live.folder)

    # A dead swapper's folder that someone put a file of their own into.
    foreign = NvmeSwapper(tmp_path / swap_folder_name(1))
    foreign.write("k", torch.ones(1000)).wait()
    (foreign.folder / "notes.txt").write_text("mine")
    os.close(foreign._lock_fd)  # as if its process had died: the lock is released
    foreign._lock_fd = None
    _age(foreign.folder)

    # Dead and just created: protected for a few seconds (a new folder is locked right after mkdir).
    young = NvmeSwapper(tmp_path / swap_folder_name(2))
    os.close(young._lock_fd)
    young._lock_fd = None

    other_host = tmp_path / "zinf-otherhost-rank00000-123-0123abcd"
    other_host.mkdir()
    (other_host / ".lock").touch()
    _age(other_host)

    # A link named like a dead folder of this host, pointing at someone's folder: never followed.
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    elsewhere.mkdir()
    (elsewhere / ".lock").touch()
    (elsewhere / "k-data").write_text("not ours")
    link = tmp_path / swap_folder_name(3)
    link.symlink_to(elsewhere)
    _age(elsewhere)

    with caplog.at_level(logging.WARNING, logger="lightning_zinf"):
        assert reclaim_stale_folders(tmp_path) == []
    assert all(p.exists() for p in (live.folder, foreign.folder, young.folder, other_host, link))
    assert sorted(p.name for p in elsewhere.iterdir()) == [".lock", "k-data"]
    assert any("notes.txt" in r.getMessage() for r in caplog.records)

    _age(young.folder)
    assert [p for p, _ in reclaim_stale_folders(tmp_path)] == [young.folder]
    live.close()
    assert not live.folder.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([foreign.folder.name, other_host.name, link.name])


def test_no_nvme_path_or_empty_is_fine(tmp_path: Path) -> None:
    assert reclaim_stale_folders(tmp_path / "missing") == []
    assert reclaim_stale_folders(tmp_path) == []
