"""A request's answer in OpenAI's shape: chat or text-completion objects, whole or as server-sent events."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from moestream.engine.sampling import TokenLogprobs
from moestream.engine.stats import GenerationStats
from moestream.serving.text import Piece, Reasoning, split_pieces

LOGPROB_FLOOR = -9999.0


@dataclass
class Choice:
    """One choice of a whole (not streamed) answer, as its events come."""

    pieces: list[Piece] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str = "length"


class Answer:
    """Formats one request's answer: OpenAI's chat or text-completion objects, whole or as SSE chunks.
    tokenizer: given when the request asked for log-probabilities (it names their tokens)."""

    def __init__(
        self,
        chat: bool,
        model_name: str,
        include_usage: bool = False,
        *,
        request_id: str | None = None,
        n: int = 1,
        tokenizer: Any = None,
    ):
        self.chat = chat
        self.include_usage = include_usage
        self.n = n
        self.tokenizer = tokenizer
        self.offsets = [0] * n  # a completion's text offsets of its tokens, per choice
        self.base = {
            "id": request_id or new_id(chat),
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model_name,
        }

    def _chunk(self, choice: dict[str, Any] | None, usage: Any = None) -> str:
        body: dict[str, Any] = {**self.base, "choices": [] if choice is None else [choice]}
        if self.include_usage or usage is not None:  # with include_usage, every chunk has the key
            body["usage"] = usage
        return sse(body)

    def _choice(
        self, piece: Piece | None, finish: str | None = None, index: int = 0, lps: list[TokenLogprobs] | None = None
    ) -> dict[str, Any]:
        logprobs = self.logprobs(lps or [], index)
        if not self.chat:
            return {"index": index, "text": piece or "", "logprobs": logprobs, "finish_reason": finish}
        if piece is None:
            delta: dict[str, Any] = {}
        elif isinstance(piece, str):
            delta = {"content": piece}
        elif isinstance(piece, Reasoning):
            delta = {"reasoning_content": piece.text}
        else:
            delta = {"tool_calls": [piece.to_dict(with_index=True)]}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def start(self) -> list[str]:
        if not self.chat:
            return []
        role = {"role": "assistant", "content": ""}
        return [
            self._chunk({"index": i, "delta": role, "logprobs": None, "finish_reason": None}) for i in range(self.n)
        ]

    def pieces(self, pieces: list[Piece], index: int = 0, lps: list[TokenLogprobs] | None = None) -> list[str]:
        """The chunks of a choice's pieces; the log-probabilities of their tokens ride on the first."""
        if not pieces:
            return [self._chunk(self._choice(None, None, index, lps))] if lps else []
        return [self._chunk(self._choice(p, None, index, lps if i == 0 else None)) for i, p in enumerate(pieces)]

    def end(self, finish: str, usage: dict[str, Any] | None, index: int = 0) -> list[str]:
        """A choice's last chunk; the request's last choice (usage given) also carries the usage."""
        if usage is None:
            return [self._chunk(self._choice(None, finish, index))]
        # usage rides on the last chunk; with include_usage, in a chunk of its own as OpenAI sends it
        if not self.include_usage:
            return [self._chunk(self._choice(None, finish, index), usage)]
        return [self._chunk(self._choice(None, finish, index)), self._chunk(None, usage)]

    def whole(self, choices: list[Choice], usage: dict[str, Any], use_tools: bool = False) -> dict[str, Any]:
        """The whole answer from all its choices' pieces: a chat answer's reasoning, content and tool calls (with
        tools, empty content is null, as OpenAI sends it)."""
        out = []
        for i, c in enumerate(choices):
            reasoning, content, calls = split_pieces(c.pieces)
            logprobs = self.logprobs(c.logprobs, i)
            if not self.chat:
                out.append({"index": i, "text": content, "logprobs": logprobs, "finish_reason": c.finish_reason})
                continue
            message: dict[str, Any] = {"role": "assistant", "content": (content or None) if use_tools else content}
            if reasoning:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = [call.to_dict() for call in calls]
            out.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": c.finish_reason})
        if not self.chat:
            return {**self.base, "choices": out, "usage": usage}
        return {**self.base, "object": "chat.completion", "choices": out, "usage": usage}

    def logprobs(self, lps: list[TokenLogprobs], index: int) -> dict[str, Any] | None:
        """OpenAI's logprobs object for these tokens: the chat shape (content: token, logprob, bytes,
        top_logprobs), or the completions' legacy one (tokens, token_logprobs, top_logprobs, text_offset)."""
        if self.tokenizer is None:
            return None
        if self.chat:
            entries = [
                {**self._token(t.token, t.logprob), "top_logprobs": [self._token(*p) for p in t.top]} for t in lps
            ]
            return {"content": entries, "refusal": None}
        tokens = [self._token(t.token, t.logprob)["token"] for t in lps]
        offsets = []
        for text in tokens:
            offsets.append(self.offsets[index])
            self.offsets[index] += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [t.logprob for t in lps],
            "top_logprobs": [{self._token(*p)["token"]: p[1] for p in t.top} for t in lps],
            "text_offset": offsets,
        }

    def _token(self, token: int, logprob: float) -> dict[str, Any]:
        tok = self.tokenizer
        raw = tok.token_bytes(token) if 0 <= token < tok.vocab_size else b""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:  # a piece of a character: OpenAI writes such a token as its bytes
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        # a token a tiny temperature makes impossible: -inf is no JSON number (OpenAI writes -9999 too)
        return {"token": text, "logprob": max(logprob, LOGPROB_FLOOR), "bytes": list(raw)}


def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def usage_of(st: GenerationStats) -> dict[str, Any]:
    """OpenAI's usage object for a generation."""
    prompt, completion = st.prompt_tokens, st.decode_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": st.reused_tokens},
    }
