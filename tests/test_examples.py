"""The main example's data: the Python stdlib's own sources, split deterministically by package."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from examples.pretrain import stdlib_sources


def test_split_is_deterministic_and_holds_out_the_package(tmp_path: Path) -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val = stdlib_sources(root, held_out="json")
    assert (train, val) == stdlib_sources(root, held_out="json")
    expected_val = b"".join((p.read_bytes() + b"\n\n") for p in sorted((root / "json").rglob("*.py")))
    assert val == expected_val
    assert (root / "json" / "decoder.py").read_bytes() not in train
    assert (root / "textwrap.py").read_bytes() in train
    assert len(train) > 10 * len(val)


def test_unknown_held_out_package(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="No stdlib file under package 'nope'"):
        stdlib_sources(tmp_path, held_out="nope")
