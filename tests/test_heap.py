"""What setup frees goes back to the system (lightning_zinf.heap), observed through glibc's own
heap accounting in a process of its own: the same run with the policy and without."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from lightning_zinf.heap import policy_active

SCRIPT = Path(__file__).resolve().parent / "heap_script.py"
MIB = 1 << 20


def _run(policy: str, nvme: Path) -> dict:
    env = dict(os.environ, LIGHTNING_ZINF_HEAP=policy, NVME=str(nvme), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_setup_leaves_no_free_heap_behind(tmp_path: Path) -> None:
    """A 17M-parameter GPT built on the meta device and partitioned onto NVMe (bf16 compute), two
    AdamW steps. Without the policy glibc keeps about 200 MiB of what construction and partitioning
    freed as free heap after setup (blocks it served from the heap once its dynamic threshold rose),
    and still holds more free heap two steps later; with it, setup leaves almost none, and the
    losses are the same. (The peak RSS of so small a model differs by less than its noise.)"""
    assert policy_active() == (platform.libc_ver()[0] == "glibc")
    on, off = _run("on", tmp_path), _run("off", tmp_path)
    assert on["loss"] == off["loss"]
    assert off["free_after_setup"] > 64 * MIB, off  # the garbage exists here: the test can fail
    assert on["free_after_setup"] < 16 * MIB, on
    # Two steps later the heap still holds less free memory: 117-133 against 175-206 MiB measured
    # here and 131 against 190 in CI (the margin of 64 MiB first asserted failed there once).
    assert on["free_at_end"] < off["free_at_end"] - 16 * MIB, (on, off)
