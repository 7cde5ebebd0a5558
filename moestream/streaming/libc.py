"""The C library, loaded once for the streaming parts that call it directly (mlock, madvise, the heap's calls)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def libc() -> ctypes.CDLL:
    """The C library, errno kept for callers that read it. OSError where there is none to load."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
