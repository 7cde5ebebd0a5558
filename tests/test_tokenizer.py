"""Tokenizer built from GGUF metadata vs. transformers' own Qwen tokenizers on the same vocab/merges."""

from __future__ import annotations

import unicodedata
from pathlib import Path
from typing import Any

import gguf
import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken
from transformers import Qwen2Tokenizer, Qwen3_5Tokenizer

from moestream.errors import ModelFileError
from moestream.formats.gguf_file import GGUFFile
from moestream.formats.tokenizer import (
    BYTE_TO_UNICODE,
    CONTROL,
    GPT2_SPLIT,
    LLAMA3_SPLIT,
    QWEN2_SPLIT,
    USER_DEFINED,
    Tokenizer,
    build_tiny_bpe_metadata,
)

SAMPLES = [
    "",
    "Hello, world!",
    "The expert network reads the question, thinks, and then writes an answer.",
    "it's they'RE we'll I'M you'd",
    "café naïve façade Ünïcödé",
    "你好，世界！今天是2026年8月13日",
    "日本語のテキストと한국어",
    "🎉🚀 family: 👨‍👩‍👧 flag: 🇫🇷",
    "12345",
    "3.14159 and 1,000,000 and 0x1F",
    "  leading spaces",
    "trailing spaces   ",
    "a\n\n\nb",
    "tabs\t\there",
    "\r\n windows line\r\nend",
    "   \n  \n",
    "def f(x):\n    return x**2  # square\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "a<|endoftext|>b<|im_start|><|im_start|>",
    "<|im_sta not special <think",
    "สวัสดีครับ ผมชื่ออเล็กซ์",
    "क्षत्रिय नमस्ते",
    "e\u0301 (decomposed e + acute)",
]


def byte_level(text: str) -> str:
    return "".join(BYTE_TO_UNICODE[b] for b in text.encode())


def tiny_tokenizer_md() -> dict[str, Any]:
    return build_tiny_bpe_metadata()


def hf_reference(md: dict[str, Any], cls: type = Qwen2Tokenizer):
    """transformers' Qwen tokenizer on the same vocab + merges, added tokens as in Qwen's tokenizer.json."""
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in md["tokenizer.ggml.merges"]]
    ref = cls(vocab=vocab, merges=merges)
    ref.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True) if k == CONTROL]
    )
    ref.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == USER_DEFINED
        ]
    )
    return ref


def python_bpe(text: str, md: dict[str, Any], split: str, nfc: bool, ignore_merges: bool = False) -> list[int]:
    """From-scratch byte-level BPE (the `regex` module + rank-ordered merges), independent of `tokenizers`."""
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    vocab = {t: i for i, t in enumerate(tokens)}
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(md["tokenizer.ggml.merges"])}
    specials = sorted(
        (t for t, k in zip(tokens, types, strict=True) if k in (CONTROL, USER_DEFINED)), key=len, reverse=True
    )
    special_re = "(" + "|".join(regex.escape(t) for t in specials) + ")"
    out: list[int] = []
    for i, chunk in enumerate(regex.split(special_re, text)):
        if i % 2:
            out.append(vocab[chunk])
            continue
        if nfc:
            chunk = unicodedata.normalize("NFC", chunk)
        for piece in regex.findall(split, chunk):
            word = [BYTE_TO_UNICODE[b] for b in piece.encode()]
            if ignore_merges and "".join(word) in vocab:
                out.append(vocab["".join(word)])
                continue
            while len(word) > 1:
                pairs = [(ranks.get(p, 1 << 30), j) for j, p in enumerate(zip(word, word[1:], strict=False))]
                rank, j = min(pairs)
                if rank == 1 << 30:
                    break
                word[j : j + 2] = [word[j] + word[j + 1]]
            out.extend(vocab[w] for w in word)
    return out


