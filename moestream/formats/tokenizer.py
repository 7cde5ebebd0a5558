"""Text <-> token ids from a GGUF's `tokenizer.ggml.*` metadata.

llama.cpp's converter stores a byte-level BPE vocabulary (`tokenizer.ggml.model == "gpt2"`) as three
parallel arrays (tokens, token types, merges) plus the name of the pre-tokenizer regex. We rebuild the
Hugging Face `tokenizers` pipeline the model was trained with (NFC for Qwen, regex split, byte-level
alphabet, BPE merges, special tokens matched in the text) and decode ids ourselves from the byte
alphabet, so streaming and one-shot decoding share one code path.
"""

from __future__ import annotations

import codecs
import warnings
from collections import Counter
from collections.abc import Iterable
from typing import Any

from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import ByteLevel as ByteLevelDecoder
from tokenizers.models import BPE

from moestream.errors import ModelFileError

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what byte-level BPE vocab strings are made of)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


BYTE_TO_UNICODE = bytes_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}

# Split regexes as the models' tokenizer.json files spell them (llama.cpp spells the contractions out
# instead of `(?i:...)`; same matches). Qwen splits digits one by one; Llama 3 in runs of up to three.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# Qwen 3.5: combining marks (\p{M}) stay with their letters instead of joining punctuation runs
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


# Pre-tokenizers that cut every digit out alone before the GPT-2 regex runs on the rest (llama.cpp's second
# regex group; SmolLM2's tokenizer.json: Digits(individual_digits) then ByteLevel): not one regex, since the
# regex's lookahead `\s+(?!\S)` then sees the end of a piece where a digit was.
DIGITS_FIRST = ("smollm", "starcoder", "refact")

