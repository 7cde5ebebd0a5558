"""moestream vs llama.cpp on the same GGUF, in three memory conditions, with repeats.

    python bench/compare.py --model /tmp/models/q30.gguf --conditions pagecache,cold,pressure \\
        --leave-gb 8 --repeat 3 --tokens 32 --threads 2

Every run is a fresh process: `python -m moestream run ... --stats-json` for moestream and
bench/llamacpp_run.py for llama.cpp (llama-cpp-python), alternating which engine goes first.

Conditions (prepared again before every run):
  pagecache  the whole file is read into the page cache first (skipped when it does not fit in RAM)
  cold       `sync; echo 3 > /proc/sys/vm/drop_caches` (needs root)
  pressure   a balloon (bench/balloon.py) mlocks all but --leave-gb GiB for the whole condition, and
             caches are dropped before each run; moestream gets --pressure-budget-mb (default
             leave - 1 GiB) and llama.cpp runs with its default mmap and, by default, repack off
             (its default repack copies the weights into anonymous memory and is OOM-killed here).

What is measured, per run: prefill and decode tok/s (each engine's own wall clocks around the phases),
disk bytes read during decode from the kernel's per-process counters (/proc/PID/io read_bytes: sampled
from outside for moestream between its first output byte and its stats line; /proc/self/io around the
decode loop in the llama.cpp runner), peak RSS (ru_maxrss from wait4), exit status (an OOM kill or a
timeout is a result, not a crash). Per condition: median and min-max over the repeats, and
moestream/llama.cpp ratios from runs of the same repeat.

Ceiling, per moestream run: decode bytes missed per token / disk bandwidth (`moestream probe` with the
engine's read size and reads in flight, measured in the same condition; or a probe of our own when that
command is missing) + compute per token with every expert cached (a calibration run whose long prompt
loads every expert before decoding). The report gives measured / ceiling.

Writes bench/results/<date>-<name>.json and prints a markdown table (also --markdown FILE).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import asdict
from importlib.metadata import version
from typing import Any

from balloon import BalloonError
from ceiling import calibrate_compute, ceiling_for, disk_bandwidth, flag_value
from engine_runs import (
    RunResult,
    condition_context,
    pagecache_fits,
    pair_ratios,
    prepare,
    run_llamacpp,
    run_moestream,
    short,
    summarize,
    to_result,
)
from harness import DEFAULT_PROMPT, GIB, add_results_args, cell, check_conditions, log, run_meta, save_results, spread

from moestream.formats.gguf_model import model_nbytes

CONDITIONS = ("pagecache", "cold", "pressure")


# ---- the benchmark -------------------------------------------------------------------------------


def llama_variants(choice: str, condition: str) -> list[bool]:
    """Repack settings to run: auto = llama.cpp's default where RAM allows it, off under pressure."""
    if choice == "both":
        return [True, False]
    if choice == "auto":
        return [condition != "pressure"]
    return [choice == "on"]


def repack_label(repack: bool) -> str:
    return "mmap, repack on (default)" if repack else "mmap, repack off (use_extra_bufts=False)"


