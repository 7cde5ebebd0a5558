"""xgrammar against llguidance on moestream's own tokenizers: what structured output costs per token.

    python bench/grammar_engines.py                       # tiny vocabulary + a trained 151,643-token one
    python bench/grammar_engines.py --vocab-json /tmp/bpe150k.json

For each engine and each vocabulary it records the one-time vocabulary setup, the compile time of every
schema (json_object and several JSON schemas), and the per-token cost of the token mask (fill the bitmask)
plus accepting the sampled token, along two kinds of walk: the tokens of a valid instance (what a model
that knows the answer writes) and a seeded random walk over the allowed tokens (what a random model
writes: long strings and numbers, where masks are dearest). The applied mask's cost (bits -> -inf on
the logits) is measured once per vocabulary, since it does not depend on the engine.

The big vocabulary is a byte-level BPE trained with the Qwen2 split on this machine's Python sources (no
network: a real model's tokenizer.json is not at hand); --vocab-json reuses a trained one (tokenizers'
JSON). Writes bench/results/<date>-grammar-engines.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import sys
import time
from typing import Any

import llguidance as llg
import numpy as np
import torch
from harness import add_results_args, log, run_meta, save_results

from moestream.engine.grammar import GrammarVocab, apply_bitmask
from moestream.formats.tokenizer import (
    CONTROL,
    NORMAL,
    QWEN2_SPLIT,
    TINY_SPECIAL_TOKENS,
    USER_DEFINED,
    Tokenizer,
    build_tiny_bpe_metadata,
)
from moestream.serving.structured import JSON_OPTIONS

SCHEMAS: dict[str, tuple[dict[str, Any] | None, Any]] = {
    "json_object": (None, {"id": 7, "tags": ["a", "b"], "ok": True}),
    "flat": (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "score": {"type": "number"}},
            "required": ["name", "age", "score"],
        },
        {"name": "Paris", "age": 42, "score": 3.14},
    ),
    "nested": (
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "unit": {"enum": ["celsius", "fahrenheit"]},
                        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                    },
                    "required": ["name", "unit", "tags"],
                },
                "points": {"type": "array", "items": {"type": "number"}},
            },
            "required": ["user", "points"],
        },
        {"user": {"name": "the weather", "unit": "celsius", "tags": ["rain", "sun"]}, "points": [1.5, 21, -3]},
    ),
}
WALK_TOKENS = 200
BIG_VOCAB = "/tmp/moestream-bench-bpe150k.json"
RANDOM_WALKS = 3


def tiny_tokenizer() -> Tokenizer:
    return Tokenizer.from_metadata(build_tiny_bpe_metadata())


def big_tokenizer(vocab_json: str | None) -> Tokenizer:
    """A 151,643-token byte-level BPE (Qwen's size) plus the tiny model's special tokens."""
    path = vocab_json or BIG_VOCAB
    if not os.path.exists(path):
        _train(path)
    model = json.load(open(path))["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [NORMAL] * len(tokens)
    for t in TINY_SPECIAL_TOKENS:
        tokens.append(t)
        types.append(CONTROL if t.startswith("<|") else USER_DEFINED)
    ids = {t: i for i, t in enumerate(tokens)}
    return Tokenizer(tokens, types, merges, pre="qwen2", eos_id=ids["<|im_end|>"], chat_template=None)


def _train(path: str) -> None:
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HF

    log("training a 151,643-token BPE on the installed Python sources (about a minute)")
    site = os.path.dirname(os.path.dirname(torch.__file__))
    files, size = [], 0
    for f in sorted(glob.glob(os.path.join(site, "**", "*.py"), recursive=True)):
        size += os.path.getsize(f)
        files.append(f)
        if size > 120e6:
            break
    tok = HF(models.BPE())
    split = pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated")
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train(files, trainers.BpeTrainer(vocab_size=151643, initial_alphabet=alphabet, show_progress=False))
    tok.save(path)


# ---- the two engines, each behind the same four calls ----------------------------------------------


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok: Tokenizer):
        import xgrammar as xgr

        self.xgr, self.V = xgr, tok.vocab_size
        raw = [b"" if tok.is_special(i) else tok.token_bytes(i) for i in range(self.V)]
        info = xgr.TokenizerInfo(raw, xgr.VocabType.RAW, vocab_size=self.V, stop_token_ids=sorted(tok.stop_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, schema: dict[str, Any] | None) -> Any:
        text = json.dumps(schema or {"type": "object"})
        return self.compiler.compile_json_schema(text, any_whitespace=False, separators=(", ", ": "))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m: Any, bitmask: torch.Tensor) -> np.ndarray:
        m.fill_next_token_bitmask(bitmask)
        return bitmask[0].numpy().view(np.uint8)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)


class LLGuidance:
    """Through moestream's own adapter (moestream/engine/grammar.py), as the server uses it."""

    name = "llguidance"

    def __init__(self, tok: Tokenizer):
        self.vocab, self.V = GrammarVocab(tok), tok.vocab_size

    def compile(self, schema: dict[str, Any] | None) -> Any:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema or {"type": "object"}, defaults=JSON_OPTIONS)
        self.vocab.compile(grammar)  # the matcher a request gets: the grammar's whole compile
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.vocab.compile(compiled).matcher

    def fill(self, m: Any, bitmask: torch.Tensor) -> np.ndarray:
        return np.frombuffer(m.compute_bitmask(), np.uint8)

    def accept(self, m: Any, token: int) -> bool:
        return m.consume_token(token)