# tokenizer.ggml.pre -> (split regex, NFC-normalize, ignore_merges). Names follow llama.cpp's
# converter. Qwen's tokenizer.json normalizes to NFC (llama.cpp skips that; identical on NFC text);
# only Llama 3 looks whole pieces up in the vocab before merging (ignore_merges).
_PRE: dict[str, tuple[str, bool, bool]] = {
    **dict.fromkeys(
        ("qwen2", "qwen3", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan"), (QWEN2_SPLIT, True, False)
    ),
    "qwen35": (QWEN35_SPLIT, True, False),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe"), (LLAMA3_SPLIT, False, True)),
    **dict.fromkeys(("dbrx", "smaug-bpe"), (LLAMA3_SPLIT, False, False)),
    **dict.fromkeys(("default", "gpt2", "gpt-2"), (GPT2_SPLIT, False, False)),
    **dict.fromkeys(DIGITS_FIRST, (GPT2_SPLIT, False, False)),
}

# Texts of tokens that end a turn in some chat format (llama.cpp's end-of-generation list).
_END_OF_TURN_TEXTS = frozenset(
    {
        "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
        "<|end_of_text|>", "<end_of_utterance>", "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>", "<|return|>", "<|call|>",
    }
)  # fmt: skip
# GPT-OSS (harmony) ends every message with <|end|> but its turn only with <|return|> or <|call|>: where
# those exist, <|end|> does not stop the generation (llama.cpp's rule too)
_HARMONY_TURN_ENDS = frozenset({"<|return|>", "<|call|>"})


class Tokenizer:
    """Byte-level BPE tokenizer rebuilt from GGUF metadata. Encoding runs in HF `tokenizers` (Rust)."""

    def __init__(
        self,
        tokens: list[str],
        token_types: list[int] | None,
        merges: list[str],
        *,
        pre: str = "default",
        bos_id: int | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
        extra_stop_ids: Iterable[int] = (),
    ):
        if not tokens:
            raise ModelFileError("the model file has an empty tokenizer vocabulary; re-convert the model")
        types = list(token_types) if token_types else [NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise ModelFileError(
                f"tokenizer.ggml.token_type has {len(types)} entries but there are {len(tokens)} tokens; "
                "re-convert the model"
            )
        for name, tid in (("bos", bos_id), ("eos", eos_id), ("padding", pad_id)):
            if tid is not None and not 0 <= tid < len(tokens):
                raise ModelFileError(
                    f"tokenizer.ggml.{name}_token_id {tid} is outside the {len(tokens)}-token vocabulary; "
                    "re-convert the model"
                )
        self.tokens = tokens
        self.token_types = types
        self.pre = pre
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._hf = _build_hf_tokenizer(tokens, types, merges, pre)
        self._bytes: list[bytes | None] = [None] * len(tokens)  # filled on first use: decoding is sparse

        stops = {i for i in (eos_id, *extra_stop_ids) if i is not None and 0 <= i < len(tokens)}
        stops.update(i for i, t in enumerate(tokens) if t in _END_OF_TURN_TEXTS)
        if _HARMONY_TURN_ENDS <= set(tokens):
            stops.difference_update(i for i, t in enumerate(tokens) if t == "<|end|>")
        self.stop_ids: set[int] = stops

    @classmethod
    def from_metadata(cls, md: dict[str, Any]) -> Tokenizer:
        model = md.get("tokenizer.ggml.model")
        if model is None:
            raise ModelFileError(
                "the model file has no tokenizer (tokenizer.ggml.model is missing); use a GGUF converted "
                "by llama.cpp's convert_hf_to_gguf.py"
            )
        if model != "gpt2":
            raise ModelFileError(
                f"tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2', as Qwen and Llama 3 use) is supported"
            )
        tokens = _str_list(md, "tokens")
        if not tokens:
            raise ModelFileError("the model file has no tokenizer.ggml.tokens vocabulary; re-convert the model")
        types = md.get("tokenizer.ggml.token_type")
        if types is not None and not (isinstance(types, list) and all(_is_int(v) for v in types)):
            raise _bad_key("token_type", "a list of integers")
        extra = [i for i in (_opt_id(md, "eot_token_id"), _opt_id(md, "eom_token_id")) if i is not None]
        pre = md.get("tokenizer.ggml.pre") or "default"
        template = md.get("tokenizer.chat_template")
        if not isinstance(pre, str):
            raise _bad_key("pre", "a string")
        if template is not None and not isinstance(template, str):
            raise ModelFileError("tokenizer.chat_template should be a string; re-convert the model")
        return cls(
            tokens,
            types,
            _str_list(md, "merges"),
            pre=pre,
            bos_id=_opt_id(md, "bos_token_id"),
            eos_id=_opt_id(md, "eos_token_id"),
            pad_id=_opt_id(md, "padding_token_id"),
            add_bos=_flag(md, "add_bos_token"),
            chat_template=template,
            extra_stop_ids=extra,
        )

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def bos_token(self) -> str:
        """Text of the BOS token ("" if none); chat templates take it as `bos_token`."""
        return "" if self.bos_id is None else self.tokens[self.bos_id]

    @property
    def eos_token(self) -> str:
        return "" if self.eos_id is None else self.tokens[self.eos_id]

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids for `text`; special tokens written in the text (`<|im_start|>`) become their ids."""
        ids = self._hf.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        data = b"".join(self.token_bytes(i, skip_special) for i in ids)
        return data.decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        """The token's vocabulary string as stored (byte-level alphabet: a leading space reads 'Ġ')."""
        self._check_id(token_id)
        return self.tokens[token_id]

    def token_bytes(self, token_id: int, skip_special: bool = False) -> bytes:
        """The bytes this token adds to the output (a piece of a UTF-8 character is possible)."""
        self._check_id(token_id)
        ttype = self.token_types[token_id]
        if ttype in (CONTROL, UNKNOWN):
            return b"" if skip_special else self.tokens[token_id].encode()
        cached = self._bytes[token_id]
        if cached is None:
            cached = self._bytes[token_id] = _piece_bytes(self.tokens[token_id], ttype)
        return cached

    def is_special(self, token_id: int) -> bool:
        return self.token_types[token_id] in (CONTROL, UNKNOWN)

    def stream(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special)

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < len(self.tokens):
            raise ValueError(f"token id {token_id} is outside the {len(self.tokens)}-token vocabulary")


class StreamDecoder:
    """Turns generated ids into text increments; bytes of an unfinished UTF-8 character wait for the rest.

    An emoji is often 2-4 byte tokens; printing each token's bytes on their own would show U+FFFD.
    Bytes that can never become a valid character are replaced (U+FFFD), as in `Tokenizer.decode`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """Text that became complete with this token (may be "")."""
        return self._utf8.decode(self.tokenizer.token_bytes(token_id, self.skip_special))

    def flush(self) -> str:
        """At the end of the stream: whatever is held back, an incomplete character as U+FFFD."""
        return self._utf8.decode(b"", final=True)


def _piece_bytes(text: str, ttype: int) -> bytes:
    if ttype == UNUSED:
        return b""  # vocabulary padding ([PAD151700]); llama.cpp prints nothing for these
    if ttype == USER_DEFINED:
        return text.encode()  # added tokens (<think>) are stored as plain text
    try:
        return bytes(UNICODE_TO_BYTE[c] for c in text)
    except KeyError:  # not in the byte alphabet: a converter that stored plain text; print it as is
        return text.encode()


def _build_hf_tokenizer(tokens: list[str], types: list[int], merges: list[str], pre: str) -> HFTokenizer:
    if pre not in _PRE:
        warnings.warn(
            f"unknown tokenizer.ggml.pre {pre!r}; splitting text with the GPT-2 regex, which may tokenize "
            "differently from the model's own tokenizer",
            stacklevel=3,
        )
    split, nfc, ignore_merges = _PRE.get(pre, _PRE["default"])
    # a string listed twice keeps its last id, as llama.cpp's token_to_id map does
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise ModelFileError(f"tokenizer.ggml.merges has a malformed entry {m!r}; re-convert the model")
        pairs.append((a, b))
    try:
        model = BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges)
    except Exception as exc:  # a merge naming a token the vocabulary lacks
        reason = " ".join(str(exc).split())[:200]  # the library's message may span lines
        raise ModelFileError(f"the tokenizer vocabulary is inconsistent ({reason}); re-convert the model") from None
    tok = HFTokenizer(model)
    if nfc:
        tok.normalizer = normalizers.NFC()
    digits = [pre_tokenizers.Digits(individual_digits=True)] if pre in DIGITS_FIRST else []
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            *digits,
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = ByteLevelDecoder()
    # Control tokens are "special" (skipped by skip_special); user-defined ones (<think>) are plain
    # added text. Both are matched whole in the input before the regex split, as llama.cpp does.
    special = [
        AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True) if k == CONTROL and t
    ]
    added = [
        AddedToken(t, special=False, normalized=False)
        for t, k in zip(tokens, types, strict=True)
        if k == USER_DEFINED and t
    ]
    tok.add_special_tokens(special)
    tok.add_tokens(added)
    return tok


# --------------------------------------------------------------------------------------------------
# A tiny working vocabulary for synthetic models and tests
# --------------------------------------------------------------------------------------------------

_TINY_CORPUS = """\
The expert network reads the question, thinks for a moment, and then writes an answer. Each layer of
the model routes every token to a few of its experts, and only those experts are read from the disk.
A small cache keeps the experts that were used most recently in memory, so the next token is faster.
When the cache is full, the expert that was used least recently is dropped to make room for a new one.

The user asks: what is the weather like in Paris today? The assistant answers that it will call a tool
to find out, because it does not know. The system message says that the assistant is helpful, honest
and brief. The tool returns a temperature of 21 degrees, and the assistant tells the user the result.
Numbers such as 0 1 2 3 4 5 6 7 8 9, 42, 2024 and 3.14 appear in text, and so do names like "get_weather"
with arguments {"city": "Paris", "unit": "celsius"}. def main(): print("hello, world") # it's done!

Good morning! Could you please summarize this article in three sentences? Certainly. The article
describes how researchers measured rainfall across several mountain villages during two summers, found
that storms arrived earlier than expected, and recommended building larger reservoirs. Would you like
more details about their methods, the equipment they used, or the conclusions they reached? Yes, please
explain the methods. They installed automatic gauges, collected hourly readings, compared them with
satellite images, and checked everything against historical records kept by local farmers.

import json
for item in items:
    if item["score"] > 0.5:
        results.append({"id": item["id"], "label": item.get("label", "unknown")})
return json.dumps(results, indent=2)
"""

TINY_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
    "<tool_response>", "</tool_response>", "<think>", "</think>",
)  # fmt: skip

# Qwen3's chat format in a compact template: tools go in the system turn inside <tools></tools>,
# assistant tool calls are <tool_call> JSON blocks, tool results come back as user turns wrapped in
# <tool_response>, and enable_thinking=false pre-fills an empty think block.
TINY_CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments ' }}
{{- 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": ' }}
{{- '<args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}
{{- '<|im_start|>assistant\\n' + content }}
{%- for call in message.tool_calls or [] %}
{%- set call = call.function if call.function else call %}
{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{{- call.arguments if call.arguments is string else (call.arguments | tojson) }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}"""


def build_tiny_bpe_metadata(extra_text: str | None = None, n_merges: int = 500) -> dict[str, Any]:
    """GGUF tokenizer metadata for a small byte-level BPE vocabulary laid out like Qwen's.

    Ids 0-255 are the byte alphabet, then one token per learned merge, then the special tokens.
    The merges are learned on a built-in paragraph (plus `extra_text`), so common English words
    become single tokens. Same arguments, same output.
    """
    corpus = _TINY_CORPUS if extra_text is None else _TINY_CORPUS + "\n" + extra_text
    splitter = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    words = Counter(piece for piece, _ in splitter.pre_tokenize_str(corpus))
    merges = _learn_merges(words, n_merges)

    tokens = [BYTE_TO_UNICODE[b] for b in BYTE_TO_UNICODE]  # GPT-2 order: '!' is id 0, as in Qwen
    known = set(tokens)
    for a, b in merges:
        if a + b not in known:  # two merges can spell the same string; it gets one id
            known.add(a + b)
            tokens.append(a + b)
    types = [NORMAL] * len(tokens)
    first_special = len(tokens)
    for t in TINY_SPECIAL_TOKENS:
        tokens.append(t)
        # llama.cpp's converter makes <|...|> tokens control tokens, other added tokens user-defined
        types.append(CONTROL if t.startswith("<|") and t.endswith("|>") else USER_DEFINED)
    ids = {t: first_special + i for i, t in enumerate(TINY_SPECIAL_TOKENS)}
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in merges],
        "tokenizer.ggml.bos_token_id": ids["<|endoftext|>"],  # Qwen3's GGUFs name <|endoftext|> as BOS
        "tokenizer.ggml.eos_token_id": ids["<|im_end|>"],
        "tokenizer.ggml.padding_token_id": ids["<|endoftext|>"],
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": TINY_CHAT_TEMPLATE,
    }


