"""Interactive terminal chat: `moestream chat -m MODEL.gguf`.

The whole conversation is re-rendered with the model's chat template every turn; the engine keeps the
KV cache of the previous turn and reuses the prefix the new prompt shares with it, so a follow-up only
computes the new message. Ctrl-C during an answer stops that answer (a SIGINT handler sets a flag, and
the answer stops iterating the generation at the next token); Ctrl-D or /exit quits.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from contextlib import closing
from typing import Any, TextIO

from moestream.engine.sampling import Sampler
from moestream.errors import MoestreamError
from moestream.formats.chat_template import render_chat
from moestream.serving.text import stream_text

try:
    import readline  # noqa: F401 - line editing and history for input()
except ImportError:
    pass
from moestream.streaming.budget import MB, peak_rss_bytes, rss_bytes

HELP = (
    "/reset clears the conversation, /stats shows speed and cache use, /exit quits (or Ctrl-D); Ctrl-C stops an answer"
)


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
    ):
        self.engine = engine
        self.tok = engine.tokenizer
        if not self.tok.chat_template:
            raise MoestreamError("this model has no chat template; use `moestream run` instead")
        self.sampler = sampler
        self.system = system
        self.max_tokens = max_tokens
        self.template_kwargs = template_kwargs or {}
        self.messages: list[dict[str, str]] = []
        self.last: Any = None  # GenerationStats of the last answer
        self.dropped = 0  # turns dropped so far to fit the context
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.engine.reset()

    def _render(self, messages: list[dict[str, str]]) -> list[int]:
        tok = self.tok
        text = render_chat(
            tok.chat_template, messages, bos_token=tok.bos_token, eos_token=tok.eos_token, **self.template_kwargs
        )
        add_bos = False if tok.bos_token and text.startswith(tok.bos_token) else None
        return tok.encode(text, add_bos=add_bos)

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
        """Answer `text`, writing the answer as it comes; returns the answer (cut short if stop())."""
        self.messages.append({"role": "user", "content": text})
        prompt = self._prompt()
        parts: list[str] = []
        max_tokens = self.max_tokens or self.engine.ctx
        try:
            steps = stream_text(self.engine, prompt, max_tokens, self.sampler, stop_ids=self.tok.stop_ids)
            with closing(steps):
                for step in steps:
                    if step.text:
                        parts.append(step.text)
                        write(step.text)
                    self.last = step.stats
                    if stop():
                        break
        except BaseException:
            self.messages.pop()  # the question stays unasked
            raise
        answer = "".join(parts)
        # a stopped answer stays in the history as far as it got: the next turn can refer to it
        self.messages.append({"role": "assistant", "content": answer})
        return answer

    def stats_text(self) -> str:
        e = self.engine.snapshot()
        lines = []
        if self.last is not None:
            s = self.last
            lines.append(
                f"last answer: prompt {s.prompt_tokens} tok ({s.reused_tokens} cached) @ {s.prompt_tps:.1f} "
                f"tok/s | decode {s.decode_tokens} tok @ {s.decode_tps:.2f} tok/s | "
                f"expert hit rate {100 * s.hit_rate:.1f}%"
            )
        lines.append(
            f"session: expert hit rate {100 * e.hit_rate:.1f}% | cache slots {e.used_slots}/"
            f"{e.n_slots} used | disk read {e.bytes_read / MB:.1f} MB | "
            f"RSS {rss_bytes() / MB:.0f} MB (peak {peak_rss_bytes() / MB:.0f} MB)"
        )
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


def repl(session: ChatSession, inp: Callable[[str], str] = input, out: TextIO = sys.stdout) -> None:
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
            with _Interrupt() as ctrl_c:
                session.ask(line, write, ctrl_c.flag.is_set)
        except MoestreamError as exc:
            write(f"error: {exc}\n")
            continue
        except KeyboardInterrupt:  # Ctrl-C a moment before generation began
            write(" [stopped]\n")
            continue
        write(" [stopped]\n" if ctrl_c.flag.is_set() else "\n")
