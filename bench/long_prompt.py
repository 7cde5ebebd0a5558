"""Long prompts: moestream vs llama.cpp prefill on the same GGUF at several prompt lengths, and an agent's
second turn against `moestream serve`.

    python bench/long_prompt.py --model /tmp/models/q30.gguf --lengths 512,2048,8192 \\
        --conditions pressure --leave-gb 8 --repeat 3 --threads 2

Prompts are real text (bench/prompt_text.py: CPython's language reference topics) cut to exactly N tokens
of the model's tokenizer; llama.cpp gets the same text, and its tokenization is checked against moestream's
(count and ids, recorded per length). Every run is a fresh process (engine_runs.run_moestream /
run_llamacpp), the two engines alternating which goes first, the condition prepared again before each run:
  pagecache  the whole file in the page cache
  pressure   a balloon leaves --leave-gb GiB for the whole condition, caches dropped before every run;
             moestream gets --pressure-budget-mb (default leave - 1 GiB), llama.cpp its mmap, repack off

Per run: prefill tok/s (each engine's own clock around its prefill), time to first token (process start
to the end of the prefill, load included), the disk bytes read during the prompt (/proc/PID/io read_bytes:
from outside for moestream, between its "mlock:" line and its first output byte; around Llama.eval in
llamacpp_run.py), peak RSS, exit status. The report divides the prompt's bytes by the routed experts'
size (the file's *_exps tensors).

Agent turn (--agent-tokens, default 8192; 0 skips it): a fresh `moestream serve` with --prompt-cache-mb
large enough for the conversation, a first request of N tokens, then the first prompt + the first answer
+ --agent-new new tokens (bench/agent_turn.py). Reported: each turn's time to first token, its cached
tokens, and the second / first ratio.

Writes bench/results/<date>-long-prompt-<model>.json, prints a markdown table and saves a plot of prefill
tok/s against prompt length next to the JSON (same name, .png).
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
from dataclasses import asdict
from typing import Any

from agent_turn import agent_turn
from balloon import Balloon, BalloonError
from engine_runs import (
    RunResult,
    condition_context,
    pair_ratios,
    prepare,
    run_llamacpp,
    run_moestream,
    summarize,
    to_result,
)
from harness import GIB, MIB, add_results_args, check_conditions, log, run_meta, save_results, spread
from long_prompt_report import markdown, plot
from prompt_text import ModelFacts, PromptMaker, corpus_info, llama_view, model_facts

from moestream.formats.gguf_model import model_nbytes

CONDITIONS = ("pagecache", "pressure")
LLAMA_VARIANT = "mmap, repack off (use_extra_bufts=False)"


def length_label(n: int) -> str:
    return f"{n} tokens"


def run_ctx(prompt_tokens: int, new_tokens: int) -> int:
    """A context that holds the prompt and what is generated, rounded up to 256 (both engines get it)."""
    return -(-(prompt_tokens + new_tokens + 16) // 256) * 256


def one_run(
    args: argparse.Namespace,
    engine: str,
    condition: str,
    rep: int,
    n: int,
    text: str,
    budget: int | None,
    extra: list[str],
    balloon: Balloon | None,
) -> RunResult:
    setup = prepare(condition, args.model, balloon)
    ctx = run_ctx(n, args.tokens)
    if engine == "moestream":
        m, stats = run_moestream(args.model, text, args.tokens, args.threads, budget, extra, args.timeout_s, ctx=ctx)
    else:
        m, stats = run_llamacpp(
            args.model, text, args.tokens, args.threads, args.llama_repack == "on", args.timeout_s, ctx=ctx
        )
    r = to_result(engine, length_label(n), condition, rep, m, stats, setup)
    if balloon is not None and not balloon.alive():
        r.status = "invalid: the balloon died during the run"
    return r


def run_line(r: RunResult, routed: int) -> str:
    if not r.ok:
        return f"{r.status} after {r.wall_s:.0f} s {r.error[-160:]}"
    disk = r.metric("prompt_disk_bytes")
    share = f"{disk / MIB:.0f} MiB = {disk / routed:.2f}x the routed experts" if disk is not None else "? MiB"
    return (
        f"{r.stats.get('prompt_tokens')} tok, prefill {r.metric('prompt_tps'):.1f} tok/s, first token "
        f"{r.metric('ttft_s'):.1f} s, prompt read {share}, peak RSS {r.metric('peak_rss_mb'):.0f} MiB, "
        f"wall {r.wall_s:.0f} s"
    )


def agent_runs(
    args: argparse.Namespace,
    condition: str,
    maker: PromptMaker,
    facts: ModelFacts,
    budget: int | None,
    extra: list[str],
    balloon: Balloon | None,
) -> dict[str, Any]:
    prompt = maker.make(args.agent_tokens, following=args.agent_new)
    total = args.agent_tokens + 2 * args.agent_answer + args.agent_new
    ctx = run_ctx(total, 0)
    cache_mb = args.prompt_cache_mb
    if cache_mb is None:  # one snapshot of the whole conversation, with room to spare
        cache_mb = math.ceil(1.25 * facts.kv_bytes(total) / MIB) + 64
    doc: dict[str, Any] = {
        "first_tokens": args.agent_tokens,
        "new_tokens": args.agent_new,
        "ctx": ctx,
        "prompt_cache_mb": cache_mb,
        "runs": [],
    }
    for rep in range(args.agent_repeat):
        setup = prepare(condition, args.model, balloon)
        run = agent_turn(
            args.model,
            facts.tokenizer,
            prompt.ids,
            prompt.following,
            answer_tokens=args.agent_answer,
            ctx=ctx,
            threads=args.threads,
            budget_mb=budget,
            cache_mb=cache_mb,
            extra=extra,
            timeout_s=args.timeout_s,
        )
        run["setup"], run["repeat"] = setup, rep
        if balloon is not None and not balloon.alive():
            run["status"] = "invalid: the balloon died during the run"
        doc["runs"].append(run)
        turns = run["turns"]
        if run["status"] == "ok":
            log(
                f"[{condition}] agent {rep + 1}/{args.agent_repeat}: first token {turns[0]['ttft_s']:.1f} s "
                f"({turns[0]['cached_tokens']} cached) then {turns[1]['ttft_s']:.2f} s "
                f"({turns[1]['cached_tokens']} of {turns[1]['prompt_tokens']} cached): {run['ttft_ratio']:.3f}x"
            )
        else:
            log(f"[{condition}] agent {rep + 1}/{args.agent_repeat}: {run['status']} | {run['log_tail']}")
    doc["ttft_ratio"] = spread(r.get("ttft_ratio") for r in doc["runs"] if r["status"] == "ok")
    return doc


def run_condition(
    args: argparse.Namespace,
    condition: str,
    maker: PromptMaker,
    facts: ModelFacts,
    prompts: dict[int, Any],
    extra: list[str],
) -> dict[str, Any]:
    budget = args.pressure_budget_mb if condition == "pressure" else args.budget_mb
    doc: dict[str, Any] = {"condition": condition, "runs": []}
    runs: list[RunResult] = []
    try:
        with condition_context(condition, args.leave_gb) as balloon:
            if balloon is not None:
                doc["balloon"] = balloon.record()
                log(f"[{condition}] balloon holds {balloon.locked_bytes / GIB:.1f} GiB")
            for n in args.lengths:
                for rep in range(args.repeat):
                    order = ["moestream", "llama.cpp"] if rep % 2 == 0 else ["llama.cpp", "moestream"]
                    for engine in order:
                        r = one_run(args, engine, condition, rep, n, prompts[n].text, budget, extra, balloon)
                        runs.append(r)
                        log(
                            f"[{condition}] {n} tokens, pair {rep + 1}/{args.repeat}, {engine}: "
                            f"{run_line(r, facts.routed_bytes)}"
                        )
            if args.agent_tokens and args.agent_repeat:
                doc["agent"] = agent_runs(args, condition, maker, facts, budget, extra, balloon)
    except BalloonError as exc:
        log(f"[{condition}] stopped: {exc}")
        doc["error"] = str(exc)
    doc["runs"] = [asdict(r) for r in runs]
    doc["summary"] = summarize(runs)
    doc["ratios"] = {
        str(n): pair_ratios(
            runs,
            lambda r, n=n: r.engine == "moestream" and r.variant == length_label(n),
            lambda r, n=n: r.engine == "llama.cpp" and r.variant == length_label(n),
            ("prompt_tps", "ttft_s", "prompt_disk_bytes"),
        )
        for n in args.lengths
    }
    return doc


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="GGUF file both engines run")
    ap.add_argument("--lengths", default="512,2048,8192", help="prompt lengths in tokens (default 512,2048,8192)")
    ap.add_argument("--conditions", default="pressure", help="comma-separated: pagecache,pressure (default pressure)")
    ap.add_argument("--leave-gb", type=float, default=8.0, help="GiB the balloon leaves in `pressure` (default 8)")
    ap.add_argument("--repeat", type=int, default=3, help="pairs per length and condition (default 3)")
    ap.add_argument("--tokens", type=int, default=4, help="tokens to generate after the prompt (default 4)")
    ap.add_argument("--threads", type=int, default=2, help="compute threads for both engines (default 2)")
    ap.add_argument("--budget-mb", type=int, default=None, help="moestream --ram-budget-mb in pagecache")
    ap.add_argument("--pressure-budget-mb", type=int, default=None, help="default: leave-gb minus 1 GiB")
    ap.add_argument("--moestream-args", default="", help="extra flags for moestream run and serve")
    ap.add_argument(
        "--llama-repack",
        choices=("on", "off"),
        default="off",
        help="llama.cpp weight repacking (default off: under pressure, on is OOM-killed)",
    )
    ap.add_argument("--agent-tokens", type=int, default=8192, help="first turn's prompt tokens (0: no agent turn)")
    ap.add_argument("--agent-new", type=int, default=200, help="new tokens the second turn adds (default 200)")
    ap.add_argument("--agent-answer", type=int, default=32, help="tokens each turn generates (default 32)")
    ap.add_argument("--agent-repeat", type=int, default=3, help="fresh servers per condition (default 3)")
    ap.add_argument(
        "--prompt-cache-mb",
        type=int,
        default=None,
        help="serve's --prompt-cache-mb (default: the conversation's KV cache x1.25 + 64)",
    )
    ap.add_argument("--timeout-s", type=float, default=3600, help="per run (default 3600)")
    add_results_args(ap, None, "results file name (default long-prompt-<model>)")
    args = ap.parse_args(argv)
    try:
        args.lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--lengths takes comma-separated token counts, got {args.lengths!r}")
    check_conditions(ap, args, CONDITIONS)
    if not args.lengths or min(args.lengths) < 1 or args.repeat < 1 or args.tokens < 1 or args.threads < 1:
        ap.error("--lengths, --repeat, --tokens and --threads must be positive")
    if min(args.agent_tokens, args.agent_new, args.agent_answer, args.agent_repeat) < 0:
        ap.error("--agent-* must be 0 or more")
    if args.pressure_budget_mb is None:
        args.pressure_budget_mb = int((args.leave_gb - 1) * 1024)
    args.model = os.path.abspath(args.model)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    extra = shlex.split(args.moestream_args)
    facts = model_facts(args.model)
    maker = PromptMaker(facts.tokenizer)
    prompts = {n: maker.make(n) for n in args.lengths}
    tokenization = {}
    for n, p in prompts.items():
        tokenization[str(n)] = view = llama_view(args.model, p)
        log(
            f"{n} tokens: {len(p.text)} characters; llama.cpp: {view['llama_tokens']} tokens, "
            f"same ids: {view['same_ids']}"
        )
    doc: dict[str, Any] = {
        "meta": run_meta(
            args,
            model_bytes=model_nbytes(args.model),
            routed_bytes=facts.routed_bytes,
            kv_bytes_per_token=facts.kv_bytes_per_token,
            corpus=corpus_info(),
            tokenization=tokenization,
            llama_variant=LLAMA_VARIANT,
        ),
        "conditions": [],
    }
    if args.llama_repack == "on":
        doc["meta"]["llama_variant"] = "mmap, repack on (default)"
    for condition in args.conditions:
        doc["conditions"].append(run_condition(args, condition, maker, facts, prompts, extra))
    path = save_results(doc, markdown(doc), args, "long-prompt")
    png = os.path.splitext(path)[0] + ".png"
    plot(doc, png)
    log(f"plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
