"""NVMe preflight: what a run will write to ``nvme_path`` is checked against the free space there
before anything is written, and a disk that fills later is reported with the run's total.

Observers outside the engine: the swap files' sizes on disk (``os.stat``), the real free space of
the real filesystem, and, for a disk of known size, a small tmpfs mounted in a user and mount
namespace (``unshare``), where this machine allows one without root.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_zinf import MixedPrecisionConfig, OffloadConfig, ZeroEngine
from lightning_zinf.offload import SwapError
from tests import models
from tests.harness import run_distributed

from lightning_zinf.offload.errors import gigabytes


def _swap_file_bytes(nvme: Path) -> int:
    return sum(f.stat().st_size for f in nvme.rglob("*.swp"))


def _step(rank: int, world: int, nvme: str, param: str, dtype: str, optimizer: str, gather: str | None = None) -> dict:
    """Build a GPT with its state on NVMe (gathered in ``gather``, a ``param_dtype``), attach
    ``optimizer``, train one step (its gradient shards swapped out once before the step, as a
    checkpoint there does); return what the preflight counted (the run's total over both ranks)
    and the bytes of every rank's swap files."""
    torch.manual_seed(0)
    model = models.GPT().to(getattr(torch, dtype))
    engine = ZeroEngine(model, offload=OffloadConfig(param=param, optimizer="nvme", nvme_path=nvme),
                        mixed_precision=MixedPrecisionConfig(param_dtype=gather))
    planned_params = engine.swapper.planned_bytes
    written_params = _swap_file_bytes(Path(nvme))
    engine.comm.barrier()
    make = {"adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
            "sgd": lambda p: torch.optim.SGD([{"params": p[:3], "momentum": 0.9}, {"params": p[3:]}], lr=1e-2)}
    opt = engine.shard_optimizer(make[optimizer](list(model.parameters())))
    x, y = models.make_batch("gpt", 0, 4)
    models.loss_fn(model, x, y).float().backward()
    # Gradient shards stay in staging memory and are consumed there while it has room: held
    # records are written when swapped out, as by a checkpoint's reads here.
    with engine.state_resident(write_back=False):
        pass
    opt.step()
    opt.zero_grad()
    engine.begin_pass("train")  # settles every write in flight
    engine.comm.barrier()
    written = _swap_file_bytes(Path(nvme))
    engine.comm.barrier()
    return {"planned_params": planned_params, "written_params": written_params,
            "planned": engine.swapper.planned_bytes, "written": written}


@pytest.mark.parametrize("param, dtype, optimizer, gather", [
    ("nvme", "float32", "adamw", None),  # fp32 masters share the parameter shards' records
    ("nvme", "bfloat16", "adamw", None),  # bf16 shards, separate fp32 masters
    ("nvme", "float32", "adamw", "bf16"),  # and bf16 compute copies of the fp32 shards
    ("cpu", "float32", "sgd", None),  # momentum in one param group only
])
def test_counted_need_is_what_is_written(tmp_path: Path, param: str, dtype: str, optimizer: str, gather) -> None:
    """The bytes the preflight counts (summed over the two ranks sharing the disk) equal the sizes of
    the swap files on disk: after partitioning for the parameter shards (and their compute copies),
    after one training step for everything (masters, gradient shards, optimizer states)."""
    for out in run_distributed(_step, 2, str(tmp_path), param, dtype, optimizer, gather):
        assert out["planned_params"] == out["written_params"], out
        assert out["planned"] == out["written"] > out["planned_params"], out


def _huge(rank: int, world: int, nvme: str) -> str:
    """A model of 932 * 2^30 = 1.0e12 parameters built on the meta device; the engine must refuse it
    before materialising or writing anything. Built on ``torch.device("meta")`` (each module's
    ``reset_parameters()`` would initialise it at setup): inside ``meta_parameters()``
    construction records its initialisation, whose random draws it runs once, as eager
    construction does, which for 10^12 values takes hours."""
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(2**15, 2**15, bias=False) for _ in range(932)])
    with pytest.raises(SwapError) as refused:
        ZeroEngine(model, offload=OffloadConfig(param="nvme", optimizer="nvme", nvme_path=nvme))
    return str(refused.value)


