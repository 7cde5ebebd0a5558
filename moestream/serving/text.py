"""The text pipeline: token ids -> text cut at stop strings, tool calls parsed out of it, and the answer
formatted as OpenAI's objects (whole, or as server-sent events).

stream_text is the one place generated tokens become text, for `run`, `chat` and `serve` alike.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

from moestream.engine.sampling import Sampler
from moestream.engine.stats import GenerationStats

# --------------------------------------------------------------------------------------------------
# Token ids -> text, with stop strings
# --------------------------------------------------------------------------------------------------


def partial_suffix(text: str, needles: list[str]) -> int:
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
    special tokens write nothing, except those in `keep` (markers a chat format's parser must see, such as
    a tool-call token); bytes of an unfinished UTF-8 character wait for the rest, and text that might be
    the start of a stop string is held back until it is known not to be."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), keep: Collection[int] = ()):
        self.tokenizer = tokenizer
        self.decoder = tokenizer.stream(skip_special=True)
        self.stop_ids = tokenizer.stop_ids
        self.keep = keep
        self.stop = [s for s in stop if s]
        self.pending = ""
        self.stopped = False

    def add(self, token_id: int) -> str:
        if token_id in self.stop_ids:
            return ""
        if token_id in self.keep:
            return self._push(self.decoder.flush() + self.tokenizer.token_text(token_id))
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
        keep = partial_suffix(self.pending, self.stop)
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
    keep: Collection[int] = (),
) -> Iterator[TextStep]:
    """Engine.stream as text (`keep`: special token ids written as text). The last step carries whatever
    text was held back. A consumer that stops early (break, close()) ends the generation as "cancelled";
    use contextlib.closing to end it at once."""
    text = StopText(engine.tokenizer, stop, keep)
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
class Reasoning:
    """A piece of the model's thinking (OpenAI's reasoning_content), as opposed to its answer."""

    text: str


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

# A call read from a block: (name, arguments as JSON text, id the model gave it or None)
ParsedCall = tuple[str, str, str | None]


def hermes_call(body: str) -> list[ParsedCall] | None:
    """The body of a Qwen3/Hermes `<tool_call>` block: {"name": ..., "arguments": {...}}."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return [(obj["name"], args, None)]


class ToolCallParser:
    """Splits streamed text into content and tool-call blocks: by default Qwen3/Hermes
    `<tool_call>\\n{json}\\n</tool_call>`; other families give their block markers and body parser.

    feed() returns what can be sent now: content strings and whole ToolCalls. Text that might be the
    start of the open marker is held back, and so is trailing whitespace (it is dropped if a call
    follows). A block whose body does not parse is passed on as content, as written. With
    `close_optional`, a block still open when the generation ends is parsed too (models often stop
    right after their last call, before the closing marker).
    """

    def __init__(
        self,
        open: str = TOOL_OPEN,
        close: str = TOOL_CLOSE,
        parse: Callable[[str], list[ParsedCall] | None] = hermes_call,
        close_optional: bool = False,
    ) -> None:
        self.open, self.close, self.parse_body, self.close_optional = open, close, parse, close_optional
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
                i = self.buf.find(self.open)
                if i < 0:
                    cut = len(self.buf) - partial_suffix(self.buf, [self.open])
                    self._content(self.buf[:cut], out)
                    self.buf = self.buf[cut:]
                    return out
                self._content(self.buf[:i], out)
                self.space_before, self.space = self.space, ""
                self.buf, self.in_call = self.buf[i + len(self.open) :], True
            else:
                i = self.buf.find(self.close)
                if i < 0:
                    return out
                body, self.buf, self.in_call = self.buf[:i], self.buf[i + len(self.close) :], False
                calls = self._parse(body)
                if calls is None:
                    self._content(self.space_before + self.open + body + self.close, out)
                else:
                    out.extend(calls)

    def finish(self) -> list[str | ToolCall]:
        """At the end of generation: whatever is held back (an unfinished call is content, unless
        close_optional and it parses)."""
        out: list[str | ToolCall] = []
        if self.in_call and self.close_optional:
            calls = self._parse(self.buf)
            if calls is not None:
                out.extend(calls)
                self.buf, self.in_call = "", False
        rest = (self.space_before + self.open if self.in_call else "") + self.buf
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

    def _parse(self, body: str) -> list[ToolCall] | None:
        parsed = self.parse_body(body)
        if not parsed:
            return None
        calls = []
        for name, args, call_id in parsed:
            call = ToolCall(len(self.calls), name, args)
            if call_id:
                call.id = call_id
            self.calls.append(call)
            calls.append(call)
        return calls


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

    def _choice(self, piece: str | Reasoning | ToolCall | None, finish: str | None = None) -> dict[str, Any]:
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

    def piece(self, piece: str | Reasoning | ToolCall) -> str:
        return self._chunk(self._choice(piece))

    def end(self, finish: str, usage: dict[str, Any]) -> list[str]:
        # usage rides on the last chunk; with include_usage, in a chunk of its own as OpenAI sends it
        if not self.include_usage:
            return [self._chunk(self._choice(None, finish), usage)]
        return [self._chunk(self._choice(None, finish)), self._chunk(None, usage)]

    def whole(self, text: str, finish_reason: str, usage: dict[str, Any], parser: Any = None) -> dict[str, Any]:
        """The whole answer; `parser` (an OutputParser) splits a chat answer into reasoning, content and
        tool calls (with tools, empty content is null, as OpenAI sends it)."""
        if not self.chat:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            return {**self.base, "choices": [choice], "usage": usage}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        calls: list[ToolCall] = []
        if parser is not None:
            pieces = parser.feed(text) + parser.finish()
            content = "".join(p for p in pieces if isinstance(p, str))
            reasoning = "".join(p.text for p in pieces if isinstance(p, Reasoning))
            calls = parser.calls
            message["content"] = (content or None) if parser.use_tools else content
            if reasoning:
                message["reasoning_content"] = reasoning
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
