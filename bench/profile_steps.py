"""Where a prompt's and a decode step's time goes, function by function (cProfile), in one process.

    python bench/profile_steps.py --model /tmp/models/dsv2lite-q4km.gguf --budget-mb 3500 --tokens 16
    python bench/profile_steps.py --model /tmp/models/oss120-l4.gguf --preload --tokens 32 --prompt-tokens 40

An Engine at the budget (or every expert loaded first with --preload), a warm-up generation, then one prompt of
--prompt-tokens token ids profiled up to its first token, and the decode of --tokens more profiled on its own.
The top functions by own time of each phase go to the results file with the phase's wall time. A profile
says where the model's thread spends its time (native calls count as the Python function that makes them);
it is a diagnosis, not a speed measurement: cProfile slows Python-heavy code, and no balloon is held.

Writes bench/results/<date>-<name>.json and prints the two tables.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import time

from harness import add_results_args, run_meta, save_results, spread_ids

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions


def top_functions(prof: cProfile.Profile, n: int) -> list[dict]:
    """The n functions with the most own time: calls, own seconds, seconds including callees."""
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = [
        {"function": f"{file}:{line}({name})", "calls": nc, "own_s": tt, "cumulative_s": ct}
        for (file, line, name), (_cc, nc, tt, ct, _callers) in stats.items()
    ]
    return sorted(rows, key=lambda r: r["own_s"], reverse=True)[:n]


def table(title: str, wall_s: float, per: str, rows: list[dict]) -> list[str]:
    lines = [f"#### {title}: {wall_s:.3f} s wall{per}", "", "| function | calls | own s | cumulative s |"]
    lines.append("|---|---|---|---|")
    lines += [f"| `{r['function']}` | {r['calls']} | {r['own_s']:.3f} | {r['cumulative_s']:.3f} |" for r in rows]
    return [*lines, ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--budget-mb", type=int, default=None, help="--ram-budget-mb (default: moestream's)")
    ap.add_argument("--preload", action="store_true", help="load every expert before the prompt")
    ap.add_argument("--tokens", type=int, default=16, help="tokens decoded after the prompt (default 16)")
    ap.add_argument("--prompt-tokens", type=int, default=98, help="token ids in the prompt (default 98)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=None, help="--ctx (default: moestream's; a long prompt needs more)")
    ap.add_argument("--top", type=int, default=15, help="functions listed per phase (default 15)")
    add_results_args(ap, None)
    args = ap.parse_args()

    eng = Engine(args.model, EngineOptions(ram_budget_mb=args.budget_mb, threads=args.threads, ctx=args.ctx))
    try:
        if args.preload:
            eng.preload()
        vocab = eng.tokenizer.vocab_size
        prompt = spread_ids(vocab, args.prompt_tokens)
        eng.generate(prompt[:8], 2)  # kernels and pools started
        steps = eng.stream(prompt, args.tokens + 1)
        prefill = cProfile.Profile()
        t = time.perf_counter()
        prefill.enable()
        next(steps)
        prefill.disable()
        prefill_s = time.perf_counter() - t
        decode = cProfile.Profile()
        t = time.perf_counter()
        decode.enable()
        n = sum(1 for _ in steps)
        decode.disable()
        decode_s = time.perf_counter() - t
        plan = eng.plan
    finally:
        eng.close()
    phases = {
        "prefill": {"wall_s": prefill_s, "tokens": args.prompt_tokens, "top": top_functions(prefill, args.top)},
        "decode": {"wall_s": decode_s, "tokens": n, "top": top_functions(decode, args.top)},
    }
    md = [f"### cProfile: {args.model}", ""]
    md += table("prefill", prefill_s, f", {args.prompt_tokens} tokens", phases["prefill"]["top"])
    per_token = f", {n} tokens ({1000 * decode_s / max(1, n):.1f} ms a token)"
    md += table("decode", decode_s, per_token, phases["decode"]["top"])
    doc = {"meta": run_meta(args, plan=dataclasses.asdict(plan) if plan is not None else None), "phases": phases}
    save_results(doc, "\n".join(md), args, "profile")


if __name__ == "__main__":
    main()
