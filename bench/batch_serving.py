"""Batched serving: aggregate decode tok/s of N concurrent greedy streams against one stream, against the bound
the step's RAM reads set, and against llama.cpp's parallel sequences.

    python bench/batch_serving.py --model /tmp/models/q30-l8.gguf --conditions pagecache,routes \\
        --streams 1,4,8 --tokens 64 --repeat 3
    python bench/batch_serving.py --model /tmp/models/q30.gguf --conditions pressure --leave-gb 8 \\
        --streams 1,4 --tokens 32 --repeat 3 --llama

Each configuration (condition, N) is a fresh `moestream serve` process (--max-batch the largest N, so every
configuration of a condition plans the same budget) with --trace; N clients (the `openai` client, streaming,
temperature 0) are released together, each with a different prompt of --prompt-tokens token ids. Repeats
run the N values in alternating order. Conditions:

  pagecache  every expert cached: --budget-mb (default: the file plus 2 GiB) and, since serve has no
             --preload, a warm-up request whose --warm-tokens prompt routes to every expert before the clients
             start; the run's cache misses are recorded to show it held
  pressure   the balloon leaves --leave-gb GiB, caches are dropped before each server starts, the server gets
             --pressure-budget-mb (default leave - 1 GiB); a 8-token warm-up request only
  routes     pagecache with skewed multi-topic routing forced by a route trace (--route-trace): topic t is a
             Zipf (--zipf) popularity over its own permutation of each layer's experts (bench/skewed_routes.py's
             workload); routes follow positions, so stream i's prompt is i x (prompt + tokens) longer and
             its decoded tokens fall in topic i's part of the trace (the clients' times to first token
             are then not comparable with a lone client's)
  routes-shared  the same with every stream's part drawn from one topic: streams that share hot experts
  real       pressure with real routes (--real-routes: imported samples, those flagged for repetition
             skipped): serve --route-trace gives each request the next sample, so the warm-up takes the
             first and each client its own; the union of experts per step is set against the streams'
             demand (N x top-k a layer)

Per run: each stream's time to first token and own decode rate; the aggregate rate = tokens generated from
the moment every stream has its first token to the end of the last, over that time; from the trace, the
distinct experts each all-streams step fetched per layer and the bound: a step's RAM bytes (dense weights
once + the union's experts, sizes from the GGUF tensor table) give an aggregate speedup over one stream of
at most N x (1-stream bytes) / (N-stream bytes). Ratios are pair by pair: N streams over 1 stream of the same
repeat, measured/bound, the last of N clients' first token over a lone client's; --llama adds
bench/llamacpp_batched.py (N sequences, one token each per llama_decode) in the pressure condition.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np
from balloon import BalloonError
from engine_runs import condition_context, prepare
from harness import BENCH_DIR, GIB, MIB, add_results_args, cell, log, run_meta, save_results, spread
from serve_runs import (
    bound_speedup,
    complete,
    prompt_ids,
    read_sizes,
    run_streams,
    start_server,
    stop_server,
    union_stats,
)
from skewed_routes import draw_routes, topic_popularity, write_route_trace

from moestream.analysis.route_files import RouteSet, read_routes, write_routes
from moestream.formats.gguf_model import model_nbytes

CONDITIONS = ("pagecache", "pressure", "routes", "routes-shared", "real")
UNDER_BALLOON = ("pressure", "real")
LLAMA_BATCHED = os.path.join(BENCH_DIR, "llamacpp_batched.py")


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def prompt_lengths(args: argparse.Namespace, condition: str, n: int) -> list[int]:
    if not condition.startswith("routes"):
        return [args.prompt_tokens] * n
    span = args.prompt_tokens + args.tokens  # one topic's part of the route trace
    return [args.prompt_tokens + i * span for i in range(n)]


def make_route_trace(args: argparse.Namespace, path: str, shared: bool) -> None:
    """One part of --prompt-tokens + --tokens positions per stream: each drawn from its own topic's popularity,
    or (shared) every part from the same topic's."""
    sizes = args.sizes
    layers = len(sizes.expert)
    span = args.prompt_tokens + args.tokens
    rng = np.random.default_rng(args.seed)
    parts = []
    for t in range(max(args.streams)):
        pop = topic_popularity(layers, sizes.n_experts, args.zipf, args.seed * 100 + (0 if shared else t))
        parts.append((str(t), "decode", draw_routes(pop, span, sizes.top_k, rng)))
    write_route_trace(path, parts, layers, sizes.n_experts, sizes.top_k)


