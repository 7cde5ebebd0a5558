"""One generation of moestream or llama.cpp in a fresh, measured process; the page-cache condition it runs
in; and the summaries over repeats that compare.py and ab.py report."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from balloon import Balloon
from harness import (
    BENCH_DIR,
    GIB,
    MIB,
    Measured,
    cached_fraction,
    drop_caches,
    meminfo,
    preread,
    run_measured,
    spread,
    tail,
)

from moestream.formats.gguf_model import model_nbytes

LLAMA_RUNNER = os.path.join(BENCH_DIR, "llamacpp_run.py")
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
    "ttft_s",
    "prompt_disk_bytes",
    "engine_prompt_bytes",
    "major_faults",
    "swap_ins",
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
        if name == "ttft_s":  # process start to the end of the prefill, load included
            return self.wall_s - s["decode_s"]
        if name == "prompt_disk_bytes":  # kernel's count for both engines
            if self.engine == "moestream":
                return e.get("prompt_read_bytes")
            return s.get("prompt_bytes_read")
        if name == "major_faults":  # pages the process read back from disk (evicted weights, code)
            return e.get("majflt")
        if name == "swap_ins":  # the machine's swap-ins during the run (bench/ab.py records them)
            return e.get("swap_ins")
        if name == "engine_prompt_bytes":  # moestream's own count of expert bytes the prompt read
            if self.engine != "moestream" or "bytes_read" not in s:  # (bench/ab.py --serve: not reported)
                return None
            return s["bytes_read"] - s["decode_bytes_read"]
        raise KeyError(name)


# ---- running an engine ---------------------------------------------------------------------------


def generation_args(model: str, prompt: str, tokens: int, threads: int, ctx: int | None = None) -> list[str]:
    """The flags both engines' command lines share (moestream run and llamacpp_run.py)."""
    return ["-m", model, "-p", prompt, "-n", str(tokens), "--threads", str(threads)] + (
        ["--ctx", str(ctx)] if ctx else []
    )


def run_moestream(
    model: str,
    prompt: str,
    tokens: int,
    threads: int,
    budget_mb: int | None,
    extra: list[str],
    timeout_s: float,
    tree: str | None = None,
    ctx: int | None = None,
) -> tuple[Measured, dict[str, Any]]:
    """One `moestream run` in a fresh process; returns (outside view, its --stats-json). tree: run the moestream
    package of another checkout (a `git worktree` of an older commit) instead of this one; ctx: --ctx (default:
    the engine's)."""

    def cmd(stats_path: str) -> list[str]:
        c = [
            # -P: the current directory (maybe this checkout) must not come before the tree on sys.path
            *(["env", f"PYTHONPATH={os.path.abspath(tree)}"] if tree else []),
            sys.executable,
            *(["-P"] if tree else []),
            "-m",
            "moestream",
            "run",
            *generation_args(model, prompt, tokens, threads, ctx),
            "--stats-json",
            stats_path,
            *extra,
        ]
        return c + (["--ram-budget-mb", str(budget_mb)] if budget_mb is not None else [])

    return _run_with_stats(cmd, "moestream-stats-", timeout_s)


def run_llamacpp(
    model: str, prompt: str, tokens: int, threads: int, repack: bool, timeout_s: float, ctx: int | None = None
) -> tuple[Measured, dict[str, Any]]:
    def cmd(stats_path: str) -> list[str]:
        return [
            sys.executable,
            LLAMA_RUNNER,
            *generation_args(model, prompt, tokens, threads, ctx),
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
    if "loaded" in m.marks and "first_output" in m.marks:
        out["prompt_read_bytes"] = m.marks["first_output"] - m.marks["loaded"]
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
        error="" if m.status == "ok" else tail(m.stderr),
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
    size, avail = model_nbytes(model), meminfo()["MemAvailable"]
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


# ---- summaries -----------------------------------------------------------------------------------


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
