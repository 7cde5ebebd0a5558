"""GPT-OSS's few, large experts: would a smaller cache/read unit (half or quarter experts) pay on this disk?

    python bench/gpt_oss_units.py routes MODEL -o routes.csv     # skewed_routes.py's workload for MODEL's shape
    python bench/gpt_oss_units.py units TRACE [TRACE ...] --probe P1.json [P2.json ...] -o units.json

`routes` writes skewed_routes.py's topic-shifting Zipf routes (three topics, each a prompt's and a decode's worth
of tokens) as a route trace for `moestream run --route-trace`, sized from the GGUF's layers, experts and top-k.

`units` replays each trace (moestream.analysis.replay: the engine's cache semantics) with LRU and Belady at the
same bytes of cache, once with the expert as the unit and once with each expert split into 2 and 4 units
(each a slice of gate/up/down rows, all of which a dense SwiGLU expert needs: every access of an expert
touches all its units). It reports byte hit rates, MB and reads per decoded token, and combines them with
`moestream probe` results (median MB/s over the given probes per read size and reads in flight) into the
read time per token for each unit, and the break-even: the share of an expert's bytes a smaller unit would
have to save per token to match the whole-expert reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from harness import write_json
from skewed_routes import session, topic_popularity, write_route_trace

from moestream.analysis.accesses import Accesses, accesses_from_trace
from moestream.analysis.replay import replay
from moestream.analysis.trace import read_trace
from moestream.formats.gguf_model import GGUFModel

UNITS = (1, 2, 4)  # pieces an expert is cut into


def split_units(acc: Accesses, s: int) -> Accesses:
    """The accesses with each expert cut into s units of 1/s of its bytes, all requested together."""
    keys = (acc.keys[:, None] * s + np.arange(s)[None]).reshape(-1)
    meta = {k: v for k, v in acc.meta.items() if k not in ("prompt_slots", "decode_slots", "read_ahead")}
    return dataclasses.replace(
        acc,
        keys=keys,
        starts=acc.starts * s,
        n_experts=acc.n_experts * s,
        expert_bytes=acc.expert_bytes // s,
        live_hits=np.repeat(acc.live_hits, s),
        meta=meta,
    )


def unit_rows(acc: Accesses, slots: list[int]) -> list[dict]:
    """LRU and Belady at each expert-slot count, the cache cut into s-times as many units of 1/s."""
    rows = []
    for s in UNITS:
        acc_s = split_units(acc, s)
        for n in slots:
            for policy in ("lru", "belady"):
                r = replay(acc_s, policy, n * s, admission="all")
                rows.append({"unit": f"1/{s}", "units_per_expert": s, "expert_slots": n, "policy": policy,
                             "byte_hit_rate": r.hit_rate, "mb_per_token": r.decode_bytes / 1e6 / r.decode_tokens,
                             "reads_per_token": r.decode_misses / r.decode_tokens})  # fmt: skip
    return rows


def median_bandwidth(probes: list[dict]) -> dict[tuple[int, int], float]:
    """(read size, reads in flight) -> median MB/s over the probes' direct rows."""
    seen: dict[tuple[int, int], list[float]] = {}
    for p in probes:
        for row in p["rows"]:
            if row["mode"] == "direct" and row["reads"] > 0:
                seen.setdefault((row["size"], row["inflight"]), []).append(row["mb_s"])
    return {key: statistics.median(v) for key, v in seen.items()}


