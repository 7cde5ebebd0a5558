"""Render a model's Jinja chat template the way transformers' `apply_chat_template` does.

Templates come from model files, so they run in Jinja's immutable sandbox, with the same helpers and
whitespace settings HF provides (templates are written against those and render differently without).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import numpy as np
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from moestream.errors import MoestreamError

# names a message's reasoning arrives under; templates read `reasoning_content` (gpt-oss: `thinking`)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _TemplateRaised(jinja2.TemplateError):
    """The template called raise_exception(): it rejects these messages."""


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; we just render it."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace() minus underscore attributes, which could reach CPython internals (as HF does)."""

    def __init__(*args: Any, **kwargs: Any):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    # HF's version: no HTML escaping (jinja's own tojson turns < into \u003c) and non-ASCII kept as is
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _from_json(text: Any) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        raise _TemplateRaised(f"a tool call's arguments are not JSON: {str(text)[:80]!r}") from None


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _dict(*args: Any, **kwargs: Any) -> dict[Any, Any]:
    return dict(*args, **kwargs)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters["from_json"] = _from_json  # DeepSeek-V4's template parses a call's arguments given as a string
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = _dict
    return env.from_string(template)


def _plain(value: Any) -> Any:
    """A JSON-typed deep copy: the template can neither modify the caller's messages nor call methods on
    arbitrary objects in them."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # enums and other subclasses carry extra methods
        return str.__str__(value)
    if isinstance(value, np.generic):  # np.bool_(False) must stay falsy
        return _plain(value.item())
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models (e.g. OpenAI SDK messages)
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _prepare_message(message: Any, style: tuple[bool, bool]) -> dict[str, Any]:
    msg = _plain(message)
    if not isinstance(msg, dict):
        raise MoestreamError(f"a chat message must be a dict with 'role' and 'content', got {message!r}")
    # OpenAI clients send content=None / tool_calls=None; templates handle a missing key, not None
    msg = {k: v for k, v in msg.items() if v is not None}
    reasoning = next((msg[k] for k in _REASONING_FIELDS if k in msg), None)
    if reasoning is not None:
        msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
    return _styled(msg, style)


def _styled(msg: dict[str, Any], style: tuple[bool, bool]) -> dict[str, Any]:
    """A tool-calling assistant turn the way the template reads it: style = (arguments as JSON text,
    content None where the turn has no text)."""
    string_arguments, null_content = style
    if not (isinstance(msg.get("tool_calls"), list) and msg["tool_calls"]):
        return msg
    msg = dict(msg)
    if null_content and not msg.get("content"):
        msg["content"] = None
    if string_arguments:
        msg["tool_calls"] = [_arguments_as_text(c) for c in msg["tool_calls"]]
    return msg


def _arguments_as_text(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or isinstance(fn.get("arguments"), str):
        return call
    return {**call, "function": {**fn, "arguments": json.dumps(fn.get("arguments", {}), ensure_ascii=False)}}


_PROBE_MESSAGES = [
    {"role": "user", "content": "probe"},
    {
        "role": "assistant",
        "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "f", "arguments": {"k": "v"}}}],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": "probe"},
]


@lru_cache(maxsize=8)
def _tool_call_style(template: str) -> tuple[bool, bool]:
    """How the template wants a tool-calling assistant turn: HF's object arguments and no content key
    (the default), or what DeepSeek's templates need: arguments concatenated as text
    (`'...' + tool['function']['arguments']`) and `content is none` tested. Found by rendering a probe
    conversation each way, as llama.cpp's minja probes a template's needs."""
    for style in ((False, False), (True, False), (False, True), (True, True)):
        try:
            _compile(template).render(
                messages=[_styled(m, style) for m in _PROBE_MESSAGES],
                tools=None,
                documents=None,
                add_generation_prompt=True,
                bos_token="",
                eos_token="",
            )
            return style
        except Exception:  # any failure means "not this way"
            continue
    return (False, False)


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """The prompt text for `messages` (OpenAI-style dicts); `extra` reaches the template as variables
    (e.g. enable_thinking=False for Qwen3)."""
    try:
        compiled = _compile(template)
    except jinja2.TemplateSyntaxError as exc:
        raise MoestreamError(
            f"the chat template does not parse (line {exc.lineno}: {_one_line(exc.message or str(exc))}); "
            "pass a working template"
        ) from None
    try:
        style = _tool_call_style(template)
        return compiled.render(
            messages=[_prepare_message(m, style) for m in messages],
            tools=_plain(tools),
            documents=None,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **{k: _plain(v) for k, v in extra.items()},
        )
    except _TemplateRaised as exc:
        raise MoestreamError(f"the chat template rejected the conversation: {_one_line(str(exc))}") from None
    except MoestreamError:
        raise
    except Exception as exc:  # a template bug surfaces as any exception type (TypeError, UndefinedError, ...)
        raise MoestreamError(
            f"the chat template failed: {type(exc).__name__}: {_one_line(str(exc))}; check the messages' "
            "fields or pass a different template"
        ) from None


def _one_line(text: str) -> str:
    return " ".join(text.split())
