"""Parallel positional reads of expert segments.

Each expert is three segments (gate, up, down) far apart in the file; reading them one after another makes
a chain of three latencies (the SDQ seed, section 2). Every segment is a separate task on a thread pool, so
one layer's misses put several reads in flight at once, which is what the disk needs to reach its bandwidth.

Reads go through O_DIRECT into page-aligned buffers when the filesystem allows it, so the page cache never
holds a second, unbudgeted copy of the experts; otherwise buffered reads are followed by FADV_DONTNEED.
os.preadv releases the GIL, so the pool really runs in parallel with the model's compute; the model's
thread packs what it reads.

A split model's parts are separate files: every read names its part (Segment.part) and lies within it, each
part has its own descriptors, and check_file() checks every part.

A read is all or nothing: it returns every byte of its range or raises DiskError. EIO, EINTR and EAGAIN are
retried a few times; a read that ends early (the file shrank, or the disk returned nothing) is an error, the
only short read accepted being O_DIRECT's round-up past the end of the file as it was when opened. Every
wait for a buffer has a deadline, so a stuck disk ends in an error rather than a hang.
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from moestream.errors import DiskError, MoestreamError
from moestream.formats.gguf_file import drop_page_cache
from moestream.streaming import libc

ALIGN = 4096
# With --run-reads a prompt reads runs of adjacent experts' matrices (consecutive ids sit next to each other in
# the file) as one read of up to this many bytes. Whether that reads faster depends on the disk: this one gave
# 1.11 vs 1.19 GB/s for one 0.6 MB Q4_K matrix vs 4 MiB at 4 in flight in bench/read_runs.py's results, and
# 1.13 vs 1.78 GB/s at another moment; the CPU per GB read fell from 0.17 to 0.12 s.
RUN_BYTES = 4 << 20

# EIO, EINTR and EAGAIN are retried after these pauses (a bad sector read again, an interrupted call), then
# the read fails with an error naming the file, the range and the errno.
RETRY_DELAYS_S = (0.005, 0.02, 0.1, 0.4)
RETRIED_ERRNOS = frozenset({errno.EIO, errno.EINTR, errno.EAGAIN})
# Waits for a buffer or a read have a deadline: what the reads that may be queued ahead take on a disk this
# slow, and never less than MIN_WAIT_S. Past it the disk is taken to be stuck (ExpertReader.wait_s).
SLOW_DISK_BPS = 4 << 20
MIN_WAIT_S = 60.0


def _buffer_nbytes(nbytes: int) -> int:
    """A buffer for reads of up to nbytes: O_DIRECT reads start and end on page boundaries around the range."""
    return (nbytes + 2 * ALIGN + ALIGN - 1) // ALIGN * ALIGN


def run_length(max_segment_nbytes: int, n_experts: int) -> int:
    """How many adjacent segments (one per expert) one run read takes."""
    return max(1, min(n_experts, RUN_BYTES // max(1, max_segment_nbytes)))


class _Countdown:
    """Calls `fn` on the n-th call: the buffer of a run read goes back once every part's lease is released."""

    __slots__ = ("left", "fn", "lock")

    def __init__(self, n: int, fn: Callable[[], None]):
        self.left, self.fn, self.lock = n, fn, threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if last:
            self.fn()


class Lease:
    """Bytes read into a pooled buffer; release() hands the buffer back for the next read."""

    __slots__ = ("view", "addr", "_release")

    def __init__(self, view: memoryview, release: Callable[[], None], addr: int = 0):
        self.view = view
        self.addr = addr  # address of view's first byte, for C callers
        self._release = [release]

    def release(self) -> None:
        """Hand the buffer back; only the first call does (list.pop is atomic, so a lease released by the
        thread that abandons a read and by the one that packed it goes back once)."""
        try:
            fn = self._release.pop()
        except IndexError:
            return
        fn()


