"""Skewed multi-topic routes: the workload, and the expert cache's tiers (profile pins, LRU, prompt admission)
replayed and run on it.

    python bench/skewed_routes.py                                   # replay only (seconds), Qwen3-30B-A3B shape
    python bench/skewed_routes.py --live /tmp/models/q30-l8.gguf    # + live runs driven by the same routes

The workload (also what batch_serving.py's `routes` conditions and gpt_oss_units.py's `routes` use). Random
weights route almost uniformly, so the routes are synthetic, built to have what recorded chat traces have: per
topic and layer, a skewed expert popularity (Zipf with exponent --zipf over a topic-specific permutation of the
experts) from which each token draws its top-k without replacement (Gumbel top-k: exact sampling). Different
topics use different permutations, so a topic's hot experts are mostly cold in another. A profile is made from
a separate sample of topic A (the "profiled workload"); the session then runs topics A, B, C in turn, each a
prompt of --prompt tokens (micro-batches of --ubatch: one fetch per layer holding the union of its tokens'
experts) followed by --decode tokens.

Replay (moestream.analysis.replay, the engine's own cache semantics) gives per-topic decode hit rates and disk MB
per token for: `pin` (profile-only: every slot but top-k pinned from the profile), `pin+lru` (half the
slots pinned, an LRU fed by decode misses for the rest), `lru`. And, for LRU and pin+LRU, prompt
admission on (the prompt's misses enter the LRU) vs off (served from scratch slots: the decode LRU is
untouched by the prompt).

Live (--live MODEL): `moestream run --route-trace` replays the same session's routing on a real GGUF
(a one-word prompt, then every token of the session decoded one by one), in the three tier settings
at one --ram-budget-mb, each with --trace so per-topic hit rates come from the engine's own records.
Results: bench/results/<date>-tiers-ab.json (the name the earlier rounds' files have).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from harness import RESULTS_DIR, write_json

from moestream.analysis.profile import Profile, write_profile
from moestream.analysis.replay import Accesses, accesses_from_groups, accesses_from_trace, replay
from moestream.analysis.trace import TraceWriter, read_trace
from moestream.formats.gguf_model import GGUFModel

TOPICS = "ABC"


def topic_popularity(n_layers: int, n_experts: int, zipf: float, seed: int) -> np.ndarray:
    """log-popularity [n_layers, n_experts] of one topic: Zipf by rank over a random permutation per layer."""
    rng = np.random.default_rng(seed)
    logp = -zipf * np.log(np.arange(1, n_experts + 1))
    return np.stack([logp[np.argsort(rng.permutation(n_experts))] for _ in range(n_layers)])


def draw_routes(pop: np.ndarray, n_tokens: int, top_k: int, rng: np.random.Generator) -> np.ndarray:
    """[n_tokens, n_layers, top_k] expert ids, each token's k drawn without replacement ~ popularity."""
    n_layers, n_experts = pop.shape
    g = pop[None] + rng.gumbel(size=(n_tokens, n_layers, n_experts))
    idx = np.argpartition(-g, top_k - 1, axis=-1)[..., :top_k]
    # rank order = descending score, as a router's top-k
    order = np.argsort(-np.take_along_axis(g, idx, -1), axis=-1)
    return np.take_along_axis(idx, order, -1)


def session(args, pops: dict[str, np.ndarray], rng) -> list[tuple[str, str, np.ndarray]]:
    """[(topic, 'prompt'|'decode', routes [T, L, k])] in order."""
    out = []
    for t in TOPICS:
        out.append((t, "prompt", draw_routes(pops[t], args.prompt, args.top_k, rng)))
        out.append((t, "decode", draw_routes(pops[t], args.decode, args.top_k, rng)))
    return out


def to_accesses(parts, n_layers: int, n_experts: int, ubatch: int, expert_bytes: int, upto: int) -> Accesses:
    """Fetch groups of the first `upto` parts, as the engine issues them."""
    groups, decode, layers = [], [], []
    for _topic, kind, routes in parts[:upto]:
        if kind == "prompt":
            for c0 in range(0, len(routes), ubatch):
                chunk = routes[c0 : c0 + ubatch]
                for layer in range(n_layers):
                    groups.append([layer * n_experts + int(e) for e in np.unique(chunk[:, layer])])
                    decode.append(False)
                    layers.append(layer)
        else:
            for tok in routes:
                for layer in range(n_layers):
                    groups.append([layer * n_experts + int(e) for e in tok[layer]])
                    decode.append(True)
                    layers.append(layer)
    return accesses_from_groups(groups, decode, layers, n_experts=n_experts, expert_bytes=expert_bytes)


