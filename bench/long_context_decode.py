"""Decode at a long context against decode at a short one, every expert cached: what sparse attention (the
lightning indexer's top-k) keeps flat as the context grows.

    python bench/long_context_decode.py --model /tmp/bench-models/glm5-l4.gguf --short 1024 --long 16384 \\
        --tokens 16 --rounds 5 --threads 2

One process per engine, the model's whole file in RAM (moestream: every expert preloaded; llama.cpp: its
mmap, page cache warm, its default repack). The prompt is real text (prompt_text.py) of --long tokens; the
short context is its first --short tokens, so both caches hold the same text.

moestream: two KV caches of the same engine, the long one prefilled once (in spans of --span tokens, timed),
the short one from the same ids. A round decodes --tokens greedy tokens at the short context, then at the
long one (the order swapped every round), each from the same position every round (the caches are written
again at the same positions), after one warm-up round; a round's ratio compares steps made moments apart.
The keys each block's last step attended to are recorded (sparse attention: the index top-k at the long
context).

llama.cpp (llama-cpp-python, a subprocess): one context; --rounds measurements at the short context (the
cache cut back to the prompt after each), then the prompt extended to the long context (the rest prefilled)
and --rounds measurements there. Its rounds are not interleaved (a 15K-token prefill per swap), so its
ratio is of medians.

Writes bench/results/<date>-<name>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from harness import add_results_args, log, median_range, run_meta, save_results, write_json
from prompt_text import PromptMaker, corpus_info

SPAN = 2048


def greedy_steps(forward: Any, first: int, pos: int, n: int) -> tuple[list[float], list[int]]:
    """n greedy decode steps from token `first` at position pos: each step's seconds and the tokens."""
    times, tokens, tok = [], [], first
    for i in range(n):
        t0 = time.perf_counter()
        logits = forward(tok, pos + i)
        tok = int(logits.argmax())
        times.append(time.perf_counter() - t0)
        tokens.append(tok)
    return times, tokens


def moestream_arm(args: argparse.Namespace, ids: list[int]) -> dict[str, Any]:
    import torch

    from moestream.engine.engine import Engine
    from moestream.engine.options import EngineOptions

    ctx = args.long + args.tokens + 8
    torch.set_num_threads(args.threads)
    engine = Engine(args.model, EngineOptions(ctx=ctx, threads=args.threads, longest_prompt=args.long))
    t0 = time.perf_counter()
    preloaded = engine.preload()
    log(f"moestream: {preloaded} experts preloaded in {time.perf_counter() - t0:.0f} s")
    caches: dict[str, Any] = {}
    first: dict[str, int] = {}
    prefill: dict[str, float] = {}
    for name, n in (("short", args.short), ("long", args.long)):
        kv = engine.model.new_kv(ctx)
        t0 = time.perf_counter()
        with engine.cache.generation():
            for a in range(0, n, args.span):
                logits = engine.forward(ids[a : min(n, a + args.span)], a, kv)
        prefill[name] = time.perf_counter() - t0
        caches[name], first[name] = kv, int(logits.argmax())
        log(f"moestream: {n} tokens prefilled in {prefill[name]:.0f} s")
    lengths = {"short": args.short, "long": args.long}

    def measure(name: str) -> tuple[list[float], list[int]]:
        kv = caches[name]
        with engine.cache.generation():
            return greedy_steps(lambda t, p: engine.forward([t], p, kv), first[name], lengths[name], args.tokens)

    rounds: list[dict[str, Any]] = []
    tokens: dict[str, list[int]] = {}
    for r in range(args.rounds + 1):  # round 0 warms up
        order = ["short", "long"] if r % 2 == 0 else ["long", "short"]
        row: dict[str, Any] = {}
        for name in order:
            times, toks = measure(name)
            row[name + "_tps"] = len(times) / sum(times)
            if name in tokens and tokens[name] != toks:
                raise SystemExit(f"error: the {name} context decoded other tokens in round {r}")
            tokens[name] = toks
        row["ratio"] = row["long_tps"] / row["short_tps"]
        if r:
            rounds.append(row)
        log(f"moestream round {r}: short {row['short_tps']:.2f}, long {row['long_tps']:.2f} tok/s, {row['ratio']:.3f}x")
    attended = {name: list(getattr(caches[name], "keys_attended", [])) for name in caches}
    snap = engine.snapshot()
    engine.close()
    return {
        "prefill_s": prefill,
        "rounds": rounds,
        "keys_attended_last_step": attended,
        "tokens": tokens,
        "misses_after_preload": snap.misses - preloaded,
    }


