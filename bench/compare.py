"""moestream vs llama.cpp on the same GGUF, in three memory conditions, with repeats.

    python bench/compare.py --model /tmp/models/q30.gguf --conditions pagecache,cold,pressure \\
        --leave-gb 8 --repeat 3 --tokens 32 --threads 2

Every run is a fresh process: `python -m moestream run ... --stats-json` for moestream and
bench/llamacpp_run.py for llama.cpp (llama-cpp-python), alternating which engine goes first.

Conditions (prepared again before every run):
  pagecache  the whole file is read into the page cache first (skipped when it does not fit in RAM)
  cold       `sync; echo 3 > /proc/sys/vm/drop_caches` (needs root)
  pressure   a balloon (bench/balloon.py) mlocks all but --leave-gb GiB for the whole condition, and
             caches are dropped before each run; moestream gets --pressure-budget-mb (default
             leave - 1 GiB) and llama.cpp runs with its default mmap and, by default, repack off
             (its default repack copies the weights into anonymous memory and is OOM-killed here).

What is measured, per run: prefill and decode tok/s (each engine's own wall clocks around the phases),
disk bytes read during decode from the kernel's per-process counters (/proc/PID/io read_bytes: sampled
from outside for moestream between its first output byte and its stats line; /proc/self/io around the
decode loop in the llama.cpp runner), peak RSS (ru_maxrss from wait4), exit status (an OOM kill or a
timeout is a result, not a crash). Per condition: median and min-max over the repeats, and
moestream/llama.cpp ratios from runs of the same repeat.

Ceiling, per moestream run: decode bytes missed per token / disk bandwidth (`moestream probe` with the
engine's read size and reads in flight, measured in the same condition; or a probe of our own when that
command is missing) + compute per token with every expert cached (a calibration run whose long prompt
loads every expert before decoding). The report gives measured / ceiling.

Writes bench/results/<date>-<name>.json and prints a markdown table (also --markdown FILE).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import mmap
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from balloon import GIB, MIB, Balloon, BalloonError, make_oom_victim, meminfo

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCH_DIR)
RESULTS_DIR = os.path.join(BENCH_DIR, "results")
LLAMA_RUNNER = os.path.join(BENCH_DIR, "llamacpp_run.py")
CONDITIONS = ("pagecache", "cold", "pressure")
DEFAULT_PROMPT = (
    "Explain in a few short paragraphs how a computer moves data between its disk, its memory and the "
    "caches of its processor, and why reading the same bytes twice can cost very different amounts of time."
)
STATS_LINE = re.compile(rb"^prompt \d+ tok @ .* decode \d+ tok @")


# ---- the machine ---------------------------------------------------------------------------------


def drop_caches() -> None:
    """Write back dirty pages and drop the page cache, dentries and inodes (root only)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except PermissionError:
        raise SystemExit("error: dropping the page cache needs root (/proc/sys/vm/drop_caches)") from None


def preread(path: str, chunk: int = 16 * MIB) -> float:
    """Read the whole file through the page cache; returns seconds taken."""
    t0 = time.perf_counter()
    buf = bytearray(chunk)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def cached_fraction(path: str) -> float:
    """Share of the file's pages resident in the page cache (mincore on a fresh mapping)."""
    import ctypes
    import ctypes.util

    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return float("nan")
        try:
            n = (size + page - 1) // page
            vec = (ctypes.c_ubyte * n)()
            if libc.mincore(addr, size, vec) != 0:
                return float("nan")
            return int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) / n
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def oom_kills() -> int:
    with open("/proc/vmstat") as f:
        for line in f:
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    return 0


def read_ahead_kb(path: str) -> int | None:
    """read_ahead_kb of the block device holding `path` (the mmap fault size llama.cpp sees)."""
    st = os.stat(path)
    base = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    for cand in (f"{base}/queue/read_ahead_kb", f"{base}/../queue/read_ahead_kb"):
        try:
            with open(cand) as f:
                return int(f.read())
        except (OSError, ValueError):
            continue
    return None


def host_info(model: str) -> dict[str, Any]:
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mi = meminfo()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_total_bytes": mi["MemTotal"],
        "mem_available_bytes": mi["MemAvailable"],
        "kernel": os.uname().release,
        "read_ahead_kb": read_ahead_kb(model),
        "loadavg": os.getloadavg(),
    }