def break_even(rows: list[dict], bw: dict[tuple[int, int], float], segment: int, depth: int) -> list[dict]:
    """Read seconds per token of each unit at `depth` reads in flight, and the share of bytes a unit of 1/s
    would have to save to read no slower than whole experts (0 or less: it costs nothing in bandwidth)."""
    out = []
    for r in rows:
        size = segment // r["units_per_expert"]
        mb_s = bw.get((size, depth))
        if mb_s is None:
            continue
        whole = next(w for w in rows if w["units_per_expert"] == 1 and w["expert_slots"] == r["expert_slots"]
                     and w["policy"] == r["policy"])  # fmt: skip
        whole_s = whole["mb_per_token"] / bw[(segment, depth)]
        out.append({**r, "read_bytes": size, "depth": depth, "mb_s": mb_s,
                    "read_s_per_token": r["mb_per_token"] / mb_s,
                    "needed_byte_saving": 1 - mb_s / bw[(segment, depth)],
                    "vs_whole": (r["mb_per_token"] / mb_s) / whole_s if whole_s else None})  # fmt: skip
    return out


def cmd_routes(args: argparse.Namespace) -> None:
    f = GGUFModel(args.model)
    layers, experts = int(f.arch_key("block_count")), int(f.arch_key("expert_count"))
    top_k = int(f.arch_key("expert_used_count"))
    f.close()
    args.top_k = top_k
    pops = {t: topic_popularity(layers, experts, args.zipf, args.seed * 100 + i) for i, t in enumerate("ABC")}
    parts = session(args, pops, np.random.default_rng(args.seed))
    n = write_route_trace(args.output, parts, layers, experts, top_k)
    print(f"{args.output}: {n} tokens, {layers} layers x {experts} experts, top-{top_k}, zipf {args.zipf}")


def cmd_units(args: argparse.Namespace) -> None:
    slots = [int(s) for s in args.slots.split(",")]
    probes = [json.loads(Path(p).read_text()) for p in args.probe]
    bw = median_bandwidth(probes)
    segment = int(probes[0]["segment_bytes"])
    result = {"meta": {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "argv": sys.argv[1:], "segment_bytes": segment},
              "bandwidth_mb_s": [{"size": s, "inflight": d, "mb_s": v} for (s, d), v in sorted(bw.items())],
              "traces": {}}  # fmt: skip
    for path in args.traces:
        meta, rows = read_trace(path)
        acc = accesses_from_trace(meta, rows)
        engine = int(meta.get("n_slots") or 0)
        use = sorted(set(slots + ([engine] if engine else [])))
        table = unit_rows(acc, use)
        result["traces"][path] = {"engine_slots": engine, "rows": table,
                                  "break_even": break_even(table, bw, segment, args.depth)}  # fmt: skip
        print(f"{path} (engine: {engine} slots)")
        for r in table:
            print(f"  unit {r['unit']:>4} {r['policy']:6s} {r['expert_slots']:4d} expert-slots: "
                  f"byte hits {r['byte_hit_rate']:6.1%}, {r['mb_per_token']:6.1f} MB/tok, "
                  f"{r['reads_per_token']:5.1f} reads/tok")  # fmt: skip
    shown = ", ".join(f"{s / 2**20:.2f} MiB x{d}: {v:.0f}" for (s, d), v in sorted(bw.items()))
    print(f"median MB/s (size, in flight): {shown}")
    write_json(args.output, result)
    print(f"results: {args.output}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("routes")
    r.add_argument("model")
    r.add_argument("-o", "--output", required=True)
    r.add_argument("--zipf", type=float, default=1.0)
    r.add_argument("--prompt", type=int, default=64, help="tokens of each topic's prompt part")
    r.add_argument("--decode", type=int, default=192, help="tokens of each topic's decode part")
    r.add_argument("--seed", type=int, default=7)
    u = sub.add_parser("units")
    u.add_argument("traces", nargs="+")
    u.add_argument("--probe", nargs="+", required=True, help="moestream probe -o results (medians taken)")
    u.add_argument("--slots", default="32,64,128,256,384", help="expert-slot counts (plus the trace's own)")
    u.add_argument("--depth", type=int, default=4, help="reads in flight (the engine's --io-threads)")
    u.add_argument("-o", "--output", required=True)
    args = ap.parse_args()
    cmd_routes(args) if args.cmd == "routes" else cmd_units(args)


if __name__ == "__main__":
    main()