def llama_arm(args: argparse.Namespace, ids: list[int]) -> dict[str, Any]:
    import llama_cpp.llama_cpp as lib
    import numpy as np
    from llamacpp_run import load_llama

    llm = load_llama(args.model, threads=args.threads, ctx=args.long + args.tokens + 8, mmap=True, repack=True)
    n_vocab = llm.n_vocab()

    def last_logits() -> Any:
        return np.ctypeslib.as_array(lib.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))

    def forward(tok: int, pos: int) -> Any:
        llm.n_tokens = pos  # eval() drops the cache from n_tokens on: the same positions every round
        llm.eval([tok])
        return last_logits()

    out: dict[str, Any] = {"prefill_s": {}, "tps": {}, "tokens": {}}
    done = 0
    for name, n in (("short", args.short), ("long", args.long)):
        llm.n_tokens = done
        t0 = time.perf_counter()
        llm.eval(ids[done:n])
        out["prefill_s"][name] = time.perf_counter() - t0
        done = n
        log(f"llama.cpp: prefilled to {n} tokens in {out['prefill_s'][name]:.0f} s")
        first = int(last_logits().argmax())
        tps = []
        for r in range(args.rounds + 1):
            times, toks = greedy_steps(forward, first, n, args.tokens)
            if r:
                tps.append(len(times) / sum(times))
            out["tokens"][name] = toks
        llm.n_tokens = n
        out["tps"][name] = tps
        log(f"llama.cpp {name}: {median_range(tps)} tok/s")
    return out


def run_llama_subprocess(args: argparse.Namespace) -> dict[str, Any]:
    sizes = ["--short", str(args.short), "--long", str(args.long), "--tokens", str(args.tokens)]
    runs = ["--rounds", str(args.rounds), "--threads", str(args.threads)]
    cmd = [sys.executable, __file__, "--llama-only", "--model", args.model, *sizes, *runs]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
    if proc.returncode != 0:
        raise SystemExit(f"error: the llama.cpp arm failed: {proc.stderr.strip().splitlines()[-1:]}")
    sys.stderr.write(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def markdown(doc: dict[str, Any], args: argparse.Namespace) -> str:
    m = doc["moestream"]
    ratios = [r["ratio"] for r in m["rounds"]]
    lines = [
        f"Decode at {args.long} against {args.short} tokens of context, every expert cached, {args.tokens} tokens "
        f"a measurement, {args.rounds} rounds",
        "",
        "| engine | short tok/s | long tok/s | long / short |",
        "|---|---|---|---|",
        f"| moestream | {median_range([r['short_tps'] for r in m['rounds']])} | "
        f"{median_range([r['long_tps'] for r in m['rounds']])} | **{median_range(ratios, 3)}** (pair by pair) |",
    ]
    if "llama" in doc:
        t = doc["llama"]["tps"]
        ratio = statistics.median(t["long"]) / statistics.median(t["short"])
        lines.append(
            f"| llama.cpp | {median_range(t['short'])} | {median_range(t['long'])} | {ratio:.3f} (of medians) |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--short", type=int, default=1024, help="the short context in tokens (default 1024)")
    ap.add_argument("--long", type=int, default=16384, help="the long context in tokens (default 16384)")
    ap.add_argument("--tokens", type=int, default=16, help="decode steps a measurement (default 16)")
    ap.add_argument("--rounds", type=int, default=5, help="measurements at each context (default 5)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--span", type=int, default=SPAN, help="prefill tokens a forward call (default 2048)")
    ap.add_argument("--no-llama", action="store_true", help="moestream only")
    ap.add_argument("--llama-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--timeout-s", type=float, default=7200)
    add_results_args(ap, None, "results file name (default long-context-decode-<model>)")
    args = ap.parse_args(argv)
    if not 0 < args.short < args.long or min(args.tokens, args.rounds, args.threads, args.span) < 1:
        ap.error("need 0 < --short < --long and positive --tokens, --rounds, --threads, --span")
    if not os.path.isfile(args.model):
        ap.error(f"no such model file: {args.model}")
    args.model = os.path.abspath(args.model)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from moestream.engine.model_file import open_model, tokenizer_if_any

    m = open_model(args.model)
    tok = tokenizer_if_any(m.gguf)
    m.close()
    if tok is None:
        raise SystemExit(f"error: {args.model} has no tokenizer")
    ids = PromptMaker(tok).make(args.long).ids
    if args.llama_only:
        print(json.dumps(llama_arm(args, ids)))
        return 0
    doc: dict[str, Any] = {"meta": run_meta(args, corpus=corpus_info())}
    doc["moestream"] = moestream_arm(args, ids)
    path = save_results(doc, markdown(doc, args), args, "long-context-decode")
    if not args.no_llama:  # after moestream's figures are saved: its arm is the long one
        doc["llama"] = run_llama_subprocess(args)
        write_json(path, doc)
        log(markdown(doc, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
