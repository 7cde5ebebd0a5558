"""Sizes in user-facing output, in one convention: binary units named as such (KiB, MiB, GiB), the units the
budget counts in (--ram-budget-mb and the other --*-mb options take MiB, 2**20 bytes)."""

from __future__ import annotations

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def fmt_bytes(n: int) -> str:
    """1.21 GiB, 15.9 GiB, 8 MiB, 0 B: three significant digits in the largest unit that fits."""
    if n <= 0:
        return "0 B"
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= size:
            v = n / size
            return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{n} B"


def mib(n: float, digits: int = 0) -> str:
    """n bytes in MiB: '512 MiB'."""
    return f"{n / MIB:.{digits}f} MiB"


def gib(n: float, digits: int = 2) -> str:
    """n bytes in GiB: '2.62 GiB'."""
    return f"{n / GIB:.{digits}f} GiB"
