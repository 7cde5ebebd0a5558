"""Interactive terminal chat: `moestream chat -m MODEL.gguf`.

The whole conversation is re-rendered with the model's chat template every turn; the engine keeps the
KV cache of the previous turn and reuses the prefix the new prompt shares with it, so a follow-up only
computes the new message. Ctrl-C during an answer stops that answer (a SIGINT handler sets a flag, and
the answer stops iterating the generation at the next token); Ctrl-D or /exit quits.

GPT-OSS (harmony) answers are split by the server's parser (chat_formats.HarmonyParser): the analysis
channel is shown as reasoning (dimmed on a terminal, after a "thinking:" label), a call addressed to a
function as such, and only the final channel's text (with the calls) is kept as the assistant's message,
as gpt-oss's template expects of earlier turns. Other families' answers are shown and kept as written, a
thinking block's markers included where they are special tokens (MiniMax-M2's and GLM-4.5's templates split
a kept answer at </think> and drop the reasoning of earlier turns).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from typing import Any, TextIO

from moestream.engine.sampling import Sampler
from moestream.errors import MoestreamError
from moestream.serving.chat_formats import HARMONY, HarmonyParser, chat_format, render_prompt
from moestream.serving.text import Piece, Reasoning, TextStream, ToolCall, special_token_ids, stream_text

try:
    import readline  # noqa: F401 - line editing and history for input()
except ImportError:
    pass
try:
    import termios
except ImportError:  # Windows: keys typed during an answer echo as before
    termios = None  # type: ignore[assignment]
from moestream.streaming.budget import MB, peak_rss_bytes, rss_bytes

HELP = (
    "/reset clears the conversation, /stats shows speed and cache use, /exit quits (or Ctrl-D); Ctrl-C stops an answer"
)
DIM, PLAIN = "\x1b[2m", "\x1b[0m"


class HarmonyView:
    """Turns a harmony answer's pieces into terminal text: reasoning after a "thinking:" label (dimmed when
    `dim`), a tool call on a line of its own, the final answer as it comes; collects what is kept."""

    def __init__(self, dim: bool):
        self.dim = dim
        self.in_reasoning = False
        self.content: list[str] = []
        self.calls: list[ToolCall] = []
        self.line_start = True  # what was shown ends a line

    def show(self, piece: Piece) -> str:
        out = ""
        if isinstance(piece, Reasoning):
            if not self.in_reasoning:
                out += ("" if self.line_start else "\n") + (DIM if self.dim else "") + "thinking: "
                self.in_reasoning = True
            out += piece.text
        else:
            out += self.end_reasoning()
            if isinstance(piece, ToolCall):
                self.calls.append(piece)
                at_start = out.endswith("\n") if out else self.line_start
                out += ("" if at_start else "\n") + f"[tool call] {piece.name}({piece.arguments})\n"
            else:
                self.content.append(piece)
                out += piece
        if out:
            self.line_start = out.endswith("\n")
        return out

    def end_reasoning(self) -> str:
        if not self.in_reasoning:
            return ""
        self.in_reasoning = False
        return (PLAIN if self.dim else "") + "\n"

    def message(self) -> dict[str, Any]:
        """The assistant's message for the history: the final channel's text and the calls it made (their
        arguments as dicts, as templates take them)."""
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(self.content)}
        if self.calls:
            calls = [c.to_dict() for c in self.calls]
            for call in calls:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
            msg["tool_calls"] = calls
        return msg


class ChatSession:
    """A conversation held as OpenAI-style messages, answered by the engine."""

    def __init__(
        self,
        engine: Any,
        sampler: Sampler,
        *,
        system: str | None = None,
        max_tokens: int | None = None,
        template_kwargs: dict[str, Any] | None = None,
        dim: bool = False,
    ):
        """dim: show a harmony answer's reasoning dimmed (a terminal that takes ANSI codes)."""
        self.engine = engine
        self.tok = engine.tokenizer
        if not self.tok.chat_template:
            raise MoestreamError("this model has no chat template; use `moestream run` instead")
        self.sampler = sampler
        self.system = system
        self.max_tokens = max_tokens
        self.template_kwargs = template_kwargs or {}
        self.dim = dim
        fmt = chat_format(self.tok.chat_template)
        self.harmony = fmt is HARMONY
        # harmony's message markers are special tokens: written as text so that the parser sees them; a
        # thinking family's </think> likewise, so that the kept answer is what its template splits on
        markers = HARMONY.markers(use_tools=True) if self.harmony else fmt.think_markers
        self.keep = special_token_ids(self.tok, markers)
        self.messages: list[dict[str, Any]] = []
        self.last: Any = None  # GenerationStats of the last answer
        self.dropped = 0  # turns dropped so far to fit the context
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.engine.reset()

    def _render(self, messages: list[dict[str, Any]]) -> list[int]:
        return render_prompt(self.tok, messages, **self.template_kwargs)[1]

    def _prompt(self) -> list[int]:
        """The prompt for the history plus the new message (the last one); the oldest turns are dropped
        while it leaves no room to answer. A message too long on its own is refused, history kept."""
        limit = self.engine.ctx - min(256, self.engine.ctx // 4)  # keep room for the answer
        ids = self._render(self.messages)
        if len(ids) <= limit:
            return ids
        first = 1 if self.messages[0]["role"] == "system" else 0
        alone = self._render(self.messages[:first] + self.messages[-1:])
        if len(alone) > limit:
            self.messages.pop()
            raise MoestreamError(
                f"that message makes a {len(alone)}-token prompt; the context holds {self.engine.ctx} with "
                f"room to answer (raise --ctx)"
            )
        while len(ids) > limit:
            # drop the oldest user turn and everything up to the next one
            end = first + 1
            while self.messages[end]["role"] != "user":
                end += 1
            del self.messages[first:end]
            self.dropped += 1
            ids = self._render(self.messages)
        return ids

    def ask(self, text: str, write: Callable[[str], None], stop: Callable[[], bool]) -> str:
        """Answer `text`, writing the answer as it comes; returns the answer kept in the history (cut short
        if stop()): the text as written, or for harmony the final channel's."""
        self.messages.append({"role": "user", "content": text})
        prompt = self._prompt()
        parts: list[str] = []
        harmony = HarmonyParser(HARMONY, use_tools=True) if self.harmony else None
        answer = TextStream(self.tok, keep=self.keep, parser=harmony)
        view = HarmonyView(self.dim)
        max_tokens = self.max_tokens or self.engine.ctx
        try:
            steps = stream_text(self.engine.stream(prompt, max_tokens, self.sampler, self.tok.stop_ids), answer)
            with closing(steps):
                for step in steps:
                    if harmony is not None:
                        if step.text or step.pieces:
                            write("".join(view.show(p) for p in step.pieces))
                    elif step.text:
                        parts.append(step.text)
                        write(step.text)
                    self.last = step.stats
                    if stop():
                        break
        except BaseException:
            self.messages.pop()  # the question stays unasked
            raise
        # a stopped answer stays in the history as far as it got: the next turn can refer to it
        if harmony is None:
            self.messages.append({"role": "assistant", "content": "".join(parts)})
        else:
            write("".join(view.show(p) for p in answer.cancel()) + view.end_reasoning())
            self.messages.append(view.message())
        return self.messages[-1]["content"]

    def stats_text(self) -> str:
        e = self.engine.snapshot()
        dense = not e.n_slots  # a dense model: no expert cache to report on
        lines = []
        if self.last is not None:
            s = self.last
            lines.append(
                f"last answer: prompt {s.prompt_tokens} tok ({s.reused_tokens} cached) @ {s.prompt_tps:.1f} "
                f"tok/s | decode {s.decode_tokens} tok @ {s.decode_tps:.2f} tok/s"
                + ("" if dense else f" | expert hit rate {100 * s.hit_rate:.1f}%")
            )
        cache = (
            "no experts to stream"
            if dense
            else f"expert hit rate {100 * e.hit_rate:.1f}% | cache slots {e.used_slots}/{e.n_slots} used | "
            f"disk read {e.bytes_read / MB:.1f} MiB"
        )
        lines.append(f"session: {cache} | RSS {rss_bytes() / MB:.0f} MiB (peak {peak_rss_bytes() / MB:.0f} MiB)")
        turns = sum(m["role"] == "user" for m in self.messages)
        dropped = f", {self.dropped} oldest dropped to fit the context" if self.dropped else ""
        lines.append(f"conversation: {turns} turn{'s' * (turns != 1)}{dropped}")
        return "\n".join(lines)


class _Interrupt:
    """While active, Ctrl-C sets a flag instead of raising KeyboardInterrupt."""

    def __init__(self) -> None:
        self.flag = threading.Event()

    def __enter__(self) -> _Interrupt:
        self.flag.clear()
        self._old = signal.signal(signal.SIGINT, lambda signum, frame: self.flag.set())
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._old)


