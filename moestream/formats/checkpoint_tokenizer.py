"""A checkpoint's tokenizer.json (+ tokenizer_config.json, chat_template.jinja) -> the `tokenizer.ggml.*`
keys llama.cpp's converter writes, so that formats/tokenizer.py reads a checkpoint's tokenizer as a GGUF's.

Byte-level BPE only (what formats/tokenizer.py runs); the pre-tokenizer is named by the split regex the
file holds, as the converter names it by what the tokenizer does.
"""

from __future__ import annotations

import os
from typing import Any

from moestream.errors import ModelFileError
from moestream.formats import tokenizer as tk


def _read(directory: str, name: str) -> Any:
    from moestream.formats.checkpoint import read_json

    path = os.path.join(directory, name)
    return read_json(path, name) if os.path.exists(path) else None


def _pre(spec: Any) -> str:
    """The tokenizer.ggml.pre name whose regex the pre-tokenizer's Split holds ('default': GPT-2's)."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            pattern = node.get("pattern")
            if node.get("type") == "Split" and isinstance(pattern, dict) and "Regex" in pattern:
                found.append(pattern["Regex"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(spec)
    names = {tk.QWEN2_SPLIT: "qwen2", tk.QWEN35_SPLIT: "qwen35", tk.LLAMA3_SPLIT: "llama-bpe"}
    return next((names[r] for r in found if r in names), "default")


def _token_id(value: Any, ids: dict[str, int]) -> int | None:
    if isinstance(value, dict):
        value = value.get("content")
    return ids.get(value) if isinstance(value, str) else None


def metadata(directory: str, vocab_size: int | None = None) -> dict[str, Any]:
    """The tokenizer keys of the checkpoint in `directory`; {} when it has no tokenizer.json."""
    spec = _read(directory, "tokenizer.json")
    if spec is None:
        return {}
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ModelFileError(f"{directory}/tokenizer.json is not a byte-level BPE tokenizer, the kind moestream runs")
    ids: dict[str, int] = dict(model["vocab"])
    special: set[str] = set()
    for t in spec.get("added_tokens") or []:
        ids[t["content"]] = t["id"]
        (special.add(t["content"]) if t.get("special") else None)
    size = max(max(ids.values()) + 1, vocab_size or 0)
    tokens, types = [f"[PAD{i}]" for i in range(size)], [tk.UNUSED] * size
    for text, i in ids.items():
        tokens[i] = text
        types[i] = tk.CONTROL if text in special else tk.USER_DEFINED if i >= len(model["vocab"]) else tk.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    conf = _read(directory, "tokenizer_config.json") or {}
    md: dict[str, Any] = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": _pre(spec.get("pre_tokenizer")),
                          "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                          "tokenizer.ggml.merges": merges,
                          "tokenizer.ggml.add_bos_token": bool(conf.get("add_bos_token", False))}  # fmt: skip
    for key, field in (("bos", "bos_token"), ("eos", "eos_token"), ("padding", "pad_token")):
        if (tid := _token_id(conf.get(field), ids)) is not None:
            md[f"tokenizer.ggml.{key}_token_id"] = tid
    template = conf.get("chat_template")
    jinja = os.path.join(directory, "chat_template.jinja")
    if template is None and os.path.exists(jinja):
        with open(jinja, encoding="utf-8") as fh:
            template = fh.read()
    if isinstance(template, str):
        md["tokenizer.chat_template"] = template
    return md
