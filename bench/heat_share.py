"""How much of a layer's routing its hottest experts take, from the co-activation files' decode heat.

    python bench/heat_share.py                  # every coactivation_*.json in ../shared/routes (or --routes DIR)

The co-activation files (../shared/routes/README.md) hold, per MoE layer, in how many decode tokens each
expert was in the top-k ("heat"), with no time order: they cannot be replayed through a cache, but they say
what a cache that keeps a layer's hottest experts would hit. For each file and each share of the experts
(--shares), the share of a layer's activations its hottest experts take: the median and min-max over the
layers, beside a uniform router's (the share itself). The hottest are ranked on the same tokens they are
scored on (in-sample): an upper bound for a cache pinned by a profile, not for LRU, which also profits from
consecutive tokens reusing experts.

With --routes-out, it also writes a route file (.npz, [tokens, layers, top_k] per sample) drawn from one
file's heat (--draw-from): each token's experts in each layer drawn without repeats in proportion to the
layer's heat, every token independently. Those routes carry the real skew but none of the reuse between
consecutive tokens, so a cache hits less on them than on the real routing: for `--route-trace` runs beside
a synthetic router's.

Writes bench/results/<date>-<name>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics

import numpy as np
from harness import log, read_heat, results_path, shared_routes_dir, write_json


def layer_heat(path: str) -> tuple[np.ndarray, dict]:
    """[layers, experts] decode heat of a co-activation file, and what the file says of itself (its top-k)."""
    heat, doc = read_heat(path)
    if not isinstance(doc.get("k"), int):
        raise SystemExit(f"error: {path} does not say its top-k ('k'); is it a co-activation file?")
    return heat, {k: doc[k] for k in ("artifact", "source_trace", "k", "profile_rows") if k in doc}


def hottest_shares(heat: np.ndarray, shares: list[float]) -> dict[str, dict[str, float]]:
    """Per share of experts: the median, min and max over layers of the activations the hottest take."""
    ranked = -np.sort(-heat, axis=1)
    totals = ranked.sum(axis=1)
    out = {}
    for s in shares:
        n = max(1, round(s * heat.shape[1]))
        took = ranked[:, :n].sum(axis=1) / np.where(totals > 0, totals, 1)
        took = took[totals > 0]
        out[f"{s:g}"] = {"experts": n, "median": float(statistics.median(took)), "min": float(took.min()),
                         "max": float(took.max())}  # fmt: skip
    return out


def draw_routes(heat: np.ndarray, top_k: int, samples: int, tokens: int, seed: int) -> dict[str, np.ndarray]:
    """Samples of [tokens, layers, top_k] expert ids, each token's drawn in proportion to the heat."""
    rng = np.random.default_rng(seed)
    p = (heat + 1e-9) / (heat + 1e-9).sum(axis=1, keepdims=True)  # an expert never seen keeps a tiny chance
    out = {}
    for i in range(samples):
        a = np.empty((tokens, heat.shape[0], top_k), np.int16)
        for layer in range(heat.shape[0]):
            for t in range(tokens):
                a[t, layer] = rng.choice(heat.shape[1], top_k, replace=False, p=p[layer])
        out[f"heat-{i}"] = a
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--routes", default=shared_routes_dir())
    ap.add_argument("--shares", default="0.1,0.25,0.5", help="shares of a layer's experts (default 0.1,0.25,0.5)")
    ap.add_argument("--results-dir", default=os.path.join(here, "results"))
    ap.add_argument("--name", default="heat-share")
    ap.add_argument("--draw-from", default="coactivation_glm52_overlay.json", help="the file --routes-out draws from")
    ap.add_argument("--routes-out", help="write routes drawn from --draw-from's heat to this .npz")
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    shares = [float(x) for x in args.shares.split(",")]
    files = sorted(glob.glob(os.path.join(args.routes, "coactivation_*.json")))
    if not files:
        raise SystemExit(f"error: no coactivation_*.json in {args.routes}; pass --routes DIR")
    models = {}
    lines = ["| file | layers x experts, top-k | decode tokens | " + " | ".join(f"hottest {s:.0%}" for s in shares)
             + " |", "|---|---|---|" + "---|" * len(shares)]  # fmt: skip
    for path in files:
        heat, about = layer_heat(path)
        k = about["k"]
        took = hottest_shares(heat, shares)
        tokens = round(float(np.median(heat.sum(axis=1))) / k)
        name = os.path.basename(path)
        models[name] = {"about": about, "layers": heat.shape[0], "experts": heat.shape[1], "top_k": k,
                        "decode_tokens": tokens, "hottest": took}  # fmt: skip
        cells = [f"{100 * t['median']:.1f}% ({100 * t['min']:.1f}-{100 * t['max']:.1f}) vs {100 * s:.0f}%"
                 for s, t in zip(shares, took.values(), strict=True)]  # fmt: skip
        lines.append(f"| `{name}` | {heat.shape[0]} x {heat.shape[1]}, {k} | {tokens} | " + " | ".join(cells) + " |")
    md = "\n".join(["### The hottest experts' share of a layer's decode activations (median over layers)", "", *lines])
    if args.routes_out:
        heat, about = layer_heat(os.path.join(args.routes, args.draw_from))
        drawn = draw_routes(heat, about["k"], args.samples, args.tokens, args.seed)
        np.savez_compressed(args.routes_out, **drawn)
        log(f"routes: {args.routes_out} ({args.samples} samples of {args.tokens} tokens from {args.draw_from})")
    path = results_path(args.results_dir, args.name)
    write_json(path, {"what": "hottest experts' share of decode activations, per co-activation file",
                      "shares": shares, "models": models, "markdown": md})  # fmt: skip
    print(md)
    log(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
