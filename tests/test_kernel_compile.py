"""The Triton kernels compile for real GPUs (sm_80, sm_90), even on a machine without one.

The interpreter tests (``test_kernels.py``) check the kernels' values; this checks what only the
GPU compiler can tell: that every launch configuration compiles to a cubin, spills nothing to
local memory, and, when the sizes are whole 16-element runs, moves its data with 16-byte vector
loads and stores (the kernels are memory-bound; byte-wide accesses would cap them far below the
copy bandwidth). ``tests/compile_kernels.py`` does the compiling in a fresh process, because the
test session runs Triton's interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("compile_kernels.py")
ARCHS = (90, 80)


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [sys.executable, str(SCRIPT)] + [f"--arch={a}" for a in ARCHS]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"compiling the kernels failed:\n{done.stderr[-4000:]}"
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_every_configuration_compiles_for_each_arch(compiled: list[dict]) -> None:
    names = {r["name"] for r in compiled}
    assert len(names) >= 20
    for arch in ARCHS:
        assert {r["name"] for r in compiled if r["arch"] == arch} == names


def test_no_register_spills(compiled: list[dict]) -> None:
    spilled = [(r["name"], r["arch"], r["local"], r["stack"]) for r in compiled if r["local"] or r["stack"]]
    assert not spilled, f"kernels spill registers to local memory: {spilled}"
    assert max(r["regs"] for r in compiled) <= 255


def test_aligned_sizes_move_data_in_16_byte_vectors(compiled: list[dict]) -> None:
    """Values and codes travel as ``.v4.b32``; the only 4-byte scalar accesses left are the fp32
    scales (one per block), and nothing narrower than 4 bytes is touched."""
    for r in (r for r in compiled if "ragged" not in r["name"]):
        ops = r["global_ops"]
        where = f"{r['name']} on sm_{r['arch']}: {ops}"
        assert not [op for op in ops if op.endswith((".b8", ".b16")) or ".v2." in op], where
        assert any(op.startswith("ld.global.v4") for op in ops), where
        assert any(op.startswith("st.global.v4") for op in ops), where
        scalar = sum(n for op, n in ops.items() if op.endswith("global.b32"))
        vector = sum(n for op, n in ops.items() if ".v4." in op)
        assert scalar <= vector, where


def test_ragged_sizes_compile(compiled: list[dict]) -> None:
    """Sizes that are not whole 16-element runs (a tail block, an odd INT4 count) still compile;
    they fall back to narrower accesses, which is why shards are padded to 16 elements."""
    ragged = [r for r in compiled if "ragged" in r["name"]]
    assert len(ragged) == 4 * len(ARCHS)