def profile_from(routes: np.ndarray) -> list[tuple[int, int]]:
    n_tokens, n_layers, _k = routes.shape
    counts: dict[tuple[int, int], int] = {}
    for layer in range(n_layers):
        ids, c = np.unique(routes[:, layer], return_counts=True)
        for e, n in zip(ids.tolist(), c.tolist(), strict=True):
            counts[(layer, e)] = n
    return sorted(counts, key=lambda key: (-counts[key], key))


def replay_part(args, parts, profile, n_layers, n_experts, expert_bytes) -> dict:
    """Per-topic decode hit rate and MB/token per setting, by replaying growing prefixes of the session."""
    settings = {
        "lru": dict(policy="lru", admission="all"),
        "lru, prompt not admitted": dict(policy="lru", admission="decode-only"),
        "profile only (pin)": dict(policy="pin", admission="all"),
        "profile + lru (pin+lru 0.5)": dict(policy="pin+lru", admission="all", pin_fraction=0.5),
        "profile + lru, prompt not admitted": dict(policy="pin+lru", admission="decode-only", pin_fraction=0.5),
    }
    out: dict[str, dict] = {}
    for name, kw in settings.items():
        prev_hits = prev_miss = prev_bytes = 0
        per_topic = {}
        for i, topic in enumerate(TOPICS):
            acc = to_accesses(parts, n_layers, n_experts, args.ubatch, expert_bytes, upto=2 * (i + 1))
            r = replay(acc, kw["policy"], args.slots, admission=kw["admission"],
                       pin_fraction=kw.get("pin_fraction", 0.5), profile=profile)  # fmt: skip
            hits, miss, nbytes = r.decode_hits - prev_hits, r.decode_misses - prev_miss, r.decode_bytes - prev_bytes
            prev_hits, prev_miss, prev_bytes = r.decode_hits, r.decode_misses, r.decode_bytes
            per_topic[topic] = {
                "hit_rate": hits / max(1, hits + miss),
                "mb_per_token": nbytes / 1e6 / args.decode,
            }
        total_tok = args.decode * len(TOPICS)
        out[name] = {
            "per_topic": per_topic,
            "hit_rate": r.decode_hits / max(1, r.decode_hits + r.decode_misses),
            "mb_per_token": r.decode_bytes / 1e6 / total_tok,
        }
        print(
            f"  {name:38s} "
            + "  ".join(f"{t}: {v['hit_rate']:6.1%} {v['mb_per_token']:7.1f} MB/tok" for t, v in per_topic.items())
            + f"  | all {out[name]['hit_rate']:6.1%}",
            flush=True,
        )
    return out


def write_route_trace(path: str, parts, n_layers: int, n_experts: int, top_k: int) -> int:
    """The session's tokens in order as a decode-only trace: what --route-trace replays."""
    step = 0
    with TraceWriter(path, {"layers": n_layers, "experts": n_experts, "top_k": top_k, "synthetic": True}) as w:
        for _topic, _kind, routes in parts:
            for tok in routes:
                for layer in range(n_layers):
                    for rank, e in enumerate(tok[layer]):
                        w.record(step, "decode", step, layer, int(e), rank, "ram", 0, 0.0)
                step += 1
    return step


