"""The tool-call bodies each family writes (see chat_formats.py for the markers around them), parsed into
calls with JSON arguments; None when a body is not a call this family writes."""

from __future__ import annotations

import json
import re
from typing import Any

from moestream.serving.text import ParsedCall

DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_DS_FENCED = re.compile(r"([^\n]+)\n```(?:json)?\n(.*?)\n?```\s*$", re.DOTALL)


def json_object(text: str) -> str | None:
    """`text` as compact-as-written JSON object text, or None when it is not one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return json.dumps(obj, ensure_ascii=False) if isinstance(obj, dict) else None


def deepseek_calls(body: str, tools: dict[str, dict[str, Any]]) -> list[ParsedCall] | None:
    """The calls between <｜tool▁calls▁begin｜> and <｜tool▁calls▁end｜>: R1/V3's `function<｜tool▁sep｜>NAME`
    + fenced JSON, or V3.1's `NAME<｜tool▁sep｜>JSON`."""
    calls: list[ParsedCall] = []
    for part in body.split(DS_CALL_BEGIN)[1:]:
        part = part.split(DS_CALL_END, 1)[0]
        head, sep, rest = part.partition(DS_SEP)
        if not sep:
            return None
        fenced = _DS_FENCED.match(rest) if head.strip() == "function" else None
        name, args = (fenced.group(1), fenced.group(2)) if fenced else (head, rest)
        args_json = json_object(args.strip())
        if not name.strip() or args_json is None:
            return None
        calls.append((name.strip(), args_json, None))
    return calls or None


DSML = "｜DSML｜"
_DSML_INVOKE = re.compile(rf'<{DSML}invoke name="([^"]*)">(.*?)</{DSML}invoke>', re.DOTALL)
_DSML_PARAM = re.compile(rf'<{DSML}parameter name="([^"]*)" string="(true|false)">(.*?)</{DSML}parameter>', re.DOTALL)


def dsml_calls(body: str, tools: dict[str, dict[str, Any]]) -> list[ParsedCall] | None:
    """The invocations of a DeepSeek-V4 `<｜DSML｜tool_calls>` block; a parameter marked string="false" must be
    JSON (else the block is not a call and stays text)."""
    calls: list[ParsedCall] = []
    for name, inner in _DSML_INVOKE.findall(body):
        args: dict[str, Any] = {}
        for key, is_string, value in _DSML_PARAM.findall(inner):
            if is_string == "true":
                args[key] = value
                continue
            try:
                args[key] = json.loads(value)
            except ValueError:
                return None
        if not name.strip():
            return None
        calls.append((name.strip(), json.dumps(args, ensure_ascii=False), None))
    return calls or None


KIMI_CALL_BEGIN, KIMI_ARGS, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_KIMI_ID = re.compile(r"^(?:functions\.)?(.+?)(?::\d+)?$")


def kimi_calls(body: str, tools: dict[str, dict[str, Any]]) -> list[ParsedCall] | None:
    """The calls in a Kimi-K2 section; the id it writes (`functions.NAME:0`) is kept as the call's id,
    since Kimi's template writes it back with the tool's result."""
    calls: list[ParsedCall] = []
    for part in body.split(KIMI_CALL_BEGIN)[1:]:
        part = part.split(KIMI_CALL_END, 1)[0]
        call_id, sep, args = part.partition(KIMI_ARGS)
        m = _KIMI_ID.match(call_id.strip())
        args_json = json_object(args.strip())
        if not sep or m is None or args_json is None:
            return None
        calls.append((m.group(1), args_json, call_id.strip()))
    return calls or None


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def glm_call(body: str, tools: dict[str, dict[str, Any]]) -> list[ParsedCall] | None:
    """One GLM-4.5 block: the name, then key/value pairs (_typed_arguments)."""
    name = body.split("<arg_key>", 1)[0].strip()
    if not name or "\n" in name:
        return None
    return [(name, _typed_arguments(_GLM_ARG.findall(body), name, tools), None)]


def _typed_arguments(pairs: list[tuple[str, str]], name: str, tools: dict[str, dict[str, Any]]) -> str:
    """(key, value text) pairs as a JSON object: a value is text as written where the tool's schema says
    the parameter is a string, else JSON if it parses (numbers, lists, ...), else text."""
    props = (tools.get(name) or {}).get("parameters", {}).get("properties", {})
    args: dict[str, Any] = {}
    for key, value in pairs:
        key = key.strip()
        if (props.get(key) or {}).get("type") == "string":
            args[key] = value
            continue
        try:
            args[key] = json.loads(value)
        except ValueError:
            args[key] = value
    return json.dumps(args, ensure_ascii=False)


MINIMAX_OPEN, MINIMAX_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
_MINIMAX_INVOKE = re.compile(r'<invoke name="([^"]+)">(.*?)</invoke>', re.DOTALL)
_MINIMAX_PARAM = re.compile(r'<parameter name="([^"]+)">(.*?)</parameter>', re.DOTALL)


def minimax_calls(body: str, tools: dict[str, dict[str, Any]]) -> list[ParsedCall] | None:
    """The `<invoke name="NAME">` elements of one MiniMax-M2 block, each with its `<parameter name="k">`
    values (typed as GLM's are); an invoke the generation ended inside is dropped."""
    calls: list[ParsedCall] = []
    for name, inner in _MINIMAX_INVOKE.findall(body):
        calls.append((name.strip(), _typed_arguments(_MINIMAX_PARAM.findall(inner), name.strip(), tools), None))
    return calls or None


# ------------------------------------------------------------------------------------------ families