def test_too_large_for_the_disk_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """10^12 fp32 parameters need 4.0 TB of parameter shards over the two ranks, more than this disk
    has free: both ranks refuse with both numbers, the path and the options, and nothing is created
    under nvme_path (no swap folder, no file)."""
    free = shutil.disk_usage(tmp_path).free
    assert free < 932 * 2**30 * 4  # the premise: the real disk cannot hold it
    need = 932 * 2**30 * 4  # fp32, shards of 2^30 / 2 elements: no padding
    for message in run_distributed(_huge, 2, str(tmp_path)):
        assert f"needs {gigabytes(need)} more at nvme_path {tmp_path} (parameter shards; 2 ranks of" in message
        numbers = re.search(r"only [0-9.,]+ GB \(([0-9,]+) bytes\) are free there", message)
        assert numbers and abs(int(numbers[1].replace(",", "")) - free) < 0.05 * free, message
        assert "OffloadConfig(nvme_path=...)" in message and "OffloadConfig(param='cpu')" in message
    assert os.listdir(tmp_path) == []


# --- a disk of known size: a tmpfs in a user and mount namespace --------------------------------------
_ON_SMALL_DISK = textwrap.dedent("""
    import sys, torch
    from lightning_zinf import OffloadConfig, ZeroEngine
    from lightning_zinf.offload import SwapError
    from tests import models
    from tests.harness import fill_disk

    nvme, fill = sys.argv[1], sys.argv[2] == "fill"
    torch.manual_seed(0)
    model = models.GPT()
    engine = ZeroEngine(model, offload=OffloadConfig(param="nvme", optimizer="nvme", nvme_path=nvme))
    try:
        opt = engine.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        if fill:  # something else takes the free space after the check
            fill_disk(nvme)
        x, y = models.make_batch("gpt", 0, 4)
        models.loss_fn(model, x, y).backward()
        opt.step()
        engine.begin_pass("train")
    except SwapError as error:
        print("PLANNED", engine.swapper.planned_bytes)
        print("ERROR", error)
""")


def _run_on_tmpfs(tmp_path: Path, size: int, mode: str) -> str:
    mount = tmp_path / "small"
    mount.mkdir(exist_ok=True)
    script = tmp_path / "on_small_disk.py"
    script.write_text(_ON_SMALL_DISK)
    inner = f"mount -t tmpfs -o size={size} none {mount} && exec {sys.executable} {script} {mount} {mode}"
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", inner],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def namespaces() -> None:
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"this machine allows no user and mount namespaces: {probe.stderr.decode().strip()}")


def _needs(tmp_path: Path) -> tuple[int, int]:
    """The bytes the preflight counts for the model of _ON_SMALL_DISK: parameter shards, and the run's total."""
    out = run_distributed(_step, 1, str(tmp_path / "sizes"), "nvme", "float32", "adamw")[0]
    return out["planned_params"], out["planned"]


def test_optimizer_state_that_does_not_fit_is_refused_when_the_optimizer_is_attached(tmp_path: Path,
                                                                                       namespaces) -> None:
    """A disk with room for the parameter shards but not for masters, gradients and Adam's moments:
    the engine builds, and attaching the optimizer refuses before writing any of them."""
    (tmp_path / "sizes").mkdir()
    params, total = _needs(tmp_path)
    out = _run_on_tmpfs(tmp_path, params + 16 * 4096, "check")
    assert f"needs {gigabytes(total - params)} more at nvme_path" in out, out
    assert "(fp32 masters, gradient shards and optimizer states; 1 rank of" in out, out
    assert f"{gigabytes(total)} for the whole run" in out, out


def test_disk_that_fills_later_reports_the_run_total(tmp_path: Path, namespaces) -> None:
    """The check passes, then another writer fills the disk: the failed swap write names nvme_path
    and the run's total need, not the size of the one record it was writing."""
    (tmp_path / "sizes").mkdir()
    _, total = _needs(tmp_path)
    out = _run_on_tmpfs(tmp_path, total + 16 * 4096, "fill")
    assert f"PLANNED {total}" in out, out
    assert re.search(rf"nvme_path \S+/small is full: this run needs {re.escape(gigabytes(total))} there in all", out), out
