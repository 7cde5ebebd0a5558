"""Decode speed with and without a json_schema request's grammar mask, in fresh `moestream serve` processes.

    python bench/grammar_decode.py --pairs 5 --tokens 96
    python bench/grammar_decode.py --vocab tiny          # the synthetic model's own 765-token vocabulary

Each run is a fresh server answering one streamed chat request, greedy: arm "plain" without response_format,
arm "json_schema" with a schema no answer can complete within --tokens (64 array items at least), so both
arms decode the same number of tokens unless the plain one meets a stop token. Arms alternate in pairs
(A B, then B A) so that a shared machine's drift falls on both; reports decode tok/s medians (min-max), the
per-pair ratio json_schema/plain, and the time to the first token (the first structured request also
prepares the vocabulary for the grammar engine).

The model: a synthetic --shape (default qwen3-30b-a3b, --layers 4) whose tokenizer is, with --vocab bpe150k
(the default), the 151,643-token byte-level BPE bench/grammar_engines.py trains, so that the mask and the
output layer have a real model's width; with --vocab tiny, the synthetic models' usual vocabulary.
Writes bench/results/<date>-grammar-decode-<vocab>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from agent_turn import Served, free_port, run_server, serve_cmd
from grammar_engines import BIG_VOCAB, big_tokenizer
from harness import add_results_args, cell, log, run_meta, save_results, spread

ARMS = ("plain", "json_schema")
SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24}, "value": {"type": "number"}},
        "required": ["name", "value"],
    },
    "minItems": 64,
}
PROMPT = "List the readings the gauges took, as JSON."


def write_model(path: str, shape: str, layers: int, vocab: str) -> str:
    """The synthetic model, written once; with vocab bpe150k its tokenizer is the trained 151k one."""
    if os.path.exists(path):
        return path
    from moestream.synth import shapes

    if vocab == "bpe150k":
        tok = big_tokenizer(None)
        md = dict(shapes.build_tiny_bpe_metadata())
        ids = {t: i for i, t in enumerate(tok.tokens)}
        md.update({
            "tokenizer.ggml.tokens": tok.tokens, "tokenizer.ggml.token_type": tok.token_types,
            "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in _trained()["model"]["merges"]],
            "tokenizer.ggml.bos_token_id": ids["<|endoftext|>"], "tokenizer.ggml.eos_token_id": ids["<|im_end|>"],
            "tokenizer.ggml.padding_token_id": ids["<|endoftext|>"],
        })  # fmt: skip
        shapes._tokenizer_md = lambda s: md  # the shape's tensors take their vocabulary size from it
    log(f"writing {path}")
    return shapes.write_synth(shape, "Q4_0", path, layers=layers, progress=False)


def _trained() -> dict[str, Any]:
    with open(BIG_VOCAB) as f:
        return json.load(f)


def one_run(model: str, arm: str, args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    cmd = serve_cmd(model, port, 2048, args.threads, args.budget_mb, 0, [])
    out: dict[str, Any] = {"arm": arm}

    def work(served: Served) -> None:
        assert served.client is not None
        extra: dict[str, Any] = {}
        if arm == "json_schema":
            extra["response_format"] = {"type": "json_schema", "json_schema": {"name": "readings", "schema": SCHEMA}}
        t0 = time.perf_counter()
        first = None
        usage = None
        stream = served.client.chat.completions.create(
            model="bench", messages=[{"role": "user", "content": PROMPT}], max_tokens=args.tokens, temperature=0,
            stream=True, stream_options={"include_usage": True}, **extra,
        )  # fmt: skip
        for chunk in stream:
            first = first or time.perf_counter()
            usage = chunk.usage or usage
        end = time.perf_counter()
        n = usage.completion_tokens if usage is not None else 0
        out.update(ttft_s=first - t0 if first else None, tokens=n, decode_s=end - (first or end))
        out["decode_tps"] = (n - 1) / out["decode_s"] if n > 1 and out["decode_s"] > 0 else None

    served = run_server(cmd, port, args.timeout_s, work)
    out["status"] = served.status
    if served.status != "ok":
        log(served.log[-2000:])
    log(f"{arm}: {out}")
    return out


def grammar_share(model: str, args: argparse.Namespace) -> dict[str, Any]:
    """Inside one process, the json_schema request's decode steps timed whole and the grammar's part of them
    (the mask and accepting the token): a share that the machine's load changes for both alike."""
    from moestream.engine.engine import Engine
    from moestream.engine.options import EngineOptions
    from moestream.engine.sampling import Sampler
    from moestream.serving.structured import Grammars, response_format_grammar

    engine = Engine(model, EngineOptions(ram_budget_mb=args.budget_mb, ctx=2048, threads=args.threads))
    try:
        tok = engine.tokenizer
        fmt = {"type": "json_schema", "json_schema": {"name": "readings", "schema": SCHEMA}}
        grammar = Grammars(tok).compile(response_format_grammar(fmt) or "", "response_format")
        spent = [0.0]
        for name in ("mask", "accept"):
            fn = getattr(grammar, name)

            def timed(*a: Any, fn: Any = fn) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*a)
                finally:
                    spent[0] += time.perf_counter() - t0

            setattr(grammar, name, timed)
        batch = engine.scheduler()
        batch.add(tok.encode(PROMPT), args.tokens, Sampler(), tok.stop_ids, grammar=grammar)
        batch.step()  # the prompt and the first token
        spent[0], steps, t0 = 0.0, 0, time.perf_counter()
        while len(batch):
            batch.step()
            steps += 1
        step_s = (time.perf_counter() - t0) / steps
    finally:
        engine.close()
    share = {"steps": steps, "step_ms": step_s * 1e3, "grammar_ms": spent[0] / steps * 1e3}
    share["grammar_share"] = share["grammar_ms"] / share["step_ms"]
    log(f"in one process: {share}")
    return share


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", choices=("bpe150k", "tiny"), default="bpe150k")
    ap.add_argument("--model", default=None, help="the synthetic model's path (written when missing)")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget-mb", type=int, default=4000)
    ap.add_argument("--timeout-s", type=float, default=600)
    add_results_args(ap, None)
    args = ap.parse_args()
    args.model = args.model or f"/tmp/moestream-grammar-{args.shape}-{args.layers}L-{args.vocab}.gguf"
    args.name = args.name or f"grammar-decode-{args.vocab}"
    write_model(args.model, args.shape, args.layers, args.vocab)
    runs = []
    for i in range(args.pairs):
        for arm in ARMS if i % 2 == 0 else ARMS[::-1]:
            runs.append({"pair": i, **one_run(args.model, arm, args)})
    by = {a: [r for r in runs if r["arm"] == a] for a in ARMS}
    ratios = []
    for i in range(args.pairs):
        p, j = (next(r for r in by[a] if r["pair"] == i) for a in ARMS)
        if p.get("decode_tps") and j.get("decode_tps"):
            ratios.append(j["decode_tps"] / p["decode_tps"])
    lines = ["| arm | decode tok/s | tokens | time to first token s |", "|---|---|---|---|"]
    for a in ARMS:
        tps, ttft = spread(r.get("decode_tps") for r in by[a]), spread(r.get("ttft_s") for r in by[a])
        lines.append(f"| {a} | {cell(tps)} | {cell(spread(r.get('tokens') for r in by[a]))} | {cell(ttft)} |")
    if ratios:
        lines.append(
            f"\njson_schema/plain decode, pair by pair: {statistics.median(ratios):.3f}x "
            f"({min(ratios):.3f}-{max(ratios):.3f}), {len(ratios)} pairs"
        )
    share = grammar_share(args.model, args)
    lines.append(
        f"\ninside one process: a decode step {share['step_ms']:.1f} ms, of which the grammar (mask + accept) "
        f"{share['grammar_ms']:.3f} ms ({100 * share['grammar_share']:.2f}%), {share['steps']} steps"
    )
    md = "\n".join(lines)
    doc = {"meta": run_meta(args, schema=SCHEMA, prompt=PROMPT), "runs": runs, "ratios": ratios, "share": share,
           "markdown": md}  # fmt: skip
    save_results(doc, md, args, args.name)


if __name__ == "__main__":
    sys.exit(main())