# ---- measuring ---------------------------------------------------------------------------------------


def allowed(bits: np.ndarray, V: int) -> list[int]:
    return np.flatnonzero(np.unpackbits(bits, bitorder="little")[:V]).tolist()


def walk(eng: Any, compiled: Any, tokens: list[int] | None, rng: random.Random | None) -> list[float]:
    """Seconds per token of fill + accept along `tokens`, or along a random walk over the allowed ones."""
    import xgrammar as xgr

    m, bitmask, out = eng.matcher(compiled), xgr.allocate_token_bitmask(1, eng.V), []
    for i in range(len(tokens) if tokens is not None else WALK_TOKENS):
        t0 = time.perf_counter()
        bits = eng.fill(m, bitmask)
        fill_s = time.perf_counter() - t0
        token = tokens[i] if tokens is not None else rng.choice(allowed(bits, eng.V))  # type: ignore[union-attr]
        t0 = time.perf_counter()
        assert eng.accept(m, token), f"{eng.name} refused token {token}"
        out.append(fill_s + time.perf_counter() - t0)
        if token in STOPS:
            break
    return out


STOPS: set[int] = set()


def stats_us(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"median_us": statistics.median(xs) * 1e6, "p90_us": xs[int(0.9 * (len(xs) - 1))] * 1e6,
            "max_us": xs[-1] * 1e6, "n": len(xs)}  # fmt: skip


def measure(eng_cls: Any, tok: Tokenizer) -> dict[str, Any]:
    t0 = time.perf_counter()
    eng = eng_cls(tok)
    row: dict[str, Any] = {"engine": eng.name, "vocab": tok.vocab_size, "setup_s": time.perf_counter() - t0}
    for name, (schema, instance) in SCHEMAS.items():
        t0 = time.perf_counter()
        compiled = eng.compile(schema)
        compile_s = time.perf_counter() - t0
        ids = tok.encode(json.dumps(instance), add_bos=False) + [tok.eos_id]
        per = walk(eng, compiled, ids, None)
        rnd = [x for k in range(RANDOM_WALKS) for x in walk(eng, compiled, None, random.Random(k))]
        row[name] = {"compile_ms": compile_s * 1e3, "instance": stats_us(per), "random": stats_us(rnd)}
        inst, rand = row[name]["instance"]["median_us"], row[name]["random"]["median_us"]
        log(
            f"{eng.name} V={tok.vocab_size} {name}: compile {compile_s * 1e3:.1f} ms, "
            f"instance {inst:.0f} us, random {rand:.0f} us"
        )
    return row


def apply_cost(V: int) -> dict[str, float]:
    import xgrammar as xgr

    logits, bitmask = torch.randn(V), xgr.allocate_token_bitmask(1, V)
    bitmask[0, ::3] = 0
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        apply_bitmask(logits.clone(), bitmask[0])
        times.append(time.perf_counter() - t0)
    return stats_us(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab-json", default=None, help="a trained tokenizers JSON for the big vocabulary")
    add_results_args(ap, "grammar-engines")
    args = ap.parse_args()
    args.model = args.vocab_json or BIG_VOCAB  # what run_meta records as the "model"
    torch.set_num_threads(1)
    rows, applied = [], {}
    for tok in (tiny_tokenizer(), big_tokenizer(args.vocab_json)):
        STOPS.clear()
        STOPS.update(tok.stop_ids)
        applied[tok.vocab_size] = apply_cost(tok.vocab_size)
        for eng in (XGrammar, LLGuidance):
            rows.append(measure(eng, tok))
    lines = ["| engine | vocab | setup s | schema | compile ms | mask+accept us, instance | same, random walk |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        for name in SCHEMAS:
            c = r[name]
            walks = " | ".join(
                f"{w['median_us']:.0f} (p90 {w['p90_us']:.0f}, max {w['max_us']:.0f})"
                for w in (c["instance"], c["random"])
            )
            lines.append(
                f"| {r['engine']} | {r['vocab']} | {r['setup_s']:.2f} | {name} | {c['compile_ms']:.1f} | {walks} |"
            )
    for V, s in applied.items():
        lines.append(f"\napplying a mask to {V} logits: {s['median_us']:.0f} us (p90 {s['p90_us']:.0f})")
    md = "\n".join(lines)
    save_results(
        {"meta": run_meta(args), "rows": rows, "apply_mask": applied, "markdown": md}, md, args, "grammar-engines"
    )


if __name__ == "__main__":
    sys.exit(main())
