"""What each model family writes around its answer: thinking blocks and tool calls, told apart from the
content, as llama.cpp's chat parsers do.

The family is read off the chat template (the markers it writes), never set by the user:
- Qwen3/Hermes (the default): `<tool_call>{json}</tool_call>`; thinking stays in the content as written.
- DeepSeek V3/R1: `<think>...</think>` (R1's template opens it in the prompt, so the answer starts inside
  it), calls `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{..}\\n```
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`; V3.1 writes `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{..}`.
- DeepSeek V4: `<think>...</think>` (opened by the prompt when thinking), calls in DSML:
  `<｜DSML｜tool_calls>` then per call `<｜DSML｜invoke name="NAME">` with one `<｜DSML｜parameter name="K"
  string="true|false">V</｜DSML｜parameter>` per argument (string="true": V as text, else JSON).
- Kimi-K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>
  {..}<|tool_call_end|>...<|tool_calls_section_end|>`.
- GLM-4.5/4.6: `<think>...</think>`, calls `<tool_call>NAME\\n<arg_key>k</arg_key>\\n<arg_value>v
  </arg_value>\\n</tool_call>` with each value as text (JSON for non-string parameters).
- MiniMax-M2: `<think>...</think>` (its template opens it in the prompt and keeps the reasoning of the turns
  after the last user message: interleaved thinking), calls `<minimax:tool_call>\n<invoke name="NAME">\n
  <parameter name="k">v</parameter>\n...</invoke>\n</minimax:tool_call>`, each value as GLM's.
- GPT-OSS (harmony): messages `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final
  <|message|>...`; the analysis channel is reasoning, final (and commentary without a recipient) content,
  and a message addressed `to=functions.NAME` (in its role or its channel part) a call with JSON arguments.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moestream.formats.chat_template import render_chat
from moestream.serving.text import (
    ParsedCall,
    Piece,
    Reasoning,
    ToolCall,
    ToolCallParser,
    hermes_call,
    partial_suffix,
    split_pieces,
)
from moestream.serving.tool_call_formats import (
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_SEP,
    DSML,
    KIMI_ARGS,
    KIMI_CALL_BEGIN,
    KIMI_CALL_END,
    MINIMAX_CLOSE,
    MINIMAX_OPEN,
    deepseek_calls,
    dsml_calls,
    glm_call,
    json_object,
    kimi_calls,
    minimax_calls,
)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ChatFormat:
    name: str
    thinks: bool  # the answer may open with a <think> block
    tool_open: str
    tool_close: str
    # body of one block -> calls (None: not a call, pass the block on as text); tools: the request's
    parse: Callable[[str, dict[str, dict[str, Any]]], list[ParsedCall] | None]
    close_optional: bool  # a block the generation ended inside still counts
    tool_markers: tuple[str, ...]  # tokens the tool parser must see as text
    message_markers: tuple[str, ...] = ()  # tokens that frame every message (harmony's), always seen

    @property
    def think_markers(self) -> tuple[str, ...]:
        return (THINK_OPEN, THINK_CLOSE) if self.thinks else self.message_markers

    def markers(self, use_tools: bool) -> tuple[str, ...]:
        """The tokens its parser must see as text (a TextStream keeps those that are special tokens)."""
        return self.think_markers + (self.tool_markers if use_tools else ())


# ---------------------------------------------------------------------------------------- call bodies

QWEN = ChatFormat("qwen", False, "<tool_call>", "</tool_call>", lambda b, t: hermes_call(b), False, ())
DEEPSEEK = ChatFormat(
    "deepseek",
    True,
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    deepseek_calls,
    True,
    ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", DS_CALL_BEGIN, DS_SEP, DS_CALL_END),
)
DEEPSEEK_V4 = ChatFormat(
    "deepseek-v4",
    True,
    f"<{DSML}tool_calls>",
    f"</{DSML}tool_calls>",
    dsml_calls,
    True,
    (f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"),
)
KIMI_K2 = ChatFormat(
    "kimi-k2",
    True,
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    kimi_calls,
    True,
    ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", KIMI_CALL_BEGIN, KIMI_ARGS, KIMI_CALL_END),
)
GLM = ChatFormat(
    "glm-4.5",
    True,
    "<tool_call>",
    "</tool_call>",
    glm_call,
    True,
    ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
)
MINIMAX_M2 = ChatFormat(
    "minimax-m2", True, MINIMAX_OPEN, MINIMAX_CLOSE, minimax_calls, True, (MINIMAX_OPEN, MINIMAX_CLOSE)
)

H_START, H_CHANNEL, H_MESSAGE, H_END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
H_CONSTRAIN, H_CALL, H_RETURN = "<|constrain|>", "<|call|>", "<|return|>"
HARMONY = ChatFormat(
    "harmony",
    False,
    "",
    "",
    lambda b, t: None,
    False,
    (),
    (H_START, H_CHANNEL, H_MESSAGE, H_END, H_CONSTRAIN),
)


def chat_format(template: str | None) -> ChatFormat:
    """The family a chat template belongs to, from the markers it writes."""
    t = template or ""
    if "<|channel|>" in t and "<|message|>" in t:
        return HARMONY
    if DSML in t:  # V4's template also writes <｜Assistant｜>
        return DEEPSEEK_V4
    if "<｜tool▁calls▁begin｜>" in t or "<｜Assistant｜>" in t:
        return DEEPSEEK
    if "<|tool_calls_section_begin|>" in t or "<|im_assistant|>" in t:
        return KIMI_K2
    if "<arg_key>" in t or "[gMASK]<sop>" in t:
        return GLM
    if MINIMAX_OPEN in t or "]~b]ai" in t:
        return MINIMAX_M2
    return QWEN


def render_prompt(tok: Any, messages: list[dict[str, Any]], **template_kwargs: Any) -> tuple[str, list[int]]:
    """The chat template's text for `messages`, and its tokens (a template that writes the BOS token itself
    does not get a second one)."""
    text = render_chat(tok.chat_template, messages, bos_token=tok.bos_token, eos_token=tok.eos_token, **template_kwargs)
    add_bos = False if tok.bos_token and text.startswith(tok.bos_token) else None
    return text, tok.encode(text, add_bos=add_bos)


def starts_thinking(fmt: ChatFormat, prompt: str) -> bool:
    """Whether the prompt leaves the model inside a thinking block (R1's, V3.1's and MiniMax-M2's templates
    open it)."""
    return fmt.thinks and prompt.rstrip().endswith(THINK_OPEN)


def tool_system_prompt(fmt: ChatFormat, template: str, tools: list[dict[str, Any]]) -> str | None:
    """For templates that never write the request's tools (DeepSeek's), the tool list and the call
    format in words, for the system prompt; None where the template writes them itself."""
    if fmt is not DEEPSEEK or "tools" in template:
        return None
    v31 = "tool['function']['name'] + '<｜tool▁sep｜>'" in template
    lines = ["## Tools", "You have access to the following tools:"]
    for tool in tools:
        fn = tool.get("function", {})
        lines += [
            "",
            f"### {fn.get('name', '')}",
            f"Description: {fn.get('description', '')}",
            "",
            f"Parameters: {json.dumps(fn.get('parameters', {}), ensure_ascii=False)}",
        ]
    call = (
        "tool_call_name<｜tool▁sep｜>tool_call_arguments"
        if v31
        else ("function<｜tool▁sep｜>tool_call_name\n```json\ntool_call_arguments\n```")
    )
    lines += [
        "",
        "IMPORTANT: ALWAYS adhere to this exact format for tool use:",
        f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{call}<｜tool▁call▁end｜>{{additional_tool_calls}}"
        "<｜tool▁calls▁end｜>",
        "",
        "Where:",
        "- `tool_call_name` must be an exact match to one of the available tools",
        "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema",
        "- For multiple tool calls, chain them directly without separators or spaces",
    ]
    return "\n".join(lines)


# -------------------------------------------------------------------------------------- the parser


class OutputParser:
    """Splits a streamed answer into Reasoning, content (str) and ToolCall pieces for one family.

    Reasoning is the text of a leading <think> block (or of the block the prompt opened), without the
    whitespace around it; text that might be a marker's start is held back until it is known not to be.
    Tool calls are parsed only when the request gave tools. Qwen's answers pass through unchanged.
    """

    def __init__(
        self,
        fmt: ChatFormat,
        *,
        use_tools: bool,
        thinking: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ):
        self.fmt = fmt
        self.use_tools = use_tools
        self.state = "reasoning" if thinking and fmt.thinks else "start" if fmt.thinks else "content"
        self.buf = ""
        self.space = ""  # trailing whitespace of the reasoning, held back
        self.began = False  # some reasoning was sent (leading whitespace is dropped until then)
        by_name = {t.get("function", {}).get("name"): t.get("function", {}) for t in tools or []}
        self.tools = (
            ToolCallParser(fmt.tool_open, fmt.tool_close, lambda b: fmt.parse(b, by_name), fmt.close_optional)
            if use_tools
            else None
        )

    @property
    def calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools else []

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        out: list[Piece] = []
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(THINK_OPEN):
                self.buf, self.state = head[len(THINK_OPEN) :], "reasoning"
            elif THINK_OPEN.startswith(head):
                return out  # nothing yet, or the start of <think>: wait
            else:
                self.state = "content"
        if self.state == "reasoning":
            i = self.buf.find(THINK_CLOSE)
            if i < 0:
                cut = len(self.buf) - partial_suffix(self.buf, [THINK_CLOSE])
                self._reason(self.buf[:cut], out)
                self.buf = self.buf[cut:]
                return out
            self._reason(self.buf[:i], out)
            self.buf, self.space, self.state = self.buf[i + len(THINK_CLOSE) :], "", "after"
        if self.state == "after":
            self.buf = self.buf.lstrip()
            if not self.buf:
                return out
            self.state = "content"
        text, self.buf = self.buf, ""
        if self.tools:
            out.extend(self.tools.feed(text))
        elif text:
            out.append(text)
        return out

    def finish(self) -> list[Piece]:
        """At the end of generation: whatever is held back (an unclosed thinking block is reasoning)."""
        out: list[Piece] = []
        if self.state == "reasoning":
            self._reason(self.buf, out)
            self.buf = ""
        elif self.state == "start":
            self.state = "content"
        if self.state == "content":
            text, self.buf = self.buf, ""
            if self.tools:
                out.extend((self.tools.feed(text) if text else []) + self.tools.finish())
            elif text:
                out.append(text)
        return out

    def _reason(self, text: str, out: list[Piece]) -> None:
        if not self.began:
            text = text.lstrip()
        body = text.rstrip()
        if body:
            out.append(Reasoning(self.space + body))
            self.began = True
            self.space = ""
        self.space += text[len(body) :]


def split_answer(parser: OutputParser, text: str) -> tuple[str, str, list[ToolCall]]:
    """A whole answer as (reasoning, content, calls)."""
    return split_pieces(parser.feed(text) + parser.finish())


# ------------------------------------------------------------------------------ harmony (GPT-OSS)

_H_RECIPIENT = re.compile(r"\bto=functions\.([^<\s]+)")
_H_CHANNEL = re.compile(re.escape(H_CHANNEL) + r"\s*(\w+)")
_H_BODY_ENDS = [H_END, H_CALL, H_RETURN, H_START]


class HarmonyParser:
    """Splits a streamed GPT-OSS answer (harmony messages, as llama.cpp's gpt-oss parser reads them) into
    Reasoning, content (str) and ToolCall pieces, with OutputParser's interface.

    Each message is a header (role, `<|channel|>NAME`, maybe ` to=functions.NAME` and a content type)
    up to `<|message|>`, then a body up to `<|end|>`, `<|call|>` or `<|return|>` (the last two end the
    generation, so the body usually just stops). Bodies are passed on as written. A call body whose
    arguments are not a JSON object, and any call when the request gave no tools, is content.
    """

    def __init__(self, fmt: ChatFormat, *, use_tools: bool, tools: list[dict[str, Any]] | None = None):
        self.fmt = fmt
        self.use_tools = use_tools
        self.calls: list[ToolCall] = []
        self.buf = ""
        self.kind: str | None = None  # in a body: "reasoning", "content" or "call"; None in a header
        self.name = ""  # the called function, in a call body

    def feed(self, text: str) -> list[Piece]:
        self.buf += text
        out: list[Piece] = []
        while True:
            if self.kind is None:
                i = self.buf.find(H_MESSAGE)
                if i < 0:
                    return out
                self._header(self.buf[:i])
                self.buf = self.buf[i + len(H_MESSAGE) :]
                continue
            hits = [i for m in _H_BODY_ENDS if (i := self.buf.find(m)) >= 0]
            if not hits:
                if self.kind != "call":
                    cut = len(self.buf) - partial_suffix(self.buf, _H_BODY_ENDS)
                    self._body(self.buf[:cut], out)
                    self.buf = self.buf[cut:]
                return out
            end = min(hits)
            self._body(self.buf[:end], out, last=True)
            rest = self.buf[end:]
            marker = next(m for m in _H_BODY_ENDS if rest.startswith(m))
            self.buf = rest if marker == H_START else rest[len(marker) :]  # <|start|> opens the next header
            self.kind = None

    def finish(self) -> list[Piece]:
        """At the end of generation: an unfinished body as it stands; a header with no body is dropped,
        unless it is plain text the model wrote without any header (then it is content)."""
        out: list[Piece] = []
        if self.kind is not None:
            self._body(self.buf, out, last=True)
        elif self.buf and not any(m in self.buf for m in (H_START, H_CHANNEL, H_END)):
            out.append(self.buf)
        self.buf, self.kind = "", None
        return out

    def _header(self, header: str) -> None:
        recipient = _H_RECIPIENT.search(header)
        channel = _H_CHANNEL.search(header)
        if recipient and self.use_tools:
            self.kind, self.name = "call", recipient.group(1)
        elif channel and channel.group(1) == "analysis":
            self.kind = "reasoning"
        else:
            self.kind = "content"

    def _body(self, text: str, out: list[Piece], last: bool = False) -> None:
        if self.kind == "call":
            if not last:
                return
            args = json_object(text.strip())
            if args is not None:
                call = ToolCall(len(self.calls), self.name, args)
                self.calls.append(call)
                out.append(call)
            elif text:
                out.append(text)
        elif text:
            out.append(Reasoning(text) if self.kind == "reasoning" else text)


def output_parser(
    fmt: ChatFormat, *, use_tools: bool, thinking: bool = False, tools: list[dict[str, Any]] | None = None
) -> OutputParser | HarmonyParser:
    """The parser for a family's answers."""
    if fmt is HARMONY:
        return HarmonyParser(fmt, use_tools=use_tools, tools=tools)
    return OutputParser(fmt, use_tools=use_tools, thinking=thinking, tools=tools)