def git_commit() -> str:
    try:
        head = subprocess.run(
            ["git", "-C", REPO_DIR, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", REPO_DIR, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        ).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ---- running one measured process ----------------------------------------------------------------


def _proc_io_read_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


@dataclass
class Measured:
    """A finished child process, as seen from outside."""

    cmd: list[str]
    status: str  # ok | timeout | oom-killed | killed (SIGNAME) | failed (rc N)
    rc: int | None
    wall_s: float
    ru_maxrss: int  # bytes
    ru_inblock_bytes: int  # whole-process disk reads (read_bytes, from wait4)
    ru_majflt: int
    marks: dict[str, int] = field(default_factory=dict)  # read_bytes at named moments
    stdout: str = ""
    stderr: str = ""


def run_measured(cmd: list[str], timeout_s: float, env: dict[str, str] | None = None) -> Measured:
    """Run `cmd` as the OOM killer's first choice; watch its /proc/PID/io from outside.

    Marks: `first_output` (read_bytes when the first stdout byte arrives: moestream's first token, the end
    of its prefill) and `stats_line` (when its stats line reaches stderr: the end of decoding).
    """
    kills_before = oom_kills()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=make_oom_victim,
        start_new_session=True,
        env=env,
        cwd=REPO_DIR,
    )
    marks: dict[str, int] = {}
    out_chunks: list[bytes] = []
    err_lines: list[bytes] = []

    def mark(name: str) -> None:
        value = _proc_io_read_bytes(proc.pid)
        if value is not None and name not in marks:
            marks[name] = value

    def read_stdout() -> None:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        while chunk := os.read(fd, 65536):
            if not out_chunks:
                mark("first_output")
            out_chunks.append(chunk)

    def read_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if STATS_LINE.match(line):
                mark("stats_line")
            err_lines.append(line)

    readers = [threading.Thread(target=read_stdout, daemon=True), threading.Thread(target=read_stderr, daemon=True)]
    for t in readers:
        t.start()
    timed_out = False
    while True:
        pid, wstatus, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() - t0 > timeout_s and not timed_out:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(wstatus)
    proc.returncode = rc  # reaped by wait4 above; keep Popen consistent
    for t in readers:
        t.join(timeout=10)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
    if timed_out:
        status = "timeout"
    elif rc == -signal.SIGKILL and oom_kills() > kills_before:
        status = "oom-killed"
    elif rc < 0:
        status = f"killed ({signal.Signals(-rc).name})"
    elif rc != 0:
        status = f"failed (rc {rc})"
    else:
        status = "ok"
    return Measured(
        cmd=cmd,
        status=status,
        rc=rc,
        wall_s=wall,
        ru_maxrss=ru.ru_maxrss * 1024,
        ru_inblock_bytes=ru.ru_inblock * 512,
        ru_majflt=ru.ru_majflt,
        marks=marks,
        stdout=b"".join(out_chunks).decode("utf-8", "replace"),
        stderr=b"".join(err_lines).decode("utf-8", "replace"),
    )


@dataclass
class RunResult:
    engine: str  # moestream | llama.cpp
    variant: str  # what was varied: budget, repack mode, extra flags
    condition: str
    repeat: int
    status: str
    wall_s: float
    stats: dict[str, Any]  # the engine's own JSON (empty when it did not finish)
    external: dict[str, Any]  # measured from outside the process
    setup: dict[str, Any]  # state of the machine right before the run
    cmd: list[str]
    ceiling: dict[str, Any] | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok" and bool(self.stats)

    def metric(self, name: str) -> float | None:
        """Comparable figures for both engines (None when the run has no value)."""
        s, e = self.stats, self.external
        if not self.ok:
            return None
        tokens = max(1, int(s.get("decode_tokens", 0)))
        if name == "decode_tps":
            return s.get("decode_tps")
        if name == "prompt_tps":
            return s.get("prompt_tps")
        if name == "decode_ms_per_token":
            return 1e3 * s["decode_s"] / tokens
        if name == "decode_disk_mb_per_token":  # kernel's count for both engines
            if self.engine == "moestream":
                b = e.get("decode_read_bytes")
                return b / MIB / tokens if b is not None else s.get("decode_mb_per_token")
            return s.get("decode_mb_per_token")
        if name == "engine_mb_per_token":  # moestream's own count of expert bytes read
            return s.get("decode_mb_per_token") if self.engine == "moestream" else None
        if name == "peak_rss_mb":
            return e["ru_maxrss"] / MIB
        if name == "hit_rate":
            return s.get("hit_rate")
        if name == "read_wait_ms_per_token":  # moestream: decode time spent waiting on reads
            w = s.get("decode_read_wait_s")
            return 1e3 * w / tokens if w is not None else None
        if name == "measured_over_ceiling":
            return self.ceiling.get("measured_over_ceiling") if self.ceiling else None
        raise KeyError(name)


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


def run_moestream(
    model: str,
    prompt: str,
    tokens: int,
    threads: int,
    budget_mb: int | None,
    extra: list[str],
    timeout_s: float,
    tree: str | None = None,
) -> tuple[Measured, dict[str, Any]]:
    """One `moestream run` in a fresh process; returns (outside view, its --stats-json). tree: run the moestream
    package of another checkout (a `git worktree` of an older commit) instead of this one."""

    def cmd(stats_path: str) -> list[str]:
        c = [
            # -P: the current directory (maybe this checkout) must not come before the tree on sys.path
            *(["env", f"PYTHONPATH={os.path.abspath(tree)}"] if tree else []),
            sys.executable,
            *(["-P"] if tree else []),
            "-m",
            "moestream",
            "run",
            "-m",
            model,
            "-p",
            prompt,
            "-n",
            str(tokens),
            "--threads",
            str(threads),
            "--stats-json",
            stats_path,
            *extra,
        ]
        return c + (["--ram-budget-mb", str(budget_mb)] if budget_mb is not None else [])

    return _run_with_stats(cmd, "moestream-stats-", timeout_s)


def run_llamacpp(
    model: str, prompt: str, tokens: int, threads: int, repack: bool, timeout_s: float
) -> tuple[Measured, dict[str, Any]]:
    def cmd(stats_path: str) -> list[str]:
        return [
            sys.executable,
            LLAMA_RUNNER,
            "-m",
            model,
            "-p",
            prompt,
            "-n",
            str(tokens),
            "--threads",
            str(threads),
            "--repack",
            "on" if repack else "off",
            "--json",
            stats_path,
        ]

    return _run_with_stats(cmd, "llamacpp-stats-", timeout_s)


def _run_with_stats(cmd: Callable[[str], list[str]], prefix: str, timeout_s: float) -> tuple[Measured, dict[str, Any]]:
    """Run an engine that writes its stats JSON to the path it is given; (measurement, stats)."""
    fd, stats_path = tempfile.mkstemp(prefix=prefix, suffix=".json")
    os.close(fd)
    try:
        m = run_measured(cmd(stats_path), timeout_s)
        stats: dict[str, Any] = {}
        if m.status == "ok":
            try:
                with open(stats_path) as f:
                    stats = json.load(f)
            except (OSError, json.JSONDecodeError):
                m.status = "failed (no stats JSON)"
        return m, stats
    finally:
        os.unlink(stats_path)


def external_view(m: Measured) -> dict[str, Any]:
    out: dict[str, Any] = {
        "ru_maxrss": m.ru_maxrss,
        "read_bytes_total": m.ru_inblock_bytes,
        "majflt": m.ru_majflt,
        "marks": m.marks,
    }
    if "first_output" in m.marks and "stats_line" in m.marks:
        out["decode_read_bytes"] = m.marks["stats_line"] - m.marks["first_output"]
    return out


def to_result(
    engine: str, variant: str, condition: str, repeat: int, m: Measured, stats: dict[str, Any], setup: dict[str, Any]
) -> RunResult:
    stats = {k: v for k, v in stats.items() if k != "tokens"} | (
        {"tokens_head": stats["tokens"][:16]} if "tokens" in stats else {}
    )
    return RunResult(
        engine=engine,
        variant=variant,
        condition=condition,
        repeat=repeat,
        status=m.status,
        wall_s=m.wall_s,
        stats=stats,
        external=external_view(m),
        setup=setup,
        cmd=m.cmd,
        error="" if m.status == "ok" else _tail(m.stderr),
    )


# ---- conditions ----------------------------------------------------------------------------------


def prepare(condition: str, model: str, balloon: Balloon | None = None) -> dict[str, Any]:
    """Put the page cache (and the balloon) in the state the condition asks for, right before a run; say
    what it was."""
    setup: dict[str, Any] = {}
    if condition == "pagecache":
        setup["preread_s"] = preread(model)
    elif condition in ("cold", "pressure"):
        drop_caches()
    if balloon is not None:
        balloon.relevel()
        setup["balloon_locked_bytes"] = balloon.locked_bytes
    setup["cached_fraction"] = round(cached_fraction(model), 4)
    setup["mem_available_bytes"] = meminfo()["MemAvailable"]
    setup["loadavg_1m"] = os.getloadavg()[0]
    return setup


def pagecache_fits(model: str) -> tuple[bool, str]:
    size, avail = os.path.getsize(model), meminfo()["MemAvailable"]
    if size + GIB > avail:
        return False, (
            f"the {size / GIB:.1f} GiB file does not fit in the page cache next to 1 GiB "
            f"({avail / GIB:.1f} GiB available)"
        )
    return True, ""


@contextmanager
def condition_context(condition: str, leave_gb: float) -> Iterator[Balloon | None]:
    if condition == "pressure":
        with Balloon(leave_gb=leave_gb) as b:
            yield b
    else:
        with nullcontext():
            yield None


# ---- disk bandwidth and the ceiling --------------------------------------------------------------


def _flag_value(args: list[str], flag: str, default: str | None = None) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return default


def disk_bandwidth(model: str, io_threads: int, direct: bool, seconds: float = 4.0) -> dict[str, Any]:
    """MB/s of the engine's reads: `moestream probe` at its read size and reads in flight, else our own."""
    mode = "direct" if direct else "buffered"
    cmd = [
        sys.executable,
        "-m",
        "moestream",
        "probe",
        "--file",
        model,
        "--json",
        "--inflight",
        str(io_threads),
        "--direct-only" if direct else "--buffered-only",
    ]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO_DIR)
        if r.returncode == 0:
            doc = json.loads(r.stdout)
            rows = [
                x
                for x in doc.get("rows", [])
                if x["size"] == doc["segment_bytes"] and x["mode"] == mode and x["inflight"] == io_threads
            ]
            if rows:
                return {
                    "source": "moestream probe",
                    "mb_s": rows[0]["mb_s"],
                    "read_bytes": rows[0]["size"],
                    "inflight": io_threads,
                    "mode": mode,
                    "p99_ms": rows[0]["p99_ms"],
                    "warnings": doc.get("warnings", []),
                }
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError, KeyError):
        pass
    return own_probe(model, io_threads, direct, seconds)


