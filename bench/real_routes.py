"""Expert cache policies replayed on real routing, at the RAM budgets people have.

    python bench/real_routes.py                       # reads ../shared/routes (or --routes DIR); a few minutes

For each real trace (analysis/route_files.py reads them: GPT-OSS-20B's 532 generated samples, Qwen3-30B-A3B
at top-6 and GPT-OSS-120B at top-2, one prompt each) the replay (moestream.analysis.replay: the engine's own
SlotPolicy) runs LRU (the engine's), LFU with decay, S3-FIFO, profile pins + LRU and Belady (the bound) at
the cache sizes the budgets buy, with the same replay of a uniform trace of the same shape and lengths (what
a synthetic model's routing gives: the floor) beside them.

Budget -> slots: (budget - the model's resident bytes - 1 GiB for KV, compute buffers and the runtime) /
the bytes one expert reads, from the shapes moestream.synth knows at the published files' quants (the files
are not written). The engine's own plan (streaming/budget.py) splits a budget more finely; this is its
first-order part. Capacity is global (one pool), as in the engine; the prompt's accesses warm the cache.

GPT-OSS-20B: to keep a replay to seconds, every third sample the source does not flag for repetition is
replayed (one request each, the cache carried across them as a server carries it); the pinned profile comes
from the other samples. Qwen3-30B's pins come from the counts file (75k decode tokens of another run, at
top-8); GPT-OSS-120B has no second source, so its pins rank the replayed trace's own counts (an oracle).
Results: bench/results/<date>-real-routes.json and .png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import read_heat, shared_routes_dir, write_json  # noqa: E402
from moestream.analysis.accesses import accesses_from_trace  # noqa: E402
from moestream.analysis.replay import replay  # noqa: E402
from moestream.analysis.route_files import RouteSample, RouteSet, read_routes, route_meta, route_rows  # noqa: E402
from moestream.synth.shapes import shape_routing  # noqa: E402

GIB, GB = 1 << 30, 10**9
POLICIES = ("lru", "lfu-decay", "s3fifo", "pin+lru", "belady")
# model: (synth shape, quant of the published files, source, budgets in GB)
MODELS = {
    "GPT-OSS-20B": ("gpt-oss-20b", "MXFP4", "gpt-oss-20b.npz", (4, 5, 6, 7, 8)),
    "Qwen3-30B-A3B": ("qwen3-30b-a3b", "Q4_K_M", "qwen3-30b-a3b-top6.route.csv", (6, 8, 10, 12)),
    "GPT-OSS-120B": ("gpt-oss-120b", "MXFP4", "gpt-oss-120b-top2.route.csv", (16, 20, 24, 28, 32)),
}
PUBLISHED = {"Qwen3-30B-A3B": [(0.12, 0.53), (0.24, 0.76)]}  # share of experts cached -> hit rate, published


def uniform_like(rs: RouteSet, seed: int = 0) -> RouteSet:
    """A random trace of the same shape and lengths: each token's experts drawn uniformly without replacement."""
    rng = np.random.default_rng(seed)

    def draw(n: int) -> np.ndarray:
        keys = rng.random((n, rs.n_layers, rs.n_experts))
        return np.argsort(keys, axis=-1)[..., : rs.top_k].astype(np.int16)

    samples = [RouteSample(draw(len(s.decode)), draw(len(s.prompt))) for s in rs.samples]
    return RouteSet(samples, rs.n_layers, rs.n_experts, rs.top_k, rs.expert_bytes, {"source": "uniform"})


def _gpt_oss_20b(path: str) -> tuple[RouteSet, list[tuple[int, int]]]:
    rs = read_routes(path)
    with open(os.path.splitext(path)[0] + ".json", encoding="utf-8") as f:
        clean = [i for i, e in enumerate(json.load(f)) if not e["has_repetition"]]
    replayed = set(clean[::3])
    keep = [rs.samples[i] for i in sorted(replayed)]
    rest = np.concatenate([s.decode for i, s in enumerate(rs.samples) if i not in replayed])
    profile = _rank(rest, rs.n_experts)
    return RouteSet(keep, rs.n_layers, rs.n_experts, rs.top_k, meta=rs.meta), profile


