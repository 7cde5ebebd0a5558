"""GPT-OSS's harmony format: its real chat template (llama.cpp's models/templates/openai-gpt-oss-120b.jinja)
renders system, user, assistant tool calls and tool results as transformers does; answers split into
reasoning_content (analysis channel), content (final channel) and tool_calls (commentary addressed to a
function), whole or streamed, through the real server and the official `openai` client.

The expected prompts below were written out by reading the template, not by running our renderer.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from moestream.formats.chat_template import render_chat
from moestream.formats.tokenizer import CONTROL, Tokenizer, build_tiny_bpe_metadata
from moestream.serving.app import create_app
from moestream.serving.chat_formats import HARMONY, HarmonyParser, chat_format, output_parser, split_answer
from moestream.serving.schemas import ChatRequest
from moestream.serving.text import Reasoning, ToolCall
from tests.test_reasoning_tools import CALL, TOOLS
from tests.test_server import ScriptedEngine, _running

TEMPLATE = (Path(__file__).parent / "templates" / "gpt-oss.jinja").read_text()
TOOL_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "thinking": "Need the weather.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22C"},
]
# the same assistant turn as an OpenAI client sends it
CALL_TURN_OPENAI = {
    "role": "assistant",
    "content": None,
    "reasoning_content": "Need the weather.",
    "tool_calls": [CALL],
}


def system_part(effort: str = "medium") -> str:
    return (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        f"Knowledge cutoff: 2024-06\nCurrent date: {datetime.now().strftime('%Y-%m-%d')}\n\n"
        f"Reasoning: {effort}\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
        "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
    )


DEVELOPER = (
    "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n"
    "namespace functions {\n\n// Current weather\ntype get_weather = (_: {\ncity: string,\ndays?: number,\n"
    "}) => any;\n\n} // namespace functions<|end|>"
)
TOOL_CALL = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
TOOL_RESULT = '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"22C"<|end|>'


def transformers_render(messages: list[dict[str, Any]], **kw: Any) -> str:
    rendered, _ = render_jinja_template(
        [messages], tools=TOOLS, chat_template=TEMPLATE, add_generation_prompt=True, **kw
    )
    return rendered[0]


# ------------------------------------------------------------------------------------------ rendering


def test_renders_system_tools_call_and_result_as_transformers_does() -> None:
    out = render_chat(TEMPLATE, TOOL_TURN, tools=TOOLS)
    want = (
        system_part() + DEVELOPER + "<|start|>user<|message|>Weather in Paris?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>"  # kept: no final answer yet
         + TOOL_CALL + TOOL_RESULT + "<|start|>assistant"
    )
    assert out == want
    assert transformers_render(TOOL_TURN) == want
    # the thinking arrives as OpenAI's reasoning_content: the same prompt
    as_openai = [*TOOL_TURN[:2], CALL_TURN_OPENAI, TOOL_TURN[3]]
    assert render_chat(TEMPLATE, as_openai, tools=TOOLS) == want


def test_final_answer_drops_earlier_analysis_and_reasoning_effort_reaches_the_template() -> None:
    msgs = [*TOOL_TURN, {"role": "assistant", "content": "It is 22C."}, {"role": "user", "content": "Thanks"}]
    out = render_chat(TEMPLATE, msgs, tools=TOOLS, reasoning_effort="high")
    want = (
        system_part("high") + DEVELOPER + "<|start|>user<|message|>Weather in Paris?<|end|>" + TOOL_CALL
        + TOOL_RESULT + "<|start|>assistant<|channel|>final<|message|>It is 22C.<|end|>"
        "<|start|>user<|message|>Thanks<|end|><|start|>assistant"
    )  # fmt: skip
    assert out == want
    assert transformers_render(msgs, reasoning_effort="high") == want


def test_family_is_read_off_the_template() -> None:
    assert chat_format(TEMPLATE) is HARMONY
    assert HARMONY.think_markers == ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>")


# -------------------------------------------------------------------------------------------- parsing

ANALYSIS = "<|channel|>analysis<|message|>The user asks. Call it.<|end|>"
CASES = {
    # the commentary channel names the recipient (what the model writes)
    "call in channel": (
        ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}',
        "The user asks. Call it.",
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    # the role names it (what the template writes)
    "call in role": (
        ANALYSIS + '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Paris"}',
        "The user asks. Call it.",
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    "final": (
        ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is 22C <in Paris> |end|.",
        "The user asks. Call it.",
        "It is 22C <in Paris> |end|.",
        [],
    ),
    # a preamble on the commentary channel is content, then the call
    "preamble then call": (
        "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 2}',
        "",
        "Checking.",
        [("get_weather", {"city": "Paris", "days": 2})],
    ),
}


def _calls(calls: list[ToolCall]) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("case", list(CASES))
def test_answer_splits_into_reasoning_content_calls(case: str) -> None:
    text, reasoning, content, calls = CASES[case]
    r, c, got = split_answer(output_parser(HARMONY, use_tools=True, tools=TOOLS), text)
    assert (r, c, _calls(got)) == (reasoning, content, calls)


@pytest.mark.parametrize("case", list(CASES))
def test_streaming_split_at_every_boundary_equals_whole(case: str) -> None:
    text = CASES[case][0]

    def run(chunks: list[str]) -> tuple[str, str, list[tuple[str, Any]]]:
        p = HarmonyParser(HARMONY, use_tools=True, tools=TOOLS)
        pieces = [x for ch in chunks for x in p.feed(ch)] + p.finish()
        assert not any(isinstance(x, str) and not x for x in pieces)
        r = "".join(x.text for x in pieces if isinstance(x, Reasoning))
        return r, "".join(x for x in pieces if isinstance(x, str)), _calls(p.calls)

    whole = run([text])
    assert whole == CASES[case][1:]
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 5):
            assert run([text[:i], text[i:j], text[j:]]) == whole, (i, j)
    assert run(list(text)) == whole


def test_edge_cases() -> None:
    def split(text: str, use_tools: bool = True) -> tuple[str, str, list[tuple[str, Any]]]:
        r, c, calls = split_answer(output_parser(HARMONY, use_tools=use_tools, tools=TOOLS), text)
        return r, c, _calls(calls)

    # cut off inside the analysis: all reasoning; a header with no body yet: nothing
    assert split("<|channel|>analysis<|message|>still thinking") == ("still thinking", "", [])
    assert split(ANALYSIS + "<|start|>assistant<|channel|>fin") == ("The user asks. Call it.", "", [])
    # arguments that are not a JSON object stay text
    bad = "<|channel|>commentary to=functions.get_weather json<|message|>{oops"
    assert split(bad) == ("", "{oops", [])
    # no tools in the request: a call's body is content
    assert split(CASES["call in channel"][0], use_tools=False) == ("The user asks. Call it.", '{"city": "Paris"}', [])
    # text written without any header is content
    assert split("Just text.") == ("", "Just text.", [])


# ------------------------------------------------------------------------------ through the server

SPECIAL = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|return|>", "<|call|>"]


def harmony_tokenizer() -> Tokenizer:
    """The tiny test vocabulary plus harmony's control tokens and the real gpt-oss template."""
    md = build_tiny_bpe_metadata()
    tokens, types = list(md["tokenizer.ggml.tokens"]), list(md["tokenizer.ggml.token_type"])
    tokens += SPECIAL
    types += [CONTROL] * len(SPECIAL)
    return Tokenizer(
        tokens, types, md["tokenizer.ggml.merges"], pre="qwen2", eos_id=tokens.index("<|return|>"),
        chat_template=TEMPLATE,
    )  # fmt: skip


