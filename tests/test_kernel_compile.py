"""The Triton kernels compile for real GPUs (sm_80, sm_90), even on a machine without one.

The interpreter tests (``test_kernels.py``) check the kernels' values; this checks what only the
GPU compiler can tell: that every launch configuration compiles to a cubin, spills nothing to
local memory, and, when the sizes are whole 16-element runs, moves its data with 16-byte vector
loads and stores (the kernels are memory-bound; byte-wide accesses would cap them far below the
copy bandwidth); that a new shard size compiles nothing new (the kernels specialise on the sizes'
divisibility only where the vector accesses need it), and that a second process finds the
kernels compiled by the first in Triton's on-disk cache. ``tests/compile_kernels.py`` does the
compiling in a fresh process, because the test session runs Triton's interpreter.
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


def run_script(*args: str, **env: str) -> list[dict]:
    """``compile_kernels.py``'s JSON lines, run without the interpreter (and with ``env`` added)."""
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, **env}
    done = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"compiling the kernels failed:\n{done.stderr[-4000:]}"
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    return run_script(*(f"--arch={a}" for a in ARCHS))


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


def test_unspecialised_sizes_keep_every_vector_access(compiled: list[dict]) -> None:
    """The sizes left unspecialised (block counts) cost no access width: each configuration moves
    its data exactly as the same kernel compiled with every integer argument specialised does."""
    changed = [(r["name"], r["arch"], r["global_ops_specialized"], r["global_ops"])
               for r in compiled if r["global_ops"] != r["global_ops_specialized"]]
    assert not changed, f"(configuration, arch, fully specialised, as launched): {changed}"


def test_shard_sizes_share_one_compiled_kernel() -> None:
    """Launches of one kernel and format at sizes with 1, 16, 32, 52 and 4096 blocks per row, all
    whole 16-value runs (as every engine shard), have one specialization key: one compile serves
    them all, where Triton would compile per block count that is 1, a multiple of 16 or neither
    (three kernels). Sizes that are not whole runs share one other key (narrower accesses). The
    launches that read or write packed rows (``PackedRows``, whose row stride is the padded row's
    length) form families of their own, with the same property."""
    from tests.compile_kernels import ODD, WHOLE_RUNS

    keys: dict[tuple[str, int, bool], set[str]] = {}
    for r in run_script("--keys", *(f"--arch={a}" for a in ARCHS)):
        assert r["n"] in WHOLE_RUNS or r["n"] in ODD
        keys.setdefault((r["family"], r["arch"], r["n"] in WHOLE_RUNS), set()).add(r["key"])
    assert len(keys) == (12 + 6) * 2 * len(ARCHS)  # families (6 of packed rows) x whole or not x arch
    several = {k: len(v) for k, v in keys.items() if len(v) > 1}
    assert not several, f"(family, arch, whole runs): distinct compiled kernels {several}"
    for family, arch, whole in keys:
        if whole:
            assert keys[family, arch, True] != keys[family, arch, False], (family, arch)


def test_a_second_process_finds_the_compiled_kernels_on_disk(tmp_path) -> None:
    """Triton caches compiled kernels in ``TRITON_CACHE_DIR``: nothing in the kernels (a global
    that changes, a kernel made anew per call) keeps a second process from using them, so GPU
    runs that share the folder (``gpu_check.py``'s steps) compile each kernel once."""
    only = ("--only=quantize bf16 INT4", "--arch=90")
    first = run_script(*only, TRITON_CACHE_DIR=str(tmp_path))
    second = run_script(*only, TRITON_CACHE_DIR=str(tmp_path))
    assert first and not any(r["cache_hit"] for r in first)
    assert [r["name"] for r in second] == [r["name"] for r in first] and all(r["cache_hit"] for r in second)
    assert [r["global_ops"] for r in second] == [r["global_ops"] for r in first]