def real_route_file(args: argparse.Namespace, path: str) -> str:
    """The first 1 + max(streams) samples of --real-routes long enough for a prompt and its tokens (those
    flagged for repetition skipped): the warm-up request takes the first, each client the next."""
    if not args.real_routes:
        raise SystemExit("error: the real condition needs --real-routes FILE")
    rs = read_routes(args.real_routes)
    flagged: set[int] = set()
    side = os.path.splitext(args.real_routes)[0] + ".json"
    if args.real_routes.endswith(".npz") and os.path.exists(side):
        with open(side, encoding="utf-8") as f:
            flagged = {i for i, e in enumerate(json.load(f)) if e.get("has_repetition")}
    need = args.prompt_tokens + args.tokens
    ok = [s for i, s in enumerate(rs.samples) if i not in flagged and len(s.decode) >= need] or rs.samples
    keep = [ok[i % len(ok)] for i in range(1 + max(args.streams))]
    write_routes(RouteSet(keep, rs.n_layers, rs.n_experts, rs.top_k, rs.expert_bytes, rs.meta), path)
    return path


def server_flags(args: argparse.Namespace, condition: str, trace: str) -> list[str]:
    budget = args.pressure_budget_mb if condition in UNDER_BALLOON else args.budget_mb
    flags = ["--threads", str(args.threads), "--ram-budget-mb", str(budget), "--ctx", str(args.ctx),
             "--max-batch", str(max(args.streams)), "--trace", trace, *args.serve_flags.split()]  # fmt: skip
    if condition.startswith("routes") or condition == "real":
        flags += ["--route-trace", args.route_traces[condition]]
    return flags


def one_run(args: argparse.Namespace, condition: str, n: int, repeat: int, balloon: Any) -> dict[str, Any]:
    setup = prepare("pressure" if condition in UNDER_BALLOON else "asis", args.model, balloon)
    fd, trace = tempfile.mkstemp(prefix="batch-trace-", suffix=".csv")
    os.close(fd)
    run: dict[str, Any] = {"condition": condition, "streams": n, "repeat": repeat, "setup": setup}
    try:
        server = start_server(args.model, server_flags(args, condition, trace), args.timeout_s)
    except RuntimeError as exc:
        os.unlink(trace)
        return run | {"status": "failed", "error": str(exc)}
    try:
        run["server_start_s"] = server.started_s
        warm = args.warm_tokens if condition not in UNDER_BALLOON else 8
        complete(server.url, prompt_ids(args.sizes.vocab, warm, 999), 1, stream=False, timeout_s=args.timeout_s)
        before = server.metrics()
        prompts = [
            prompt_ids(args.sizes.vocab, length, i) for i, length in enumerate(prompt_lengths(args, condition, n))
        ]
        run |= run_streams(server, prompts, args.tokens, args.timeout_s)
        after = server.metrics()
        run["cache"] = {
            "slots": after.get("expert_cache_slots"),
            "slots_used": after.get("expert_cache_slots_used"),
            "misses_during_run": after.get("expert_cache_misses_total", 0) - before.get("expert_cache_misses_total", 0),
            "hits_during_run": after.get("expert_cache_hits_total", 0) - before.get("expert_cache_hits_total", 0),
        }
    except Exception as exc:
        run["errors"] = [*run.get("errors", []), f"{type(exc).__name__}: {exc}"]
    finally:
        run["server"] = stop_server(server)
    if balloon is not None and not balloon.alive():
        run["status"] = "invalid: the balloon died during the run"
    else:
        run["status"] = "ok" if not run.get("errors") and "aggregate_tps" in run else "failed"
    try:
        run["union"] = union_stats(trace, args.sizes)
        run["bound_speedup"] = bound_speedup(n, run["union"])
        if run["union"].get("steps"):  # each stream asks top-k distinct experts a layer
            run["union"]["demand_per_layer"] = n * args.sizes.top_k
            run["union"]["union_over_demand"] = run["union"]["distinct_per_layer_mean"] / (n * args.sizes.top_k)
            run["union"]["disk_experts_per_step"] = run["union"]["disk_rows"] / run["union"]["steps"]
    except Exception as exc:  # a server killed before it flushed its trace
        run["union"] = {"error": str(exc)}
    os.unlink(trace)
    return run