def write_gguf(path: Path, md: dict[str, Any]) -> None:
    w = gguf.GGUFWriter(str(path), arch="qwen3moe")
    w.add_tokenizer_model(md["tokenizer.ggml.model"])
    w.add_tokenizer_pre(md["tokenizer.ggml.pre"])
    w.add_token_list(md["tokenizer.ggml.tokens"])
    w.add_token_types(md["tokenizer.ggml.token_type"])
    w.add_token_merges(md["tokenizer.ggml.merges"])
    w.add_bos_token_id(md["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(md["tokenizer.ggml.eos_token_id"])
    w.add_pad_token_id(md["tokenizer.ggml.padding_token_id"])
    w.add_add_bos_token(md["tokenizer.ggml.add_bos_token"])
    w.add_chat_template(md["tokenizer.chat_template"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def md() -> dict[str, Any]:
    return tiny_tokenizer_md()


@pytest.fixture(scope="module")
def tok(md: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_metadata(md)


@pytest.fixture(scope="module")
def ref(md: dict[str, Any]):
    return hf_reference(md)


def test_from_gguf_file_matches_transformers(tmp_path: Path, md: dict[str, Any], ref) -> None:
    path = tmp_path / "tok.gguf"
    write_gguf(path, md)
    read = GGUFFile(path).metadata
    assert read["tokenizer.ggml.tokens"] == md["tokenizer.ggml.tokens"]
    tok = Tokenizer.from_metadata(read)
    assert tok.chat_template == md["tokenizer.chat_template"]
    assert tok.add_bos is False
    for s in SAMPLES:
        assert tok.encode(s) == ref.encode(s, add_special_tokens=False), s


@pytest.mark.parametrize("text", SAMPLES)
def test_encode_matches_transformers_and_python_bpe(tok: Tokenizer, ref, md: dict[str, Any], text: str) -> None:
    ids = tok.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False)
    assert ids == python_bpe(text, md, QWEN2_SPLIT, nfc=True)


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    # Qwen normalizes to NFC, so the round trip is exact for NFC text (all of SAMPLES but the last)
    assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=40))
def test_random_text_matches_transformers_and_round_trips(tok: Tokenizer, ref, text: str) -> None:
    ids = tok.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == unicodedata.normalize("NFC", text)


def test_qwen_splits_digits_one_by_one(tok: Tokenizer) -> None:
    ids = tok.encode("12345")
    assert [tok.token_text(i) for i in ids] == list("12345")


def test_special_tokens_are_single_ids(tok: Tokenizer, md: dict[str, Any]) -> None:
    tokens = md["tokenizer.ggml.tokens"]
    for t in (
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
    ):
        assert tok.encode(t) == [tokens.index(t)]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tokens.index("<|im_start|>") and ids[-1] == tokens.index("<|im_end|>")


def test_decode_skip_special_drops_control_tokens_only(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\n<think>\nok\n</think>\n\nDone.<|im_end|>")
    assert tok.decode(ids) == "<|im_start|>assistant\n<think>\nok\n</think>\n\nDone.<|im_end|>"
    # <think> is a user-defined token (llama.cpp prints it); <|im_...|> are control tokens
    assert tok.decode(ids, skip_special=True) == "assistant\n<think>\nok\n</think>\n\nDone."


def test_ids_and_stop_set(tok: Tokenizer, md: dict[str, Any]) -> None:
    tokens = md["tokenizer.ggml.tokens"]
    assert tok.vocab_size == len(tokens)
    assert tok.bos_id == tokens.index("<|endoftext|>") and tok.bos_token == "<|endoftext|>"
    assert tok.eos_id == tokens.index("<|im_end|>") and tok.eos_token == "<|im_end|>"
    assert tok.stop_ids == {tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")}
    assert tok.encode("hi", add_bos=True)[0] == tok.bos_id
    assert tok.encode("hi")[0] != tok.bos_id  # add_bos_token is false for Qwen
    assert tok.token_text(tok.encode(" the")[0]) == "Ġthe"


def test_stream_decoder_holds_back_partial_utf8(tok: Tokenizer) -> None:
    text = "Hi 🎉 你好 é!"
    ids = tok.encode(text)
    stream = tok.stream()
    pieces = [stream.add(i) for i in ids]
    pieces.append(stream.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    # the emoji is 4 byte tokens: three of them yield nothing, the fourth yields the whole character
    emoji_ids = tok.encode("🎉")
    assert len(emoji_ids) == 4
    stream = tok.stream()
    assert [stream.add(i) for i in emoji_ids] == ["", "", "", "🎉"]


def test_stream_decoder_flushes_incomplete_tail(tok: Tokenizer) -> None:
    stream = tok.stream()
    assert stream.add(tok.encode("🎉")[0]) == ""
    assert stream.flush() == "\ufffd"
    assert tok.decode(tok.encode("🎉")[:2]) == "\ufffd"


def test_llama3_pre_groups_digits_and_ignores_merges(md: dict[str, Any]) -> None:
    md3 = {**md, "tokenizer.ggml.pre": "llama-bpe"}
    tok = Tokenizer.from_metadata(md3)
    for text in SAMPLES[:-1]:
        assert tok.encode(text) == python_bpe(text, md3, LLAMA3_SPLIT, nfc=False, ignore_merges=True), text
    assert [tok.token_text(i) for i in tok.encode("12345")] == ["1", "2", "3", "4", "5"]  # no 3-digit merges


def test_gpt2_pre(md: dict[str, Any]) -> None:
    md2 = {**md, "tokenizer.ggml.pre": "gpt2"}
    tok = Tokenizer.from_metadata(md2)
    for text in SAMPLES:
        assert tok.encode(text) == python_bpe(text, md2, GPT2_SPLIT, nfc=False), text


def test_qwen35_pre_matches_transformers(md: dict[str, Any]) -> None:
    md35 = {**md, "tokenizer.ggml.pre": "qwen35"}
    tok = Tokenizer.from_metadata(md35)
    ref35 = hf_reference(md35, Qwen3_5Tokenizer)
    for text in [*SAMPLES, "naïve a\u0300!b", "x\u0301.\u0302y"]:
        assert tok.encode(text) == ref35.encode(text, add_special_tokens=False), text
    # a combining mark joins the word before it, not the punctuation after it (x has no precomposed
    # accented form, so NFC keeps the mark). The vocab learns the qwen2 piece "\u0301!".
    md_marks = build_tiny_bpe_metadata("x\u0301! " * 4)
    qwen2 = Tokenizer.from_metadata(md_marks)
    qwen35 = Tokenizer.from_metadata({**md_marks, "tokenizer.ggml.pre": "qwen35"})
    assert [qwen2.token_text(i) for i in qwen2.encode("x\u0301!")] == ["x", byte_level("\u0301!")]
    assert qwen35.token_text(qwen35.encode("x\u0301!")[-1]) == "!"


def test_unknown_pre_warns_and_falls_back(md: dict[str, Any]) -> None:
    with pytest.warns(UserWarning, match="unknown tokenizer.ggml.pre"):
        tok = Tokenizer.from_metadata({**md, "tokenizer.ggml.pre": "some-new-model"})
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_unsupported_model_and_missing_vocab_errors(md: dict[str, Any]) -> None:
    with pytest.raises(ModelFileError, match="'llama'"):
        Tokenizer.from_metadata({**md, "tokenizer.ggml.model": "llama"})
    with pytest.raises(ModelFileError, match="tokenizer.ggml.model is missing"):
        Tokenizer.from_metadata({k: v for k, v in md.items() if k != "tokenizer.ggml.model"})
    with pytest.raises(ModelFileError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_metadata({k: v for k, v in md.items() if k != "tokenizer.ggml.tokens"})
    with pytest.raises(ModelFileError, match="token_type"):
        Tokenizer.from_metadata({**md, "tokenizer.ggml.token_type": [1, 1]})
    with pytest.raises(ModelFileError, match="inconsistent"):
        Tokenizer.from_metadata({**md, "tokenizer.ggml.merges": ["nota token"]})


def test_out_of_range_id(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="outside"):
        tok.decode([tok.vocab_size])


def test_tiny_metadata_is_deterministic_and_shaped_like_qwen(md: dict[str, Any]) -> None:
    assert build_tiny_bpe_metadata() == md
    tokens = md["tokenizer.ggml.tokens"]
    assert len(md["tokenizer.ggml.merges"]) == 500
    assert tokens[:256] == list(BYTE_TO_UNICODE.values()) and tokens[0] == "!"
    assert len(set(tokens)) == len(tokens)
    assert md["tokenizer.ggml.token_type"][tokens.index("<|im_start|>")] == CONTROL
    assert md["tokenizer.ggml.token_type"][tokens.index("<think>")] == USER_DEFINED
    bigger = build_tiny_bpe_metadata("supercalifragilistic " * 5, n_merges=40)
    assert len(bigger["tokenizer.ggml.merges"]) == 40 and bigger != md
    # common words from the built-in text are single tokens
    tok = Tokenizer.from_metadata(md)
    assert len(tok.encode(" the")) == 1 and len(tok.encode(" expert")) == 1