def test_end_is_not_a_stop_but_return_and_call_are() -> None:
    tok = harmony_tokenizer()
    ids = {t: tok.encode(t, add_bos=False)[0] for t in SPECIAL}
    assert ids["<|return|>"] in tok.stop_ids and ids["<|call|>"] in tok.stop_ids
    assert ids["<|end|>"] not in tok.stop_ids


def _stream(c: openai.OpenAI, **kw: Any) -> tuple[str, str, str | None, list[tuple[str, Any]]]:
    reasoning, content, finish, calls = "", "", None, {}
    for chunk in c.chat.completions.create(stream=True, **kw):
        for d in chunk.choices:
            reasoning += getattr(d.delta, "reasoning_content", None) or ""
            content += d.delta.content or ""
            finish = d.finish_reason or finish
            for tc in d.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
    return reasoning, content, finish, [(v["name"], json.loads(v["arguments"])) for _, v in sorted(calls.items())]


def test_server_reasoning_content_and_tool_calls() -> None:
    tok = harmony_tokenizer()
    call_script = CASES["call in channel"][0] + "<|call|>"
    final_script = CASES["final"][0] + "<|return|>"
    weather = [("get_weather", {"city": "Paris"})]
    user = [{"role": "user", "content": "Weather in Paris?"}]
    engine = ScriptedEngine(tok, call_script, ctx=8192)
    with _running(create_app(engine, "oss")) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        kw: dict[str, Any] = dict(model="oss", messages=user, tools=TOOLS)
        r = c.chat.completions.create(**kw)
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls"
        assert (m.reasoning_content, m.content) == ("The user asks. Call it.", None)
        assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == weather
        assert _stream(c, **kw) == ("The user asks. Call it.", "", "tool_calls", weather)

        # the calls and results go back; the template renders them, and a final answer comes out
        engine.script = final_script
        follow = [
            *user,
            m.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "22C"},
        ]
        kw2: dict[str, Any] = dict(model="oss", messages=follow, tools=TOOLS, reasoning_effort="low")
        r2 = c.chat.completions.create(**kw2)
        m2 = r2.choices[0].message
        assert r2.choices[0].finish_reason == "stop" and not m2.tool_calls
        assert (m2.reasoning_content, m2.content) == ("The user asks. Call it.", "It is 22C <in Paris> |end|.")
        assert _stream(c, **kw2) == ("The user asks. Call it.", "It is 22C <in Paris> |end|.", "stop", [])

        # without tools the channels are still split
        r3 = c.chat.completions.create(model="oss", messages=user)
        assert (r3.choices[0].message.reasoning_content, r3.choices[0].message.content) == (
            "The user asks. Call it.",
            "It is 22C <in Paris> |end|.",
        )


def test_reasoning_effort_reaches_the_prompt() -> None:
    tok = harmony_tokenizer()
    svc = create_app(ScriptedEngine(tok, "x", ctx=8192), "oss").state.service
    for effort in ("low", "high"):
        req = ChatRequest.model_validate(
            {"model": "oss", "messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": effort}
        )
        ids, parser = svc.chat_prompt(req)
        assert f"Reasoning: {effort}\n\n" in tok.decode(ids) and isinstance(parser, HarmonyParser)
    with pytest.raises(Exception, match="reasoning_effort"):
        ChatRequest.model_validate({"model": "oss", "messages": [], "reasoning_effort": "extreme"})
