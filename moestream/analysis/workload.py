"""What a trace says about the workload, before any policy: the route-overlap analysis of
an expert-streaming pager built on llama.cpp.

U(k)          distinct experts per layer over k consecutive decode tokens. A k-token batch (speculative
              decoding, several users at once) reads U(k) experts per layer instead of k * top_k: the read
              saving is 1 - U(k) / (k * top_k).
reuse         for each decode access, how many decode tokens ago the same (layer, expert) was last used.
singletons    share of the accesses in a W-token window whose (layer, expert) occurs only once in it: what
              an admission rule like min-hits could keep out of the cache.
per-layer     hit rates the engine observed (from each row's source), decode and prompt.
coverage      share of decode accesses the N most used (layer, expert) pairs serve: the best a static
              pin of N slots could do.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from moestream.analysis.trace import DECODE, DISK, PROMPT

REUSE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # upper bounds, in decode tokens


def slot_ladder(lowest: int, total: int, meta: dict[str, Any]) -> list[int]:
    """Cache sizes worth a look: powers of two from `lowest` up to `total` experts, `total`, and the size the
    trace was recorded at (its n_slots), if any."""
    out = []
    n = lowest
    while n < total:
        out.append(n)
        n *= 2
    out.append(total)
    if meta.get("n_slots"):
        out.append(int(meta["n_slots"]))
    return sorted(set(out))


def _decode_view(meta: dict[str, Any], rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Decode rows as (token index 0.., key), and the number of experts per layer and of decode tokens."""
    dec = rows[rows["phase"] == DECODE]
    n_experts = max(int(meta.get("experts") or 1), int(rows["expert"].max()) + 1 if len(rows) else 1)
    steps, tok = np.unique(dec["step"], return_inverse=True)
    keys = dec["layer"].astype(np.int64) * n_experts + dec["expert"]
    return tok.astype(np.int64), keys, n_experts, len(steps)


def u_of_k(
    tok: np.ndarray, keys: np.ndarray, n_tokens: int, n_experts: int, ks: tuple[int, ...]
) -> list[dict[str, float]]:
    """Mean distinct experts per (layer, k-token window) over whole windows, and the read saving."""
    out = []
    for k in ks:
        n_win = n_tokens // k
        if n_win == 0:
            continue
        keep = tok < n_win * k
        win = tok[keep] // k
        layer = keys[keep] // n_experts
        distinct = len(np.unique(win * (1 << 40) + keys[keep]))
        groups = len(np.unique(win * (1 << 20) + layer))
        accesses = int(keep.sum())
        u = distinct / groups
        out.append(
            {
                "k": k,
                "windows": int(n_win),
                "U": u,
                "per_token": u / k,
                "saving": 1.0 - distinct / accesses if accesses else 0.0,
            }
        )
    return out


def reuse_distances(tok: np.ndarray, keys: np.ndarray) -> dict[str, Any]:
    """Histogram of decode-token gaps between consecutive uses of the same key."""
    order = np.lexsort((tok, keys))
    k, t = keys[order], tok[order]
    same = k[1:] == k[:-1]
    gaps = (t[1:] - t[:-1])[same]
    first = len(keys) - len(gaps)
    edges = [1, *(hi + 1 for hi in REUSE_BUCKETS), np.iinfo(np.int64).max]  # gaps are >= 1
    counts = np.histogram(gaps, bins=edges)[0] if len(gaps) else np.zeros(len(edges) - 1, int)
    labels = []
    lo = 1
    for hi in REUSE_BUCKETS:
        labels.append(str(hi) if lo == hi else f"{lo}-{hi}")
        lo = hi + 1
    labels.append(f">{REUSE_BUCKETS[-1]}")
    total = max(len(keys), 1)
    hist = [{"tokens": lab, "accesses": c, "share": c / total} for lab, c in zip(labels, counts.tolist(), strict=True)]
    hist.append({"tokens": "first use", "accesses": int(first), "share": first / total})
    return {"median": float(np.median(gaps)) if len(gaps) else None, "histogram": hist}


def singletons(tok: np.ndarray, keys: np.ndarray, window: int) -> dict[str, Any]:
    """Share of accesses whose key appears once in its `window`-token window."""
    if not len(keys):
        return {"window": window, "share": 0.0}
    win = tok // window
    _, inverse, counts = np.unique(win * (1 << 40) + keys, return_inverse=True, return_counts=True)
    single = counts[inverse] == 1
    return {"window": window, "share": float(single.mean()), "accesses": int(single.sum())}


def per_layer_hits(rows: np.ndarray, n_layers: int) -> list[dict[str, Any]]:
    out = []
    for layer in range(n_layers):
        r = rows[rows["layer"] == layer]
        entry: dict[str, Any] = {"layer": layer}
        for name, code in (("decode", DECODE), ("prompt", PROMPT)):
            p = r[r["phase"] == code]
            entry[f"{name}_accesses"] = len(p)
            entry[f"{name}_hit_rate"] = float((p["source"] != DISK).mean()) if len(p) else None
        out.append(entry)
    return out


