"""Parallel positional reads of expert segments.

Each expert is three segments (gate, up, down) far apart in the file; reading them one after another makes
a chain of three latencies (the SDQ seed, section 2). Every segment is a separate task on a thread pool, so
one layer's misses put several reads in flight at once, which is what the disk needs to reach its bandwidth.

Reads go through O_DIRECT into page-aligned buffers when the filesystem allows it, so the page cache never
holds a second, unbudgeted copy of the experts; otherwise buffered reads are followed by FADV_DONTNEED.
os.preadv releases the GIL, so the pool really runs in parallel with the model's compute; the model's
thread packs what it reads.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from moestream.errors import MoestreamError
from moestream.gguf_file import drop_page_cache

ALIGN = 4096


class Lease:
    """Bytes read into a pooled buffer; release() hands the buffer back for the next read."""

    __slots__ = ("view", "release", "addr")

    def __init__(self, view: memoryview, release: Callable[[], None], addr: int = 0):
        self.view = view
        self.release = release
        self.addr = addr  # address of view's first byte, for C callers


class AlignedBuffer:
    """Page-aligned memory (anonymous mmap) that os.preadv can fill with O_DIRECT."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.mem = mmap.mmap(-1, nbytes)
        self.view = memoryview(self.mem)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.mem))


def open_direct(path: str) -> int | None:
    """An O_DIRECT descriptor if this filesystem supports it (tmpfs, for one, refuses)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError:
        return None
    probe = AlignedBuffer(ALIGN)
    try:
        os.preadv(fd, [probe.view], 0)
    except OSError:
        os.close(fd)
        return None
    finally:
        probe.view.release()
        probe.mem.close()
    return fd


class ExpertReader:
    """Reads byte ranges of the model file on a thread pool and hands each to a consumer in that thread."""

    def __init__(
        self, path: str, max_segment_nbytes: int, threads: int = 4, direct: bool | None = None, buffers: int = 0
    ):
        self.path = path
        self.threads = max(1, threads)
        self._fd_buffered = os.open(path, os.O_RDONLY)
        self._fd_direct = open_direct(path) if direct in (None, True) else None
        if direct is True and self._fd_direct is None:
            raise MoestreamError(f"O_DIRECT reads are not supported on the filesystem of {path}; drop --direct")
        self.direct = self._fd_direct is not None
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd_buffered, 0, 0, os.POSIX_FADV_RANDOM)
        # Buffers big enough for the largest segment plus alignment slack at both ends.
        self.buffer_nbytes = (max_segment_nbytes + 2 * ALIGN + ALIGN - 1) // ALIGN * ALIGN
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="moestream-read")
        self._inflight = 0
        self._busy_since = 0.0
        self.busy_s = 0.0
        self.bytes_read = 0
        # Buffers for read(): enough for a whole layer's misses (the engine asks for 3 x top-k), so the disk
        # never waits for the model's thread to pack finished segments (with 2 x threads it did: the reads
        # reached ~50% of the probe's bandwidth while misses were outstanding).
        self.n_buffers = max(buffers, 2 * self.threads)
        self._pool_buffers: queue.SimpleQueue[AlignedBuffer] = queue.SimpleQueue()
        for _ in range(self.n_buffers):
            self._pool_buffers.put(AlignedBuffer(self.buffer_nbytes))

    @property
    def buffers_nbytes(self) -> int:
        """Memory the reader holds at most (counted in the budget)."""
        return self.n_buffers * self.buffer_nbytes

    def _read_to(self, buf: AlignedBuffer, offset: int, nbytes: int) -> int:
        """Read the range into buf; returns where in buf it starts."""
        if self._fd_direct is not None:
            start = offset // ALIGN * ALIGN
            end = (offset + nbytes + ALIGN - 1) // ALIGN * ALIGN
            self._pread_full(self._fd_direct, buf.view[: end - start], start, allow_short=True)
            return offset - start
        self._pread_full(self._fd_buffered, buf.view[:nbytes], offset, allow_short=False)
        drop_page_cache(self._fd_buffered, offset, nbytes)
        return 0

    def _pread_full(self, fd: int, view: memoryview, offset: int, allow_short: bool) -> None:
        done = 0
        total = len(view)
        while done < total:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                if allow_short:  # an O_DIRECT read rounded up past the end of the file
                    return
                raise MoestreamError(f"{self.path}: short read at byte {offset + done}; is the file truncated?")
            done += n

    def read(self, offset: int, nbytes: int) -> Future:
        """Read a range on the pool into a pooled buffer; the future gives a Lease the caller must release.

        The caller (the model's thread) packs the bytes itself: on a 2-core machine the pool threads then
        only sleep in the kernel (O_DIRECT is DMA), and never compete with the compute threads for a core.
        """

        def task() -> Lease:
            buf = self._pool_buffers.get()
            try:
                lead = self._read_to(buf, offset, nbytes)
            except BaseException:
                self._pool_buffers.put(buf)
                raise
            finally:
                self._busy_end(nbytes)
            return Lease(buf.view[lead : lead + nbytes], lambda: self._pool_buffers.put(buf), buf.addr + lead)

        self._busy_begin()
        return self._pool.submit(task)

    # Bandwidth while reads are outstanding: bytes over the time at least one read was in flight. This is
    # what to compare with the probe's figure for the same reads in flight (issue 2's 80% goal).
    def _busy_begin(self) -> None:
        with self._lock:
            if self._inflight == 0:
                self._busy_since = time.perf_counter()
            self._inflight += 1

    def _busy_end(self, nbytes: int) -> None:
        with self._lock:
            self._inflight -= 1
            self.bytes_read += nbytes
            if self._inflight == 0:
                self.busy_s += time.perf_counter() - self._busy_since

    @property
    def busy_bandwidth(self) -> float:
        """Bytes per second over the time reads were in flight (0 before any read)."""
        return self.bytes_read / self.busy_s if self.busy_s > 0 else 0.0

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for fd in (self._fd_buffered, self._fd_direct):
            if fd is not None and fd >= 0:
                os.close(fd)
        self._fd_direct = None
        self._fd_buffered = -1
