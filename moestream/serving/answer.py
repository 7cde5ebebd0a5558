"""A request's answer in OpenAI's shape: chat or text-completion objects, whole or as server-sent events."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from moestream.engine.stats import GenerationStats
from moestream.serving.text import Piece, Reasoning, split_pieces


class Answer:
    """Formats one request's answer: OpenAI's chat or text-completion objects, whole or as SSE chunks."""

    def __init__(self, chat: bool, model_name: str, include_usage: bool = False):
        self.chat = chat
        self.include_usage = include_usage
        self.base = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model_name,
        }

    def _chunk(self, choice: dict[str, Any] | None, usage: Any = None) -> str:
        body: dict[str, Any] = {**self.base, "choices": [] if choice is None else [choice]}
        if self.include_usage or usage is not None:  # with include_usage, every chunk has the key
            body["usage"] = usage
        return sse(body)

    def _choice(self, piece: Piece | None, finish: str | None = None) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
        if piece is None:
            delta: dict[str, Any] = {}
        elif isinstance(piece, str):
            delta = {"content": piece}
        elif isinstance(piece, Reasoning):
            delta = {"reasoning_content": piece.text}
        else:
            delta = {"tool_calls": [piece.to_dict(with_index=True)]}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def start(self) -> list[str]:
        return (
            [
                self._chunk(
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                )
            ]
            if self.chat
            else []
        )

    def piece(self, piece: Piece) -> str:
        return self._chunk(self._choice(piece))

    def end(self, finish: str, usage: dict[str, Any]) -> list[str]:
        # usage rides on the last chunk; with include_usage, in a chunk of its own as OpenAI sends it
        if not self.include_usage:
            return [self._chunk(self._choice(None, finish), usage)]
        return [self._chunk(self._choice(None, finish)), self._chunk(None, usage)]

    def whole(
        self, pieces: list[Piece], finish_reason: str, usage: dict[str, Any], use_tools: bool = False
    ) -> dict[str, Any]:
        """The whole answer from all its pieces: a chat answer's reasoning, content and tool calls (with tools,
        empty content is null, as OpenAI sends it)."""
        reasoning, content, calls = split_pieces(pieces)
        if not self.chat:
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish_reason}
            return {**self.base, "choices": [choice], "usage": usage}
        message: dict[str, Any] = {"role": "assistant", "content": (content or None) if use_tools else content}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [c.to_dict() for c in calls]
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
        return {**self.base, "object": "chat.completion", "choices": [choice], "usage": usage}


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
