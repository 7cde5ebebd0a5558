"""moestream's decode ceiling: the disk's bandwidth at the engine's read size, and compute per token with
every expert cached; a run's measured time per token over the two."""

from __future__ import annotations

import json
import mmap
import os
import random
import subprocess
import sys
import threading
import time
from typing import Any

from engine_runs import run_moestream
from harness import MIB, REPO_DIR, drop_caches, tail


def flag_value(args: list[str], flag: str, default: str | None = None) -> str | None:
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
        return {"status": m.status, "error": tail(m.stderr)}
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
