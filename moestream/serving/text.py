"""The text pipeline: token ids -> text cut at stop strings, tool calls parsed out of it, and the answer
formatted as OpenAI's objects (whole, or as server-sent events).

stream_text is the one place generated tokens become text, for `run`, `chat` and `serve` alike.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

from moestream.engine.sampling import Sampler
from moestream.engine.stats import GenerationStats

# --------------------------------------------------------------------------------------------------
# Token ids -> text, with stop strings
# --------------------------------------------------------------------------------------------------


def _partial_suffix(text: str, needles: list[str]) -> int:
    """Length of the longest end of `text` that is the start of some needle (it may still become one)."""
    best = 0
    for s in needles:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class StopText:
    """Token ids -> text increments, cut before the first stop string. The tokenizer's stop tokens and
    special tokens write nothing; bytes of an unfinished UTF-8 character wait for the rest, and text that
    might be the start of a stop string is held back until it is known not to be."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()):
        self.decoder = tokenizer.stream(skip_special=True)
        self.stop_ids = tokenizer.stop_ids
        self.stop = [s for s in stop if s]
        self.pending = ""
        self.stopped = False

    def add(self, token_id: int) -> str:
        if token_id in self.stop_ids:
            return ""
        return self._push(self.decoder.add(token_id))

    def flush(self) -> str:
        if self.stopped:
            return ""
        out = self._push(self.decoder.flush())
        if not self.stopped:
            out, self.pending = out + self.pending, ""
        return out

    def _push(self, text: str) -> str:
        if self.stopped:
            return ""
        self.pending += text
        hits = [i for s in self.stop if (i := self.pending.find(s)) >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[: min(hits)], ""
            return out
        keep = _partial_suffix(self.pending, self.stop)
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out


@dataclass
class TextStep:
    """One generated token as text (possibly empty). finish_reason is set on the last step: the engine's
    (stop | length), or "stop" when a stop string ended the generation."""

    text: str
    stats: GenerationStats
    finish_reason: str | None = None


def stream_text(
    engine: Any,
    prompt: list[int],
    max_new_tokens: int,
    sampler: Sampler | None = None,
    *,
    stop_ids: set[int] | None = None,
    stop: Sequence[str] = (),
) -> Iterator[TextStep]:
    """Engine.stream as text. The last step carries whatever text was held back. A consumer that stops
    early (break, close()) ends the generation as "cancelled"; use contextlib.closing to end it at once."""
    text = StopText(engine.tokenizer, stop)
    with closing(engine.stream(prompt, max_new_tokens, sampler, stop_ids)) as steps:
        for step in steps:
            piece = text.add(step.token)
            if text.stopped:
                steps.close()  # a stop string ends the generation at once
                yield TextStep(piece, step.stats, "stop")
                return
            if step.finish_reason is not None:
                piece += text.flush()
            yield TextStep(piece, step.stats, step.finish_reason)


@dataclass
class ToolCall:
    index: int
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self, with_index: bool = False) -> dict[str, Any]:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, **d} if with_index else d


TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


class ToolCallParser:
    """Splits streamed text into content and Qwen3/Hermes `<tool_call>\\n{json}\\n</tool_call>` calls.

    feed() returns what can be sent now: content strings and whole ToolCalls. Text that might be the
    start of `<tool_call>` is held back, and so is trailing whitespace (it is dropped if a call follows).
    A block whose JSON does not parse is passed on as content, as written.
    """

    def __init__(self) -> None:
        self.buf = ""
        self.space = ""  # whitespace held back
        self.in_call = False
        self.space_before = ""  # whitespace before the open call: layout if it parses, content if not
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[str | ToolCall]:
        self.buf += text
        out: list[str | ToolCall] = []
        while True:
            if not self.in_call:
                i = self.buf.find(TOOL_OPEN)
                if i < 0:
                    cut = len(self.buf) - _partial_suffix(self.buf, [TOOL_OPEN])
                    self._content(self.buf[:cut], out)
                    self.buf = self.buf[cut:]
                    return out
                self._content(self.buf[:i], out)
                self.space_before, self.space = self.space, ""
                self.buf, self.in_call = self.buf[i + len(TOOL_OPEN) :], True
            else:
                i = self.buf.find(TOOL_CLOSE)
                if i < 0:
                    return out
                body, self.buf, self.in_call = self.buf[:i], self.buf[i + len(TOOL_CLOSE) :], False
                call = self._parse(body)
                if call is None:
                    self._content(self.space_before + TOOL_OPEN + body + TOOL_CLOSE, out)
                else:
                    self.calls.append(call)
                    out.append(call)

    def finish(self) -> list[str | ToolCall]:
        """At the end of generation: whatever is held back (an unfinished call is content)."""
        out: list[str | ToolCall] = []
        rest = (self.space_before + TOOL_OPEN if self.in_call else "") + self.buf
        self.buf, self.in_call = "", False
        self._content(rest, out)
        if self.space and not self.calls:
            out.append(self.space)
        self.space = ""
        return out

    def _content(self, text: str, out: list[str | ToolCall]) -> None:
        text = self.space + text
        body = text.rstrip()
        self.space = text[len(body) :]
        if body:
            out.append(body)

    def _parse(self, body: str) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        return ToolCall(len(self.calls), obj["name"], args)


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Whole-text version of ToolCallParser: (content or None, calls)."""
    p = ToolCallParser()
    pieces = p.feed(text) + p.finish()
    content = "".join(x for x in pieces if isinstance(x, str))
    return content or None, p.calls


# --------------------------------------------------------------------------------------------------
# Answers in OpenAI's shape
# --------------------------------------------------------------------------------------------------


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

    def _choice(self, piece: str | ToolCall | None, finish: str | None = None) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
        if piece is None:
            delta: dict[str, Any] = {}
        elif isinstance(piece, str):
            delta = {"content": piece}
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

    def piece(self, piece: str | ToolCall) -> str:
        return self._chunk(self._choice(piece))

    def end(self, finish: str, usage: dict[str, Any]) -> list[str]:
        # usage rides on the last chunk; with include_usage, in a chunk of its own as OpenAI sends it
        if not self.include_usage:
            return [self._chunk(self._choice(None, finish), usage)]
        return [self._chunk(self._choice(None, finish)), self._chunk(None, usage)]

    def whole(self, text: str, finish_reason: str, usage: dict[str, Any], use_tools: bool) -> dict[str, Any]:
        if not self.chat:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            return {**self.base, "choices": [choice], "usage": usage}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        calls: list[ToolCall] = []
        if use_tools:
            message["content"], calls = parse_tool_calls(text)
            if calls:
                message["tool_calls"] = [c.to_dict() for c in calls]
        finish = finish_reason_with_calls(finish_reason, bool(calls))
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        return {**self.base, "object": "chat.completion", "choices": [choice], "usage": usage}


def finish_reason_with_calls(reason: str, has_calls: bool) -> str:
    return "tool_calls" if has_calls and reason == "stop" else reason


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
