"""Disk bandwidth of a prompt's reads: one expert matrix per read vs runs of adjacent experts in one read.

    python bench/read_runs.py --model /tmp/models/q36.gguf --runs 1,4,7 --repeat 3 --gib 3

A prompt that routes to most of a layer's experts reads nearly every expert of it; consecutive expert ids
are adjacent in each of the layer's three expert tensors, so `run` adjacent matrices can be one read. This
reads --gib GiB of the model's expert tensors through moestream's own reader (O_DIRECT, --threads reads in
flight, the engine's default), in runs of each length, run order shuffled, page cache dropped before each
row; rows interleave over the repeats so drift spreads over all of them. Reports GB/s and the process's
CPU seconds per GB (medians, min-max). Needs root (drop_caches).

Writes bench/results/<date>-<name>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

from harness import add_results_args, drop_caches, log, median_range, save_rows

from moestream.formats.gguf_model import GGUFModel
from moestream.streaming.reader import ExpertReader


def expert_tensors(path: str) -> tuple[list[tuple[int, int, int]], int, list[str]]:
    """(part, offset, bytes per expert) of every routed expert tensor, the experts per tensor, and the model's
    files (a split model's parts: a run read stays in its tensor's part)."""
    f = GGUFModel(path)
    try:
        out, n_exp = [], 0
        for t in f.tensors.values():
            if t.name.endswith("_exps.weight") and len(t.shape) == 3:
                n_exp = t.shape[0]
                out.append((t.part, t.offset, t.nbytes // t.shape[0]))
        return out, n_exp, f.paths
    finally:
        f.close()


def one_row(
    paths: list[str], tensors: list[tuple[int, int, int]], n_exp: int, run: int, nbytes: int, threads: int, seed: int
):
    seg = max(s for _, _, s in tensors)
    reader = ExpertReader(paths, seg, threads=threads, buffers=2 * threads, run_buffers=4 * threads, run_len=run)
    reqs = [(p, off + e0 * s, s, min(run, n_exp - e0)) for p, off, s in tensors for e0 in range(0, n_exp, run)]
    random.Random(seed).shuffle(reqs)
    total, picked = 0, []
    for r in reqs:
        if total >= nbytes:
            break
        picked.append(r)
        total += r[2] * r[3]
    drop_caches()
    t0, c0 = time.perf_counter(), time.process_time()
    window: list = []
    for part, off, s, count in picked:
        window.append(reader.read_run(off, s, count, part))
        if len(window) > 4 * threads:
            for fut in window.pop(0):
                fut.result().release()
    for futs in window:
        for fut in futs:
            fut.result().release()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    reader.close()
    return {"run": run, "gb_s": total / wall / 1e9, "cpu_s_per_gb": cpu / (total / 1e9), "reads": len(picked)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--runs", default="1,4,7", help="run lengths in experts (default 1,4,7)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--gib", type=float, default=3.0, help="GiB read per row (default 3)")
    ap.add_argument("--threads", type=int, default=4, help="reads in flight (default 4, the engine's)")
    add_results_args(ap, "read-runs")
    args = ap.parse_args()
    runs = [int(x) for x in args.runs.split(",")]
    tensors, n_exp, paths = expert_tensors(args.model)
    if not tensors:
        sys.exit(f"error: {args.model} has no routed expert tensors (*_exps.weight)")
    rows = []
    for rep in range(args.repeat):
        for run in runs if rep % 2 == 0 else runs[::-1]:
            row = one_row(paths, tensors, n_exp, run, int(args.gib * 2**30), args.threads, seed=rep)
            row["repeat"] = rep
            rows.append(row)
            log(f"repeat {rep + 1}/{args.repeat} run {run}: {row['gb_s']:.2f} GB/s")
    seg = max(s for _, s in tensors)
    md = [
        f"### Read size: {os.path.basename(args.model)}, {args.threads} reads in flight, O_DIRECT",
        "",
        "| experts per read | read size | GB/s | CPU s per GB | vs 1 |",
        "|---|---|---|---|---|",
    ]
    base = {r["repeat"]: r["gb_s"] for r in rows if r["run"] == runs[0]}
    for run in runs:
        mine = [r for r in rows if r["run"] == run]
        gbs = median_range([r["gb_s"] for r in mine])
        cpu = statistics.median(r["cpu_s_per_gb"] for r in mine)
        ratio = [r["gb_s"] / base[r["repeat"]] for r in mine]
        md.append(
            f"| {run} | {run * seg / 2**20:.2f} MiB | {gbs} | {cpu:.3f} "
            f"| {statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f}) |"
        )
    save_rows(args, rows, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
