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


PAGES = Path(__file__).resolve().parent / "pages_script.py"


def _pages(policy: str) -> dict:
    env = dict(os.environ, LIGHTNING_ZINF_HEAP=policy, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(PAGES)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_units_flat_gradient_is_faulted_in_by_huge_pages() -> None:
    """A unit's flat gradient of 42 MB (above the size glibc maps on its own, so fresh pages at
    every backward) takes its pages 2 MiB at a time where the system gives huge pages on advice:
    each step after the first makes fewer minor page faults (the kernel's count, ``getrusage``) by
    at least 80% of the buffer's 4 KiB pages, at the same losses. Where the system gives huge pages
    always or never, no advice is given and the counts are the same."""
    on, off = _pages("on"), _pages("off")
    assert on["losses"] == off["losses"] and on["units"] == 2
    buffer_pages = 4096 * 2560 * 4 // 4096
    saved = [b - a for a, b in zip(on["faults"][1:], off["faults"][1:])]
    if on["thp"] == "madvise":
        assert min(saved) > 0.8 * buffer_pages, (on["faults"], off["faults"])
    else:
        assert max(abs(s) for s in saved) < 0.1 * buffer_pages, (on, off)
