"""A/B of two moestream command lines or two source trees on the same model, interleaved A B A B ... in fresh
processes.

    python bench/ab.py --model /tmp/models/q30.gguf --a "--io-threads 2" --b "--io-threads 8" \\
        --budget-mb 6000 --repeat 5 --tokens 32
    python bench/ab.py --model /tmp/models/q30.gguf --variant mlock --leave-gb 6 --budget-mb 4096
    python bench/ab.py --model /tmp/models/q30.gguf --variant versions --a-tree /tmp/base --leave-gb 8

Named variants (--variant NAME) set both arms' flags and the condition; --a, --b and --condition given as well
override them:
{variants}

Two versions of moestream: `git worktree add /tmp/base <commit>`, then `--a '' --a-tree /tmp/base --b ''`
(or --variant versions) runs arm A from that checkout and arm B from this one. With --serve each run is a fresh
`moestream serve` (the flags are serve's) answering one streamed request of the prompt: prefill is the time to the
first chunk, decode the tokens after it (bench/agent_turn.py, served_prompt); the engine's own counters are not
reported.

Everything but the two flag strings is shared: model, prompt, tokens, threads, budget, and the page-cache
state made before every run (--condition: cold drops caches, pagecache pre-reads the file, pressure holds
a balloon leaving --leave-gb GiB, asis leaves the machine alone). Interleaving spreads the drift of a
shared machine over both arms; the B/A ratios come from the pairs run back to back.

Reports medians and min-max of decode and prefill tok/s, expert hit rate, disk MB per decoded token (the
kernel's count for the process, and moestream's own), time waiting on reads per token, peak RSS, the process's
major page faults and the machine's swap-ins during the run (pages evicted and read back: what --mlock is for;
the JSON records whether the machine had swap at all).
Writes bench/results/<date>-<name>.json and prints a markdown table (also --markdown FILE).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import asdict
from typing import Any, NamedTuple

from agent_turn import served_prompt
from balloon import BalloonError
from engine_runs import RunResult, condition_context, pair_ratios, prepare, run_moestream, short, summarize, to_result
from harness import DEFAULT_PROMPT, add_results_args, cell, log, meminfo, run_meta, save_results, vmstat


class Variant(NamedTuple):
    a: str
    b: str
    condition: str
    what: str


VARIANTS = {
    "versions": Variant("", "", "pressure", "the same flags, arm A from --a-tree (an older checkout), B from this one"),
    "mlock": Variant(
        "--no-mlock",
        "--mlock",
        "pressure",
        "dense weights locked or not under the balloon (no swap: nothing to evict, no difference)",
    ),
    "buffered": Variant("", "--buffered", "cold", "experts read with O_DIRECT or through the page cache"),
    "io-threads": Variant("--io-threads 2", "--io-threads 8", "cold", "reads in flight"),
    "prefill-span": Variant(
        "--prefill-span 128", "", "cold", "a prompt micro-batch by micro-batch (A) vs layer-major spans (B)"
    ),
    "preload": Variant(
        "--preload", "--preload", "pagecache", "both arms with every expert cached (compute alone): give --a-tree"
    ),
}

AB_CONDITIONS = ("cold", "pagecache", "pressure", "asis")
__doc__ = __doc__.format(variants="\n".join(f"  {name:13s}{v.what}" for name, v in VARIANTS.items()))
COLUMNS = (
    ("decode tok/s", "decode_tps", 1.0, ""),
    ("prefill tok/s", "prompt_tps", 1.0, ""),
    ("hit rate", "hit_rate", 100.0, "%"),
    ("disk MB/tok", "decode_disk_mb_per_token", 1.0, ""),
    ("moestream MB/tok", "engine_mb_per_token", 1.0, ""),
    ("read wait ms/tok", "read_wait_ms_per_token", 1.0, ""),
    ("peak RSS MB", "peak_rss_mb", 1.0, ""),
    ("major faults", "major_faults", 1.0, ""),
    ("swap-ins", "swap_ins", 1.0, ""),
)
RATIO_METRICS = ("decode_tps", "prompt_tps", "hit_rate", "engine_mb_per_token")


def run_ab(args: argparse.Namespace) -> dict[str, Any]:
    arms = {"A": shlex.split(args.a), "B": shlex.split(args.b)}
    trees = {"A": args.a_tree, "B": args.b_tree}
    runs: list[RunResult] = []
    doc: dict[str, Any] = {"swap_total_bytes": meminfo().get("SwapTotal", 0)}
    try:
        with condition_context(args.condition, args.leave_gb) as balloon:
            if balloon is not None:
                doc["balloon"] = balloon.record()
            for rep in range(args.repeat):
                for arm, extra in arms.items():
                    setup = prepare(args.condition, args.model, balloon) if args.condition != "asis" else {}
                    swap_ins = vmstat().get("pswpin", 0)
                    m, stats = (served_prompt if args.serve else run_moestream)(
                        args.model,
                        args.prompt,
                        args.tokens,
                        args.threads,
                        args.budget_mb,
                        extra,
                        args.timeout_s,
                        trees[arm],
                    )
                    r = to_result("moestream", arm, args.condition, rep, m, stats, setup)
                    r.external["swap_ins"] = vmstat().get("pswpin", 0) - swap_ins
                    if balloon is not None and not balloon.alive():
                        r.status = "invalid: the balloon died during the run"
                    runs.append(r)
                    log(f"repeat {rep + 1}/{args.repeat} {arm} ({args.a if arm == 'A' else args.b}): {short(r)}")
    except BalloonError as exc:
        doc["error"] = str(exc)
        log(f"failed: {exc}")
    doc["runs"] = [asdict(r) for r in runs]
    doc["summary"] = summarize(runs)
    doc["ratio_b_over_a"] = pair_ratios(runs, lambda r: r.variant == "B", lambda r: r.variant == "A", RATIO_METRICS)
    return doc


def markdown(doc: dict[str, Any]) -> str:
    meta, args = doc["meta"], doc["meta"]["args"]
    flags = {}
    for arm in ("A", "B"):
        tree = args.get(arm.lower() + "_tree")
        flags[arm] = (args[arm.lower()] or "(defaults)") + (f" (from {tree})" if tree else "")
    cond = args["condition"] + (f", {args['leave_gb']:g} GiB left" if args["condition"] == "pressure" else "")
    lines = [
        f"### moestream A/B: {os.path.basename(meta['model'])}",
        "",
        f"{meta['date']}, {meta['host']['cpu']}, {meta['host']['cores']} cores; condition {cond}; "
        f"{args['threads']} threads, {args['tokens']} tokens, budget "
        f"{args['budget_mb'] or 'default'} MB; A B A B ... {args['repeat']} runs each; moestream "
        f"{meta['moestream_commit']}. Cells: median (min-max).",
        "",
        "| arm | flags | runs ok | " + " | ".join(c[0] for c in COLUMNS) + " |",
        "|---|---|---|" + "---|" * len(COLUMNS),
    ]
    for arm in ("A", "B"):
        s = doc["summary"].get(f"moestream | {arm}")
        if s is None:
            lines.append(f"| {arm} | `{flags[arm]}` | 0 | " + " | ".join("-" for _ in COLUMNS) + " |")
            continue
        mt = s["metrics"]
        ok = f"{s['statuses'].get('ok', 0)}/{s['runs']}"
        lines.append(
            f"| {arm} | `{flags[arm]}` | {ok} | "
            + " | ".join(cell(mt.get(key), scale, suf) for _, key, scale, suf in COLUMNS)
            + " |"
        )
    ratio = doc["ratio_b_over_a"]
    n = ratio["decode_tps"]["n"] if "decode_tps" in ratio else 0
    cells = [
        f"**{cell(ratio.get(key), suffix='x')}**"
        if key == "decode_tps"
        else (cell(ratio.get(key), suffix="x") if key in RATIO_METRICS else "")
        for _, key, _, _ in COLUMNS
    ]
    lines.append(f"| **B / A** | | {n} pairs | " + " | ".join(cells) + " |")
    bad = [r for r in doc["runs"] if r["status"] != "ok"]
    notes = [f"{r['variant']} repeat {r['repeat'] + 1}: {r['status']}: {r['error'][-200:]}" for r in bad]
    if "error" in doc:
        notes.append(doc["error"])
    if notes:
        lines += ["", *[f"- {x}" for x in notes]]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--variant", choices=VARIANTS, help="a named pair of arms and its condition (see above)")
    ap.add_argument("--a", help="moestream run flags of arm A (quote them; '' for defaults)")
    ap.add_argument("--b", help="moestream run flags of arm B")
    ap.add_argument("--a-tree", default=None, help="run arm A's moestream from this checkout (a git worktree)")
    ap.add_argument("--b-tree", default=None, help="run arm B's moestream from this checkout")
    ap.add_argument("--repeat", type=int, default=5, help="runs per arm (default 5)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget-mb", type=int, default=None, help="--ram-budget-mb for both arms")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument(
        "--condition",
        choices=AB_CONDITIONS,
        default=None,
        help="page-cache state before each run (default: the variant's, else cold)",
    )
    ap.add_argument("--leave-gb", type=float, default=8.0, help="with --condition pressure")
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument(
        "--serve",
        action="store_true",
        help="run each arm as a fresh `moestream serve` answering one streamed request of the prompt (the flags "
        "are serve's); prefill = time to the first chunk",
    )
    add_results_args(ap, None, "results file name (default ab-<model>)")
    args = ap.parse_args(argv)
    preset = VARIANTS.get(args.variant)
    for key in ("a", "b", "condition"):
        if getattr(args, key) is None:
            setattr(args, key, getattr(preset, key) if preset else "cold" if key == "condition" else None)
    if args.a is None or args.b is None:
        ap.error("give --a and --b, or --variant")
    if preset and preset.a == preset.b and args.a == args.b and args.a_tree == args.b_tree:
        ap.error(f"--variant {args.variant} runs the same flags in both arms: give --a-tree (or --b-tree)")
    if not os.path.isfile(args.model):
        ap.error(f"no such model file: {args.model}")
    if args.repeat < 1 or args.tokens < 1:
        ap.error("--repeat and --tokens must be positive")
    # an arm may set its own --ram-budget-mb (an A/B of budgets) when ab.py sets none for both
    shared = ("-m", "--model", "-p", "--prompt", "-n", "--threads", "--stats-json")
    for flag in shared + (("--ram-budget-mb",) if args.budget_mb is not None else ()):
        if flag in shlex.split(args.a) + shlex.split(args.b):
            ap.error(f"{flag} is set by ab.py itself for both arms; pass it as ab.py's own option")
    for tree in (args.a_tree, args.b_tree):
        if tree is not None and not os.path.isfile(os.path.join(tree, "moestream", "__init__.py")):
            ap.error(f"{tree} is not a moestream checkout (no moestream/__init__.py)")
    args.model = os.path.abspath(args.model)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    doc: dict[str, Any] = {"meta": run_meta(args)}
    doc |= run_ab(args)
    save_results(doc, markdown(doc), args, "ab")
    return 0


if __name__ == "__main__":
    sys.exit(main())
