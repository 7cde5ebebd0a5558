"""A memory balloon: lock all but N GB of RAM so the process under test really has only N GB.

Run alone (`python bench/balloon.py --leave-gb 8`) it maps a private anonymous region
(MAP_PRIVATE | MAP_ANONYMOUS), touches and mlocks it in chunks, prints `READY ...` and holds it until
SIGTERM or SIGINT (or --max-hold-s, or the death of its parent), then releases it and prints `RELEASED`.
From Python, `with Balloon(leave_gb=8) as b: ...` starts that process, waits for READY and stops it on
exit. The held size is MemAvailable minus N: what other processes already use stays theirs. On a shared
machine others' use drifts, so `b.relevel()` (SIGUSR1 to the process) grows or shrinks the balloon back
to N GB available; the harness calls it before every run.

The balloon sets its own oom_score_adj to about 300 (less when it holds most of RAM: see
`balloon_oom_score_adj`); the processes under test should get 1000 (harness.py's `make_oom_victim` as
a Popen preexec_fn, or `set_oom_score_adj(pid, 1000)`), so that when memory runs out the kernel kills the
process under test first, then the balloon, and a bystander last.

Locked memory cannot be reclaimed, swapped or taken by the guest's DAMON reclaim, so the N GB left is
what page cache, mmap'd model files and anonymous memory of everything else must share.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import resource
import select
import signal
import subprocess
import sys
import time
from types import TracebackType

from harness import GIB, MIB, VICTIM_OOM_SCORE_ADJ, meminfo, set_oom_score_adj

CAP_IPC_LOCK = 14
PR_SET_PDEATHSIG = 1
BALLOON_OOM_SCORE_ADJ = 300

PROT_READ, PROT_WRITE = 0x1, 0x2
MAP_PRIVATE, MAP_ANONYMOUS = 0x02, 0x20
MAP_FAILED = ctypes.c_void_p(-1).value


class BalloonError(RuntimeError):
    """The balloon cannot hold what was asked (not enough RAM, mlock not allowed, it died)."""


def balloon_oom_score_adj(locked_bytes: int) -> int:
    """~300, but low enough that the balloon always scores below a process at 1000.

    The OOM killer picks the highest rss + adj * RAM / 1000. A process at 1000 scores at least RAM; the
    balloon scores locked + adj * RAM / 1000, so a balloon holding most of RAM needs adj below
    1000 * (RAM - locked) / RAM (with a margin) or the kernel kills it instead of the process under test."""
    total = meminfo()["MemTotal"]
    room = 1000 * (total - locked_bytes) // total - 50
    return max(0, min(BALLOON_OOM_SCORE_ADJ, room))


def has_cap_ipc_lock() -> bool:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    return False


def check_memlock(nbytes: int) -> str:
    """Make sure this process may lock `nbytes`; returns how (for the READY line), raises if it cannot."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or soft >= nbytes:
        return "RLIMIT_MEMLOCK"
    if hard == resource.RLIM_INFINITY or hard >= nbytes:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
        return "RLIMIT_MEMLOCK raised to the hard limit"
    if has_cap_ipc_lock():  # root: the kernel ignores RLIMIT_MEMLOCK
        return "CAP_IPC_LOCK"
    raise BalloonError(
        f"cannot lock {nbytes / GIB:.1f} GiB: RLIMIT_MEMLOCK is {soft // 1024} KiB (hard {hard // 1024} KiB) "
        "and this process lacks CAP_IPC_LOCK; run as root or raise the limit (`ulimit -l unlimited`)"
    )


def plan_hold(leave_bytes: int) -> int:
    """Bytes to lock so that `leave_bytes` stay available; raises if the machine cannot leave that much."""
    mi = meminfo()
    total, avail = mi["MemTotal"], mi["MemAvailable"]
    if leave_bytes >= total:
        raise BalloonError(
            f"asked to leave {leave_bytes / GIB:.1f} GiB but the machine has only {total / GIB:.1f} GiB of RAM"
        )
    if leave_bytes > avail:
        raise BalloonError(
            f"asked to leave {leave_bytes / GIB:.1f} GiB but only {avail / GIB:.1f} GiB is "
            "available now (other processes use the rest); nothing to balloon"
        )
    return (avail - leave_bytes) // MIB * MIB


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    libc.memset.restype = ctypes.c_void_p
    return libc


