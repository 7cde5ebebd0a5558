"""A prompt span's routed experts, their inputs gathered per expert against read from one quantization.

    python bench/moe_inputs_ab.py --tokens 2048 --threads 2

One MoE layer of the Qwen3.6-35B-A3B shape by default (256 experts of 512, hidden 2048, 8 a token; gate/up
Q4_K, down Q6_K; random weights in RAM), a span of --tokens tokens routed at random, run in batches of at
most SWIGLU_MAX_ROWS rows as models/moe.run_experts runs them, two ways, alternating call by call (the order
swapped every round):

- gathered: each batch's rows copied out of x (one torch gather), then quantized per (token, expert) row in
  the native call (what run_experts did before);
- prepared: x quantized once for the span (linear.PreparedRows), each batch's rows copied from it by the
  native call (linear.RowsOf).

Reports the median (min-max) over rounds of gathered / prepared (above 1: prepared is faster), each arm's
median milliseconds, and whether both give the same bits. Writes bench/results/<date>-<name>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics

import numpy as np
import torch
from gguf import GGMLQuantizationType
from harness import add_results_args, alternate, log, median_range, save_rows

from moestream.compute import linear, native
from moestream.formats import quants
from moestream.models.moe import row_batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--gate-up-type", default="Q4_K")
    ap.add_argument("--down-type", default="Q6_K")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=11)
    add_results_args(ap, "moe-inputs-ab")
    args = ap.parse_args()
    if min(args.tokens, args.experts, args.top_k, args.rounds, args.threads) < 1 or args.top_k > args.experts:
        raise SystemExit("moe_inputs_ab: --tokens, --experts, --top-k (at most --experts), --rounds, --threads >= 1")
    if not native.lane_ok():
        raise SystemExit("moe_inputs_ab: this CPU runs no lane kernels (they need AVX-512 VNNI, or AVX2 + FMA + F16C)")
    native.set_threads(args.threads)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    h, f = args.hidden, args.ffn
    gt, dt = GGMLQuantizationType[args.gate_up_type], GGMLQuantizationType[args.down_type]
    experts = [
        (linear.from_gguf(quants.random_gguf(gt, 2 * f * h, rng), gt, 2 * f, h, False), None,
         linear.from_gguf(quants.random_gguf(dt, h * f, rng), dt, h, f, False))
        for _ in range(args.experts)
    ]  # fmt: skip
    x = torch.from_numpy(rng.standard_normal((args.tokens, h)).astype(np.float32))
    ids = np.stack([rng.choice(args.experts, args.top_k, replace=False) for _ in range(args.tokens)])
    order = np.argsort(ids.reshape(-1), kind="stable")
    counts = np.bincount(ids.reshape(-1), minlength=args.experts).tolist()
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rows = [order[s : s + n] // args.top_k for s, n in zip(starts, counts, strict=True)]
    groups = [[e for e, _ in b] for b in row_batches([(e, None) for e in range(args.experts)], dict(enumerate(counts)))]
    outs = {arm: [torch.empty(n, h) for n in counts] for arm in ("gathered", "prepared")}

    def gathered() -> None:
        for g in groups:
            xs = list(x[torch.from_numpy(np.concatenate([rows[e] for e in g]))].split([counts[e] for e in g]))
            linear.lane_swiglu([experts[e] for e in g], xs, [outs["gathered"][e] for e in g])

    def prepared() -> None:
        prep = linear.PreparedRows(x)
        for g in groups:
            linear.lane_swiglu([experts[e] for e in g], linear.RowsOf(prep, [rows[e] for e in g]),
                               [outs["prepared"][e] for e in g])  # fmt: skip

    times = alternate({"gathered": gathered, "prepared": prepared}, args.rounds)
    same = all(
        torch.equal(a.view(torch.int32), b.view(torch.int32))
        for a, b in zip(outs["gathered"], outs["prepared"], strict=True)
    )
    ratios = [a / b for a, b in zip(times["gathered"], times["prepared"], strict=True)]
    types = f"{args.gate_up_type}/{args.down_type}"
    name = f"{args.tokens} tokens, {args.experts} experts of {f} (top {args.top_k}), {types}"
    lines = [
        f"{args.threads} threads, {args.rounds} rounds, one MoE layer's routed experts",
        "",
        "| case | gathered/prepared (median, min-max over rounds) | gathered ms | prepared ms | same bits |",
        "|---|---|---|---|---|",
        f"| {name} | {median_range(ratios, 3)}x | {statistics.median(times['gathered']) * 1e3:.1f} | "
        f"{statistics.median(times['prepared']) * 1e3:.1f} | {'yes' if same else 'NO'} |",
    ]
    log(f"{name}: {statistics.median(ratios):.3f}x, same bits: {same}")
    args.model = os.devnull  # random weights: no model file
    save_rows(args, [{"case": name, **{f"{a}_s": t for a, t in times.items()}, "same_bits": same}], lines)


if __name__ == "__main__":
    main()