def llama_run(args: argparse.Namespace, n: int, repeat: int, balloon: Any) -> dict[str, Any]:
    setup = prepare("pressure", args.model, balloon)
    fd, out = tempfile.mkstemp(prefix="llama-batched-", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, LLAMA_BATCHED, "-m", args.model, "--streams", str(n), "--prompt-tokens",
           str(args.prompt_tokens), "-n", str(args.tokens), "--threads", str(args.threads), "--repack", "off",
           "--json", out]  # fmt: skip
    run: dict[str, Any] = {"engine": "llama.cpp", "streams": n, "repeat": repeat, "setup": setup, "cmd": cmd}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
        if p.returncode == 0:
            with open(out) as f:
                doc = json.load(f)
            doc.pop("tokens", None)
            run |= {"status": "ok", "aggregate_tps": doc["aggregate_tps"], "stats": doc}
        else:
            run |= {"status": f"failed (rc {p.returncode})", "error": p.stderr.strip()[-300:]}
    except subprocess.TimeoutExpired:
        run["status"] = "timeout"
    finally:
        os.unlink(out)
    return run


def run_condition(args: argparse.Namespace, condition: str) -> dict[str, Any]:
    doc: dict[str, Any] = {"condition": condition, "runs": [], "llama": []}
    try:
        with condition_context("pressure" if condition in UNDER_BALLOON else condition, args.leave_gb) as balloon:
            if balloon is not None:
                doc["balloon"] = balloon.record()
            for rep in range(args.repeat):
                order = args.streams if rep % 2 == 0 else args.streams[::-1]
                for n in order:
                    r = one_run(args, condition, n, rep, balloon)
                    doc["runs"].append(r)
                    log(f"[{condition}] repeat {rep + 1}/{args.repeat} N={n}: {short(r)}")
                if args.llama and condition == "pressure":
                    for n in args.llama_streams:
                        r = llama_run(args, n, rep, balloon)
                        doc["llama"].append(r)
                        log(f"[{condition}] repeat {rep + 1}/{args.repeat} llama.cpp N={n}: {r['status']} "
                            f"{r.get('aggregate_tps', 0):.2f} tok/s")  # fmt: skip
    except BalloonError as exc:
        log(f"[{condition}] stopped: {exc}")
        doc["error"] = str(exc)
    doc["summary"] = summarize(doc, args)
    return doc


def short(r: dict[str, Any]) -> str:
    if r["status"] != "ok":
        return f"{r['status']}: {r.get('error') or r.get('errors')}"
    u = r.get("union", {})
    misses = r.get("cache", {}).get("misses_during_run")
    return (
        f"aggregate {r['aggregate_tps']:.2f} tok/s, ttft last {r['ttft_last_s']:.2f} s, "
        f"union {u.get('distinct_per_layer_mean', float('nan')):.1f}/layer over {u.get('steps')} steps, "
        f"bound {r.get('bound_speedup') or float('nan'):.2f}x, cache misses {misses}"
    )


# ---- summaries -----------------------------------------------------------------------------------


def ok_runs(doc: dict[str, Any], n: int) -> dict[int, dict[str, Any]]:
    return {r["repeat"]: r for r in doc["runs"] if r["streams"] == n and r["status"] == "ok"}