def _learn_merges(words: Counter[str], n_merges: int) -> list[tuple[str, str]]:
    """Plain BPE training: repeatedly merge the most frequent adjacent pair (ties: smallest pair)."""
    # sorted so the result never depends on dict order
    segs = [(list(w), c) for w, c in sorted(words.items())]
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        counts: Counter[tuple[str, str]] = Counter()
        for seg, c in segs:
            for pair in zip(seg, seg[1:], strict=False):
                counts[pair] += c
        if not counts:
            break  # every word is one token already
        best = min(counts, key=lambda p: (-counts[p], p))
        merges.append(best)
        a, b = best
        for seg, _ in segs:
            i = 0
            while i < len(seg) - 1:
                if seg[i] == a and seg[i + 1] == b:
                    seg[i : i + 2] = [a + b]
                i += 1
    return merges


def _bad_key(key: str, what: str) -> ModelFileError:
    return ModelFileError(f"tokenizer.ggml.{key} should be {what}; re-convert the model")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _str_list(md: dict[str, Any], key: str) -> list[str]:
    v = md.get(f"tokenizer.ggml.{key}")
    if v is None:
        return []
    if not (isinstance(v, list) and all(isinstance(s, str) for s in v)):
        raise _bad_key(key, "a list of strings")
    return v


def _opt_id(md: dict[str, Any], key: str) -> int | None:
    v = md.get(f"tokenizer.ggml.{key}")
    if v is not None and not _is_int(v):
        raise _bad_key(key, "an integer token id")
    return v


def _flag(md: dict[str, Any], key: str) -> bool:
    v = md.get(f"tokenizer.ggml.{key}", False)
    if not isinstance(v, bool | int) or isinstance(v, float):
        raise _bad_key(key, "true or false")
    return bool(v)
