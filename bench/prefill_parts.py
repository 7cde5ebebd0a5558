"""Where a prompt's time goes, with the cache's memory committed before it and as a fresh process runs it.

    python bench/prefill_parts.py --model /tmp/models/q36.gguf --budget-mb 7168 --repeat 3

Each run is a fresh process (this script re-runs itself with --one): page cache dropped, an Engine at the budget,
then one prompt (the compare.py prompt) and one token (--tokens N: N, and the decode's ms a token). Arm `committed`
waits for the background commit of the expert slots (ExpertCache.prefault) before the prompt; arm `fresh` starts
the prompt at once, as `moestream run` does. Timers wrap the model's parts (linear attention, full attention, the
MoE block: routed and shared experts with their waits and packing) and the packing of read segments (with --tokens,
over the decode too); the reader reports how long reads waited for a free buffer and its bandwidth while reads were
in flight. Arms alternate. Needs root (drop_caches). No balloon: run it on an otherwise idle machine.

Writes bench/results/<date>-<name>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time

from harness import DEFAULT_PROMPT, REPO_DIR, add_results_args, drop_caches, log, median_range, save_rows

PARTS = (
    "prompt_s",
    "read_wait_s",
    "cpu_s",
    "linear_attention_s",
    "attention_s",
    "moe_s",
    "dense_ffn_s",
    "pack_s",
    "commit_wait_s",
    "decode_ms_per_token",
)


def one(model: str, budget_mb: int, committed: bool, threads: int, tokens: int) -> dict:
    from moestream.engine.engine import Engine
    from moestream.engine.options import EngineOptions
    from moestream.models import deltanet, layer, moe, qwen3moe, qwen35moe
    from moestream.streaming import fetch, pending

    spent: dict[str, float] = collections.defaultdict(float)
    depth: dict[str, int] = collections.defaultdict(int)

    def timed(owner, name: str, key: str) -> None:
        f = getattr(owner, name)

        def wrapper(*a, **k):
            # counted once where one timed call runs inside another of the same key (a subclass's __call__)
            depth[key] += 1
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                depth[key] -= 1
                if not depth[key]:
                    spent[key] += time.perf_counter() - t

        setattr(owner, name, wrapper)

    timed(deltanet.GatedDeltaNet, "__call__", "linear_attention_s")
    timed(qwen35moe.GatedAttention, "__call__", "attention_s")
    timed(qwen3moe.Attention, "__call__", "attention_s")
    timed(layer.SplitMixer, "__call__", "attention_s")  # the other architectures' attention (MLA, GQA, ...)
    timed(moe.MoE, "__call__", "moe_s")  # every architecture's MoE block
    timed(moe.DenseFFN, "__call__", "dense_ffn_s")
    # the fetch's module and pending's each call pack_lanes by their own global name
    timed(fetch, "pack_lanes", "pack_s")
    timed(pending, "pack_lanes", "pack_s")
    drop_caches()
    eng = Engine(model, EngineOptions(ram_budget_mb=budget_mb, threads=threads))
    t = time.perf_counter()
    if committed:
        eng.cache.arena.wait_prefault()
    commit_wait = time.perf_counter() - t
    ids = eng.tokenizer.encode(DEFAULT_PROMPT)
    spent.clear()
    cpu0 = time.process_time()
    g = eng.generate(ids, tokens)
    snap = eng.snapshot()
    out = dict(spent)
    out.update(
        arm="committed" if committed else "fresh",
        prompt_tokens=len(ids),
        prompt_s=g.stats.prompt_s,
        read_wait_s=g.stats.read_wait_s,
        cpu_s=time.process_time() - cpu0,
        commit_wait_s=commit_wait,
        buffer_wait_s=snap.read_buffer_wait_s,
        read_busy_mb_s=snap.read_busy_mb_s,
        n_slots=snap.n_slots,
        decode_ms_per_token=1e3 * g.stats.decode_s / max(1, g.stats.decode_tokens - 1),
    )
    eng.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--budget-mb", type=int, default=7168)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1, help="tokens to generate (default 1: the prompt alone)")
    add_results_args(ap, "prefill-parts")
    ap.add_argument("--one", choices=("committed", "fresh"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.model, args.budget_mb, args.one == "committed", args.threads, args.tokens)))
        return 0
    rows = []
    for rep in range(args.repeat):
        for arm in ("committed", "fresh") if rep % 2 == 0 else ("fresh", "committed"):
            cmd = [sys.executable, os.path.abspath(__file__), "--model", args.model, "--budget-mb", str(args.budget_mb)]
            cmd += ["--threads", str(args.threads), "--tokens", str(args.tokens), "--one", arm]
            res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_DIR)
            if res.returncode != 0:
                sys.exit(f"error: the {arm} run failed:\n{res.stderr[-2000:]}")
            row = json.loads(res.stdout.strip().splitlines()[-1])
            row["repeat"] = rep
            rows.append(row)
            log(f"repeat {rep + 1}/{args.repeat} {arm}: prompt {row['prompt_s']:.1f} s")
    md = [
        f"### Where a prompt's time goes: {os.path.basename(args.model)}, {args.budget_mb} MB, "
        f"{rows[0]['prompt_tokens']} tokens",
        "",
        "| arm | " + " | ".join(PARTS) + " |",
        "|---|" + "---|" * len(PARTS),
    ]
    for arm in ("committed", "fresh"):
        mine = [r for r in rows if r["arm"] == arm]
        cells = [median_range([r.get(p, 0.0) for r in mine], 1) for p in PARTS]
        md.append(f"| {arm} | " + " | ".join(cells) + " |")
    save_rows(args, rows, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
