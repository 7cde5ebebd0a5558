"""A failing disk under a running generation: faults injected into the reader's system calls (EIO, EINTR,
EAGAIN, short reads, reads that return nothing, slow and stuck reads) and a model file truncated mid-run.

Every run must end, within a watchdog's deadline, either with exactly the undisturbed greedy tokens or with
a DiskError that says what failed; transient faults must give the undisturbed tokens. After a failed run the
same engine, on a healthy disk again, must give the undisturbed tokens with nothing left pinned or leased.
Each case runs with O_DIRECT and buffered reads, and with a cache small enough that every layer misses
(prompt run reads, decode single reads) and one that reads the next layer ahead.
"""

from __future__ import annotations

import errno
import faulthandler
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler
from moestream.errors import DiskError
from moestream.formats.gguf_file import GGUFFile
from moestream.streaming import reader as reader_module
from moestream.streaming.expert_cache import ExpertCache
from moestream.streaming.expert_store import ExpertStore
from moestream.streaming.reader import ALIGN, RETRY_DELAYS_S
from moestream.synth.shapes import write_synth

pytestmark = pytest.mark.slow  # injected disk faults, each a run of its own: .ci/run

PROMPT = list(range(5, 45))
N = 8
WATCHDOG_S = 60.0  # a run that has not ended by then is a hang
WAIT_S = 20.0  # the reader's deadline in these tests (the default is at least a minute)
REAL_PREADV = os.preadv

MODES = {"direct": True, "buffered": False}
CACHES = {"misses": 8, "ahead": 80}  # slots: every layer misses / the prompt reads the next layer ahead


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("faults") / "tiny.gguf")
    write_synth("tiny", "Q4_0", path, progress=False)
    return path


def options(mode: str, cache: str) -> EngineOptions:
    return EngineOptions(n_slots=CACHES[cache], direct=MODES[mode], io_threads=3)


@pytest.fixture(scope="module")
def baseline(tiny) -> dict[tuple[str, str], tuple[list[int], int]]:
    """Undisturbed tokens and the number of reads the run makes, per (mode, cache)."""
    out = {}
    for mode in MODES:
        for cache in CACHES:
            disk = FaultyDisk(lambda call, fd, bufs, at: REAL_PREADV(fd, bufs, at))
            tokens, error = run_case(tiny, mode, cache, disk)
            assert error is None
            out[mode, cache] = tokens, disk.calls
    assert len({tuple(t) for t, _ in out.values()}) == 1  # every configuration computes the same tokens
    return out


class FaultyDisk:
    """Stands in for os.preadv while armed: every call goes through `fault(call number, fd, buffers, offset)`,
    which makes the real call, or fails, or changes what it returns."""

    def __init__(self, fault: Callable[[int, int, list, int], int]):
        self.fault = fault
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, fd: int, buffers: list, offset: int, *flags) -> int:
        with self.lock:
            self.calls += 1
            call = self.calls
        return self.fault(call, fd, buffers, offset)


def run_case(path: str, mode: str, cache: str, disk: FaultyDisk, then: Callable[[Engine], None] | None = None):
    """Generate with `disk` standing in for os.preadv, under a watchdog; (tokens, None) or (None, the error).
    `then(engine)` runs afterwards on a healthy disk, with the same engine."""
    result: dict = {}

    def body() -> None:
        eng = Engine(path, options(mode, cache))
        try:
            assert eng.reader.direct == MODES[mode]
            eng.reader.wait_s = WAIT_S
            os.preadv = disk  # only the reader calls it while generating
            try:
                result["tokens"] = eng.generate(PROMPT, N, Sampler()).tokens
            except DiskError as exc:
                result["error"] = exc
            finally:
                os.preadv = REAL_PREADV
            if then is not None:
                then(eng)
        finally:
            eng.close()

    within_deadline(body)
    return result.get("tokens"), result.get("error")


