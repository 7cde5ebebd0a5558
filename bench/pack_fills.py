"""What packing fetched experts costs on a slot's first fill against its later fills, during one prompt.

    python bench/pack_fills.py --model /tmp/models/q36.gguf --budget-mb 7168 --prompt-tokens 2048

An Engine at the budget, a warm-up generation of 8 prompt tokens (kernels and pools started; it fills a few
slots), then one prompt of --prompt-tokens token ids up to its first token. Every call of the expert cache's
pack_lanes (one native ms_lane_pack_many over the segments whose reads completed) is timed, and split by
whether any of its segments went into a slot that no earlier call had filled: a first fill commits the
slot's memory (page faults) inside the pack. A diagnosis, in one process, no balloon: it says where the
packing time goes, not how fast a prompt runs (bench/long_prompt.py does that).

Writes bench/results/<date>-<name>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import time

from harness import add_results_args, run_meta, save_results, spread_ids

import moestream.streaming.fetch as fetch
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions


class TimedPack:
    """Stands in for fetch.pack_lanes: calls it and records (seconds, segments, segments into new slots)."""

    def __init__(self, pack):
        self.pack = pack
        self.calls: list[tuple[float, int, int]] = []
        self.filled: set[int] = set()

    def __call__(self, jobs) -> None:
        slots = [p.slot for p, _, _ in jobs]
        first = sum(1 for s in slots if s not in self.filled)
        self.filled.update(slots)
        t = time.perf_counter()
        self.pack(jobs)
        self.calls.append((time.perf_counter() - t, len(jobs), first))


def summary(calls: list[tuple[float, int, int]]) -> dict[str, float]:
    s = sum(c[0] for c in calls)
    segs = sum(c[1] for c in calls)
    return {"calls": len(calls), "seconds": s, "segments": segs, "ms_per_segment": 1000 * s / segs if segs else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--budget-mb", type=int, default=7168, help="--ram-budget-mb (default 7168)")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    add_results_args(ap, None)
    args = ap.parse_args()

    timed = TimedPack(fetch.pack_lanes)
    fetch.pack_lanes = timed
    eng = Engine(args.model, EngineOptions(ram_budget_mb=args.budget_mb, threads=args.threads))
    try:
        vocab = eng.tokenizer.vocab_size
        prompt = spread_ids(vocab, args.prompt_tokens)
        eng.generate(prompt[:8], 2)
        timed.calls.clear()
        t = time.perf_counter()
        next(eng.stream(prompt, 2))
        prefill_s = time.perf_counter() - t
    finally:
        eng.close()
    first = summary([c for c in timed.calls if c[2] > 0])
    later = summary([c for c in timed.calls if c[2] == 0])
    doc = {"meta": run_meta(args), "prefill_s": prefill_s, "with_first_fills": first, "later_fills_only": later}
    md = (
        f"prefill of {args.prompt_tokens} tokens: {prefill_s:.1f} s\n\n"
        "| pack calls | calls | segments | seconds | ms a segment |\n|---|---|---|---|---|\n"
        + "".join(
            f"| {label} | {s['calls']} | {s['segments']} | {s['seconds']:.2f} | {s['ms_per_segment']:.3f} |\n"
            for label, s in (("with a slot's first fill", first), ("later fills only", later))
        )
    )
    save_results(doc, md, args, "pack-fills")


if __name__ == "__main__":
    main()
