"""Structured output: one request's grammar (llguidance) masks its logits token by token.

llguidance was chosen over xgrammar by measurement (bench/grammar_engines.py, bench/RESULTS.md): on a
Qwen-sized vocabulary it compiles a JSON schema in about a millisecond, where xgrammar's compile is tens of
milliseconds a request, and its mask stays cheap inside long strings, where xgrammar's grew several times.

The grammar sees the vocabulary as the answer's text is made of it: each token's bytes as the tokenizer
decodes them (Tokenizer.token_bytes, so byte-level BPE pieces, added tokens such as <tool_call> as their
text), control tokens (<|im_end|>, ...) as special tokens that no text can spell, and the tokenizer's stop
tokens as the ends that are allowed once the grammar accepts.
"""

from __future__ import annotations

from typing import Any

import llguidance as llg
import numpy as np
import torch

from moestream.errors import MoestreamError


class GrammarError(MoestreamError):
    """A grammar or schema the engine cannot compile; its message is one line."""


class _Vocab:
    """What llguidance.TokenizerWrapper reads of a tokenizer."""

    def __init__(self, tok: Any):
        self.tok = tok
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else min(tok.stop_ids, default=0)
        self.bos_token_id = tok.bos_id
        # 0xff marks a special token (llguidance's convention); it refers to it by name, never as text
        self.tokens = [
            b"\xff" + t.encode() if tok.is_special(i) else tok.token_bytes(i) for i, t in enumerate(tok.tokens)
        ]
        self.special_token_ids = [i for i in range(tok.vocab_size) if tok.is_special(i)]

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self.tok.encode(text, add_bos=False)


class GrammarVocab:
    """A tokenizer's vocabulary made ready for llguidance once (it walks every token), then any number of
    grammars compiled against it."""

    def __init__(self, tok: Any):
        self.vocab_size = tok.vocab_size
        self.stop_ids = sorted(tok.stop_ids)
        self.lltok = llg.LLTokenizer(llg.TokenizerWrapper(_Vocab(tok)), eos_token=self.stop_ids or None)

    def compile(self, grammar: str) -> TokenGrammar:
        """A fresh matcher for `grammar` (llguidance's JSON or Lark grammar text); GrammarError if it is bad."""
        matcher = llg.LLMatcher(self.lltok, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(one_line(matcher.get_error()))
        return TokenGrammar(matcher, self.vocab_size, self.stop_ids)


class TokenGrammar:
    """One request's place in its grammar: which tokens may come next, and whether it is complete."""

    def __init__(self, matcher: Any, vocab_size: int, stop_ids: list[int]):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids

    @property
    def done(self) -> bool:
        """The grammar is complete and nothing may follow: the answer ends here, as with a stop token."""
        return self.matcher.is_stopped()

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [V] with the tokens the grammar forbids next at -inf. A matcher gone wrong (it never
        should: only allowed tokens are sampled) allows the stop tokens alone, so the request ends rather
        than the batch's step failing."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), np.uint8)
        if self.matcher.is_error():
            bits = np.zeros_like(bits)
            for i in self.stop_ids:
                bits[i >> 3] |= 1 << (i & 7)
        return apply_bitmask(logits, bits)

    def accept(self, token: int) -> None:
        self.matcher.consume_token(token)


def apply_bitmask(logits: torch.Tensor, bitmask: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A copy of `logits` [V] with every token whose bit is 0 in `bitmask` (bit i of byte b = token 8b+i,
    as llguidance and xgrammar lay it out) at -inf; ids past the mask (a model whose output is wider than
    its vocabulary) too."""
    raw = bitmask.numpy() if isinstance(bitmask, torch.Tensor) else bitmask
    bits = np.unpackbits(raw.view(np.uint8), bitorder="little")
    out = logits.detach().to("cpu", torch.float32).numpy().copy()
    n = min(len(bits), len(out))
    out[:n][bits[:n] == 0] = -np.inf
    out[n:] = -np.inf
    return torch.from_numpy(out)


def one_line(message: str) -> str:
    """An engine's error as one line: its first non-empty line, without llguidance's prefixes."""
    first = next((line.strip() for line in message.splitlines() if line.strip()), "invalid grammar")
    for prefix in ("Error: ", "Parser Error: "):
        first = first.removeprefix(prefix)
    return first