class AlignedBuffer:
    """Page-aligned memory (anonymous mmap) that os.preadv can fill with O_DIRECT."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.mem = mmap.mmap(-1, nbytes)
        self.view = memoryview(self.mem)
        self.addr = libc.buffer_address(self.mem)


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


class _OpenFile:
    """One file of the model as the reader holds it: a buffered descriptor, an O_DIRECT one where the
    filesystem allows, and its size, mtime, inode and device as opened (check() compares them)."""

    def __init__(self, path: str, direct: bool | None):
        self.path = path
        self.fd_buffered = os.open(path, os.O_RDONLY)
        self.fd_direct = open_direct(path) if direct in (None, True) else None
        if direct is True and self.fd_direct is None:
            self.close()
            raise MoestreamError(f"O_DIRECT reads are not supported on the filesystem of {path}; drop --direct")
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd_buffered, 0, 0, os.POSIX_FADV_RANDOM)
        st = os.fstat(self.fd_buffered)
        self.opened = (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)
        self.size = st.st_size

    def check(self) -> None:
        """Raise DiskError if the file was truncated, replaced or rewritten since it was opened."""
        try:
            st = os.stat(self.path)
        except OSError as exc:
            raise DiskError(
                f"the model file {self.path} is gone while moestream was running ({exc.strerror}); restart with a file"
            ) from None
        size, mtime_ns, ino, dev = self.opened
        if (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev) == self.opened:
            return
        if st.st_size != size:
            what = f"size {size} -> {st.st_size}"
        elif (st.st_ino, st.st_dev) != (ino, dev):
            what = "replaced by another file of the same size"
        else:
            what = "rewritten in place"
        raise DiskError(
            f"the model file {self.path} changed while moestream was running ({what}); restart with the new file"
        )

    def buffered_only(self) -> None:
        if self.fd_direct is not None:
            os.close(self.fd_direct)
            self.fd_direct = None

    def close(self) -> None:
        self.buffered_only()
        if self.fd_buffered >= 0:
            os.close(self.fd_buffered)
            self.fd_buffered = -1


def _open_files(paths: Sequence[str], direct: bool | None) -> list[_OpenFile]:
    """Every file of the model, O_DIRECT for all of them or none (the parts of one model share a disk)."""
    files: list[_OpenFile] = []
    try:
        for path in paths:
            files.append(_OpenFile(path, direct))
    except BaseException:
        for f in files:
            f.close()
        raise
    if any(f.fd_direct is None for f in files):
        for f in files:
            f.buffered_only()
    return files


class ExpertReader:
    """Reads byte ranges of the model's files on a thread pool and hands each to a consumer in that thread."""

    def __init__(
        self,
        path: str | Sequence[str],
        max_segment_nbytes: int,
        threads: int = 4,
        direct: bool | None = None,
        buffers: int = 0,
        run_buffers: int = 0,
        run_len: int = 1,
    ):
        # path: the model's file, or a split model's files in order (a read's `part` indexes them)
        paths = [path] if isinstance(path, str) else list(path)
        self.path = paths[0]
        self.threads = max(1, threads)
        self.files = _open_files(paths, direct)
        self.direct = self.files[0].fd_direct is not None
        # Buffers big enough for the largest segment plus alignment slack at both ends.
        self.buffer_nbytes = _buffer_nbytes(max_segment_nbytes)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="moestream-read")
        self._inflight = 0
        self._busy_since = 0.0
        self.busy_s = 0.0
        self.bytes_read = 0
        self.buffer_wait_s = 0.0  # summed over reads: time spent waiting for a free buffer
        # Buffers for read(): enough for a whole layer's misses (the engine asks for 3 x top-k), so the disk
        # never waits for the model's thread to pack finished segments (with 2 x threads it did: the reads
        # reached ~50% of the probe's bandwidth while misses were outstanding).
        self.n_buffers = max(buffers, 2 * self.threads)
        self._pool_buffers: queue.SimpleQueue[AlignedBuffer] = queue.SimpleQueue()
        for _ in range(self.n_buffers):
            self._pool_buffers.put(AlignedBuffer(self.buffer_nbytes))
        # Bigger buffers for run reads (read_run); without them every part is read on its own.
        self.n_run_buffers = run_buffers
        self.run_len = run_len if run_buffers else 1
        self.run_buffer_nbytes = _buffer_nbytes(self.run_len * max_segment_nbytes)
        self._run_buffers: queue.SimpleQueue[AlignedBuffer] = queue.SimpleQueue()
        for _ in range(run_buffers):
            self._run_buffers.put(AlignedBuffer(self.run_buffer_nbytes))
        # Deadline of any one wait for a buffer or a read (seconds); tests lower it.
        self.wait_s = max(MIN_WAIT_S, self.buffers_nbytes / SLOW_DISK_BPS)

    def ahead_buffers(self, runs: bool = True) -> int:
        """Buffers a read-ahead may hold at once: all but 2 x threads of the pool its reads use. Those it leaves
        are what the current layer's own reads cycle through; were the read-ahead to hold them all, a read the
        model's thread waits for would find no buffer (waiters are not served in order) until the deadline.
        runs=False: of the segment buffers (the decode lookahead's reads are one segment each)."""
        pool = self.n_run_buffers if runs and self.n_run_buffers else self.n_buffers
        return pool - 2 * self.threads

    @property
    def buffers_nbytes(self) -> int:
        """Memory the reader holds at most (counted in the budget)."""
        return self.n_buffers * self.buffer_nbytes + self.n_run_buffers * self.run_buffer_nbytes

    def _read_to(self, buf: AlignedBuffer, offset: int, nbytes: int, part: int = 0) -> int:
        """Read the range of file `part` into buf; returns where in buf it starts."""
        f = self.files[part]
        end = offset + nbytes
        if end > f.size:
            raise self._read_error(f, offset, nbytes, f"the range ends past the end of the file ({f.size} bytes)")
        if f.fd_direct is not None:
            start = offset // ALIGN * ALIGN
            stop = (end + ALIGN - 1) // ALIGN * ALIGN
            # the one short read O_DIRECT may give: the last page rounded up past the end of the file
            need = min(stop, f.size) - start
            self._pread_full(f, True, buf.view[: stop - start], start, need, offset, nbytes)
            return offset - start
        self._pread_full(f, False, buf.view[:nbytes], offset, nbytes, offset, nbytes)
        drop_page_cache(f.fd_buffered, offset, nbytes)
        return 0

    def _pread_full(
        self, f: _OpenFile, direct: bool, view: memoryview, at: int, need: int, offset: int, nbytes: int
    ) -> None:
        """Read at least `need` bytes of view from position `at` of file f, or raise DiskError. A partial read
        goes on from where it stopped (from the page it stopped in, for O_DIRECT, so that reads stay aligned);
        a read that returns nothing before `need` means the file ended early."""
        fd, step = (f.fd_direct, ALIGN) if direct else (f.fd_buffered, 1)
        assert fd is not None
        done, retries = 0, 0
        while done < need:
            try:
                n = os.preadv(fd, [view[done:]], at + done)
            except OSError as exc:
                if exc.errno not in RETRIED_ERRNOS or retries == len(RETRY_DELAYS_S):
                    raise self._read_error(f, offset, nbytes, _describe(exc, retries)) from None
                time.sleep(RETRY_DELAYS_S[retries])
                retries += 1
                continue
            if n <= 0:
                why = f"a read at byte {at + done} returned nothing (the file had {f.size} bytes when opened)"
                raise self._read_error(f, offset, nbytes, why)
            reached = done + n
            if reached < need and step > 1:
                reached -= reached % step
                if reached == done:  # less than a page: read that page again, a bounded number of times
                    if retries == len(RETRY_DELAYS_S):
                        raise self._read_error(f, offset, nbytes, f"reads kept returning less than a page ({n} bytes)")
                    time.sleep(RETRY_DELAYS_S[retries])
                    retries += 1
                    continue
            done, retries = reached, 0  # the bound is on failures in a row at one position

    def _read_error(self, f: _OpenFile, offset: int, nbytes: int, why: str) -> DiskError:
        what = f"reading {nbytes} bytes at offset {offset} failed: {why}; the disk or the file is damaged"
        return self.error(what, f.path)

    def error(self, what: str, path: str | None = None) -> DiskError:
        """The error for a read (of file `path`, default the first) that failed or never finished: a file
        having changed since it was opened explains it best, so that is checked first."""
        try:
            self.check_file()
        except DiskError as changed:
            return changed
        return DiskError(f"{path or self.path}: {what}")

    def check_file(self) -> None:
        """Raise DiskError if a file of the model was truncated, replaced or rewritten since it was opened. One
        stat per file: cheap enough to call between requests; every read error calls it too."""
        for f in self.files:
            f.check()

    def read(self, offset: int, nbytes: int, part: int = 0) -> Future:
        """Read a range of file `part` on the pool into a pooled buffer; the future gives a Lease the caller
        must release.

        The caller (the model's thread) packs the bytes itself: on a 2-core machine the pool threads then
        only sleep in the kernel (O_DIRECT is DMA), and never compete with the compute threads for a core.
        """

        def task() -> Lease:
            buf = None
            try:
                buf = self._buffer(self._pool_buffers)
                lead = self._read_to(buf, offset, nbytes, part)
            except BaseException:
                if buf is not None:
                    self._pool_buffers.put(buf)
                raise
            finally:
                self._busy_end(nbytes)
            return Lease(buf.view[lead : lead + nbytes], lambda: self._pool_buffers.put(buf), buf.addr + lead)

        self._busy_begin()
        return self._pool.submit(task)

    def read_run(self, offset: int, each_nbytes: int, count: int, part: int = 0) -> list[Future]:
        """`count` adjacent ranges of each_nbytes bytes (count <= run_len) of file `part`, read as one; one
        future per range, each giving its Lease. The buffer goes back once every range's lease is released."""
        if not self.n_run_buffers:
            return [self.read(offset + i * each_nbytes, each_nbytes, part) for i in range(count)]
        if count > self.run_len:
            raise ValueError(f"a run of {count} ranges is longer than this reader's {self.run_len}")
        futures: list[Future] = [Future() for _ in range(count)]
        pool = self._run_buffers

        def task() -> None:
            buf = None
            try:
                buf = self._buffer(pool)
                lead = self._read_to(buf, offset, each_nbytes * count, part)
            except BaseException as exc:
                if buf is not None:
                    pool.put(buf)
                for f in futures:
                    f.set_exception(exc)
                return
            finally:
                self._busy_end(each_nbytes * count)
            release = _Countdown(count, lambda: pool.put(buf))
            for i, f in enumerate(futures):
                at = lead + i * each_nbytes
                f.set_result(Lease(buf.view[at : at + each_nbytes], release, buf.addr + at))

        self._busy_begin()
        self._pool.submit(task)
        return futures

    def _buffer(self, pool: queue.SimpleQueue[AlignedBuffer]) -> AlignedBuffer:
        """A free buffer; the time a read waits for one (all held by reads not yet packed) is counted."""
        try:
            return pool.get_nowait()
        except queue.Empty:
            t = time.perf_counter()
            try:
                buf = pool.get(timeout=self.wait_s)
            except queue.Empty:
                raise self.error(
                    f"no read buffer came free within {self.wait_s:g} s (the reads holding them are stuck); "
                    "the disk is not responding"
                ) from None
            with self._lock:
                self.buffer_wait_s += time.perf_counter() - t
            return buf

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
        for f in self.files:
            f.close()


def _describe(exc: OSError, retries: int) -> str:
    name = errno.errorcode.get(exc.errno or 0, "?")
    tried = f" (tried {retries + 1} times)" if exc.errno in RETRIED_ERRNOS else ""
    return f"{exc.strerror or exc} (errno {exc.errno}, {name}){tried}"