def _rank(routes: np.ndarray, n_experts: int) -> list[tuple[int, int]]:
    """(layer, expert) by decode use, most used first."""
    L = routes.shape[1]
    keys = (np.arange(L)[None, :, None] * n_experts + routes).reshape(-1)
    counts = np.bincount(keys, minlength=L * n_experts)
    order = np.argsort(-counts, kind="stable")
    return [(int(k // n_experts), int(k % n_experts)) for k in order]


def _heat_profile(path: str) -> list[tuple[int, int]]:
    heat, _ = read_heat(path)
    order = np.argsort(-heat.reshape(-1), kind="stable")
    E = heat.shape[1]
    return [(int(k // E), int(k % E)) for k in order]


def budget_slots(info: dict, budgets: tuple[int, ...]) -> dict[int, int]:
    return {b: int((b * GB - info["dense_bytes"] - GIB) // info["expert_bytes"]) for b in budgets}


def _replays(rs: RouteSet, slots: list[int], profile, policies) -> dict[str, list[dict]]:
    acc = accesses_from_trace(route_meta(rs), route_rows(rs))
    out: dict[str, list[dict]] = {}
    for p in policies:
        out[p] = []
        for s in slots:
            r = replay(acc, p, s, profile=profile if p.startswith("pin") else None)
            out[p].append({"slots": s, "hit_rate": round(r.hit_rate, 4), "decode_hits": r.decode_hits,
                           "decode_misses": r.decode_misses})  # fmt: skip
            print(f"  {p:9s} {s:6d} slots: {100 * r.hit_rate:5.1f}%", file=sys.stderr)
    return out


def run_model(name: str, routes_dir: str) -> dict:
    shape, quant, source, budgets = MODELS[name]
    info = shape_routing(shape, quant)
    path = os.path.join(routes_dir, source)
    if name == "GPT-OSS-20B":
        rs, profile = _gpt_oss_20b(path)
    else:
        rs = read_routes(path)
        profile = _rank(rs.samples[0].decode, rs.n_experts)
        heat = os.path.join(routes_dir, "coactivation_qwen3-30b-a3b.json")
        if name == "Qwen3-30B-A3B" and os.path.exists(heat):
            profile = _heat_profile(heat)
    total = rs.n_layers * rs.n_experts
    by_budget = budget_slots(info, budgets)
    extra = [round(f * total) for f, _ in PUBLISHED.get(name, [])]
    slots = sorted({*by_budget.values(), *extra, *(round(f * total) for f in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6))})
    slots = [s for s in slots if rs.top_k * rs.n_layers <= s < total]
    print(f"{name}: {len(rs.samples)} samples, {rs.decode_tokens} decode tokens, slots {slots}", file=sys.stderr)
    return {
        "source": source,
        "shape": shape,
        "quant": quant,
        "sizes": info,
        "samples": len(rs.samples),
        "decode_tokens": rs.decode_tokens,
        "experts_total": total,
        "budget_slots": {f"{b} GB": s for b, s in by_budget.items()},
        "published": [{"share": f, "hit_rate": h, "slots": round(f * total)} for f, h in PUBLISHED.get(name, [])],
        "real": _replays(rs, slots, profile, POLICIES),
        "uniform": _replays(uniform_like(rs), slots, None, ("lru", "belady")),
    }


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5))
    for ax, (name, r) in zip(np.atleast_1d(axes), results.items(), strict=True):
        total = r["experts_total"]
        for p, rows in r["real"].items():
            ax.plot([100 * x["slots"] / total for x in rows], [100 * x["hit_rate"] for x in rows], "o-", label=p)
        for p, rows in r["uniform"].items():
            xs = [100 * x["slots"] / total for x in rows]
            ax.plot(xs, [100 * x["hit_rate"] for x in rows], "k--" if p == "lru" else "k:", label=f"uniform {p}")
        for b, s in r["budget_slots"].items():
            ax.axvline(100 * s / total, color="0.85", lw=0.8)
            ax.text(100 * s / total, 2, b, rotation=90, fontsize=7, color="0.4")
        for i, x in enumerate(r["published"]):
            ax.plot(100 * x["share"], 100 * x["hit_rate"], "r*", ms=12, label=None if i else "published")
        ax.set(title=f"{name} ({r['samples']} samples, {r['decode_tokens']} tokens)", xlabel="cache, % of experts",
               ylabel="decode hit rate %", ylim=(0, 100))  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--routes", default=shared_routes_dir())
    ap.add_argument("--out", default=os.path.join(here, "results", f"{datetime.date.today()}-real-routes"))
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args()
    results = {name: run_model(name, args.routes) for name in args.models.split(",")}
    write_json(args.out + ".json", {"what": "replayed hit rates on real routing", "models": results})
    plot(results, args.out + ".png")
    print(f"{args.out}.json, {args.out}.png", file=sys.stderr)


if __name__ == "__main__":
    main()