def own_probe(model: str, io_threads: int, direct: bool, seconds: float, size: int = 2 * MIB) -> dict[str, Any]:
    """Fallback: `io_threads` threads of 2 MiB random reads (O_DIRECT into page-aligned buffers)."""
    import random

    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    fd = os.open(model, flags)
    file_bytes = os.path.getsize(model)
    done = [0] * io_threads
    deadline = time.perf_counter() + seconds

    def worker(j: int) -> None:
        rng = random.Random(j)
        buf = mmap.mmap(-1, size)
        view = memoryview(buf)
        try:
            while time.perf_counter() < deadline:
                off = rng.randrange(0, (file_bytes - size) // 4096) * 4096
                done[j] += os.preadv(fd, [view], off)
                if not direct:
                    os.posix_fadvise(fd, off, size, os.POSIX_FADV_DONTNEED)
        finally:
            view.release()
            buf.close()

    if not direct:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(j,)) for j in range(io_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    os.close(fd)
    return {
        "source": "bench own probe",
        "mb_s": sum(done) / 1e6 / wall,
        "read_bytes": size,
        "inflight": io_threads,
        "mode": "direct" if direct else "buffered",
        "warnings": [],
    }


def calibrate_compute(
    model: str,
    prompt: str,
    tokens: int,
    threads: int,
    extra: list[str],
    timeout_s: float,
    prompt_repeat: int,
    budget_mb: int | None,
) -> dict[str, Any]:
    """Decode time per token with every expert already cached: --preload fills the cache before the prompt
    (a generation grows the cache only step by step), the budget keeps every expert, and the decode then
    reads nothing. The long prompt is kept so that the decode runs at a realistic context length."""
    long_prompt = " ".join([prompt] * prompt_repeat)
    drop_caches()
    m, stats = run_moestream(model, long_prompt, tokens, threads, budget_mb, [*extra, "--preload"], timeout_s)
    if m.status != "ok":
        return {"status": m.status, "error": _tail(m.stderr)}
    n = max(1, stats["decode_tokens"])
    compute_s = (stats["decode_s"] - stats["decode_read_wait_s"]) / n
    return {
        "status": "ok",
        "compute_ms_per_token": 1e3 * compute_s,
        "decode_ms_per_token": 1e3 * stats["decode_s"] / n,
        "decode_mb_per_token": stats["decode_mb_per_token"],
        "fully_cached": stats["decode_bytes_read"] == 0,
        "prompt_tokens": stats["prompt_tokens"],
        "n_slots": stats["n_slots"],
        "hit_rate": stats["hit_rate"],
    }


def ceiling_for(stats: dict[str, Any], mb_s: float, compute_ms: float | None) -> dict[str, Any] | None:
    """Per-token decode ceiling: bytes missed / bandwidth + compute with everything cached."""
    n = stats.get("decode_tokens", 0)
    if not n or mb_s <= 0:
        return None
    missed = stats["decode_bytes_read"] / n
    read_ms = 1e3 * missed / (mb_s * 1e6)
    measured_ms = 1e3 * stats["decode_s"] / n
    run_compute_ms = 1e3 * (stats["decode_s"] - stats["decode_read_wait_s"]) / n
    out: dict[str, Any] = {
        "missed_mb_per_token": missed / MIB,
        "disk_mb_s": mb_s,
        "read_ms": read_ms,
        "measured_ms": measured_ms,
        "run_compute_ms": run_compute_ms,
        "run_read_wait_ms": 1e3 * stats["decode_read_wait_s"] / n,
    }
    if compute_ms is not None:
        out["compute_ms"] = compute_ms
        out["ceiling_ms"] = read_ms + compute_ms
        out["measured_over_ceiling"] = measured_ms / out["ceiling_ms"]
    return out


# ---- summaries -----------------------------------------------------------------------------------


METRICS = (
    "decode_tps",
    "prompt_tps",
    "decode_ms_per_token",
    "decode_disk_mb_per_token",
    "engine_mb_per_token",
    "peak_rss_mb",
    "hit_rate",
    "read_wait_ms_per_token",
    "measured_over_ceiling",
)


def spread(values: Iterable[float | None]) -> dict[str, float] | None:
    v = [x for x in values if x is not None]
    if not v:
        return None
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def summarize(runs: list[RunResult]) -> dict[str, Any]:
    """Per variant: status counts and the spread of every metric over its successful repeats."""
    out: dict[str, Any] = {}
    for key in dict.fromkeys((r.engine, r.variant) for r in runs):
        mine = [r for r in runs if (r.engine, r.variant) == key]
        statuses: dict[str, int] = {}
        for r in mine:
            statuses[r.status] = statuses.get(r.status, 0) + 1
        out[f"{key[0]} | {key[1]}"] = {
            "engine": key[0],
            "variant": key[1],
            "runs": len(mine),
            "statuses": statuses,
            "metrics": {m: s for m in METRICS if (s := spread(r.metric(m) for r in mine)) is not None},
        }
    return out


def pair_ratios(
    runs: list[RunResult],
    num: Callable[[RunResult], bool],
    den: Callable[[RunResult], bool],
    metrics: tuple[str, ...] = ("decode_tps", "prompt_tps"),
) -> dict[str, Any]:
    """num/den of each metric for runs of the same repeat (measured back to back), over the repeats."""
    by_rep: dict[int, dict[str, RunResult]] = {}
    for r in runs:
        if num(r):
            by_rep.setdefault(r.repeat, {})["num"] = r
        elif den(r):
            by_rep.setdefault(r.repeat, {})["den"] = r
    out: dict[str, Any] = {}
    for metric in metrics:
        vals = []
        for pair in by_rep.values():
            a, b = pair.get("num"), pair.get("den")
            va = a.metric(metric) if a else None
            vb = b.metric(metric) if b else None
            if va is not None and vb:
                vals.append(va / vb)
        s = spread(vals)
        if s is not None:
            out[metric] = s
    return out


# ---- the benchmark -------------------------------------------------------------------------------


def llama_variants(choice: str, condition: str) -> list[bool]:
    """Repack settings to run: auto = llama.cpp's default where RAM allows it, off under pressure."""
    if choice == "both":
        return [True, False]
    if choice == "auto":
        return [condition != "pressure"]
    return [choice == "on"]


def repack_label(repack: bool) -> str:
    return "mmap, repack on (default)" if repack else "mmap, repack off (use_extra_bufts=False)"


def run_condition(
    args: argparse.Namespace, condition: str, extra: list[str], compute_ms: float | None, log: Callable[[str], None]
) -> dict[str, Any]:
    model = args.model
    doc: dict[str, Any] = {"condition": condition, "runs": []}
    if condition == "pagecache":
        fits, why = pagecache_fits(model)
        if not fits:
            log(f"[{condition}] skipped: {why}")
            return doc | {"skipped": why}
    budget = args.pressure_budget_mb if condition == "pressure" else args.budget_mb
    ms_variant = f"budget {budget} MB" if budget else "budget: default"
    if extra:
        ms_variant += " " + " ".join(extra)
    io_threads = int(_flag_value(extra, "--io-threads", "4") or 4)
    direct = "--buffered" not in extra
    runs: list[RunResult] = []
    try:
        with condition_context(condition, args.leave_gb) as balloon:
            if balloon is not None:
                doc["balloon"] = {
                    "leave_gb": args.leave_gb,
                    "locked_bytes": balloon.locked_bytes,
                    "mem_available_bytes": balloon.mem_available_bytes,
                    "inflate_s": balloon.inflate_s,
                    "oom_score_adj": balloon.oom_score_adj,
                }
                log(
                    f"[{condition}] balloon holds {balloon.locked_bytes / GIB:.1f} GiB, "
                    f"{balloon.mem_available_bytes / GIB:.1f} GiB left"
                )
            if not args.no_ceiling:
                doc["disk"] = disk_bandwidth(model, io_threads, direct)
                log(
                    f"[{condition}] disk: {doc['disk']['mb_s']:.0f} MB/s ({doc['disk']['source']}, "
                    f"{doc['disk']['inflight']} in flight, {doc['disk']['mode']})"
                )
            for rep in range(args.repeat):
                jobs: list[tuple[str, bool | None]] = [("moestream", None)]
                jobs += [("llama.cpp", rp) for rp in llama_variants(args.llama_repack, condition)]
                if rep % 2:
                    jobs.reverse()  # alternate who goes first: drift hits both engines alike
                for engine, repack in jobs:
                    setup = prepare(condition, model, balloon)
                    if engine == "moestream":
                        m, stats = run_moestream(
                            model, args.prompt, args.tokens, args.threads, budget, extra, args.timeout_s
                        )
                        r = to_result(engine, ms_variant, condition, rep, m, stats, setup)
                        if r.ok and "disk" in doc:
                            r.ceiling = ceiling_for(r.stats, doc["disk"]["mb_s"], compute_ms)
                    else:
                        assert repack is not None
                        m, stats = run_llamacpp(model, args.prompt, args.tokens, args.threads, repack, args.timeout_s)
                        r = to_result(engine, repack_label(repack), condition, rep, m, stats, setup)
                    if balloon is not None and not balloon.alive():
                        r.status = "invalid: the balloon died during the run"
                    runs.append(r)
                    log(f"[{condition}] repeat {rep + 1}/{args.repeat} {engine:9s} {r.variant}: {short(r)}")
    except BalloonError as exc:
        log(f"[{condition}] stopped: {exc}")
        doc["error"] = str(exc)
    doc["runs"] = [asdict(r) for r in runs]
    doc["summary"] = summarize(runs)
    doc["ratios"] = [
        {"label": f"moestream / llama.cpp (repack {'on' if rp else 'off'})", "versus": repack_label(rp)}
        | pair_ratios(
            runs,
            lambda r: r.engine == "moestream",
            lambda r, rp=rp: r.engine == "llama.cpp" and r.variant == repack_label(rp),
        )
        for rp in llama_variants(args.llama_repack, condition)
    ]
    return doc


def short(r: RunResult) -> str:
    if not r.ok:
        return f"{r.status} after {r.wall_s:.0f} s {r.error[-160:]}"
    disk = r.metric("decode_disk_mb_per_token")
    txt = (
        f"prefill {r.metric('prompt_tps'):.1f} tok/s, decode {r.metric('decode_tps'):.2f} tok/s, "
        f"disk {disk if disk is not None else float('nan'):.1f} MB/tok, peak RSS {r.metric('peak_rss_mb'):.0f} MB"
    )
    if r.engine == "moestream":
        txt += f", hit {100 * (r.metric('hit_rate') or 0):.1f}%"
        if r.ceiling and "measured_over_ceiling" in r.ceiling:
            txt += f", {r.ceiling['measured_over_ceiling']:.2f}x ceiling"
    return txt


# ---- markdown ------------------------------------------------------------------------------------


def fmt(x: float) -> str:
    a = abs(x)
    return f"{x:.0f}" if a >= 100 else f"{x:.1f}" if a >= 10 else f"{x:.2f}" if a >= 0.1 else f"{x:.3f}"


def cell(s: dict[str, float] | None, scale: float = 1.0, suffix: str = "") -> str:
    if s is None:
        return "-"
    med, lo, hi = s["median"] * scale, s["min"] * scale, s["max"] * scale
    if s["n"] == 1:
        return f"{fmt(med)}{suffix}"
    return f"{fmt(med)}{suffix} ({fmt(lo)}-{fmt(hi)})"


def condition_title(cond: dict[str, Any], leave_gb: float) -> str:
    name = cond["condition"]
    if name == "pressure":
        return f"pressure ({leave_gb:g} GiB left)"
    return name


def markdown(doc: dict[str, Any]) -> str:
    meta = doc["meta"]
    host = meta["host"]
    lines = [
        f"### moestream vs llama.cpp: {os.path.basename(meta['model'])} ({meta['model_bytes'] / 1e9:.1f} GB)",
        "",
        f"{meta['date']}, {host['cpu']}, {host['cores']} cores, {host['mem_total_bytes'] / GIB:.0f} GiB RAM, "
        f"read_ahead_kb {host['read_ahead_kb']}; {meta['args']['threads']} threads, {meta['args']['tokens']} "
        f"tokens, {meta['args']['repeat']} fresh processes per cell, prompt {meta['prompt_tokens']} tokens; "
        f"moestream {meta['moestream_commit']}, llama-cpp-python {meta['llama_cpp_version']}.",
        "Cells: median (min-max) over repeats. Disk MB/tok: bytes the kernel read for the process during decode.",
        "",
        "| condition | engine | runs ok | decode tok/s | prefill tok/s | disk MB/tok | peak RSS MB | hit rate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    notes: list[str] = []
    for cond in doc["conditions"]:
        title = condition_title(cond, meta["args"]["leave_gb"])
        if "skipped" in cond or not cond["runs"]:
            lines.append(f"| {title} | - | - | {cond.get('skipped') or cond.get('error')} | | | | |")
            continue
        if "error" in cond:
            notes.append(f"{title}: stopped early: {cond['error']}")
        first = True
        for s in cond["summary"].values():
            mt = s["metrics"]
            ok = s["statuses"].get("ok", 0)
            bad = ", ".join(f"{n} {st}" for st, n in s["statuses"].items() if st != "ok")
            runs_ok = f"{ok}/{s['runs']}" + (f" ({bad})" if bad else "")
            engine = f"{s['engine']}, {s['variant']}"
            lines.append(
                f"| {title if first else ''} | {engine} | {runs_ok} | {cell(mt.get('decode_tps'))} | "
                f"{cell(mt.get('prompt_tps'))} | {cell(mt.get('decode_disk_mb_per_token'))} | "
                f"{cell(mt.get('peak_rss_mb'))} | {cell(mt.get('hit_rate'), 100, '%')} |"
            )
            first = False
        for ratio in cond.get("ratios", []):
            pairs = ratio["decode_tps"]["n"] if "decode_tps" in ratio else 0
            decode, prefill = cell(ratio.get("decode_tps"), suffix="x"), cell(ratio.get("prompt_tps"), suffix="x")
            if not pairs:
                st = cond["summary"].get(f"llama.cpp | {ratio['versus']}", {}).get("statuses", {})
                failed = ", ".join(f"{n} {k}" for k, n in st.items() if k != "ok")
                decode = f"n/a (llama.cpp: {failed})" if failed else "n/a"
            lines.append(f"| | **{ratio['label']}** | {pairs} pairs | **{decode}** | {prefill} | | | |")
        ceil_runs = [r["ceiling"] for r in cond["runs"] if r["engine"] == "moestream" and r.get("ceiling")]
        if ceil_runs and "disk" in cond:
            c0 = ceil_runs[0]
            moc = spread(c.get("measured_over_ceiling") for c in ceil_runs)
            parts = [
                f"{title}: moestream ceiling = missed {cell(spread(c['missed_mb_per_token'] for c in ceil_runs))}"
                f" MB/tok / {cond['disk']['mb_s']:.0f} MB/s ({cond['disk']['source']}, "
                f"{cond['disk']['inflight']} in flight)"
            ]
            if "compute_ms" in c0:
                parts.append(
                    f" + compute {c0['compute_ms']:.1f} ms/tok (all cached) = "
                    f"{cell(spread(c['ceiling_ms'] for c in ceil_runs))} ms/tok; measured "
                    f"{cell(spread(c['measured_ms'] for c in ceil_runs))} ms/tok = **{cell(moc, suffix='x')}"
                    " the ceiling** (runs: " + ", ".join(f"{c['measured_over_ceiling']:.2f}x" for c in ceil_runs) + ")"
                )
            parts.append(
                f" (this run's own split: compute {cell(spread(c['run_compute_ms'] for c in ceil_runs))}"
                f" + waiting on reads {cell(spread(c['run_read_wait_ms'] for c in ceil_runs))} ms/tok)"
            )
            notes.append("".join(parts))
            notes += [f"{title}: disk probe: {w}" for w in cond["disk"].get("warnings", [])[:1]]
        for r in cond["runs"]:
            if r["status"] != "ok":
                notes.append(
                    f"{title}: {r['engine']} ({r['variant']}) repeat {r['repeat'] + 1}: {r['status']}"
                    + (f": {r['error'][-200:]}" if r["error"] else "")
                )
    cal = doc.get("calibration")
    if cal:
        if cal.get("status") == "ok":
            notes.append(
                f"compute calibration: {cal['prompt_tokens']}-token prompt, {cal['n_slots']} slots, decode "
                f"{cal['decode_ms_per_token']:.1f} ms/tok of which {cal['compute_ms_per_token']:.1f} compute, "
                f"{cal['decode_mb_per_token']:.2f} MB/tok still read"
                + (
                    ""
                    if cal["decode_mb_per_token"] < 1
                    else " (not every expert was cached: compute is the decode time not spent waiting on reads)"
                )
            )
        else:
            notes.append(f"compute calibration {cal.get('status')}: {cal.get('error', '')}")
    notes += meta.get("notes", [])
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


def run_meta(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    """What every results file records about its run: when, which model, the machine, the commit, the args."""
    return {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "model": args.model,
        "host": host_info(args.model),
        "moestream_commit": git_commit(),
        "args": vars(args),
        **extra,
    }


def save_results(doc: dict[str, Any], md: str, args: argparse.Namespace, kind: str, log: Callable[[str], None]) -> str:
    """Write the JSON under --results-dir, print the markdown table (and to --markdown); the JSON path."""
    name = args.name or f"{kind}-{os.path.splitext(os.path.basename(args.model))[0]}"
    path = results_path(args.results_dir, name)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(md)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(md)
    log(f"results: {path}")
    return path


def results_path(directory: str, name: str) -> str:
    os.makedirs(directory, exist_ok=True)
    base = os.path.join(directory, f"{dt.date.today().isoformat()}-{name}")
    path, i = base + ".json", 2
    while os.path.exists(path):
        path, i = f"{base}-{i}.json", i + 1
    return path


def prompt_token_counts(runs: list[dict[str, Any]]) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for r in runs:
        if r["stats"].get("prompt_tokens"):
            out.setdefault(r["engine"], set()).add(r["stats"]["prompt_tokens"])
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="GGUF file both engines run")
    ap.add_argument("--conditions", default=",".join(CONDITIONS), help="comma-separated: pagecache,cold,pressure")
    ap.add_argument("--leave-gb", type=float, default=8.0, help="GiB the balloon leaves in `pressure` (default 8)")
    ap.add_argument("--repeat", type=int, default=3, help="fresh processes per engine and condition (default 3)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens to decode (default 32)")
    ap.add_argument("--threads", type=int, default=2, help="compute threads for both engines (default 2)")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument(
        "--budget-mb",
        type=int,
        default=None,
        help="moestream --ram-budget-mb in pagecache and cold (default: moestream's own default)",
    )
    ap.add_argument(
        "--pressure-budget-mb",
        type=int,
        default=None,
        help="moestream's budget under pressure (default: leave-gb minus 1 GiB)",
    )
    ap.add_argument("--moestream-args", default="", help="extra flags for moestream run, e.g. '--io-threads 8'")
    ap.add_argument(
        "--llama-repack",
        choices=("auto", "on", "off", "both"),
        default="auto",
        help="llama.cpp weight repacking: auto = default (on) in pagecache/cold, off under pressure",
    )
    ap.add_argument("--timeout-s", type=float, default=1800, help="per run (default 1800)")
    ap.add_argument("--no-ceiling", action="store_true", help="skip the disk probe and the compute calibration")
    ap.add_argument(
        "--calib-prompt-repeat",
        type=int,
        default=3,
        help="the calibration prompt is the prompt repeated this many times (default 3: ~300 "
        "tokens, enough for a uniform top-8-of-128 router to touch every expert)",
    )
    ap.add_argument(
        "--calib-budget-mb",
        type=int,
        default=None,
        help="moestream budget for the calibration run (default: moestream's default)",
    )
    ap.add_argument("--name", default=None, help="results file name (default compare-<model>)")
    ap.add_argument("--results-dir", default=RESULTS_DIR)
    ap.add_argument("--markdown", default=None, help="also write the markdown table here")
    args = ap.parse_args(argv)
    args.conditions = [c.strip() for c in args.conditions.split(",") if c.strip()]
    for c in args.conditions:
        if c not in CONDITIONS:
            ap.error(f"unknown condition {c!r}; choose from {', '.join(CONDITIONS)}")
    if not os.path.isfile(args.model):
        ap.error(f"no such model file: {args.model}")
    if args.repeat < 1 or args.tokens < 1 or args.threads < 1:
        ap.error("--repeat, --tokens and --threads must be positive")
    if args.pressure_budget_mb is None:
        args.pressure_budget_mb = int((args.leave_gb - 1) * 1024)
    if "pressure" in args.conditions:
        if args.pressure_budget_mb <= 0 or args.pressure_budget_mb > args.leave_gb * 1024:
            ap.error(
                f"--pressure-budget-mb {args.pressure_budget_mb} must fit in the {args.leave_gb:g} GiB "
                "the balloon leaves"
            )
    args.model = os.path.abspath(args.model)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    extra = shlex.split(args.moestream_args)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    doc: dict[str, Any] = {
        "meta": run_meta(args, model_bytes=os.path.getsize(args.model), llama_cpp_version=_llama_version(), notes=[]),
        "conditions": [],
    }
    compute_ms = None
    if not args.no_ceiling:
        log("calibrating compute: moestream with every expert cached ...")
        cal = calibrate_compute(
            args.model,
            args.prompt,
            args.tokens,
            args.threads,
            extra,
            args.timeout_s,
            args.calib_prompt_repeat,
            args.calib_budget_mb,
        )
        doc["calibration"] = cal
        if cal.get("status") == "ok":
            compute_ms = cal["compute_ms_per_token"]
            log(
                f"compute with experts cached: {compute_ms:.1f} ms/tok (decode reads {cal['decode_mb_per_token']:.2f} "
                f"MB/tok, {cal['prompt_tokens']}-token prompt)"
            )
        else:
            log(f"calibration {cal.get('status')}: {cal.get('error')}")
    for condition in args.conditions:
        doc["conditions"].append(run_condition(args, condition, extra, compute_ms, log))
    all_runs = [r for c in doc["conditions"] for r in c.get("runs", [])]
    counts = prompt_token_counts(all_runs)
    doc["meta"]["prompt_tokens"] = "/".join(str(t) for t in sorted(set().union(*counts.values()))) or "?"
    if len({frozenset(v) for v in counts.values()}) > 1:
        doc["meta"]["notes"].append(f"the engines tokenized the prompt differently: {counts}")
    if any(c["condition"] == "pressure" and "runs" in c for c in doc["conditions"]):
        doc["meta"]["notes"].append(
            "llama.cpp's default CPU repack copies Q4_0/Q4_K weights into anonymous memory (as much again as the "
            "file); with less RAM than that it is OOM-killed while loading, so under pressure it runs with repack "
            "off (use_extra_bufts=False) unless --llama-repack says otherwise."
        )
    doc["meta"]["notes"].append(
        "All runs on a shared 2-core VM are noisy: compare ratios measured in the same run, not absolute figures "
        "across days. The guest reclaims memory idle for ~60 s (DAMON), so page-cache state is re-made before "
        "every run."
    )
    save_results(doc, markdown(doc), args, "compare", log)
    return 0


def _llama_version() -> str:
    try:
        from importlib.metadata import version

        return version("llama_cpp_python")
    except Exception:  # noqa: BLE001 - any failure means "not installed"
        return "not installed"


if __name__ == "__main__":
    sys.exit(main())