def summarize(doc: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Per N: spreads over repeats, and ratios to the 1-stream run of the same repeat."""
    base = ok_runs(doc, 1)
    llama = {(r["streams"], r["repeat"]): r for r in doc["llama"] if r["status"] == "ok"}
    out: dict[str, Any] = {}
    for n in args.streams:
        mine = ok_runs(doc, n)
        pairs = [(r, base[rep]) for rep, r in mine.items() if rep in base]
        gain = [r["aggregate_tps"] / b["aggregate_tps"] for r, b in pairs]
        bound = [r["bound_speedup"] for r in mine.values() if r.get("bound_speedup")]
        out[str(n)] = {
            "runs": sum(1 for r in doc["runs"] if r["streams"] == n),
            "ok": len(mine),
            "aggregate_tps": spread(r["aggregate_tps"] for r in mine.values()),
            "stream_tps": spread(s["decode_tps"] for r in mine.values() for s in r["per_stream"]),
            "ttft_last_s": spread(r["ttft_last_s"] for r in mine.values()),
            "distinct_per_layer": spread(r["union"].get("distinct_per_layer_mean") for r in mine.values()),
            "disk_mb_per_token": spread(r.get("window_disk_mb_per_token") for r in mine.values()),
            "gain_vs_1": spread(gain),
            "bound_speedup": spread(bound),
            "measured_over_bound": spread(
                (r["aggregate_tps"] / b["aggregate_tps"]) / r["bound_speedup"]
                for r, b in pairs
                if r.get("bound_speedup")
            ),
            "ttft_last_over_lone": spread(r["ttft_last_s"] / b["ttft_last_s"] for r, b in pairs),
            "llama_aggregate_tps": spread(
                llama[(n, rep)]["aggregate_tps"] for rep in range(args.repeat) if (n, rep) in llama
            ),
            "over_llama": spread(
                r["aggregate_tps"] / llama[(n, rep)]["aggregate_tps"] for rep, r in mine.items() if (n, rep) in llama
            ),
        }
    return out


def markdown(doc: dict[str, Any], args: argparse.Namespace) -> str:
    meta, host = doc["meta"], doc["meta"]["host"]
    sizes = meta["read_sizes"]
    lines = [
        f"### Batched serving: {os.path.basename(args.model)} ({meta['model_bytes'] / 1e9:.1f} GB)",
        "",
        f"{meta['date']}, {host['cpu']}, {host['cores']} cores, {host['mem_total_bytes'] / GIB:.0f} GiB RAM; "
        f"{args.threads} threads, {args.tokens} tokens per stream, prompts of {args.prompt_tokens} token ids, "
        f"{args.repeat} fresh servers per cell; moestream {meta['moestream_commit']}. Dense bytes per step "
        f"{sizes['dense'] / MIB:.0f} MiB, one expert {sizes['expert_mean'] / MIB:.2f} MiB x {sizes['layers']} layers, "
        f"top-{sizes['top_k']} of {sizes['n_experts']}.",
        "Cells: median (min-max) over repeats; ratios from runs of the same repeat. Aggregate: tokens from the moment "
        "every stream has its first token to the end of the last, over that time. Bound: N x (RAM bytes of a 1-stream "
        "step) / (RAM bytes of the N-stream step: dense once + the union's experts, from the trace).",
        "",
        "| condition | N | ok | aggregate tok/s | per stream tok/s | gain vs 1 | bound | measured/bound | "
        "experts/layer/step | TTFT last s | TTFT last/lone | disk MB/tok | llama.cpp tok/s | vs llama.cpp |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cond in doc["conditions"]:
        title = f"pressure ({args.leave_gb:g} GiB left)" if cond["condition"] == "pressure" else cond["condition"]
        if "error" in cond:
            title += " (stopped early)"
        for n, s in cond["summary"].items():
            lines.append(
                f"| {title} | {n} | {s['ok']}/{s['runs']} | {cell(s['aggregate_tps'])} | {cell(s['stream_tps'])} | "
                f"{cell(s['gain_vs_1'], suffix='x')} | {cell(s['bound_speedup'], suffix='x')} | "
                f"{cell(s['measured_over_bound'])} | {cell(s['distinct_per_layer'])} | {cell(s['ttft_last_s'])} | "
                f"{cell(s['ttft_last_over_lone'], suffix='x')} | {cell(s['disk_mb_per_token'])} | "
                f"{cell(s['llama_aggregate_tps'])} | {cell(s['over_llama'], suffix='x')} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--conditions", default="pagecache", help=f"comma-separated: {', '.join(CONDITIONS)}")
    ap.add_argument("--streams", type=int_list, default=[1, 4, 8], help="concurrent clients, e.g. 1,4,8")
    ap.add_argument("--tokens", type=int, default=64, help="tokens each client generates (default 64)")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="token ids in each client's prompt (default 64)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget-mb", type=int, default=None, help="pagecache/routes budget (default: file + 2 GiB)")
    ap.add_argument("--leave-gb", type=float, default=8.0)
    ap.add_argument("--pressure-budget-mb", type=int, default=None, help="default: --leave-gb minus 1 GiB")
    ap.add_argument("--warm-tokens", type=int, default=512, help="warm-up prompt that touches every expert (512)")
    ap.add_argument("--zipf", type=float, default=1.0, help="routes: popularity skew (default 1.0)")
    ap.add_argument("--seed", type=int, default=7, help="routes: the topics' seed")
    ap.add_argument("--llama", action="store_true", help="pressure: also llama.cpp with N parallel sequences")
    ap.add_argument("--llama-streams", type=int_list, default=[1, 4])
    ap.add_argument("--serve-flags", default="", help="more flags for moestream serve")
    ap.add_argument("--real-routes", default=None, help="real: the real routes (.npz + .json, route_trace CSV)")
    ap.add_argument("--timeout-s", type=float, default=3600)
    add_results_args(ap, None, "results file name (default batch-serving-<model>)")
    args = ap.parse_args(argv)
    conditions = [c for c in args.conditions.split(",") if c]
    if not os.path.isfile(args.model):
        print(f"error: no such model file: {args.model}", file=sys.stderr)
        return 2
    bad = [c for c in conditions if c not in CONDITIONS]
    if bad or not conditions or not args.streams or min(args.streams) < 1 or 1 not in args.streams:
        print(f"error: --conditions from {', '.join(CONDITIONS)}; --streams must include 1", file=sys.stderr)
        return 2
    args.sizes = read_sizes(args.model)
    file_mb = model_nbytes(args.model) // MIB
    args.budget_mb = args.budget_mb or file_mb + 2048
    args.pressure_budget_mb = args.pressure_budget_mb or int(args.leave_gb * 1024) - 1024
    longest = max(max(prompt_lengths(args, c, max(args.streams))) for c in conditions) + args.tokens
    warm_needed = args.warm_tokens
    if any(c.startswith("routes") for c in conditions):  # the warm-up prompt covers every position the streams route by
        warm_needed = max(warm_needed, max(args.streams) * (args.prompt_tokens + args.tokens))
    args.warm_tokens = warm_needed
    args.ctx = -(-(max(longest, warm_needed) + 16) // 256) * 256
    with tempfile.TemporaryDirectory(prefix="batch-serving-") as tmp:
        args.route_traces = {c: os.path.join(tmp, f"{c}.trace.csv") for c in conditions if c.startswith("routes")}
        for c, path in args.route_traces.items():
            make_route_trace(args, path, shared=c == "routes-shared")
        if "real" in conditions:
            args.route_traces["real"] = real_route_file(args, os.path.join(tmp, "real.routes.csv"))
        docs = [run_condition(args, c) for c in conditions]
    sizes = args.sizes
    del args.sizes
    doc = {
        "meta": run_meta(
            args,
            model_bytes=model_nbytes(args.model),
            read_sizes={
                "dense": sizes.dense,
                "expert_mean": float(np.mean(list(sizes.expert.values()))),
                "layers": len(sizes.expert),
                "n_experts": sizes.n_experts,
                "top_k": sizes.top_k,
            },
        ),  # fmt: skip
        "conditions": docs,
    }
    md = markdown(doc, args)
    doc["markdown"] = md
    save_results(doc, md, args, "batch-serving")
    return 0


if __name__ == "__main__":
    sys.exit(main())
