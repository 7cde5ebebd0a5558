"""Where generated tokens become text, for `run`, `chat` and `serve` alike: a TextStream turns one generation's
token ids into its answer (text cut at stop strings, unfinished UTF-8 characters completed, thinking and tool
calls split off by the chat format's parser) and says how it finished, whichever loop generated the tokens
(Engine.stream for run and chat, the server's batch steps for serve). Also the Qwen3/Hermes tool-call blocks'
parser, which the other chat formats build on (chat_formats).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Collection, Generator, Iterable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any, Protocol

from moestream.engine.stats import GenerationStats, GenerationStep


def partial_suffix(text: str, needles: list[str]) -> int:
    """Length of the longest end of `text` that is the start of some needle (it may still become one)."""
    best = 0
    for s in needles:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


# --------------------------------------------------------------------------------------------------
# The pieces of an answer
# --------------------------------------------------------------------------------------------------


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


Piece = str | Reasoning | ToolCall  # content, thinking, or a call


class AnswerParser(Protocol):
    """A chat format's parser (chat_formats): streamed text in, the answer's pieces out."""

    @property
    def calls(self) -> list[ToolCall]: ...

    def feed(self, text: str) -> list[Piece]: ...

    def finish(self) -> list[Piece]: ...


def split_pieces(pieces: list[Piece]) -> tuple[str, str, list[ToolCall]]:
    """An answer's pieces joined: (reasoning, content, calls)."""
    reasoning = "".join(p.text for p in pieces if isinstance(p, Reasoning))
    content = "".join(p for p in pieces if isinstance(p, str))
    return reasoning, content, [p for p in pieces if isinstance(p, ToolCall)]


def special_token_ids(tokenizer: Any, markers: Iterable[str]) -> frozenset[int]:
    """The special tokens among `markers` (those that are one token in this vocabulary): a TextStream's
    `keep`, so that a parser sees them as text."""
    ids = (tokenizer.encode(m, add_bos=False) for m in markers)
    return frozenset(i[0] for i in ids if len(i) == 1 and tokenizer.is_special(i[0]))


# --------------------------------------------------------------------------------------------------
# Token ids -> the answer
# --------------------------------------------------------------------------------------------------


@dataclass
class TextDelta:
    """What one token added to the answer: its text (cut at a stop string) and the pieces the parser made
    of it (without a parser, the text itself). The last token's carries whatever was held back."""

    text: str
    pieces: list[Piece]


class TextStream:
    """One generation's token ids -> its answer, and how it finished.

    The tokenizer's stop tokens and special tokens write nothing, except those in `keep` (markers a chat
    format's parser must see, such as a tool-call token); bytes of an unfinished UTF-8 character wait for the
    rest, and text that might be the start of a stop string is held back until it is known not to be. A
    stop string ends the answer before it: `stopped` is set, and whoever generates stops at once. With a
    `parser`, the text is split into content, Reasoning and ToolCall pieces.
    """

    def __init__(
        self, tokenizer: Any, stop: Sequence[str] = (), keep: Collection[int] = (), parser: AnswerParser | None = None
    ):
        self.tokenizer = tokenizer
        self.decoder = tokenizer.stream(skip_special=True)
        self.keep = keep
        self.stop = [s for s in stop if s]
        self.parser = parser
        self.pending = ""  # text held back: it may be the start of a stop string
        self.stopped = False
        # set when the answer ended: the generation's (stop | length), "stop" after a stop string, "cancelled"
        # when its consumer left, "tool_calls" where OpenAI says so (a stop after the answer called tools)
        self.finish_reason: str | None = None

    @property
    def calls(self) -> list[ToolCall]:
        return self.parser.calls if self.parser is not None else []

    def add(self, token_id: int, finish_reason: str | None = None) -> TextDelta:
        """The next generated token, with the generation's finish reason on its last one."""
        if self.finish_reason is not None:
            return TextDelta("", [])
        text = self._cut(self._decode(token_id))
        if self.stopped:
            finish_reason = "stop"
        elif finish_reason is not None:
            text += self._flush()
        pieces = self._parse(text)
        if finish_reason is not None:
            pieces += self._end(finish_reason)
        return TextDelta(text, pieces)

    def cancel(self) -> list[Piece]:
        """The generation stopped before its end: the pieces the parser held back (text held back for a stop
        string or an unfinished character is dropped)."""
        return self._end("cancelled") if self.finish_reason is None else []

    def _decode(self, token_id: int) -> str:
        if token_id in self.tokenizer.stop_ids:
            return ""
        if token_id in self.keep:
            return self.decoder.flush() + self.tokenizer.token_text(token_id)
        return self.decoder.add(token_id)

    def _cut(self, text: str) -> str:
        """`text` after what was held back, up to a stop string or to what might be the start of one."""
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

    def _flush(self) -> str:
        """At the generation's end: the decoder's last bytes, and the text held back."""
        out = self._cut(self.decoder.flush())
        if not self.stopped:
            out, self.pending = out + self.pending, ""
        return out

    def _parse(self, text: str) -> list[Piece]:
        if not text:
            return []
        return [text] if self.parser is None else self.parser.feed(text)

    def _end(self, reason: str) -> list[Piece]:
        pieces = self.parser.finish() if self.parser is not None else []
        self.finish_reason = "tool_calls" if reason == "stop" and self.calls else reason
        return pieces


@dataclass
class TextStep:
    """One generated token as text (`text` possibly empty, `pieces` possibly none). finish_reason is set on
    the last step: the TextStream's."""

    text: str
    pieces: list[Piece]
    stats: GenerationStats
    finish_reason: str | None = None


def stream_text(steps: Generator[GenerationStep, None, None], text: TextStream) -> Iterator[TextStep]:
    """Engine.stream's steps as text; a stop string ends the generation at once. A consumer that stops early
    (break, close()) ends the generation as "cancelled"; use contextlib.closing to end it at once."""
    with closing(steps):
        for step in steps:
            delta = text.add(step.token, step.finish_reason)
            if text.stopped:
                steps.close()
            yield TextStep(delta.text, delta.pieces, step.stats, text.finish_reason)
            if text.stopped:
                return


# --------------------------------------------------------------------------------------------------
# Tool-call blocks
# --------------------------------------------------------------------------------------------------


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
    _, content, calls = split_pieces([*p.feed(text), *p.finish()])
    return content or None, calls