@contextmanager
def quiet_keys(fd: int | None) -> Iterator[None]:
    """While an answer streams: keys typed on the terminal `fd` are not echoed into the answer, and what they
    typed is dropped at the end rather than sent, unseen, as the next question. Ctrl-C still stops the answer.
    The terminal's settings come back however the answer ends. No-op where fd is None or not a terminal."""
    if fd is None or termios is None or not os.isatty(fd):
        yield
        return
    saved = termios.tcgetattr(fd)
    quiet = list(saved)
    quiet[3] &= ~termios.ECHO  # the local modes
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSAFLUSH, saved)  # TCSAFLUSH: drops input not read yet


def repl(
    session: ChatSession, inp: Callable[[str], str] = input, out: TextIO = sys.stdout, tty: int | None = None
) -> None:
    """The loop of questions and answers. `tty`: the terminal's file descriptor, whose echo is off while an
    answer streams (quiet_keys)."""

    def write(text: str) -> None:
        out.write(text)
        out.flush()

    while True:
        try:
            line = inp("> ")
        except EOFError:  # Ctrl-D
            write("\n")
            return
        except KeyboardInterrupt:  # Ctrl-C at the prompt clears the line, as in a shell
            write("\n")
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            session.reset()
            write("(conversation cleared)\n")
            continue
        if text == "/stats":
            write(session.stats_text() + "\n")
            continue
        if text in ("/help", "/?"):
            write(HELP + "\n")
            continue
        if text.startswith("/"):
            write(f"unknown command {text.split()[0]}; {HELP}\n")
            continue
        try:
            with _Interrupt() as ctrl_c, quiet_keys(tty):
                session.ask(line, write, ctrl_c.flag.is_set)
        except MoestreamError as exc:
            write(f"error: {exc}\n")
            continue
        except KeyboardInterrupt:  # Ctrl-C a moment before generation began
            write(" [stopped]\n")
            continue
        write(" [stopped]\n" if ctrl_c.flag.is_set() else "\n")
