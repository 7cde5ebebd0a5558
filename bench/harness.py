"""What the benchmark scripts share: the machine's state (/proc/meminfo, /proc/vmstat, the page cache), a
child process measured from outside, results files with what every run records about itself, and the
median (min-max) cells of the tables.

Importing it also puts this checkout first on sys.path, so that a script run as `python bench/x.py`
measures the moestream next to it rather than an installed one.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import datetime as dt
import json
import mmap
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCH_DIR)
RESULTS_DIR = os.path.join(BENCH_DIR, "results")
if REPO_DIR not in sys.path:
    sys.path.insert(0, REPO_DIR)

GIB = 1 << 30
MIB = 1 << 20
VICTIM_OOM_SCORE_ADJ = 1000
DEFAULT_PROMPT = (
    "Explain in a few short paragraphs how a computer moves data between its disk, its memory and the "
    "caches of its processor, and why reading the same bytes twice can cost very different amounts of time."
)
STATS_LINE = re.compile(rb"^prompt \d+ tok @ .* decode \d+ tok @")
LOADED_LINE = re.compile(rb"^mlock: ")  # `moestream run` prints it once loaded, right before the prompt


def log(msg: str) -> None:
    """Progress goes to stderr; stdout carries the table."""
    print(msg, file=sys.stderr, flush=True)


# ---- the machine ---------------------------------------------------------------------------------


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, rest = line.split(":", 1)
            parts = rest.split()
            out[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return out


def vmstat() -> dict[str, int]:
    """/proc/vmstat: the kernel's event counters (swap-ins, OOM kills, ...)."""
    out: dict[str, int] = {}
    with open("/proc/vmstat") as f:
        for line in f:
            key, value = line.split()
            out[key] = int(value)
    return out


def proc_io(pid: int | str = "self") -> dict[str, int]:
    """/proc/PID/io: the process's I/O counters (read_bytes: what it made the disk read)."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            key, value = line.split(":")
            out[key] = int(value)
    return out


def set_oom_score_adj(pid: int | str, value: int) -> None:
    """Write /proc/PID/oom_score_adj (-1000..1000; lowering it needs root)."""
    with open(f"/proc/{pid}/oom_score_adj", "w") as f:
        f.write(str(value))


def make_oom_victim() -> None:
    """Popen preexec_fn: the child is the first the OOM killer picks (before the balloon, before a bystander)."""
    set_oom_score_adj("self", VICTIM_OOM_SCORE_ADJ)


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
    return vmstat().get("oom_kill", 0)


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


SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpuinfo_first() -> dict[str, str]:
    """The fields of the first processor in /proc/cpuinfo (every core of these machines lists the same)."""
    fields: dict[str, str] = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if not key.strip():
                break
            fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_model_and_simd() -> tuple[str, list[str]]:
    """The CPU's model name and the vector extensions that decide moestream's kernels (the same model name may
    have or lack them)."""
    fields = cpuinfo_first()
    have = set(fields.get("flags", "").split())
    return fields.get("model name", "unknown"), [w for w in SIMD_FLAGS if w in have]


def cpu_record() -> dict[str, Any]:
    """The CPU's model name, family and model numbers (a VM's name "AMD EPYC" covers several generations) and
    every flag /proc/cpuinfo gives it (the same name comes with or without AVX-512 or AMX, host by host)."""
    fields = cpuinfo_first()
    return {
        "model": fields.get("model name", "unknown"),
        "vendor": fields.get("vendor_id"),
        "family": fields.get("cpu family"),
        "model_number": fields.get("model"),
        "stepping": fields.get("stepping"),
        "flags": fields.get("flags", "").split(),
    }


def shared_routes_dir() -> str:
    """../shared/routes beside the checkout, or beside the folder of its worktrees (the first that exists)."""
    near = [os.path.join(REPO_DIR, *[".."] * n, "shared", "routes") for n in (1, 2)]
    return next((d for d in near if os.path.isdir(d)), near[0])


def read_heat(path: str) -> tuple[np.ndarray, dict[str, Any]]:
    """A co-activation file's decode heat [layers, experts] (../shared/routes/README.md), and the file."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    return np.array([layer["heat"] for layer in doc["layers"]], float), doc


def write_json(path: str | os.PathLike[str], doc: dict[str, Any]) -> None:
    """Write a results document with the CPU it ran on (`cpu`: model and flags) added at its top level: every
    JSON the bench tools write goes through here."""
    with open(path, "w") as f:
        json.dump({**doc, "cpu": cpu_record()}, f, indent=1, default=str)