def within_deadline(body: Callable[[], None]) -> None:
    """Run body in a thread and re-raise what it raised; fail the test if it has not ended within the
    watchdog's deadline. Then the hung threads are left alone (closing the reader would wait for them) and,
    since they would keep the process from exiting, it dumps every stack and exits a minute later."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            body()
        except BaseException as exc:
            raised.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(WATCHDOG_S)
    os.preadv = REAL_PREADV
    if t.is_alive():
        faulthandler.dump_traceback(all_threads=True)
        faulthandler.dump_traceback_later(60, exit=True)
        pytest.fail(f"the run did not end within {WATCHDOG_S:.0f} s (a hang)")
    if raised:
        raise raised[0]


def check_clean_error(error: BaseException, path: str, *fragments: str) -> None:
    msg = str(error)
    assert "\n" not in msg and path in msg, msg
    for fragment in fragments:
        assert fragment in msg, msg


def healthy_again(want: list[int]) -> Callable[[Engine], None]:
    """After a failed run: the same engine gives the undisturbed tokens, and afterwards nothing is pinned and
    every read buffer is back (abandoned reads give theirs back as they finish)."""

    def check(eng: Engine) -> None:
        assert eng.generate(PROMPT, N, Sampler()).tokens == want
        assert not any(eng.cache.policy.pins)
        reader = eng.reader
        deadline = time.monotonic() + 10
        while reader._pool_buffers.qsize() < reader.n_buffers or reader._run_buffers.qsize() < reader.n_run_buffers:
            assert time.monotonic() < deadline, "read buffers were never given back"
            time.sleep(0.01)

    return check


def mid_run(baseline, mode, cache) -> list[int]:
    """Call numbers to fault: early in the prompt, and late (in the decode)."""
    calls = baseline[mode, cache][1]
    return [3, max(4, calls - 4)]


def eio() -> OSError:
    return OSError(errno.EIO, os.strerror(errno.EIO))


params = pytest.mark.parametrize(
    "mode,cache", [(m, c) for m in MODES for c in CACHES], ids=[f"{m}-{c}" for m in MODES for c in CACHES]
)


# -- transient faults: the undisturbed tokens --------------------------------------------------------------


@params
@pytest.mark.parametrize(
    "kind,times",
    [("EIO", 1), ("EIO", len(RETRY_DELAYS_S)), ("EINTR", 3), ("EAGAIN", 2)],
    ids=["eio-once", "eio-retried-to-the-limit", "eintr", "eagain"],
)
def test_a_transient_error_is_retried_and_changes_nothing(tiny, baseline, mode, cache, kind, times):
    code = getattr(errno, kind)
    for at in mid_run(baseline, mode, cache):

        def fault(call, fd, bufs, offset, at=at):
            if at <= call < at + times:
                raise OSError(code, os.strerror(code))
            return REAL_PREADV(fd, bufs, offset)

        tokens, error = run_case(tiny, mode, cache, FaultyDisk(fault))
        assert error is None, error
        assert tokens == baseline[mode, cache][0]


@params
def test_short_reads_are_continued_and_change_nothing(tiny, baseline, mode, cache):
    """The first call at each position reports less than it read, at no particular alignment: the reader goes
    on from there (O_DIRECT from the page it stopped in, read again)."""
    seen: set[int] = set()

    def fault(call, fd, bufs, offset):
        n = REAL_PREADV(fd, bufs, offset)
        if offset in seen or n <= 1:
            return n
        seen.add(offset)
        return max(1, n // 2 - 7)

    tokens, error = run_case(tiny, mode, cache, FaultyDisk(fault))
    assert error is None, error
    assert tokens == baseline[mode, cache][0]


@params
def test_slow_reads_change_nothing(tiny, baseline, mode, cache):
    def fault(call, fd, bufs, offset):
        time.sleep(0.002)
        return REAL_PREADV(fd, bufs, offset)

    tokens, error = run_case(tiny, mode, cache, FaultyDisk(fault))
    assert error is None, error
    assert tokens == baseline[mode, cache][0]


# -- persistent faults: a clear error, and a cache still usable ---------------------------------------------


@params
def test_a_persistent_eio_is_a_clear_error_and_the_cache_stays_usable(tiny, baseline, mode, cache):
    want = baseline[mode, cache][0]
    for at in mid_run(baseline, mode, cache):

        def fault(call, fd, bufs, offset, at=at):
            if call >= at:
                raise eio()
            return REAL_PREADV(fd, bufs, offset)

        tokens, error = run_case(tiny, mode, cache, FaultyDisk(fault), then=healthy_again(want))
        assert tokens is None
        check_clean_error(error, tiny, "Input/output error", "errno 5", "EIO", "at offset", "bytes")


@params
def test_one_unreadable_range_fails_the_run_and_only_that(tiny, baseline, mode, cache):
    """One expert's range stays unreadable (a bad sector) while the others read: a clear error, and the
    failed expert is not left behind as cached."""
    want = baseline[mode, cache][0]
    bad: list[int] = []

    def fault(call, fd, bufs, offset):
        if call == 5:
            bad.append(offset)
        if bad and offset == bad[0]:
            raise eio()
        return REAL_PREADV(fd, bufs, offset)

    tokens, error = run_case(tiny, mode, cache, FaultyDisk(fault), then=healthy_again(want))
    assert tokens is None
    check_clean_error(error, tiny, "Input/output error")


@params
def test_a_read_that_returns_nothing_is_a_clear_error(tiny, baseline, mode, cache):
    want = baseline[mode, cache][0]
    for at in mid_run(baseline, mode, cache):

        def fault(call, fd, bufs, offset, at=at):
            return 0 if call == at else REAL_PREADV(fd, bufs, offset)

        tokens, error = run_case(tiny, mode, cache, FaultyDisk(fault), then=healthy_again(want))
        assert tokens is None
        check_clean_error(error, tiny, "returned nothing")


@params
def test_reads_that_stop_short_for_good_are_a_clear_error(tiny, baseline, mode, cache):
    """A read that keeps coming back less than a page short of what is needed (O_DIRECT), or with one byte
    at a time (buffered, which then makes progress): the clear error, or the undisturbed tokens."""

    def fault(call, fd, bufs, offset):
        n = REAL_PREADV(fd, bufs, offset)
        return min(n, ALIGN - 1) if n > 1 else n

    tokens, error = run_case(tiny, mode, cache, FaultyDisk(fault))
    if mode == "direct":
        check_clean_error(error, tiny, "less than a page")
    else:
        assert error is None and tokens == baseline[mode, cache][0]


@params
def test_a_stuck_read_ends_at_the_deadline(tiny, baseline, mode, cache, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "WAIT_S", 0.5)

    def fault(call, fd, bufs, offset):
        if call == 4:
            time.sleep(2.0)
        return REAL_PREADV(fd, bufs, offset)

    def then(eng: Engine) -> None:
        eng.reader.wait_s = 20.0
        healthy_again(baseline[mode, cache][0])(eng)

    tokens, error = run_case(tiny, mode, cache, FaultyDisk(fault), then=then)
    assert tokens is None
    check_clean_error(error, tiny, "not responding")


@pytest.mark.parametrize("direct", [None, False], ids=["direct", "buffered"])
def test_a_failed_read_while_others_wait_for_buffers_does_not_hang(tiny, direct):
    """A decode-phase fetch of a whole layer: 48 segment reads through 4 buffers. One read fails while later
    reads wait for buffers held by finished ones: the fetch raises (the reads it abandons give their
    buffers back as they finish) and the same layer then reads in full on a healthy disk."""
    f = GGUFFile(tiny)
    store = ExpertStore(f, 4, 16, False)
    reader = reader_module.ExpertReader(tiny, store.max_segment_nbytes, threads=2, direct=direct, buffers=4)
    reader.wait_s = WAIT_S
    cache = ExpertCache(store, reader, 64)
    bad = store.segments(0, 2)[1]  # expert 2's up matrix
    bad_at = bad.offset // ALIGN * ALIGN if reader.direct else bad.offset

    def fault(call, fd, bufs, offset):
        if offset == bad_at:
            raise eio()
        return REAL_PREADV(fd, bufs, offset)

    def body() -> None:
        try:
            os.preadv = FaultyDisk(fault)
            with pytest.raises(Exception) as failed:
                for _ in cache.fetch(0, list(range(16))):
                    pass
            os.preadv = REAL_PREADV
            assert isinstance(failed.value, DiskError), failed.value
            check_clean_error(failed.value, tiny, "Input/output error", f"at offset {bad.offset}")
            assert sorted(dict(cache.fetch(0, list(range(16))))) == list(range(16))
            assert not any(cache.policy.pins)
            deadline = time.monotonic() + 10
            while reader._pool_buffers.qsize() < reader.n_buffers:
                assert time.monotonic() < deadline, "read buffers were never given back"
                time.sleep(0.01)
        finally:
            os.preadv = REAL_PREADV
            cache.close()
            reader.close()
            f.close()

    within_deadline(body)


# -- the model file changed under the running process -----------------------------------------------------


@params
def test_a_file_truncated_mid_run_stops_with_a_clear_message(tiny, baseline, mode, cache, tmp_path):
    path = str(tmp_path / "copy.gguf")
    shutil.copyfile(tiny, path)
    size = os.path.getsize(path)
    at = mid_run(baseline, mode, cache)[0]

    def fault(call, fd, bufs, offset):
        if call == at:
            os.truncate(path, size // 2)
        return REAL_PREADV(fd, bufs, offset)

    tokens, error = run_case(path, mode, cache, FaultyDisk(fault))
    assert tokens is None  # a truncated file is never silently computed from
    check_clean_error(error, path, "changed while moestream was running", f"size {size} -> {size // 2}", "restart")


def test_check_file_notices_truncation_replacement_and_rewrites(tiny, tmp_path):
    path = str(tmp_path / "copy.gguf")
    shutil.copyfile(tiny, path)
    size = os.path.getsize(path)
    r = reader_module.ExpertReader(path, 4096, threads=1)
    try:
        r.check_file()  # unchanged
        os.truncate(path, size - 1)
        with pytest.raises(DiskError, match=rf"changed while moestream was running \(size {size} -> {size - 1}\)"):
            r.check_file()
        shutil.copyfile(tiny, path + ".new")
        os.replace(path + ".new", path)  # same size again, another file
        with pytest.raises(DiskError, match="replaced by another file"):
            r.check_file()
        os.remove(path)
        with pytest.raises(DiskError, match="is gone"):
            r.check_file()
    finally:
        r.close()
    shutil.copyfile(tiny, path)
    r = reader_module.ExpertReader(path, 4096, threads=1)
    try:
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        with pytest.raises(DiskError, match="rewritten in place"):
            r.check_file()
    finally:
        r.close()


def test_a_range_past_the_end_of_the_file_is_an_error_not_a_short_read(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(3 * ALIGN + 100))
    for direct in (None, False):
        r = reader_module.ExpertReader(str(path), 2 * ALIGN, threads=1, direct=direct)
        try:
            lease = r.read(2 * ALIGN, ALIGN + 100).result()  # ends exactly at the end: O_DIRECT's round-up
            assert bytes(lease.view) == path.read_bytes()[2 * ALIGN :]
            lease.release()
            with pytest.raises(DiskError, match="past the end of the file"):
                r.read(2 * ALIGN + 1, ALIGN + 100).result()
        finally:
            r.close()


# -- the command line, end to end ---------------------------------------------------------------------------

# The CLI in a child process, with reads of the routed experts' ranges failing with EIO (the dense weights,
# read at load, are outside them).
CLI_WITH_BAD_EXPERTS = """
import errno, json, os, sys
ranges = json.loads(sys.argv[1])
real = os.preadv
def preadv(fd, bufs, offset, *flags):
    if any(lo <= offset < hi for lo, hi in ranges):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    return real(fd, bufs, offset, *flags)
os.preadv = preadv
from moestream.cli.main import main

sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("buffered", [False, True], ids=["direct", "buffered"])
def test_the_cli_reports_a_failing_disk_in_one_line(tiny, buffered):
    f = GGUFFile(tiny)
    try:
        ranges = [(t.offset, t.offset + t.nbytes) for t in f.tensors.values() if "_exps." in t.name]
    finally:
        f.close()
    args = ["run", "-m", tiny, "-p", "hello world", "-n", "4"] + (["--buffered"] if buffered else [])
    proc = subprocess.run(
        [sys.executable, "-c", CLI_WITH_BAD_EXPERTS, json.dumps(ranges), *args],
        capture_output=True,
        text=True,
        timeout=WATCHDOG_S,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert tiny in errors[0] and "Input/output error" in errors[0]