def run_condition(
    args: argparse.Namespace, condition: str, extra: list[str], compute_ms: float | None, log: Callable[[str], None]
) -> dict[str, Any]:
    model = args.model
    doc: dict[str, Any] = {"condition": condition, "runs": []}
    if condition == "pagecache":
        fits, why = pagecache_fits(model)
        if not fits:
            log(f"[{condition}] skipped: {why}")
            return doc | {"skipped": why}
    budget = args.pressure_budget_mb if condition == "pressure" else args.budget_mb
    ms_variant = f"budget {budget} MB" if budget else "budget: default"
    if extra:
        ms_variant += " " + " ".join(extra)
    io_threads = int(flag_value(extra, "--io-threads", "4") or 4)
    direct = "--buffered" not in extra
    runs: list[RunResult] = []
    try:
        with condition_context(condition, args.leave_gb) as balloon:
            if balloon is not None:
                doc["balloon"] = balloon.record()
                log(
                    f"[{condition}] balloon holds {balloon.locked_bytes / GIB:.1f} GiB, "
                    f"{balloon.mem_available_bytes / GIB:.1f} GiB left"
                )
            if not args.no_ceiling:
                doc["disk"] = disk_bandwidth(model, io_threads, direct)
                log(
                    f"[{condition}] disk: {doc['disk']['mb_s']:.0f} MB/s ({doc['disk']['source']}, "
                    f"{doc['disk']['inflight']} in flight, {doc['disk']['mode']})"
                )
            for rep in range(args.repeat):
                jobs: list[tuple[str, bool | None]] = [("moestream", None)]
                jobs += [("llama.cpp", rp) for rp in llama_variants(args.llama_repack, condition)]
                if rep % 2:
                    jobs.reverse()  # alternate who goes first: drift hits both engines alike
                for engine, repack in jobs:
                    setup = prepare(condition, model, balloon)
                    if engine == "moestream":
                        m, stats = run_moestream(
                            model, args.prompt, args.tokens, args.threads, budget, extra, args.timeout_s
                        )
                        r = to_result(engine, ms_variant, condition, rep, m, stats, setup)
                        if r.ok and "disk" in doc:
                            r.ceiling = ceiling_for(r.stats, doc["disk"]["mb_s"], compute_ms)
                    else:
                        assert repack is not None
                        m, stats = run_llamacpp(model, args.prompt, args.tokens, args.threads, repack, args.timeout_s)
                        r = to_result(engine, repack_label(repack), condition, rep, m, stats, setup)
                    if balloon is not None and not balloon.alive():
                        r.status = "invalid: the balloon died during the run"
                    runs.append(r)
                    log(f"[{condition}] repeat {rep + 1}/{args.repeat} {engine:9s} {r.variant}: {short(r)}")
    except BalloonError as exc:
        log(f"[{condition}] stopped: {exc}")
        doc["error"] = str(exc)
    doc["runs"] = [asdict(r) for r in runs]
    doc["summary"] = summarize(runs)
    doc["ratios"] = [
        {"label": f"moestream / llama.cpp (repack {'on' if rp else 'off'})", "versus": repack_label(rp)}
        | pair_ratios(
            runs,
            lambda r: r.engine == "moestream",
            lambda r, rp=rp: r.engine == "llama.cpp" and r.variant == repack_label(rp),
        )
        for rp in llama_variants(args.llama_repack, condition)
    ]
    return doc


# ---- markdown ------------------------------------------------------------------------------------


def condition_title(cond: dict[str, Any], leave_gb: float) -> str:
    name = cond["condition"]
    if name == "pressure":
        return f"pressure ({leave_gb:g} GiB left)"
    return name


def ceiling_notes(cond: dict[str, Any], title: str) -> list[str]:
    """The lines under the table that put moestream's decode against its disk + compute ceiling."""
    notes: list[str] = []
    ceil_runs = [r["ceiling"] for r in cond["runs"] if r["engine"] == "moestream" and r.get("ceiling")]
    if ceil_runs and "disk" in cond:
        c0 = ceil_runs[0]
        moc = spread(c.get("measured_over_ceiling") for c in ceil_runs)
        parts = [
            f"{title}: moestream ceiling = missed {cell(spread(c['missed_mb_per_token'] for c in ceil_runs))}"
            f" MB/tok / {cond['disk']['mb_s']:.0f} MB/s ({cond['disk']['source']}, "
            f"{cond['disk']['inflight']} in flight)"
        ]
        if "compute_ms" in c0:
            parts.append(
                f" + compute {c0['compute_ms']:.1f} ms/tok (all cached) = "
                f"{cell(spread(c['ceiling_ms'] for c in ceil_runs))} ms/tok; measured "
                f"{cell(spread(c['measured_ms'] for c in ceil_runs))} ms/tok = **{cell(moc, suffix='x')}"
                " the ceiling** (runs: " + ", ".join(f"{c['measured_over_ceiling']:.2f}x" for c in ceil_runs) + ")"
            )
        parts.append(
            f" (this run's own split: compute {cell(spread(c['run_compute_ms'] for c in ceil_runs))}"
            f" + waiting on reads {cell(spread(c['run_read_wait_ms'] for c in ceil_runs))} ms/tok)"
        )
        notes = ["".join(parts)]
        notes += [f"{title}: disk probe: {w}" for w in cond["disk"].get("warnings", [])[:1]]
    return notes


