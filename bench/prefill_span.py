"""Layer-major prefill against the micro-batch-major path: prefill tok/s and expert bytes read per prompt.

    python bench/prefill_span.py                                   # a synthetic model, 512 and 2048 tokens
    python bench/prefill_span.py --model /tmp/models/q30-l8.gguf --lengths 512 2048 8192 --budget-mb 6000

Arm `span` runs each prompt through every layer in spans as long as the budget holds (the default), arm
`micro` with --prefill-span equal to the micro-batch (every micro-batch through every layer, as before).
Both arms run in this process, interleaved span micro span micro ..., each run on a fresh engine (a cold
expert cache; the page cache is the machine's, so use --buffered only knowingly). Reported per prompt length:
median (min-max) prefill tok/s, expert MB read by the prompt, the span the engine ran and the micro/span
ratio of bytes read. Prompts are random token ids: the synthetic model's router spreads them over the
experts about as a real prompt does at these lengths. Results: bench/results/<date>-prefill-span.json.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile

from harness import add_results_args, log, median_range, save_rows

from moestream.engine.engine import Engine
from moestream.engine.model_file import open_model
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler
from moestream.synth.shapes import write_synth


def run_once(args: argparse.Namespace, prompt: list[int], span: int | None) -> dict:
    opts = EngineOptions(
        ram_budget_mb=args.budget_mb,
        n_slots=args.slots if args.budget_mb is None else None,
        ctx=args.ctx,
        threads=args.threads,
        ubatch=args.ubatch,
        prefill_span=span,
        direct=False if args.buffered else None,
    )
    eng = Engine(args.model, opts)
    try:
        eng.cache.arena.wait_prefault()
        gen = eng.generate(prompt, 1, Sampler())
        st = gen.stats
        return {
            "span": eng.prompt_span,
            "prompt_tokens": len(prompt),
            "prompt_s": st.prompt_s,
            "prefill_tps": len(prompt) / st.prompt_s if st.prompt_s else 0.0,
            "read_mb": st.bytes_read / 1e6,
            "misses": st.misses,
        }
    finally:
        eng.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file (default: a synthetic model written to a temp dir)")
    ap.add_argument("--shape", default="qwen3-30b-a3b", help="synthetic shape when no --model")
    ap.add_argument("--layers", type=int, default=2, help="synthetic model's layers when no --model")
    ap.add_argument("--quant", default="Q4_0", help="synthetic model's expert type when no --model")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--ubatch", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--budget-mb", type=int, default=None, help="--ram-budget-mb (default: a fixed --slots)")
    ap.add_argument("--slots", type=int, default=None, help="expert slots without a budget (default: one layer's)")
    ap.add_argument("--buffered", action="store_true")
    add_results_args(ap, "prefill-span")
    args = ap.parse_args()
    tmp = None
    if args.model is None:
        tmp = tempfile.TemporaryDirectory(prefix="prefill-span-")
        args.model = os.path.join(tmp.name, f"{args.shape}-l{args.layers}.gguf")
        log(f"writing a {args.layers}-layer {args.shape} {args.quant} model to {args.model}")
        write_synth(args.shape, args.quant, args.model, layers=args.layers, progress=False)
    try:
        n_experts, vocab = _sizes(args.model)
        if args.slots is None and args.budget_mb is None:
            args.slots = n_experts  # one layer's experts: a cache far smaller than the model, so prefill streams
        rows, lines = [], ["| prompt | arm | span | prefill tok/s | expert MB read |", "|---|---|---|---|---|"]
        for n in args.lengths:
            rng = random.Random(n)
            prompt = [rng.randrange(100, vocab) for _ in range(n)]
            runs: dict[str, list[dict]] = {"span": [], "micro": []}
            for rep in range(args.repeat):
                for arm, span in (("span", None), ("micro", args.ubatch)):
                    r = run_once(args, prompt, span)
                    log(f"{n} tokens, {arm} #{rep + 1}: {r['prefill_tps']:.1f} tok/s, {r['read_mb']:.0f} MB read")
                    runs[arm].append(r)
                    rows.append({"arm": arm, "rep": rep, **r})
            for arm, rs in runs.items():
                tps = [r["prefill_tps"] for r in rs]
                mb = [r["read_mb"] for r in rs]
                lines.append(f"| {n} | {arm} | {rs[0]['span']} | {median_range(tps, 1)} | {median_range(mb, 0)} |")
            ratio = statistics.median(r["read_mb"] for r in runs["micro"]) / max(
                1e-9, statistics.median(r["read_mb"] for r in runs["span"])
            )
            lines.append(f"| {n} | micro/span bytes | | | {ratio:.2f}x |")
        save_rows(args, rows, lines)
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0


def _sizes(path: str) -> tuple[int, int]:
    """(experts per layer, vocabulary size) of the model file."""
    m = open_model(path)
    try:
        return m.cfg.n_experts, m.cfg.vocab_size
    finally:
        m.close()


if __name__ == "__main__":
    sys.exit(main())
