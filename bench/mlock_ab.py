"""A/B of --mlock vs --no-mlock under memory pressure: does locking the dense weights keep decode fast?

    python bench/mlock_ab.py --model /tmp/models/q30.gguf --leave-gb 6 --ram-budget-mb 4096 \\
        --repeat 3 --tokens 64 --threads 2

A balloon (bench/balloon.py) mlocks all but --leave-gb GiB of RAM for the whole benchmark, so the process
under test, the page cache and everything else share what is left. Then, alternating which goes first,
each repeat runs `python -m moestream run ... --mlock` and `... --no-mlock` as fresh processes (the OOM
killer's first choice, never the balloon) with --stats-json, and records per run: prompt and decode tok/s,
peak RSS, the child's major page faults (pages it had to read back from disk: evicted weights, code) and
the machine's swap-ins/outs during the run (/proc/vmstat), plus the `mlock:` line the run printed.

What to expect: moestream's dense weights live in anonymous memory (copied out of the file at load), so
without swap (or zram) the kernel cannot evict them at all and the A/B measures nothing but noise; the
report says whether swap was present. With swap, pressure pushes unlocked weights out and every decode
step faults them back (the ds4 seed: 1.27 -> 4.54 tok/s once locked).

Writes bench/results/<date>-mlock-ab.json (or --out) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from typing import Any

from balloon import Balloon
from harness import GIB, REPO_DIR, RESULTS_DIR, make_oom_victim, meminfo, vmstat

ARMS = ("mlock", "no-mlock")
DEFAULT_PROMPT = "Explain, step by step, how a cache that streams experts from disk decides what to keep. " * 4


def run_once(args: argparse.Namespace, arm: str) -> dict[str, Any]:
    """One fresh `moestream run` with --mlock or --no-mlock; its stats plus faults and swap traffic."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        stats_path = tmp.name
    cmd = [
        sys.executable, "-m", "moestream", "run", "-m", args.model, "-p", args.prompt, "-n", str(args.tokens),
        "--stats-json", stats_path, f"--{arm}",
    ]  # fmt: skip
    for flag, value in (("--ram-budget-mb", args.ram_budget_mb), ("--ctx", args.ctx), ("--threads", args.threads)):
        if value is not None:
            cmd += [flag, str(value)]
    ru0, vm0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), vmstat(), time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=REPO_DIR, capture_output=True, text=True, timeout=args.timeout, preexec_fn=make_oom_victim
        )
        rc, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr or b""
        rc, stderr = "timeout", err.decode(errors="replace") if isinstance(err, bytes) else err
    ru1, vm1 = resource.getrusage(resource.RUSAGE_CHILDREN), vmstat()
    row: dict[str, Any] = {
        "arm": arm,
        "rc": rc,
        "wall_s": time.perf_counter() - t0,
        "majflt": ru1.ru_majflt - ru0.ru_majflt,
        "pswpin": vm1.get("pswpin", 0) - vm0.get("pswpin", 0),
        "pswpout": vm1.get("pswpout", 0) - vm0.get("pswpout", 0),
        "mlock_line": next((s for s in stderr.splitlines() if s.startswith("mlock:")), None),
    }
    if rc == 0:
        with open(stats_path) as f:
            st = json.load(f)
        row.update({k: st[k] for k in ("prompt_tps", "decode_tps", "hit_rate", "peak_rss", "decode_tokens")})
    else:
        row["error"] = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit {rc}"
    os.unlink(stats_path)
    return row


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for arm in ARMS:
        ok = [r for r in rows if r["arm"] == arm and r["rc"] == 0]
        if not ok:
            continue
        out[arm] = {
            "runs": len(ok),
            "decode_tps": statistics.median(r["decode_tps"] for r in ok),
            "decode_tps_min": min(r["decode_tps"] for r in ok),
            "decode_tps_max": max(r["decode_tps"] for r in ok),
            "prompt_tps": statistics.median(r["prompt_tps"] for r in ok),
            "majflt": statistics.median(r["majflt"] for r in ok),
            "pswpin": statistics.median(r["pswpin"] for r in ok),
            "peak_rss_mb": max(r["peak_rss"] for r in ok) / 2**20,
        }
    return out


def markdown(summary: dict[str, dict[str, float]], swap_total: int) -> str:
    lines = [
        f"swap on this machine: {swap_total / GIB:.1f} GiB"
        + ("" if swap_total else " (dense weights cannot be evicted)"),
        "",
        "| arm | runs | decode tok/s (median, min-max) | prompt tok/s | major faults | swap-ins | peak RSS |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, s in summary.items():
        lines.append(
            f"| {arm} | {s['runs']} | {s['decode_tps']:.2f} ({s['decode_tps_min']:.2f}-{s['decode_tps_max']:.2f}) "
            f"| {s['prompt_tps']:.1f} | {s['majflt']:.0f} | {s['pswpin']:.0f} | {s['peak_rss_mb']:.0f} MB |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--leave-gb", type=float, help="GiB of RAM the balloon leaves to everything else")
    g.add_argument("--no-balloon", action="store_true", help="no pressure (checks the script itself)")
    ap.add_argument("--ram-budget-mb", type=int, default=None)
    ap.add_argument("--ctx", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run before it counts as a timeout")
    ap.add_argument("--out", default=None, help="JSON results (default bench/results/<date>-mlock-ab.json)")
    args = ap.parse_args(argv)

    swap_total = meminfo().get("SwapTotal", 0)
    rows: list[dict[str, Any]] = []
    pressure = nullcontext() if args.no_balloon else Balloon(leave_gb=args.leave_gb)
    with pressure as balloon:
        if balloon is not None:
            print(
                f"balloon holds {balloon.locked_bytes / GIB:.1f} GiB, "
                f"{balloon.mem_available_bytes / GIB:.1f} GiB left available",
                file=sys.stderr,
            )
        for i in range(args.repeat):
            for arm in ARMS if i % 2 == 0 else ARMS[::-1]:  # alternate who goes first
                row = run_once(args, arm)
                row["repeat"] = i
                rows.append(row)
                shown = f"{row['decode_tps']:.2f} tok/s" if row["rc"] == 0 else f"failed: {row.get('error')}"
                print(
                    f"[{i + 1}/{args.repeat}] {arm}: {shown}, {row['majflt']} major faults, "
                    f"{row['pswpin']} swap-ins | {row['mlock_line']}",
                    file=sys.stderr,
                )
    summary = summarize(rows)
    doc = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "args": vars(args),
        "swap_total": swap_total,
        "balloon": None if args.no_balloon else {"leave_gb": args.leave_gb},
        "rows": rows,
        "summary": summary,
    }
    out = args.out or os.path.join(RESULTS_DIR, f"{dt.date.today().isoformat()}-mlock-ab.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print(markdown(summary, swap_total))
    print(f"wrote {out}", file=sys.stderr)
    return 0 if summary else 1


if __name__ == "__main__":
    sys.exit(main())
