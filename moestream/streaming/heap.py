"""The C heap during a prompt step: what one layer frees is kept for the next.

A prompt span's activations are tens to hundreds of MB a layer. glibc hands allocations over its mmap
threshold (at most 32 MiB by default) out as fresh mappings and gives the heap's free top back past its trim
threshold, so each layer of a long span faulted its activations in anew, page by page; under memory pressure
each fresh page is also one the kernel first reclaims from the page cache (bench/RESULTS.md, "Keeping the
freed heap"). While a prompt step runs, both thresholds are raised and the next layer reuses the pages the
last one freed; when it ends, the free heap goes back to the OS (malloc_trim) and the thresholds return to
the values glibc's own rule reaches once a prompt has freed its first big blocks. So what is kept is the
step's own activations, which the plan counts, and the allocator's slack between them, which the budget's
reserve covers; the mmap threshold is the plan's room for them, so no single block beyond it is kept.

Decode steps are left to glibc: checking the heap after every token (mallinfo2) slowed decoding.
Without glibc (musl, macOS) every call here is a no-op and allocation behaves as the C library decides.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from moestream.streaming import libc

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# mallopt takes an int: as a trim threshold, one the heap's free top never reaches
MALLOPT_MAX = (1 << 31) - 1
# where glibc's dynamic thresholds end on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX, and twice it for trimming)
GLIBC_MMAP_MAX = 32 << 20
GLIBC_TRIM_AT_MAX = 2 * GLIBC_MMAP_MAX


def release_free_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc malloc_trim), so RSS measures what is really held.

    Loading reads every dense tensor into a buffer and frees it after packing; glibc keeps much of that
    freed memory, which would be counted as resident and then
    reused by the first prompt's buffers: the budget would be both too high and inconsistent with the
    estimate made before loading.
    """
    libc.malloc_trim(0)


class FreedHeap:
    """Keeps what a prompt step frees for its next layers (see the module's docstring)."""

    def __init__(self, limit: int):
        self.limit = min(limit, MALLOPT_MAX)  # the mmap threshold while a prompt step runs
        self.trims = 0  # prompt steps whose free heap went back to the OS
        self.active = libc.has("mallopt") and self.limit > GLIBC_MMAP_MAX

    @contextmanager
    def prompt_step(self) -> Iterator[None]:
        """Around a prompt step: its freed blocks stay for its next layers, and go back when it ends."""
        if not self.active:
            yield
            return
        libc.mallopt(M_MMAP_THRESHOLD, self.limit)
        libc.mallopt(M_TRIM_THRESHOLD, MALLOPT_MAX)
        try:
            yield
        finally:
            libc.mallopt(M_MMAP_THRESHOLD, GLIBC_MMAP_MAX)
            libc.mallopt(M_TRIM_THRESHOLD, GLIBC_TRIM_AT_MAX)
            release_free_heap()
            self.trims += 1
