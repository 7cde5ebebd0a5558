"""Locked dense weights: what is locked, the summary line, and the fallback when RLIMIT_MEMLOCK is too low."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.streaming.mlock import LockReport, resident_ranges, routed_nbytes
from moestream.synth.shapes import write_synth
from moestream.units import fmt_bytes

# Run the CLI in a child whose RLIMIT_MEMLOCK is `limit` bytes and which has dropped CAP_IPC_LOCK (root
# keeps the capability otherwise, and with it the kernel ignores the limit).
CHILD = textwrap.dedent(
    """
    import ctypes, ctypes.util, resource, sys

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    hdr, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    if libc.capget(ctypes.byref(hdr), data) == 0:
        data[0].effective &= ~(1 << 14)  # CAP_IPC_LOCK
        data[0].permitted &= ~(1 << 14)
        libc.capset(ctypes.byref(hdr), data)
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit, limit))
    if sys.argv[2] == "bypass-check":  # reach a real mlock() failure instead of the up-front refusal
        import moestream.streaming.mlock
        moestream.streaming.mlock._limit_allows = lambda need: None
    from moestream.cli.main import main
    sys.exit(main(sys.argv[3:]))
    """
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("mlock") / "tiny.gguf")
    write_synth("tiny", "Q4_0", path, layers=2, progress=False)
    return path


def _vm_lck() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmLck:"):
                return int(line.split()[1]) * 1024
    return 0


def _run_limited(tiny: str, limit: int, mode: str = "check", *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", CHILD, str(limit), mode, "run", "-m", tiny, "-p", "hello", "-n", "3", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_line_reads_like_the_summary():
    r = LockReport(locked_bytes=int(1.21 * (1 << 30)), failed_bytes=0, skipped_bytes=int(15.9 * (1 << 30)))
    assert r.line() == (
        "mlock: locked 1.21 GiB of dense weights, 0 B failed; routed experts (15.9 GiB) stream from disk, "
        "deliberately not locked"
    )
    assert "skipped" not in r.line()  # it read as a failure
    assert fmt_bytes(8 << 20) == "8 MiB" and fmt_bytes(64 << 10) == "64 KiB"


def test_every_dense_tensor_is_found_and_no_expert(tiny):
    eng = Engine(tiny, EngineOptions(n_slots=8))
    try:
        ranges = resident_ranges(eng.model)
        total = sum(n for _, n in ranges)
        # every resident weight, the rope tables, and the few bytes of alignment slack per buffer
        rope = sum(t.untyped_storage().nbytes() for t in vars(eng.model.rope).values() if isinstance(t, torch.Tensor))
        assert eng.model.dense_nbytes + rope <= total <= eng.model.dense_nbytes + rope + 16 * 1024
        arena = eng.cache.arena.memory.data_ptr(), eng.cache.arena.memory.numel()
        assert all(a + n <= arena[0] or a >= arena[0] + arena[1] for a, n in ranges)
        assert eng.lock_report.skipped_bytes == routed_nbytes(eng.gguf) > 0
    finally:
        eng.close()


def test_engine_locks_and_close_unlocks(tiny):
    before = _vm_lck()
    eng = Engine(tiny, EngineOptions(n_slots=8))
    report = eng.lock_report
    if report.error:  # a machine where even these few MB may not be locked: the line must say why
        assert "ulimit -l" in report.error and report.locked_bytes == 0
        eng.close()
        return
    assert report.locked_bytes == sum(n for _, n in resident_ranges(eng.model)) and report.failed_bytes == 0
    assert _vm_lck() - before >= report.locked_bytes
    eng.close()
    assert _vm_lck() == before


def test_no_mlock_locks_nothing(tiny):
    eng = Engine(tiny, EngineOptions(n_slots=8, mlock=False))
    try:
        assert eng.lock_report.locked_bytes == 0 and "mlock: off" in eng.lock_report.line()
    finally:
        eng.close()


def test_low_rlimit_falls_back_and_names_the_limit(tiny):
    r = _run_limited(tiny, 64 * 1024)
    assert r.returncode == 0, r.stderr
    line = next(s for s in r.stderr.splitlines() if s.startswith("mlock:"))
    assert line.startswith("mlock: locked 0 B of dense weights, 1.")  # all of the ~1.7 MB failed
    assert "RLIMIT_MEMLOCK is 64 KiB" in line and "ulimit -l" in line and "--no-mlock" in line
    assert "decode 3 tok" in r.stderr  # the engine ran anyway


def test_mlock_failure_never_stops_the_engine(tiny):
    r = _run_limited(tiny, 64 * 1024, "bypass-check")
    assert r.returncode == 0, r.stderr
    line = next(s for s in r.stderr.splitlines() if s.startswith("mlock:"))
    assert "failed (ENOMEM" in line and "ulimit -l" in line, line
    assert "decode 3 tok" in r.stderr


def test_no_mlock_flag(tiny):
    r = _run_limited(tiny, 0, "check", "--no-mlock")
    assert r.returncode == 0, r.stderr
    assert "mlock: off (--no-mlock)" in r.stderr and "decode 3 tok" in r.stderr