def coverage(keys: np.ndarray, sizes: list[int]) -> dict[str, Any]:
    """Share of accesses served by the top-N keys, for each N, and the N that reaches given shares."""
    if not len(keys):
        return {"distinct": 0, "top": [], "slots_for": {}}
    counts = np.sort(np.unique(keys, return_counts=True)[1])[::-1]
    cum = np.cumsum(counts) / counts.sum()
    top = [{"n": n, "share": float(cum[min(n, len(cum)) - 1])} for n in sizes if n >= 1]
    slots_for = {f"{round(100 * s)}%": int(np.searchsorted(cum, s - 1e-12) + 1) for s in (0.5, 0.8, 0.9, 0.95, 0.99)}
    return {"distinct": len(counts), "top": top, "slots_for": slots_for}


def workload_stats(
    meta: dict[str, Any],
    rows: np.ndarray,
    ks: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
    window: int = 48,
    top_n: list[int] | None = None,
) -> dict[str, Any]:
    """All of the above as one JSON-ready dict."""
    tok, keys, n_experts, n_tokens = _decode_view(meta, rows)
    n_layers = max(int(meta.get("layers") or 0), int(rows["layer"].max()) + 1 if len(rows) else 0)
    dec = rows[rows["phase"] == DECODE]
    top_k = int(meta.get("top_k") or (round(len(dec) / max(1, n_tokens * n_layers)) if n_tokens else 0))
    total_keys = n_layers * n_experts
    if top_n is None:
        top_n = slot_ladder(1 << max(0, int(np.log2(max(1, top_k * n_layers)))), total_keys, meta)
    expert_bytes = int(meta.get("expert_bytes") or (dec["bytes"].max() if len(dec) else 0))
    u = u_of_k(tok, keys, n_tokens, n_experts, ks)
    for row in u:
        row["mb_per_token"] = row["per_token"] * n_layers * expert_bytes / 1e6
    rows_decode_hits = float((dec["source"] != DISK).mean()) if len(dec) else None
    prompt = rows[rows["phase"] == PROMPT]
    return {
        "meta": meta,
        "decode_tokens": n_tokens,
        "decode_accesses": len(dec),
        "prompt_accesses": len(prompt),
        "layers": n_layers,
        "experts": n_experts,
        "top_k": top_k,
        "expert_bytes": expert_bytes,
        "decode_hit_rate": rows_decode_hits,
        "prompt_hit_rate": float((prompt["source"] != DISK).mean()) if len(prompt) else None,
        "decode_mb_per_token": float(dec["bytes"].sum() / 1e6 / n_tokens) if n_tokens else 0.0,
        "u_of_k": u,
        "reuse": reuse_distances(tok, keys),
        "singletons": singletons(tok, keys, window),
        "per_layer": per_layer_hits(rows, n_layers),
        "coverage": coverage(keys, top_n),
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def format_report(s: dict[str, Any]) -> str:
    """The stats as text for a terminal."""
    m = s["meta"]
    lines = [
        f"trace: {m.get('model', '?')}, {s['layers']} layers x {s['experts']} experts, top-{s['top_k']}, "
        f"{m.get('n_slots', '?')} slots ({m.get('policy', '?')})",
        f"decode: {s['decode_tokens']} tokens, {s['decode_accesses']} accesses, hit rate "
        f"{_pct(s['decode_hit_rate'])}, {s['decode_mb_per_token']:.1f} MB/token read | prompt: "
        f"{s['prompt_accesses']} accesses, hit rate {_pct(s['prompt_hit_rate'])}",
        "",
        "U(k): distinct experts per layer over k decode tokens (a k-token batch reads U(k), not k*top_k)",
        f"  {'k':>4} {'U(k)':>8} {'per token':>10} {'saving':>8} {'MB/token':>9} {'windows':>8}",
    ]
    for r in s["u_of_k"]:
        lines.append(
            f"  {r['k']:>4} {r['U']:>8.2f} {r['per_token']:>10.2f} {100 * r['saving']:>7.1f}% "
            f"{r['mb_per_token']:>9.1f} {r['windows']:>8}"
        )
    reuse = s["reuse"]
    lines += ["", f"reuse distance: decode tokens since the same expert was last used (median {reuse['median']})"]
    for h in reuse["histogram"]:
        lines.append(f"  {h['tokens']:>10} {h['accesses']:>9} {100 * h['share']:>6.1f}%")
    sg = s["singletons"]
    lines += [
        "",
        f"singletons: {100 * sg['share']:.1f}% of accesses use an expert only once in their "
        f"{sg['window']}-token window (what min-hits admission could keep out)",
    ]
    cov = s["coverage"]
    lines += ["", f"coverage of the N most used experts ({cov['distinct']} distinct used)"]
    for t in cov["top"]:
        lines.append(f"  top {t['n']:>7}: {100 * t['share']:5.1f}% of decode accesses")
    lines.append("  slots needed for " + ", ".join(f"{k}: {v}" for k, v in cov["slots_for"].items()))
    lines += ["", "per-layer hit rates (as recorded)", f"  {'layer':>5} {'decode':>8} {'prompt':>8}"]
    for p in s["per_layer"]:
        lines.append(f"  {p['layer']:>5} {_pct(p['decode_hit_rate']):>8} {_pct(p['prompt_hit_rate']):>8}")
    return "\n".join(lines)


def to_json(s: dict[str, Any]) -> str:
    return json.dumps(s, indent=1)