def live_part(args, parts, profile, n_layers: int, n_experts: int) -> dict:
    from moestream.engine.planning import budget_for_slots  # heavy import: only for live runs

    tmp = Path(tempfile.mkdtemp(prefix="tiers-ab-"))
    routes_path = str(tmp / "routes.trace.csv")
    write_route_trace(routes_path, parts, n_layers, n_experts, args.top_k)
    prof_path = str(tmp / "profile.txt")
    write_profile(Profile([(layer, e, len(profile) - i) for i, (layer, e) in enumerate(profile)],
                          {"source": "synthetic topic A"}), prof_path)  # fmt: skip
    budget_mb = args.live_budget_mb or budget_for_slots(args.live, args.slots)
    # a one-word prompt, then the whole session decoded token by token (its prompts included: the replay
    # covers prompt micro-batches; live, every token's routing comes from the trace by position)
    n_decode = sum(len(r) for _t, _k, r in parts) - 4
    settings = {
        "lru": [],
        "profile only": ["--pin-profile", prof_path, "--pin-mb", str(args.pin_only_mb)],
        "profile + lru": ["--pin-profile", prof_path, "--pin-mb", str(args.pin_half_mb)],
    }
    results = {}
    for name, extra in settings.items():
        trace = str(tmp / f"live-{name.replace(' ', '')}.trace.csv")
        stats = str(tmp / f"live-{name.replace(' ', '')}.json")
        cmd = [sys.executable, "-m", "moestream", "run", "-m", args.live, "-p", "x",
               "-n", str(n_decode), "--ignore-eos", "--threads", str(args.threads), "--ram-budget-mb",
               str(budget_mb), "--route-trace", routes_path, "--trace", trace,
               "--stats-json", stats, *extra]  # fmt: skip
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            results[name] = {"error": proc.stderr.strip().splitlines()[-1:]}
            print(f"  {name}: failed: {results[name]['error']}", flush=True)
            continue
        st = json.loads(Path(stats).read_text())
        meta, rows = read_trace(trace)
        acc = accesses_from_trace(meta, rows, phases="decode")
        hits = np.add.reduceat(acc.live_hits.astype(np.int64), acc.starts[:-1])
        sizes = np.diff(acc.starts)
        # decode token d is session token prompt + d; parts alternate prompt/decode per topic
        ends = np.cumsum([len(r) for _t, _k, r in parts])
        # the prompt text may not tokenize to exactly args.prompt tokens: the engine says how many it was
        session_tok = int(st["prompt_tokens"]) + (acc.group_step - acc.group_step.min())
        topic_of_group = np.searchsorted(ends, session_tok, side="right") // 2
        per_topic = {}
        for ti, topic in enumerate(TOPICS):
            sel = topic_of_group == ti
            per_topic[topic] = {"hit_rate": int(hits[sel].sum()) / max(1, int(sizes[sel].sum()))}
        results[name] = {
            "decode_tps": st.get("decode_tps"),
            "hit_rate": st.get("hit_rate"),
            "mb_per_token": st.get("decode_mb_per_token"),
            "per_topic": per_topic,
            "wall_s": time.time() - t0,
            "args": extra,
        }
        print(
            f"  {name:16s} decode {st.get('decode_tps', 0):6.2f} tok/s, "
            f"{st.get('decode_mb_per_token', 0):6.1f} MB/tok, "
            + "  ".join(f"{t}: {v['hit_rate']:6.1%}" for t, v in per_topic.items()),
            flush=True,
        )
    return {"budget_mb": budget_mb, "decode_tokens": n_decode, "settings": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-mb", type=float, default=2.65, help="MB one expert reads (Q4_0 Qwen3-30B-A3B)")
    ap.add_argument("--slots", type=int, default=0, help="cache slots (default: a third of all experts)")
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--ubatch", type=int, default=128)
    ap.add_argument("--decode", type=int, default=256)
    ap.add_argument("--profile-tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--live", help="GGUF to run the session on (its layers/experts/top-k replace the shape args)")
    ap.add_argument("--live-budget-mb", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--results-dir", default=RESULTS_DIR)
    args = ap.parse_args()

    if args.live:
        f = GGUFModel(args.live)
        args.layers = int(f.arch_key("block_count"))
        args.experts = int(f.arch_key("expert_count"))
        args.top_k = int(f.arch_key("expert_used_count"))
        f.close()
    args.slots = args.slots or args.layers * args.experts // 3
    expert_bytes = int(args.expert_mb * 1e6)
    pops = {
        t: topic_popularity(args.layers, args.experts, args.zipf, args.seed * 100 + i) for i, t in enumerate(TOPICS)
    }
    rng = np.random.default_rng(args.seed)
    profile = profile_from(draw_routes(pops["A"], args.profile_tokens, args.top_k, rng))
    parts = session(args, pops, rng)
    print(f"replay: {args.layers} layers x {args.experts} experts, top-{args.top_k}, {args.slots} slots "
          f"({args.slots / (args.layers * args.experts):.0%} of the experts), zipf {args.zipf}; profile from topic A; "
          f"session A, B, C: {args.prompt}-token prompt + {args.decode} decoded tokens each", flush=True)  # fmt: skip
    result = {
        "meta": {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "args": vars(args)},
        "replay": replay_part(args, parts, profile, args.layers, args.experts, expert_bytes),
    }
    if args.live:
        slot_mb = expert_bytes / (1 << 20)
        args.pin_only_mb = int((args.slots - 2 * args.top_k) * slot_mb)
        args.pin_half_mb = int(args.slots // 2 * slot_mb)
        print(f"live: {args.live}", flush=True)
        result["live"] = live_part(args, parts, profile, args.layers, args.experts)
    os.makedirs(args.results_dir, exist_ok=True)
    out = Path(args.results_dir) / f"{time.strftime('%Y-%m-%d')}-tiers-ab.json"
    write_json(out, result)
    print(f"results: {out}")


if __name__ == "__main__":
    main()
