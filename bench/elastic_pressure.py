"""The elastic expert cache under a second process that allocates and frees memory (issue 7).

    python bench/elastic_pressure.py --model /tmp/models/q30.gguf --budget-mb 12000 --keep-free-mb 3000 \
        --hog-gb 14 --tokens 64

moestream decodes with `--keep-free-mb`; meanwhile a hog process allocates memory in 1 GiB steps (touching
every page) up to --hog-gb, holds it, then frees it. Recorded: whether either process was killed, the
lowest MemAvailable seen, swap use, moestream's decode tok/s and its elastic summary (shrinks, slots given
back, grows). Writes JSON to bench/results/ and prints a short report.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

from harness import RESULTS_DIR, meminfo, write_json

HOG = r"""
import mmap, sys, time
step, top, hold = 1 << 30, int(float(sys.argv[1]) * (1 << 30)), float(sys.argv[2])
time.sleep(float(sys.argv[3]))
maps = []
while sum(len(m) for m in maps) < top:
    m = mmap.mmap(-1, step)
    for off in range(0, step, 4096):
        m[off] = 1
    maps.append(m)
    print("hog", sum(len(m) for m in maps) >> 30, "GiB", flush=True)
    time.sleep(0.5)
time.sleep(hold)
for m in maps:
    m.close()
print("hog freed", flush=True)
time.sleep(hold)
"""


def engine_command(args: argparse.Namespace, stats_path: str) -> list[str]:
    """`moestream run` decoding --tokens tokens whatever comes, with --keep-free-mb, its stats to `stats_path`."""
    return [sys.executable, "-m", "moestream", "run", "-m", args.model, "-p", "Tell me about disks and memory.",
            "-n", str(args.tokens), "--ignore-eos", "--threads", str(args.threads), "--ram-budget-mb",
            str(args.budget_mb), "--keep-free-mb", str(args.keep_free_mb), "--stats-json", stats_path]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--budget-mb", type=int, required=True)
    ap.add_argument("--keep-free-mb", type=int, default=3000)
    ap.add_argument("--hog-gb", type=float, default=12.0)
    ap.add_argument("--hog-hold-s", type=float, default=20.0)
    ap.add_argument("--hog-delay-s", type=float, default=15.0, help="let the cache fill before the hog starts")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--results-dir", default=RESULTS_DIR)
    args = ap.parse_args()

    stats_path = f"/tmp/elastic-{os.getpid()}.json"
    cmd = engine_command(args, stats_path)
    low = {"avail": meminfo()["MemAvailable"], "swap_used": 0}
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.1):
            m = meminfo()
            low["avail"] = min(low["avail"], m["MemAvailable"])
            low["swap_used"] = max(low["swap_used"], m["SwapTotal"] - m["SwapFree"])

    threading.Thread(target=watch, daemon=True).start()
    t0 = time.time()
    engine = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    hog = subprocess.Popen(
        [sys.executable, "-c", HOG, str(args.hog_gb), str(args.hog_hold_s), str(args.hog_delay_s)],
        stdout=subprocess.PIPE,
        text=True,
    )
    _, err = engine.communicate()
    hog_out, _ = hog.communicate()
    stop.set()
    stats = json.load(open(stats_path)) if os.path.exists(stats_path) else {}
    elastic = [ln for ln in err.splitlines() if ln.startswith("elastic:")]
    result = {
        "args": vars(args),
        "engine_rc": engine.returncode,
        "hog_rc": hog.returncode,
        "hog_log": hog_out.splitlines()[-3:],
        "elapsed_s": time.time() - t0,
        "min_mem_available_mb": low["avail"] >> 20,
        "max_swap_used_mb": low["swap_used"] >> 20,
        "decode_tps": stats.get("decode_tps"),
        "peak_rss_mb": (stats.get("peak_rss") or 0) >> 20,
        "elastic": elastic[-1] if elastic else None,
        "stderr_tail": err.splitlines()[-4:],
    }
    os.makedirs(args.results_dir, exist_ok=True)
    out = os.path.join(args.results_dir, time.strftime("%Y-%m-%d") + "-elastic-pressure.json")
    write_json(out, result)
    shown = ("engine_rc", "hog_rc", "min_mem_available_mb", "max_swap_used_mb", "decode_tps", "peak_rss_mb", "elastic")
    for k in shown:
        print(f"{k}: {result[k]}")
    print("results:", out)
    return 0 if engine.returncode == 0 and hog.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
