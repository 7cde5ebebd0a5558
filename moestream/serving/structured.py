"""Structured output for the server: a request's response_format, and its strict tools, as a grammar.

- `{"type": "text"}` (or none): no grammar.
- `{"type": "json_object"}`: any JSON object.
- `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`: JSON valid against the schema,
  whatever `strict` says (a grammar that lets the answer stray would only be a weaker one).
- tools whose `function.strict` is true (Qwen/Hermes-format models): the answer is free text, but a
  `<tool_call>` block it opens must hold {"name": one of the tools, "arguments": what its schema allows};
  the other tools' arguments are any JSON object. With tool_choice "required" (or one function named) the
  answer is calls only (to that function). Other families' call blocks are left free.
- A prompt that opened a thinking block (DeepSeek-R1's template) gets its reasoning and `</think>` first.

/v1/completions has no response_format in OpenAI's API: the server refuses it there (app.py).

JSON is written with the separators json.dumps writes (", " and ": ") and no other whitespace: the layout
models most often write on one line, and a random model cannot run on in whitespace.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance as llg

from moestream.engine.grammar import GrammarError, GrammarVocab, TokenGrammar, one_line
from moestream.serving.chat_formats import QWEN, ChatFormat
from moestream.serving.schemas import APIError

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FORMAT_TYPES = ("text", "json_object", "json_schema")


def _json_grammar(schema: Any, param: str, thinking: bool = False) -> str:
    """The grammar of JSON valid against `schema`; `thinking`: after the rest of a thinking block the prompt
    opened (its text, `</think>`, then the JSON), so that the reasoning stays reasoning."""
    if not isinstance(schema, dict):
        raise APIError(400, f"{param} must be a JSON object (a JSON Schema)", param=param, code="invalid_value")
    if thinking:
        inline = json.dumps({**schema, "x-guidance": JSON_OPTIONS})
        return "\n".join([f"start: think NL? %json{inline}", "think[lazy]: /(?s:.*)<\\/think>/", "NL: /[ \\n]+/"])
    try:
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    except ValueError as exc:
        raise APIError(400, f"invalid {param}: {one_line(str(exc))}", param=param, code="invalid_value") from None


def response_format_grammar(fmt: Any, thinking: bool = False) -> str | None:
    """The grammar text of a request's response_format (None: free text); APIError 400 if it is not one.
    thinking: the prompt opened a thinking block (_json_grammar)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in FORMAT_TYPES:
        raise APIError(
            400,
            f"response_format.type must be one of {', '.join(FORMAT_TYPES)}, got {json.dumps(kind)}",
            param="response_format.type",
            code="invalid_value",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return _json_grammar({"type": "object"}, "response_format", thinking)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise APIError(
            400,
            "response_format.json_schema must be an object with a name (and a schema)",
            param="response_format.json_schema",
            code="invalid_value",
        )
    return _json_grammar(spec.get("schema", {}), "response_format.json_schema.schema", thinking)


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a Lark string literal is written as a JSON string is


def tool_call_grammar(fmt: ChatFormat, tools: list[dict[str, Any]], choice: Any = None) -> str | None:
    """A Lark grammar for an answer whose tool calls follow their tools' schemas where `strict` is set;
    with tool_choice "required" (or one function named) the answer is calls only (to that function). None
    when no tool is strict, or for families whose call blocks are not Qwen/Hermes JSON."""
    fns = [t.get("function") or {} for t in tools]
    if fmt is not QWEN or not any(f.get("strict") is True for f in fns):
        return None
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if named is not None:
        fns = [f for f in fns if f.get("name") == named]
    bodies = []
    for f in fns:
        if not isinstance(f.get("name"), str):
            continue
        params = f.get("parameters") if f.get("strict") is True else None
        schema = params if isinstance(params, dict) else {"type": "object"}
        schema = {**schema, "x-guidance": JSON_OPTIONS}
        head = '{"name": ' + json.dumps(f["name"], ensure_ascii=False) + ', "arguments": '
        bodies.append(f'{_lark_string(head)} %json{json.dumps(schema)} "}}"')
    if not bodies:
        return None
    # TEXT: an answer without calls; to_call: the text up to the first call (lazy: it ends at the first
    # <tool_call>, however it is spelled), so content before the calls stays free
    start = '"<tool_call>" calls' if choice == "required" or named is not None else "TEXT | to_call calls"
    return "\n".join(
        [
            "start: " + start,
            "TEXT: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/",
            "to_call[lazy]: /(?s:.*)<tool_call>/",
            'calls: call ("\\n<tool_call>" call)*',
            'call: "\\n" body "\\n</tool_call>"',
            "body: " + " | ".join(bodies),
        ]
    )


class Grammars:
    """The grammar engine of one tokenizer: its vocabulary prepared on first use, then a fresh matcher per
    request."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._vocab: GrammarVocab | None = None

    def compile(self, grammar: str, param: str) -> TokenGrammar:
        if self._vocab is None:
            self._vocab = GrammarVocab(self.tokenizer)
        try:
            return self._vocab.compile(grammar)
        except GrammarError as exc:
            raise APIError(400, f"invalid {param}: {exc}", param=param, code="invalid_value") from None


_ENGINES: dict[int, tuple[Any, Grammars]] = {}  # id(tokenizer) -> (the tokenizer, kept alive; its engine)


def request_grammar(tokenizer: Any, fmt: ChatFormat, req: Any, parser: Any) -> TokenGrammar | None:
    """The grammar a chat request's answer must follow (None: free text): its response_format, else its
    strict tools' calls. parser: the answer's (chat_formats), which says whether the answer starts inside a
    thinking block and whether tools are in use. APIError 400 for a format or schema that is not one."""
    entry = _ENGINES.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer:
        entry = _ENGINES[id(tokenizer)] = (tokenizer, Grammars(tokenizer))
    grammar = response_format_grammar(req.response_format, getattr(parser, "state", None) == "reasoning")
    if grammar is not None:
        return entry[1].compile(grammar, "response_format")
    if parser.use_tools and req.tools:
        grammar = tool_call_grammar(fmt, [t.model_dump(exclude_none=True) for t in req.tools], req.tool_choice)
        if grammar is not None:
            return entry[1].compile(grammar, "tools")
    return None
