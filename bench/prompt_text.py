"""Prompts of real English text cut to an exact number of a model's tokens, and what a model file says about
itself that long_prompt.py reports (its tokenizer, the routed experts' bytes, the KV cache per context).

The text is CPython's own documentation: the language reference topics that ship with every install for
`help()` (pydoc_data.topics, 79 topics, ~465 KB in 3.11), joined in sorted topic order. The same Python
gives the same text; its sha256 goes into the results. A prompt of N tokens is the first N tokens of it;
text that follows (the agent turn's new tokens) is the tokens after those.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pydoc_data.topics import topics
from typing import Any

from llamacpp_run import tokenize as llama_tokenize

from moestream.engine.model_file import open_model, tokenizer_if_any
from moestream.formats.tokenizer import Tokenizer
from moestream.streaming.mlock import routed_nbytes

CORPUS_NAME = "pydoc_data.topics (CPython's language reference topics, sorted by topic)"


def corpus() -> str:
    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def corpus_info() -> dict[str, Any]:
    text = corpus()
    return {
        "source": CORPUS_NAME,
        "python": sys.version.split()[0],
        "chars": len(text),
        "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
    }


@dataclass
class ModelFacts:
    path: str
    tokenizer: Tokenizer
    routed_bytes: int  # sum of the routed *_exps tensors' bytes
    kv_bytes_per_token: int  # moestream's KV cache for one position (all layers)
    kv_fixed_bytes: int  # what it holds whatever the length (a hybrid model's recurrent states)

    def kv_bytes(self, tokens: int) -> int:
        return self.kv_fixed_bytes + self.kv_bytes_per_token * tokens


def model_facts(path: str) -> ModelFacts:
    m = open_model(path)
    try:
        tok = tokenizer_if_any(m.gguf)
        if tok is None:
            raise SystemExit(f"error: {path} has no tokenizer; long prompts need one")
        memory = m.arch.memory(m.cfg)
        at_1k, at_2k = (memory.kv_nbytes(n, m.exact) for n in (1024, 2048))
        per_token = (at_2k - at_1k) // 1024
        return ModelFacts(path, tok, routed_nbytes(m.gguf), per_token, at_1k - 1024 * per_token)
    finally:
        m.close()


@dataclass
class Prompt:
    text: str
    ids: list[int]  # moestream's tokens of `text` (what `moestream run -p text` prefills)
    following: list[int]  # the corpus's next tokens after the prompt (no BOS)


class PromptMaker:
    """Cuts the corpus into prompts of exactly n tokens of one tokenizer."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.all_ids = tok.encode(corpus(), add_bos=False)
        self.bos = len(tok.encode("a")) - len(tok.encode("a", add_bos=False))  # 1 where the model adds a BOS

    def make(self, n: int, following: int = 0) -> Prompt:
        """The first n tokens as text whose encoding is exactly n tokens (BOS included where the model adds
        one). Cutting inside a word can re-encode to a token more or less, so near cuts are tried too."""
        body = n - self.bos
        if body + following + 8 > len(self.all_ids):
            raise SystemExit(f"error: the corpus holds {len(self.all_ids)} tokens; {n} + {following} asked")
        for k in sorted(range(max(1, body - 8), body + 9), key=lambda k: abs(k - body)):
            text = self.tok.decode(self.all_ids[:k])
            ids = self.tok.encode(text)
            if len(ids) == n:
                return Prompt(text, ids, self.all_ids[k : k + following])
        raise SystemExit(f"error: no cut of the corpus encodes to exactly {n} tokens")


def llama_view(model: str, prompt: Prompt) -> dict[str, Any]:
    """How llama.cpp tokenizes the same text (llamacpp_run.py's own call): its count, and whether its ids
    are moestream's."""
    ids = llama_tokenize(model, prompt.text)
    same = ids == prompt.ids
    first_diff = None
    if not same:
        first_diff = next((i for i, (a, b) in enumerate(zip(ids, prompt.ids, strict=False)) if a != b), None)
        if first_diff is None:
            first_diff = min(len(ids), len(prompt.ids))
    return {"llama_tokens": len(ids), "moestream_tokens": len(prompt.ids), "same_ids": same, "first_diff": first_diff}
