"""Byte counts as users write them (``"40GiB"``, ``"12GB"``, ``12e9``) and as the plan prints them."""

from __future__ import annotations

import re
from typing import Union

__all__ = ["parse_bytes", "format_bytes"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(value: Union[int, float, str], owner: str = "memory_budget") -> int:
    """A number of bytes from an integer, a float (``12e9``) or a string with a decimal (``"12GB"``)
    or binary (``"40GiB"``) unit, case-insensitive.

    Raises:
        ValueError: less than one byte, not a number, or an unknown unit; the message names
            ``owner`` and the forms accepted.
    """
    text = value if isinstance(value, str) else None
    if isinstance(value, bool):
        number = None
    elif isinstance(value, (int, float)):
        number = value
    else:
        match = _PATTERN.match(text or "")
        unit = match.group(2).lower() if match else None
        number = float(match.group(1)) * _UNITS[unit] if match and unit in _UNITS else None
    if number is None or number != number or number < 1 or number >= 1 << 62:  # (NaN != NaN)
        raise ValueError(
            f"{owner}={value!r} is invalid: give a positive number of bytes per rank, as an integer or with a unit "
            "(e.g. 12000000000, '12GB', '40GiB', '512MiB'; units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)."
        )
    return int(number)


def format_bytes(nbytes: int) -> str:
    """``nbytes`` in MiB (under 1 GiB) or GiB, two decimals: how the plan prints sizes."""
    return f"{nbytes / (1 << 30):.2f} GiB" if abs(nbytes) >= 1 << 30 else f"{nbytes / (1 << 20):.2f} MiB"