def host_info(model: str) -> dict[str, Any]:
    cpu, simd = cpu_model_and_simd()
    mi = meminfo()
    return {
        "cpu": cpu,
        "simd": simd,
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


# ---- one measured child process ------------------------------------------------------------------


def proc_read_bytes(pid: int) -> int | None:
    try:
        return proc_io(pid).get("read_bytes")
    except (OSError, ValueError):
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

    Marks: `loaded` (read_bytes when moestream's mlock line reaches stderr: the model is loaded, the prompt
    starts), `first_output` (when the first stdout byte arrives: moestream's first token, the end of its
    prefill) and `stats_line` (when its stats line reaches stderr: the end of decoding).
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
        value = proc_read_bytes(proc.pid)
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
            if LOADED_LINE.match(line):
                mark("loaded")
            if STATS_LINE.match(line):
                mark("stats_line")
            err_lines.append(line)

    readers = [threading.Thread(target=read_stdout, daemon=True), threading.Thread(target=read_stderr, daemon=True)]
    for t in readers:
        t.start()
    timed_out, wstatus, ru = wait_killing_after(proc, t0 + timeout_s)
    wall = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(wstatus)
    proc.returncode = rc  # reaped by wait4; keep Popen consistent
    for t in readers:
        t.join(timeout=10)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
    return Measured(
        cmd=cmd,
        status="timeout" if timed_out else exit_status(rc, oom_kills() > kills_before),
        rc=rc,
        wall_s=wall,
        ru_maxrss=ru.ru_maxrss * 1024,
        ru_inblock_bytes=ru.ru_inblock * 512,
        ru_majflt=ru.ru_majflt,
        marks=marks,
        stdout=b"".join(out_chunks).decode("utf-8", "replace"),
        stderr=b"".join(err_lines).decode("utf-8", "replace"),
    )


def wait_killing_after(proc: subprocess.Popen[bytes], deadline: float) -> tuple[bool, int, Any]:
    """Reap `proc` with wait4 (its rusage is the process's own), killing its process group once past `deadline`
    (a perf_counter time): (timed out, wait status, rusage)."""
    timed_out = False
    while True:
        pid, wstatus, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            return timed_out, wstatus, ru
        if time.perf_counter() > deadline and not timed_out:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(0.05)


def exit_status(rc: int, oom_killed_one: bool) -> str:
    """ok, oom-killed (SIGKILL while the kernel's OOM-kill count rose), killed (SIGNAL) or failed (rc N)."""
    if rc == -signal.SIGKILL and oom_killed_one:
        return "oom-killed"
    if rc < 0:
        return f"killed ({signal.Signals(-rc).name})"
    return f"failed (rc {rc})" if rc != 0 else "ok"


def tail(text: str, lines: int = 3) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


# ---- results files -------------------------------------------------------------------------------


def spread_ids(vocab: int, n: int) -> list[int]:
    """n token ids spread over the vocabulary (no tokenizer, no corpus): the in-process diagnostics' prompt."""
    return [5 + (i * 7919) % (vocab - 10) for i in range(n)]


def add_results_args(ap: argparse.ArgumentParser, name: str | None, name_help: str | None = None) -> None:
    """--name, --results-dir and --markdown: where save_results writes."""
    ap.add_argument("--name", default=name, help=name_help or f"results file name (default {name})")
    ap.add_argument("--results-dir", default=RESULTS_DIR)
    ap.add_argument("--markdown", default=None, help="also write the markdown table to this file")


def check_conditions(ap: argparse.ArgumentParser, args: argparse.Namespace, known: Sequence[str]) -> None:
    """args.conditions ("pagecache,pressure") made a list of known conditions, and args.model checked to be a
    file: ap.error otherwise."""
    args.conditions = [c.strip() for c in args.conditions.split(",") if c.strip()]
    for c in args.conditions:
        if c not in known:
            ap.error(f"unknown condition {c!r}; choose from {', '.join(known)}")
    if not os.path.isfile(args.model):
        ap.error(f"no such model file: {args.model}")


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


def save_results(doc: dict[str, Any], md: str, args: argparse.Namespace, kind: str) -> str:
    """Write the JSON under --results-dir, print the markdown table (and to --markdown); the JSON path."""
    name = args.name or f"{kind}-{os.path.splitext(os.path.basename(args.model))[0]}"
    path = results_path(args.results_dir, name)
    write_json(path, doc)
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


def save_rows(args: argparse.Namespace, rows: list[dict[str, Any]], lines: Sequence[str]) -> str:
    """The results of a script whose runs are rows and whose report is one table: the JSON path."""
    text = "\n".join(lines)
    doc = {"meta": run_meta(args), "rows": rows, "markdown": text}
    return save_results(doc, text, args, args.name)


# ---- in-process A/B ----------------------------------------------------------------------------


def alternate(arms: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each arm's calls after one warm-up call each: one call of every arm a round, the order
    swapped every round, so that a round's ratio compares calls made moments apart (what a noisy shared VM
    cannot blur)."""
    for fn in arms.values():
        fn()
    times: dict[str, list[float]] = {a: [] for a in arms}
    order = list(arms)
    for i in range(rounds):
        for a in order if i % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            arms[a]()
            times[a].append(time.perf_counter() - t0)
    return times


@dataclass
class Case:
    """One comparison: `arms` maps the baseline's name, then the measured arm's, to one call each."""

    name: str
    arms: dict[str, Callable[[], object]]
    check: str  # how far the outputs are apart: "same bits", "NO", or a difference
    work: float | None = None  # operations one call of the measured arm does (its rate in the table)
    unit: str = "GFLOP/s"


@dataclass
class Suite:
    """A family of cases: its options, its header line and its cases (made lazily: they allocate)."""

    help: str
    rounds: int
    threads: int
    add_args: Callable[[argparse.ArgumentParser], None]
    header: Callable[[argparse.Namespace], str]
    cases: Callable[[argparse.Namespace], Iterable[Case]]
    torch_threads: Callable[[argparse.Namespace], int] = lambda args: args.threads


# ---- cells ---------------------------------------------------------------------------------------


def spread(values: Iterable[float | None]) -> dict[str, float] | None:
    v = [x for x in values if x is not None]
    if not v:
        return None
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


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


def median_range(xs: Sequence[float], digits: int = 2) -> str:
    """'median (min-max)' with a fixed number of decimals."""
    return f"{statistics.median(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"
