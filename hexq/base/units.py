"""Byte sizes as people write them: "200MB", "1.5GiB", "12 kB", "4096".

Decimal units (kB, MB, GB, TB) are powers of 1000 and binary units (KiB, MiB, GiB, TiB) powers of 1024, as in
the SI / IEC standards; the unit is case-insensitive except that a bare "b" means bytes.
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 10**3, "m": 10**6, "g": 10**9}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """The number of bytes `text` describes (rounded down); ValueError naming the accepted forms otherwise."""
    match = _PATTERN.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 200MB, 1.5GiB, 512KiB or a byte count")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return value


def format_bytes(n: int) -> str:
    """A short human form with binary units: 1536 -> '1.50 KiB'."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