class Held:
    """Locked private anonymous memory, kept as a list of mappings so it can grow and shrink."""

    def __init__(self, chunk_bytes: int):
        self.libc = _libc()
        self.chunk_bytes = chunk_bytes
        self.maps: list[tuple[int, int]] = []  # (address, bytes)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.maps)

    def grow(self, nbytes: int, stop: dict[str, int]) -> None:
        """Map, touch and mlock `nbytes` more, a chunk at a time."""
        nbytes = nbytes // MIB * MIB
        while nbytes > 0 and not stop["signal"]:
            n = min(self.chunk_bytes, nbytes)
            addr = self.libc.mmap(None, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
            if addr in (None, MAP_FAILED):
                raise BalloonError(f"mmap failed after {self.nbytes / GIB:.2f} GiB: {os.strerror(ctypes.get_errno())}")
            self.libc.memset(addr, 0x5A, n)  # non-zero: real pages, nothing to dedupe
            if self.libc.mlock(addr, n) != 0:
                err = os.strerror(ctypes.get_errno())
                self.libc.munmap(addr, n)
                raise BalloonError(f"mlock failed after {self.nbytes / GIB:.2f} GiB: {err}")
            self.maps.append((addr, n))
            nbytes -= n

    def shrink(self, nbytes: int) -> None:
        """Give back `nbytes` (whole MiB), newest mappings first."""
        nbytes = nbytes // MIB * MIB
        while nbytes > 0 and self.maps:
            addr, n = self.maps.pop()
            if n > nbytes:  # keep the head of this mapping, unmap its tail
                keep = n - nbytes
                self.libc.munmap(addr + keep, nbytes)
                self.maps.append((addr, keep))
                return
            self.libc.munmap(addr, n)
            nbytes -= n

    def level(self, leave_bytes: int, stop: dict[str, int], tolerance: int = 64 * MIB, rounds: int = 4) -> int:
        """Grow or shrink until MemAvailable is within `tolerance` of `leave_bytes`; returns MemAvailable.
        Other processes come and go on a shared machine; this puts the condition back between runs."""
        avail = meminfo()["MemAvailable"]
        for _ in range(rounds):
            diff = avail - leave_bytes
            if abs(diff) <= tolerance or stop["signal"]:
                break
            if diff > 0:
                self.grow(diff, stop)
            else:
                self.shrink(-diff)
            time.sleep(0.2)  # let the kernel's counters settle
            avail = meminfo()["MemAvailable"]
        return avail

    def release(self) -> None:
        self.shrink(self.nbytes)


def hold(leave_bytes: int, chunk_bytes: int = 256 * MIB, max_hold_s: float = 3 * 3600) -> int:
    """Lock all but `leave_bytes` of available RAM, print READY, hold until a signal, release. Exit code.

    SIGUSR1 re-levels (grow or shrink back to `leave_bytes` available) and prints a LEVEL line."""
    libc = _libc()
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # never outlive the harness that started us
    if os.getppid() == 1:
        raise BalloonError("parent already gone")
    planned = plan_hold(leave_bytes)
    how = check_memlock(planned)

    def set_adj(locked: int) -> int:
        adj = balloon_oom_score_adj(locked)
        try:
            set_oom_score_adj("self", adj)
        except OSError as exc:
            print(f"warning: cannot set oom_score_adj: {exc}", file=sys.stderr)
        return adj

    adj = set_adj(planned + 256 * MIB)  # before inflating: the OOM killer may run while we grow

    stop = {"signal": 0, "relevel": 0}

    def on_signal(signum: int, _frame: object) -> None:
        stop["signal"] = signum

    def on_usr1(_signum: int, _frame: object) -> None:
        stop["relevel"] += 1

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)
    signal.signal(signal.SIGUSR1, on_usr1)

    held = Held(chunk_bytes)
    t0 = time.monotonic()
    try:
        held.grow(planned, stop)
        avail = held.level(leave_bytes, stop)
        adj = set_adj(held.nbytes)
        if stop["signal"]:
            print(f"stopped by signal {stop['signal']} while inflating", file=sys.stderr)
            return 1
        print(
            f"READY locked_bytes={held.nbytes} mem_available_bytes={avail} "
            f"inflate_s={time.monotonic() - t0:.1f} oom_score_adj={adj} via={how.replace(' ', '_')}",
            flush=True,
        )
        deadline = time.monotonic() + max_hold_s
        while not stop["signal"] and time.monotonic() < deadline:
            if stop["relevel"]:
                stop["relevel"] = 0
                avail = held.level(leave_bytes, stop)
                adj = set_adj(held.nbytes)
                print(f"LEVEL locked_bytes={held.nbytes} mem_available_bytes={avail} oom_score_adj={adj}", flush=True)
            time.sleep(0.1)
        return 0
    finally:
        held.release()
        print("RELEASED", flush=True)


