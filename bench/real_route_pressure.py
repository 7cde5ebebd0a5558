"""Decode under memory pressure on real routes, beside the uniform floor, Belady's bound, the disk floor,
llama.cpp and the forecast.

    python bench/real_route_pressure.py --model /tmp/models/goss20.gguf --routes ../shared/routes/gpt-oss-20b.npz \\
        --leave-gb 6 --repeat 5 --tokens 16 --name real-route-pressure-goss20

One balloon (bench/balloon.py) leaves --leave-gb GiB for the whole run; caches are dropped before every run;
every run is a fresh `moestream run` (or bench/llamacpp_run.py) process. Per repeat the arms run in turn, the
first arm rotating (A B C, B C A, ...), so load on the shared machine hits all of them:

  real      `--route-trace` of one real sample (repeat i takes the i-th usable sample: one a user's
            conversation each; the source's samples flagged for repetition are skipped)
  uniform   the synthetic model's own router (random weights route close to uniformly: the floor)
  llama.cpp on the same file, its default mmap with repack off; it routes by its own random router, so its
            figure is on uniform routing (--llama-every N: in every N-th repeat only, it is slow here)

Per moestream run (each records its accesses with --trace):
  disk floor  decode bytes missed per token / the probe's bandwidth at the engine's read size and reads in
              flight (`moestream probe` under the same balloon): the run's tok/s over this bound's tok/s
              is `over_disk_floor` (the target is >= 0.9); compute per token (decode time minus read waits)
              is beside it
  Belady      the run's own trace replayed at the engine's slots with LRU (equals the live count) and
              Belady (the bound for any policy), and the disk floor at Belady's misses
  forecast    `moestream forecast --probe --trace --compute-from` on the run's trace and stats; the
              forecast's decode tok/s over the measured one (`forecast_over_measured`)

Writes bench/results/<date>-<name>.json (CPU model and flags, load averages before each run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from balloon import Balloon  # noqa: E402
from engine_runs import prepare, run_llamacpp, run_moestream, summarize, to_result  # noqa: E402
from harness import add_results_args, log, results_path, run_meta, spread, write_json  # noqa: E402

from moestream.analysis.accesses import accesses_from_trace  # noqa: E402
from moestream.analysis.replay import replay  # noqa: E402
from moestream.analysis.route_files import RouteSet, read_routes, write_routes  # noqa: E402
from moestream.analysis.trace import read_trace  # noqa: E402

MIB = 1 << 20
DEFAULT_PROMPT = "Explain, step by step, how a mixture-of-experts language model decides which experts to run."


def pick_samples(src: str, count: int, need: int) -> tuple[RouteSet, list[int]]:
    """`count` samples of at least `need` tokens, spread over the source, skipping those flagged for repetition."""
    rs = read_routes(src)
    flagged: set[int] = set()
    side = os.path.splitext(src)[0] + ".json"
    if src.endswith(".npz") and os.path.exists(side):
        with open(side, encoding="utf-8") as f:
            flagged = {i for i, e in enumerate(json.load(f)) if e.get("has_repetition")}
    ok = [i for i, s in enumerate(rs.samples) if i not in flagged and len(s.decode) >= need]
    if not ok:  # a single short trace (Qwen3-30B's): it is cycled
        ok = list(range(len(rs.samples)))
    step = max(1, len(ok) // count)
    return rs, [ok[(j * step) % len(ok)] for j in range(count)]


def sample_file(rs: RouteSet, index: int, path: str) -> str:
    write_routes(RouteSet([rs.samples[index]], rs.n_layers, rs.n_experts, rs.top_k, rs.expert_bytes, rs.meta), path)
    return path


def probe(model: str, io_threads: int, path: str) -> dict[str, Any]:
    """`moestream probe` (O_DIRECT, the engine's reads in flight) saved for the forecast; its bandwidth at the
    engine's read size."""
    cmd = [sys.executable, "-m", "moestream", "probe", "--file", model, "--json", "--direct-only"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True).stdout
    with open(path, "w", encoding="utf-8") as f:
        f.write(out)
    doc = json.loads(out)
    rows = [r for r in doc["rows"] if r["size"] == doc["segment_bytes"] and r["mode"] == "direct"]
    best = min(rows, key=lambda r: abs(r["inflight"] - io_threads))
    return {"mb_s": best["mb_s"], "read_bytes": best["size"], "inflight": best["inflight"], "rows": doc["rows"]}


def bounds(stats: dict[str, Any], trace: str, mb_s: float) -> dict[str, Any]:
    """Disk floor, compute, and the trace's replay at the engine's slots (LRU and Belady)."""
    n = max(1, stats["decode_tokens"])
    missed = stats["decode_bytes_read"] / n
    measured_ms = 1e3 * stats["decode_s"] / n
    floor_ms = 1e3 * missed / (mb_s * 1e6)
    out: dict[str, Any] = {
        "missed_mb_per_token": missed / MIB,
        "measured_ms": measured_ms,
        "disk_floor_ms": floor_ms,
        "over_disk_floor": floor_ms / measured_ms,
        "compute_ms": 1e3 * (stats["decode_s"] - stats["decode_read_wait_s"]) / n,
        "read_wait_ms": 1e3 * stats["decode_read_wait_s"] / n,
    }
    meta, rows = read_trace(trace)
    acc = accesses_from_trace(meta, rows)
    slots = int(meta.get("n_slots") or 0)
    if slots:
        expert_bytes = float(meta.get("expert_bytes") or 0)
        for policy in ("lru", "belady"):
            r = replay(acc, policy, slots)
            out[f"{policy}_decode_hit_rate"] = r.decode_hits / max(1, r.decode_hits + r.decode_misses)
            out[f"{policy}_decode_misses"] = r.decode_misses
        belady_missed = out["belady_decode_misses"] * expert_bytes / n
        out["belady_disk_floor_ms"] = 1e3 * belady_missed / (mb_s * 1e6)
        out["slots"] = slots
    return out


def forecast(model: str, probe_path: str, trace: str, stats: dict[str, Any], io_threads: int) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(stats, f)
    try:
        cmd = [sys.executable, "-m", "moestream", "forecast", "--probe", probe_path, "--model", model,
               "--trace", trace, "--compute-from", f.name, "--measured", f.name,
               "--io-threads", str(io_threads), "--json"]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode:
            return {"error": r.stderr.strip()[-300:]}
        return json.loads(r.stdout)
    finally:
        os.unlink(f.name)


def forecast_tps(doc: dict[str, Any]) -> float | None:
    """The replayed case's decode tok/s from `forecast --json`."""
    for case in doc.get("cases", []):
        if case["case"].startswith("replay"):
            return float(case["tok_s"])
    return None


def run_one(args: argparse.Namespace, arm: str, rep: int, balloon: Balloon, tmp: str) -> dict[str, Any]:
    setup = prepare("pressure", args.model, balloon)
    setup["loadavg"] = list(os.getloadavg())
    if arm == "llama.cpp":
        m, stats = run_llamacpp(args.model, args.prompt, args.tokens, args.threads, False, args.timeout_s)
        log(f"llama.cpp #{rep}: {m.status} decode {stats.get('decode_tps', 0):.2f} tok/s")
        return {"result": to_result("llama.cpp", "repack off", "pressure", rep, m, stats, setup)}
    trace = os.path.join(tmp, f"{arm}-{rep}.trace.csv")
    extra = ["--trace", trace, "--io-threads", str(args.io_threads), *args.moestream_args.split()]
    if arm == "real":
        extra += ["--route-trace", args.sample_files[rep]]
    m, stats = run_moestream(args.model, args.prompt, args.tokens, args.threads, args.budget_mb, extra, args.timeout_s)
    r = to_result("moestream", arm, "pressure", rep, m, stats, setup)
    out: dict[str, Any] = {"result": r}
    if r.ok:
        out["bounds"] = bounds(stats, trace, args.disk["mb_s"])
        fdoc = forecast(args.model, args.probe_path, trace, stats, args.io_threads)
        tps = forecast_tps(fdoc)
        n = stats["decode_tokens"]
        out["forecast"] = {"tok_s": tps, "cases": fdoc.get("cases"), "error": fdoc.get("error")}
        if tps:
            out["forecast"]["over_measured"] = tps / stats["decode_tps"]
            # the first decode token comes from the prefill's logits: n tokens, n - 1 forward passes
            passes = max(1, n - 1)
            out["forecast"]["over_measured_per_pass"] = tps / (passes / stats["decode_s"])
    os.unlink(trace)
    log(f"{arm} #{rep}: {r.status} decode {stats.get('decode_tps', 0):.2f} tok/s hit {stats.get('hit_rate', 0):.3f}")
    return out


def ratios(runs: list[dict[str, Any]], num: str, den: str) -> dict[str, float] | None:
    by: dict[int, dict[str, float]] = {}
    for x in runs:
        r = x["result"]
        if r.ok:
            by.setdefault(r.repeat, {})[r.variant if r.engine == "moestream" else "llama.cpp"] = r.metric("decode_tps")
    return spread(p[num] / p[den] for p in by.values() if num in p and den in p and p[den])


def metric_spread(runs: list[dict[str, Any]], arm: str, key: str, part: str = "bounds") -> dict[str, float] | None:
    return spread(x[part].get(key) for x in runs if x["result"].variant == arm and x.get(part, {}).get(key) is not None)


def report(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "real_over_uniform": ratios(runs, "real", "uniform"),
        "real_over_llamacpp": ratios(runs, "real", "llama.cpp"),
        "uniform_over_llamacpp": ratios(runs, "uniform", "llama.cpp"),
    }
    for arm in ("real", "uniform"):
        out[arm] = {k: metric_spread(runs, arm, k) for k in (
            "over_disk_floor", "disk_floor_ms", "belady_disk_floor_ms", "measured_ms", "compute_ms",
            "read_wait_ms", "missed_mb_per_token", "lru_decode_hit_rate", "belady_decode_hit_rate")}  # fmt: skip
        out[arm]["forecast_over_measured"] = metric_spread(runs, arm, "over_measured", "forecast")
        out[arm]["forecast_over_measured_per_pass"] = metric_spread(runs, arm, "over_measured_per_pass", "forecast")
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--routes", required=True, help="real routes (.npz + .json, route_trace CSV, route file)")
    ap.add_argument("--leave-gb", type=float, default=6.0)
    ap.add_argument("--budget-mb", type=int, default=None, help="moestream's budget (default: leave - 1 GiB)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--llama-every", type=int, default=1, help="llama.cpp in every N-th repeat (0: never)")
    ap.add_argument("--moestream-args", default="", help="extra flags for both moestream arms")
    ap.add_argument("--timeout-s", type=float, default=900)
    add_results_args(ap, "real-route-pressure")
    args = ap.parse_args(argv)
    if args.budget_mb is None:
        args.budget_mb = int(args.leave_gb * 1024) - 1024
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rs, picked = pick_samples(args.routes, args.repeat, need=64 + args.tokens)
    runs: list[dict[str, Any]] = []
    path = results_path(args.results_dir, args.name)
    with tempfile.TemporaryDirectory(prefix="real-route-") as tmp, Balloon(leave_gb=args.leave_gb) as balloon:
        args.sample_files = [sample_file(rs, i, os.path.join(tmp, f"sample-{i}.csv")) for i in picked]
        args.probe_path = os.path.join(tmp, "probe.json")
        args.disk = probe(args.model, args.io_threads, args.probe_path)
        log(f"probe: {args.disk['mb_s']:.0f} MB/s at {args.disk['read_bytes']} B x {args.disk['inflight']}")
        for rep in range(args.repeat):
            arms = ["real", "uniform"]
            if args.llama_every and rep % args.llama_every == 0:
                arms.append("llama.cpp")
            k = rep % len(arms)
            for arm in arms[k:] + arms[:k]:
                runs.append(run_one(args, arm, rep, balloon, tmp))
                save(args, rs, picked, runs, path)  # after every run: a run cut short keeps what it measured
    print(json.dumps(save(args, rs, picked, runs, path)["report"], indent=1))
    log(f"wrote {path}")
    return 0


def save(args: argparse.Namespace, rs: RouteSet, picked: list[int], runs: list[dict[str, Any]], path: str) -> dict:
    doc = {
        "what": "decode under pressure on real routes vs the uniform floor, the disk floor, Belady, llama.cpp",
        "meta": run_meta(args, samples=picked, routes_shape=rs.shape, disk=args.disk),
        "summary": summarize([x["result"] for x in runs]),
        "report": report(runs),
        "runs": [{**x, "result": vars(x["result"])} for x in runs],
    }
    write_json(path, doc)
    return doc


if __name__ == "__main__":
    sys.exit(main())
