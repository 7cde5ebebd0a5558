"""Structured output: response_format and strict tools, through the real server, engine and grammar engine.

A tiny random-weight model left to itself writes gibberish; every JSON answer here parses and validates only
because llguidance's mask (moestream/engine/grammar.py) steered each of its tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import torch
from fastapi.testclient import TestClient

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler
from moestream.serving.app import create_app
from moestream.serving.chat_formats import QWEN
from moestream.serving.structured import Grammars, response_format_grammar, tool_call_grammar
from moestream.synth.shapes import write_synth

MODEL = "tiny"
# bounded strings, numbers and arrays, so that a random model's answer ends within max_tokens
NAME = {"type": "string", "maxLength": 12}
SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {
            "name": NAME,
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "ok"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"name": NAME, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["name", "unit"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3},
        },
        "required": ["user", "tags"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": -10, "maximum": 10},
            "points": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 4},
            "level": {"enum": [1, 2, 3, "max"]},
        },
        "required": ["score", "points", "level"],
        "additionalProperties": False,
    },
}
WEATHER = {
    "type": "object",
    "properties": {"city": NAME, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    path = write_synth("tiny", "Q4_0", tmp_path_factory.mktemp("model") / "tiny.gguf", progress=False)
    eng = Engine(path, EngineOptions(n_slots=10_000, ctx=1024, max_batch=4))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def client(engine: Engine) -> Iterator[TestClient]:
    with TestClient(create_app(engine, MODEL)) as c:
        yield c


def _chat(client: TestClient, stream: bool, **body: Any) -> tuple[int, dict[str, Any]]:
    """Status and answer (a stream's chunks gathered into one message, as a client would)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 400,
            "stream": stream, **body}  # fmt: skip
    if not stream:
        r = client.post("/v1/chat/completions", json=body)
        return r.status_code, r.json()
    content, calls, finish = "", {}, None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.json()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            content += choice["delta"].get("content") or ""
            for c in choice["delta"].get("tool_calls") or []:
                calls[c["index"]] = c
            finish = choice["finish_reason"] or finish
    tool_calls = [calls[i] for i in sorted(calls)]
    message = {"content": content, "tool_calls": tool_calls or None}
    return 200, {"choices": [{"message": message, "finish_reason": finish}]}


SAMPLING = {"greedy": {"temperature": 0}, "sampled": {"temperature": 1.0, "top_p": 0.95, "seed": 7}}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_answers_validate(client: TestClient, name: str, sampling: str, stream: bool) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
    status, answer = _chat(client, stream, response_format=fmt, **SAMPLING[sampling])
    assert status == 200, answer
    choice = answer["choices"][0]
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMAS[name])
    assert choice["finish_reason"] == "stop"  # the grammar's end ends the answer


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_object_answers_are_objects(client: TestClient, seed: int, stream: bool) -> None:
    # bounded only by max_tokens: an answer cut by it is no object yet, so only finished ones must parse
    status, answer = _chat(client, stream, response_format={"type": "json_object"}, seed=seed, max_tokens=600)
    assert status == 200, answer
    choice = answer["choices"][0]
    text = choice["message"]["content"]
    assert text.startswith("{")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)


def test_text_format_is_free_text(client: TestClient) -> None:
    status, answer = _chat(client, False, response_format={"type": "text"}, temperature=0, max_tokens=8)
    assert status == 200 and answer["choices"][0]["finish_reason"] == "length"