class Balloon:
    """`with Balloon(leave_gb=8) as b:` runs the balloon process and holds until the block ends.

    `b.locked_bytes` and `b.mem_available_bytes` (right after inflating) say what it did. Processes under
    test should be started with `preexec_fn=make_oom_victim` or passed to `b.victim(pid)`.
    """

    def __init__(
        self, leave_gb: float, *, chunk_mb: int = 256, ready_timeout_s: float = 600, max_hold_s: float = 3 * 3600
    ):
        self.leave_gb = leave_gb
        self.leave_bytes = int(leave_gb * GIB)
        self.chunk_mb = chunk_mb
        self.ready_timeout_s = ready_timeout_s
        self.max_hold_s = max_hold_s
        self.proc: subprocess.Popen[str] | None = None
        self.locked_bytes = 0
        self.mem_available_bytes = 0
        self.inflate_s = 0.0
        self.oom_score_adj = BALLOON_OOM_SCORE_ADJ

    def __enter__(self) -> Balloon:
        plan_hold(self.leave_bytes)  # refuse early, with the message, in the caller's process
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--leave-bytes",
            str(self.leave_bytes),
            "--chunk-mb",
            str(self.chunk_mb),
            "--max-hold-s",
            str(self.max_hold_s),
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._stop()
                raise BalloonError(f"balloon not ready after {self.ready_timeout_s:.0f} s")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 1.0))
            if not ready:
                continue
            line = self.proc.stdout.readline()
            if line.startswith("READY"):
                fields = dict(kv.split("=", 1) for kv in line.split()[1:])
                self.locked_bytes = int(fields["locked_bytes"])
                self.mem_available_bytes = int(fields["mem_available_bytes"])
                self.inflate_s = float(fields["inflate_s"])
                self.oom_score_adj = int(fields["oom_score_adj"])
                return self
            if not line:  # exited before READY
                err = self.proc.stderr.read() if self.proc.stderr else ""
                self.proc.wait()
                last = err.strip().splitlines()[-1] if err.strip() else f"exit code {self.proc.returncode}"
                raise BalloonError(f"balloon failed: {last}")

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop()

    def relevel(self, timeout_s: float = 120) -> int:
        """Grow or shrink back to `leave_gb` available (others' memory use drifts on a shared machine);
        call it between runs, never during one. Returns MemAvailable afterwards."""
        if self.proc is None or self.proc.poll() is not None:
            raise BalloonError("the balloon is not running (OOM-killed?); the condition no longer holds")
        assert self.proc.stdout is not None
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            if not ready:
                continue
            line = self.proc.stdout.readline()
            if not line:
                raise BalloonError("the balloon exited while re-levelling")
            if line.startswith("LEVEL"):
                fields = dict(kv.split("=", 1) for kv in line.split()[1:])
                self.locked_bytes = int(fields["locked_bytes"])
                self.oom_score_adj = int(fields["oom_score_adj"])
                return int(fields["mem_available_bytes"])
        raise BalloonError(f"the balloon did not re-level within {timeout_s:.0f} s")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def record(self) -> dict[str, float | int]:
        """What a results file says about the balloon of its pressure condition, as it stood after inflating."""
        return {
            "leave_gb": self.leave_gb,
            "locked_bytes": self.locked_bytes,
            "mem_available_bytes": self.mem_available_bytes,
            "inflate_s": self.inflate_s,
            "oom_score_adj": self.oom_score_adj,
        }

    def victim(self, pid: int) -> None:
        """Make `pid` the OOM killer's first choice."""
        set_oom_score_adj(pid, VICTIM_OOM_SCORE_ADJ)

    def _stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        self.proc = None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--leave-gb", type=float, help="GiB of RAM to leave available to everything else")
    g.add_argument("--leave-bytes", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--chunk-mb", type=int, default=256, help="touch and mlock this much at a time")
    ap.add_argument(
        "--max-hold-s",
        type=float,
        default=3 * 3600,
        help="release by itself after this long (a safety net; default 3 h)",
    )
    args = ap.parse_args(argv)
    leave = args.leave_bytes if args.leave_bytes is not None else int(args.leave_gb * GIB)
    try:
        return hold(leave, args.chunk_mb * MIB, args.max_hold_s)
    except BalloonError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
