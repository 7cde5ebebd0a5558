"""What committing fresh memory costs the rest of the machine: decode speed with and without a concurrent commit.

    python bench/commit_cost.py --model /tmp/models/q36.gguf --budget-mb 6144 --gib 5 --repeat 3 --tokens 24

A cache arena's pages are committed on first touch (moestream prefaults its arena in a background thread).
On bare metal that costs a fraction of a second per GB; in a VM whose host backs guest memory lazily it can
cost far more, and not only on the committing thread. This loads one engine, waits until its own arena is
committed, then decodes --tokens tokens after a short prompt, alternating: alone, and while a second thread
commits --gib GiB of fresh anonymous memory slot by slot (MADV_POPULATE_WRITE, as the engine's prefault
does). Reports decode tok/s of both arms (medians, min-max, and the paired ratio) and the commit's GB/s.

Writes bench/results/<date>-<name>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import sys
import threading
import time

from harness import add_results_args, median_range, save_rows

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.streaming.expert_cache import MADV_POPULATE_WRITE

PROMPT = "Explain how a disk works."


def commit(nbytes: int, step: int, stop: threading.Event, out: dict) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    t0, done = time.perf_counter(), 0
    for off in range(0, nbytes - step + 1, step):
        if stop.is_set():
            break
        libc.madvise(ctypes.c_void_p(base + off), ctypes.c_size_t(step), MADV_POPULATE_WRITE)
        done += step
    out.update(bytes=done, seconds=time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--budget-mb", type=int, default=6144)
    ap.add_argument("--gib", type=float, default=5.0, help="fresh memory the second thread commits (default 5)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    add_results_args(ap, "commit-cost")
    args = ap.parse_args()
    eng = Engine(args.model, EngineOptions(ram_budget_mb=args.budget_mb, threads=args.threads))
    eng.cache.arena.wait_prefault()
    prompt = eng.tokenizer.encode(PROMPT)
    rows = []
    try:
        for rep in range(args.repeat):
            for arm in ("alone", "commit") if rep % 2 == 0 else ("commit", "alone"):
                eng.reset()
                first = eng.generate(prompt, 1).tokens  # the prefill, outside the timing
                stop, res = threading.Event(), {}
                th = None
                if arm == "commit":
                    th = threading.Thread(
                        target=commit, args=(int(args.gib * 2**30), eng.snapshot().slot_nbytes, stop, res), daemon=True
                    )
                    th.start()
                g = eng.generate(prompt + first, args.tokens)
                stop.set()
                if th is not None:
                    th.join()
                row = {"repeat": rep, "arm": arm, "decode_tps": g.stats.decode_tokens / g.stats.decode_s}
                if res:
                    row["commit_gb_s"] = res["bytes"] / res["seconds"] / 1e9 if res["seconds"] else 0.0
                rows.append(row)
                print(f"repeat {rep + 1}/{args.repeat} {arm}: decode {row['decode_tps']:.2f} tok/s", file=sys.stderr)
    finally:
        eng.close()
    alone = {r["repeat"]: r["decode_tps"] for r in rows if r["arm"] == "alone"}
    with_c = [r for r in rows if r["arm"] == "commit"]
    ratios = [r["decode_tps"] / alone[r["repeat"]] for r in with_c]
    save_rows(
        args,
        rows,
        [
            f"### Decode with a concurrent commit: {os.path.basename(args.model)}, {args.threads} threads",
            "",
            "| arm | decode tok/s | commit GB/s |",
            "|---|---|---|",
            f"| alone | {median_range(list(alone.values()))} | |",
            f"| while {args.gib:g} GiB are committed | {median_range([r['decode_tps'] for r in with_c])} "
            f"| {median_range([r['commit_gb_s'] for r in with_c])} |",
            f"| **ratio** | **{median_range(ratios)}x** | |",
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