BAD_FORMATS = [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}, "objectx"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/nope"}}}, "nope"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "not a schema"}}, "JSON Schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "name"),
    ({"type": "json_schema"}, "name"),
    ({"type": "yaml"}, "response_format.type"),
    ({"schema": {}}, "response_format.type"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(("fmt", "says"), BAD_FORMATS)
def test_bad_response_format_is_a_400(client: TestClient, fmt: dict[str, Any], says: str, stream: bool) -> None:
    status, answer = _chat(client, stream, response_format=fmt)
    assert status == 400, answer
    err = answer["error"]
    assert err["type"] == "invalid_request_error" and err["param"].startswith("response_format")
    assert says in err["message"] and "\n" not in err["message"]


def test_completions_refuse_response_format(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("seed", [1, 2])
def test_strict_tool_call_arguments_validate(client: TestClient, seed: int, stream: bool) -> None:
    status, answer = _chat(client, stream, tools=TOOLS, tool_choice="required", seed=seed)
    assert status == 200, answer
    choice = answer["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert calls and choice["finish_reason"] == "tool_calls"
    for call in calls:
        args = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "get_weather":
            jsonschema.validate(args, WEATHER)
        else:
            assert call["function"]["name"] == "get_time" and isinstance(args, dict)


def test_named_strict_tool_is_the_one_called(client: TestClient) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    status, answer = _chat(client, False, tools=TOOLS, tool_choice=choice, temperature=0)
    assert status == 200, answer
    calls = answer["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"] * len(calls) and calls
    for c in calls:
        jsonschema.validate(json.loads(c["function"]["arguments"]), WEATHER)


def test_auto_tool_choice_allows_text_and_calls(engine: Engine) -> None:
    """With tool_choice auto the answer may be text, text then calls, or calls; a call's arguments are held
    to the strict tool's schema (the grammar walked here with the tokens a model could write)."""
    grammars = Grammars(engine.tokenizer)
    lark = tool_call_grammar(QWEN, TOOLS)
    assert lark is not None
    tok = engine.tokenizer
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "%s"}}\n</tool_call>'
    good, bad = "Let me look.\n" + call % "celsius", call % "kelvin"
    for text, ok in [("Just text, no call.", True), (good, True), (bad, False)]:
        assert _walk(grammars.compile(lark, "tools"), tok, text) == ok, text
    assert tool_call_grammar(QWEN, [{"type": "function", "function": {"name": "f", "parameters": {}}}]) is None


def test_grammar_leaves_the_rest_of_the_batch_alone(engine: Engine) -> None:
    """A plain request's tokens are the same alone and beside a json_schema request in the same steps."""
    tok = engine.tokenizer
    plain = tok.encode("The expert network reads the question")
    grammar = Grammars(tok).compile(response_format_grammar({"type": "json_object"}) or "", "response_format")

    def run(with_grammar: bool) -> list[int]:
        engine.reset()
        batch = engine.scheduler()
        seq = batch.add(plain, 24, Sampler())
        if with_grammar:
            batch.add(tok.encode("Answer in JSON."), 24, Sampler(), grammar=grammar)
        out: dict[int, list[int]] = {}
        while len(batch):
            for ev in batch.step():
                out.setdefault(id(ev.sequence), []).append(ev.token)
        return out[id(seq)]

    assert run(True) == run(False)


def _walk(grammar: Any, tok: Any, text: str) -> bool:
    """Whether the grammar lets a model write `text`, token by token."""
    for t in tok.encode(text):
        if not bool(grammar.mask(torch.zeros(tok.vocab_size))[t].isfinite()):
            return False
        grammar.accept(t)
    return True


def test_a_prompt_that_opened_thinking_keeps_its_reasoning(engine: Engine) -> None:
    """DeepSeek-R1-style prompts end inside <think>: the JSON comes after the reasoning and </think>, so the
    answer's parser still tells the two apart."""
    tok, grammars = engine.tokenizer, Grammars(engine.tokenizer)
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    after = response_format_grammar(fmt, thinking=True)
    plain = response_format_grammar(fmt)
    assert after is not None and plain is not None
    answer = '{"city": "Paris", "unit": "celsius"}'
    g = grammars.compile(after, "response_format")
    assert _walk(g, tok, "Paris, then.</think>\n\n" + answer) and g.done
    g = grammars.compile(after, "response_format")
    assert _walk(g, tok, "Paris, then.</think>" + answer.replace("celsius", "kelvin")[:-3]) is False
    assert not _walk(grammars.compile(plain, "response_format"), tok, "Paris, then.")


def test_bad_strict_tool_schema_is_a_400(client: TestClient) -> None:
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}, "strict": True}}]
    status, answer = _chat(client, False, tools=bad)
    assert status == 400, answer
    assert answer["error"]["param"] == "tools" and "\n" not in answer["error"]["message"]


def test_each_of_n_choices_follows_the_schema(client: TestClient) -> None:
    """n sampled choices decode in the same steps, each held to the schema by a grammar of its own."""
    name = next(iter(SCHEMAS))
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
    status, answer = _chat(client, False, response_format=fmt, n=3, temperature=1.0, seed=11)
    assert status == 200, answer
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    for choice in answer["choices"]:
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMAS[name])
        assert choice["finish_reason"] == "stop"