def markdown(doc: dict[str, Any]) -> str:
    meta = doc["meta"]
    host = meta["host"]
    lines = [
        f"### moestream vs llama.cpp: {os.path.basename(meta['model'])} ({meta['model_bytes'] / 1e9:.1f} GB)",
        "",
        f"{meta['date']}, {host['cpu']}, {host['cores']} cores, {host['mem_total_bytes'] / GIB:.0f} GiB RAM, "
        f"read_ahead_kb {host['read_ahead_kb']}; {meta['args']['threads']} threads, {meta['args']['tokens']} "
        f"tokens, {meta['args']['repeat']} fresh processes per cell, prompt {meta['prompt_tokens']} tokens; "
        f"moestream {meta['moestream_commit']}, llama-cpp-python {meta['llama_cpp_version']}.",
        "Cells: median (min-max) over repeats. Disk MB/tok: bytes the kernel read for the process during decode.",
        "",
        "| condition | engine | runs ok | decode tok/s | prefill tok/s | disk MB/tok | peak RSS MB | hit rate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    notes: list[str] = []
    for cond in doc["conditions"]:
        title = condition_title(cond, meta["args"]["leave_gb"])
        if "skipped" in cond or not cond["runs"]:
            lines.append(f"| {title} | - | - | {cond.get('skipped') or cond.get('error')} | | | | |")
            continue
        if "error" in cond:
            notes.append(f"{title}: stopped early: {cond['error']}")
        first = True
        for s in cond["summary"].values():
            mt = s["metrics"]
            ok = s["statuses"].get("ok", 0)
            bad = ", ".join(f"{n} {st}" for st, n in s["statuses"].items() if st != "ok")
            runs_ok = f"{ok}/{s['runs']}" + (f" ({bad})" if bad else "")
            engine = f"{s['engine']}, {s['variant']}"
            lines.append(
                f"| {title if first else ''} | {engine} | {runs_ok} | {cell(mt.get('decode_tps'))} | "
                f"{cell(mt.get('prompt_tps'))} | {cell(mt.get('decode_disk_mb_per_token'))} | "
                f"{cell(mt.get('peak_rss_mb'))} | {cell(mt.get('hit_rate'), 100, '%')} |"
            )
            first = False
        for ratio in cond.get("ratios", []):
            pairs = ratio["decode_tps"]["n"] if "decode_tps" in ratio else 0
            decode, prefill = cell(ratio.get("decode_tps"), suffix="x"), cell(ratio.get("prompt_tps"), suffix="x")
            if not pairs:
                st = cond["summary"].get(f"llama.cpp | {ratio['versus']}", {}).get("statuses", {})
                failed = ", ".join(f"{n} {k}" for k, n in st.items() if k != "ok")
                decode = f"n/a (llama.cpp: {failed})" if failed else "n/a"
            lines.append(f"| | **{ratio['label']}** | {pairs} pairs | **{decode}** | {prefill} | | | |")
        notes += ceiling_notes(cond, title)
        for r in cond["runs"]:
            if r["status"] != "ok":
                notes.append(
                    f"{title}: {r['engine']} ({r['variant']}) repeat {r['repeat'] + 1}: {r['status']}"
                    + (f": {r['error'][-200:]}" if r["error"] else "")
                )
    cal = doc.get("calibration")
    if cal:
        if cal.get("status") == "ok":
            notes.append(
                f"compute calibration: {cal['prompt_tokens']}-token prompt, {cal['n_slots']} slots, decode "
                f"{cal['decode_ms_per_token']:.1f} ms/tok of which {cal['compute_ms_per_token']:.1f} compute, "
                f"{cal['decode_mb_per_token']:.2f} MB/tok still read"
                + (
                    ""
                    if cal["decode_mb_per_token"] < 1
                    else " (not every expert was cached: compute is the decode time not spent waiting on reads)"
                )
            )
        else:
            notes.append(f"compute calibration {cal.get('status')}: {cal.get('error', '')}")
    notes += meta.get("notes", [])
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


def prompt_token_counts(runs: list[dict[str, Any]]) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for r in runs:
        if r["stats"].get("prompt_tokens"):
            out.setdefault(r["engine"], set()).add(r["stats"]["prompt_tokens"])
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="GGUF file both engines run")
    ap.add_argument("--conditions", default=",".join(CONDITIONS), help="comma-separated: pagecache,cold,pressure")
    ap.add_argument("--leave-gb", type=float, default=8.0, help="GiB the balloon leaves in `pressure` (default 8)")
    ap.add_argument("--repeat", type=int, default=3, help="fresh processes per engine and condition (default 3)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens to decode (default 32)")
    ap.add_argument("--threads", type=int, default=2, help="compute threads for both engines (default 2)")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument(
        "--budget-mb",
        type=int,
        default=None,
        help="moestream --ram-budget-mb in pagecache and cold (default: moestream's own default)",
    )
    ap.add_argument(
        "--pressure-budget-mb",
        type=int,
        default=None,
        help="moestream's budget under pressure (default: leave-gb minus 1 GiB)",
    )
    ap.add_argument("--moestream-args", default="", help="extra flags for moestream run, e.g. '--io-threads 8'")
    ap.add_argument(
        "--llama-repack",
        choices=("auto", "on", "off", "both"),
        default="auto",
        help="llama.cpp weight repacking: auto = default (on) in pagecache/cold, off under pressure",
    )
    ap.add_argument("--timeout-s", type=float, default=1800, help="per run (default 1800)")
    ap.add_argument("--no-ceiling", action="store_true", help="skip the disk probe and the compute calibration")
    ap.add_argument(
        "--calib-prompt-repeat",
        type=int,
        default=3,
        help="the calibration prompt is the prompt repeated this many times (default 3: ~300 "
        "tokens, enough for a uniform top-8-of-128 router to touch every expert)",
    )
    ap.add_argument(
        "--calib-budget-mb",
        type=int,
        default=None,
        help="moestream budget for the calibration run (default: moestream's default)",
    )
    add_results_args(ap, None, "results file name (default compare-<model>)")
    args = ap.parse_args(argv)
    check_conditions(ap, args, CONDITIONS)
    if args.repeat < 1 or args.tokens < 1 or args.threads < 1:
        ap.error("--repeat, --tokens and --threads must be positive")
    if args.pressure_budget_mb is None:
        args.pressure_budget_mb = int((args.leave_gb - 1) * 1024)
    if "pressure" in args.conditions:
        if args.pressure_budget_mb <= 0 or args.pressure_budget_mb > args.leave_gb * 1024:
            ap.error(
                f"--pressure-budget-mb {args.pressure_budget_mb} must fit in the {args.leave_gb:g} GiB "
                "the balloon leaves"
            )
    args.model = os.path.abspath(args.model)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    extra = shlex.split(args.moestream_args)
    doc: dict[str, Any] = {
        "meta": run_meta(args, model_bytes=model_nbytes(args.model), llama_cpp_version=_llama_version(), notes=[]),
        "conditions": [],
    }
    compute_ms = None
    if not args.no_ceiling:
        log("calibrating compute: moestream with every expert cached ...")
        cal = calibrate_compute(
            args.model,
            args.prompt,
            args.tokens,
            args.threads,
            extra,
            args.timeout_s,
            args.calib_prompt_repeat,
            args.calib_budget_mb,
        )
        doc["calibration"] = cal
        if cal.get("status") == "ok":
            compute_ms = cal["compute_ms_per_token"]
            log(
                f"compute with experts cached: {compute_ms:.1f} ms/tok (decode reads {cal['decode_mb_per_token']:.2f} "
                f"MB/tok, {cal['prompt_tokens']}-token prompt)"
            )
        else:
            log(f"calibration {cal.get('status')}: {cal.get('error')}")
    for condition in args.conditions:
        doc["conditions"].append(run_condition(args, condition, extra, compute_ms, log))
    all_runs = [r for c in doc["conditions"] for r in c.get("runs", [])]
    counts = prompt_token_counts(all_runs)
    doc["meta"]["prompt_tokens"] = "/".join(str(t) for t in sorted(set().union(*counts.values()))) or "?"
    if len({frozenset(v) for v in counts.values()}) > 1:
        doc["meta"]["notes"].append(f"the engines tokenized the prompt differently: {counts}")
    if any(c["condition"] == "pressure" and "runs" in c for c in doc["conditions"]):
        doc["meta"]["notes"].append(
            "llama.cpp's default CPU repack copies Q4_0/Q4_K weights into anonymous memory (as much again as the "
            "file); with less RAM than that it is OOM-killed while loading, so under pressure it runs with repack "
            "off (use_extra_bufts=False) unless --llama-repack says otherwise."
        )
    doc["meta"]["notes"].append(
        "All runs on a shared 2-core VM are noisy: compare ratios measured in the same run, not absolute figures "
        "across days. The guest reclaims memory idle for ~60 s (DAMON), so page-cache state is re-made before "
        "every run."
    )
    save_results(doc, markdown(doc), args, "compare")
    return 0


def _llama_version() -> str:
    try:
        return version("llama_cpp_python")
    except Exception:  # noqa: BLE001 - any failure means "not installed"
        return "not installed"


if __name__ == "__main__":
    sys.exit(main())
