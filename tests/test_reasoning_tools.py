"""DeepSeek V3/R1/V3.1, Kimi-K2, GLM-4.5 and MiniMax-M2: their chat templates (real ones; MiniMax-M2's
rewritten from what is known of it, see templates/README.md) render conversations with tools, tool results
and thinking; their answers split into reasoning_content, content and tool_calls, streamed
or whole, through the real server and the official `openai` client.

The expected prompts below were written out by reading each template, not by running our renderer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from moestream.formats.chat_template import render_chat
from moestream.formats.tokenizer import CONTROL, USER_DEFINED, Tokenizer, build_tiny_bpe_metadata
from moestream.serving.app import create_app
from moestream.serving.chat_formats import (
    DEEPSEEK,
    DEEPSEEK_V4,
    GLM,
    KIMI_K2,
    MINIMAX_M2,
    QWEN,
    OutputParser,
    chat_format,
    split_answer,
    starts_thinking,
)
from moestream.serving.schemas import ChatRequest
from moestream.serving.text import Reasoning, ToolCall
from tests.test_server import ScriptedEngine, _running

TEMPLATES = Path(__file__).parent / "templates"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22C"},
]


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


# ------------------------------------------------------------------------------------------ rendering


def test_deepseek_r1_renders_tool_calls_results_and_opens_thinking() -> None:
    t = template("deepseek-r1")
    msgs = [*TOOL_TURN, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nIt is 22C."}]
    msgs.append({"role": "user", "content": "Thanks"})
    out = render_chat(t, msgs, tools=TOOLS, bos_token="<｜begin▁of▁sentence｜>")
    assert out == (
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Weather in Paris?<｜Assistant｜><｜tool▁calls▁begin｜>"
        '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>22C"
        "<｜tool▁output▁end｜><｜tool▁outputs▁end｜><think>\nhm\n</think>\n\nIt is 22C.<｜end▁of▁sentence｜>"
        "<｜User｜>Thanks"
        "<｜Assistant｜><think>\n"
    )
    assert starts_thinking(DEEPSEEK, out)


def test_deepseek_v3_two_calls_and_string_arguments_pass_through() -> None:
    two = [CALL, {**CALL, "id": "call_2", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": two}]
    out = render_chat(template("deepseek-v3"), msgs, add_generation_prompt=False)
    assert out == (
        "<｜User｜>Hi<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
        '```json\n{"tz": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>'
    )


def test_deepseek_v3_0324_tool_results_then_generation() -> None:
    out = render_chat(template("deepseek-v3-0324"), TOOL_TURN, bos_token="<B>")
    assert out == (
        "<B>Be brief.<｜User｜>Weather in Paris?<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
        '<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
        "<｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>22C<｜tool▁output▁end｜>"
        "<｜tool▁outputs▁end｜>"
    )


@pytest.mark.parametrize(("kwargs", "tail"), [({}, "</think>"), ({"thinking": True}, "<think>")])
def test_deepseek_v31_thinking_switch(kwargs: dict[str, Any], tail: str) -> None:
    msgs = [
        {"role": "system", "content": "A"},
        {"role": "system", "content": "B"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>x</think>Hello"},
        {"role": "user", "content": "Again"},
    ]
    out = render_chat(template("deepseek-v3.1"), msgs, **kwargs)
    assert (
        out
        == "A\n\nB<｜User｜>Hi<｜Assistant｜></think>Hello<｜end▁of▁sentence｜><｜User｜>Again<｜Assistant｜>" + tail
    )
    assert starts_thinking(DEEPSEEK, out) == (tail == "<think>")
    calls = render_chat(template("deepseek-v3.1"), TOOL_TURN)
    assert calls.endswith(
        '<｜Assistant｜></think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁output▁begin｜>22C<｜tool▁output▁end｜>"
    )


def test_glm45_tools_reasoning_and_no_thinking() -> None:
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22C"},
    ]
    out = render_chat(template("glm-4.5"), msgs, tools=TOOLS, enable_thinking=False)
    tool_json = json.dumps(TOOLS[0], ensure_ascii=False)
    assert out == (
        "[gMASK]<sop><|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{tool_json}\n</tools>\n\nFor each function call, output the function name and arguments within the "
        "following XML format:\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n"
        "<arg_value>{arg-value-1}</arg_value>\n<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>"
        "\n...\n</tool_call><|user|>\nWeather in Paris?/nothink<|assistant|>\n<think>Need the tool.</think>\n"
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
        "<|observation|>\n<tool_response>\n22C\n</tool_response><|assistant|>\n<think></think>"
    )
    # reasoning of turns before the last user message is dropped
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>r</think>b"},
        {"role": "user", "content": "c"},
    ]
    assert render_chat(template("glm-4.5"), msgs) == (
        "[gMASK]<sop><|user|>\na<|assistant|>\n<think></think>\nb<|user|>\nc<|assistant|>"
    )


def test_kimi_k2_thinking_keeps_ids_and_recent_reasoning() -> None:
    call = {**CALL, "id": "functions.get_weather:0"}
    msgs = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "use tool", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "22C"},
    ]
    out = render_chat(template("kimi-k2-thinking"), msgs, tools=TOOLS)
    assert out == (
        f"<|im_system|>tool_declare<|im_middle|>{json.dumps(TOOLS)}<|im_end|>"
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
        "<|im_user|>user<|im_middle|>Weather?<|im_end|><|im_assistant|>assistant<|im_middle|><think>use tool</think>"
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n22C<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )
    plain = render_chat(template("kimi-k2"), [{"role": "user", "content": "Hi"}])
    assert plain == (
        "<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|><|im_user|>user<|im_middle|>Hi"
        "<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )


def test_minimax_m2_keeps_the_reasoning_of_the_current_turn_only() -> None:
    """Interleaved thinking: the reasoning of assistant turns after the last user message (the tool-calling
    loop of this turn) is written back, that of earlier turns dropped; the prompt opens <think>."""
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22C"},
    ]
    out = render_chat(template("minimax-m2"), msgs, tools=TOOLS)
    tool_json = json.dumps(TOOLS[0]["function"], ensure_ascii=False)
    assert out == (
        "]~!b[]~b]system\nYou are a helpful assistant. Your name is MiniMax-M2 and is built by MiniMax.\n\n"
        "# Tools\nYou may call one or more tools to assist with the user query.\nHere are the tools available in "
        f"JSONSchema format:\n\n<tools>\n<tool>{tool_json}</tool>\n</tools>\n\nWhen making tool calls, use XML "
        'format to invoke tools and pass parameters:\n\n<minimax:tool_call>\n<invoke name="tool-name-1">\n'
        '<parameter name="param-key-1">param-value-1</parameter>\n<parameter name="param-key-2">param-value-2'
        "</parameter>\n...\n</invoke>\n</minimax:tool_call>[e~[\n]~b]user\nWeather in Paris?[e~[\n]~b]ai\n"
        '<think>\nNeed the tool.\n</think>\n\n\n<minimax:tool_call>\n<invoke name="get_weather">\n'
        '<parameter name="city">Paris</parameter>\n</invoke>\n</minimax:tool_call>[e~[\n]~b]tool\n'
        "<response>22C</response>[e~[\n]~b]ai\n<think>\n"
    )
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>\nr\n</think>\n\nb"},  # as `chat` keeps an answer
        {"role": "user", "content": "c"},
    ]
    assert render_chat(template("minimax-m2"), msgs).endswith(
        "]~b]user\na[e~[\n]~b]ai\nb[e~[\n]~b]user\nc[e~[\n]~b]ai\n<think>\n"
    )
    assert starts_thinking(MINIMAX_M2, out)


def test_family_is_read_off_the_template() -> None:
    for name in ("deepseek-v3", "deepseek-r1", "deepseek-v3-0324", "deepseek-v3.1"):
        assert chat_format(template(name)) is DEEPSEEK
    assert chat_format(template("glm-4.5")) is GLM
    assert chat_format(template("deepseek-v4")) is DEEPSEEK_V4
    assert chat_format(template("minimax-m2")) is MINIMAX_M2
    assert chat_format(template("kimi-k2")) is KIMI_K2 and chat_format(template("kimi-k2-thinking")) is KIMI_K2
    assert chat_format(None) is QWEN and chat_format("{{ messages }}") is QWEN


def test_deepseek_v4_renders_tools_calls_results_and_the_thinking_switch() -> None:
    """V4's template (llama.cpp's, written into V4 GGUFs by its converter): the tools in the system prompt
    with the DSML call format, a call written back in DSML (its arguments given as a JSON string too), the
    result as <tool_result> in a user turn, and the generation prompt closing (no thinking) or opening
    (thinking) the <think> block."""
    t = template("deepseek-v4")
    string_args = dict(CALL, function={"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'})
    msgs = [*TOOL_TURN[:2], {"role": "assistant", "content": None, "tool_calls": [string_args]}, TOOL_TURN[3]]
    out = render_chat(t, msgs, tools=TOOLS, add_generation_prompt=True, bos_token="<｜begin▁of▁sentence｜>")
    assert out.startswith("<｜begin▁of▁sentence｜>Be brief.\n\n## Tools\n")
    assert json.dumps(TOOLS[0]["function"], ensure_ascii=False) in out
    assert out.endswith(
        "<｜User｜>Weather in Paris?<｜Assistant｜></think>\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
        "<｜end▁of▁sentence｜><｜User｜><tool_result>22C</tool_result><｜Assistant｜></think>"
    )
    thinking = render_chat(t, TOOL_TURN[:2], add_generation_prompt=True, enable_thinking=True, bos_token="")
    assert thinking == "Be brief.<｜User｜>Weather in Paris?<｜Assistant｜><think>"
    assert starts_thinking(DEEPSEEK_V4, thinking)


# ------------------------------------------------------------------------------------------- parsing

R1_TEXT = (
    "Okay, the user wants weather.\nI will call the tool.\n</think>\n\nChecking."
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
    "```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
)
V31_TEXT = (
    'plan</think>ok<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
    "<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
)
GLM_TEXT = (
    "<think>The user asks.\nCall it.</think>\nSure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
    "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>\n"
    "<tool_call>get_time\n</tool_call>"
)
KIMI_TEXT = (
    "<think>Let me see.</think>Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Paris", "days": 2}<|tool_call_end|><|tool_call_begin|>'
    "functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>"
)
V4_TEXT = (
    'The user asks.\nCall it.</think>Sure.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    '<｜DSML｜invoke name="get_time">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
)
MINIMAX_TEXT = (  # the prompt opened <think>
    'The user asks.\nCall it.\n</think>\n\nSure.\n<minimax:tool_call>\n<invoke name="get_weather">\n'
    '<parameter name="city">Paris</parameter>\n<parameter name="days">2</parameter>\n</invoke>\n'
    '<invoke name="get_time">\n</invoke>\n</minimax:tool_call>'
)
WEATHER_AND_TIME = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
CASES = {
    "r1": (DEEPSEEK, True, R1_TEXT, "Okay, the user wants weather.\nI will call the tool.", "Checking."),
    "v3.1": (DEEPSEEK, True, V31_TEXT, "plan", "ok"),
    "glm": (GLM, False, GLM_TEXT, "The user asks.\nCall it.", "Sure."),
    "kimi": (KIMI_K2, False, KIMI_TEXT, "Let me see.", "Checking."),
    "v4": (DEEPSEEK_V4, True, V4_TEXT, "The user asks.\nCall it.", "Sure."),
    "minimax-m2": (MINIMAX_M2, True, MINIMAX_TEXT, "The user asks.\nCall it.", "Sure."),
}


def _calls(calls: list[ToolCall]) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("case", list(CASES))
def test_answer_splits_into_reasoning_content_calls(case: str) -> None:
    fmt, thinking, text, reasoning, content = CASES[case]
    r, c, calls = split_answer(OutputParser(fmt, use_tools=True, thinking=thinking, tools=TOOLS), text)
    want = WEATHER_AND_TIME if case != "v3.1" else [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert (r, c, _calls(calls)) == (reasoning, content, want)
    assert [c.index for c in calls] == [0, 1]
    if case == "kimi":
        assert [c.id for c in calls] == ["functions.get_weather:0", "functions.get_time:1"]


@pytest.mark.parametrize("case", list(CASES))
def test_streaming_split_at_every_boundary_equals_whole(case: str) -> None:
    fmt, thinking, text, _, _ = CASES[case]

    def run(chunks: list[str]) -> tuple[str, str, list[tuple[str, Any]]]:
        p = OutputParser(fmt, use_tools=True, thinking=thinking, tools=TOOLS)
        pieces = [x for ch in chunks for x in p.feed(ch)] + p.finish()
        assert not any(isinstance(x, str) and not x for x in pieces)
        r = "".join(x.text for x in pieces if isinstance(x, Reasoning))
        return r, "".join(x for x in pieces if isinstance(x, str)), _calls(p.calls)

    whole = run([text])
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 7):
            assert run([text[:i], text[i:j], text[j:]]) == whole, (i, j)
    assert run(list(text)) == whole


def test_edge_cases() -> None:
    def split(fmt: Any, text: str, **kw: Any) -> tuple[str, str, list[tuple[str, Any]]]:
        r, c, calls = split_answer(OutputParser(fmt, **{"use_tools": True, "tools": TOOLS, **kw}), text)
        return r, c, _calls(calls)

    # no thinking block: all content; an unclosed one is all reasoning
    assert split(GLM, "Just text.") == ("", "Just text.", [])
    assert split(GLM, "  <think> still thinking") == ("still thinking", "", [])
    assert split(DEEPSEEK, "thinking cut off", thinking=True) == ("thinking cut off", "", [])
    # the generation ended before <｜tool▁calls▁end｜>: the calls still count
    cut = R1_TEXT.removesuffix("<｜tool▁calls▁end｜>")
    assert split(DEEPSEEK, cut, thinking=True)[2] == WEATHER_AND_TIME
    # a block that does not parse stays text, as written
    bad = "x<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{oops\n```<｜tool▁call▁end｜>"
    assert split(DEEPSEEK, bad + "<｜tool▁calls▁end｜>") == ("", bad + "<｜tool▁calls▁end｜>", [])
    # GLM: string parameters stay text even when they look like JSON; others parse as JSON when they can
    glm = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>42</arg_value>\n<arg_key>days</arg_key>"
    glm += "\n<arg_value>3</arg_value>\n<arg_key>note</arg_key>\n<arg_value>a b</arg_value>\n</tool_call>"
    assert split(GLM, glm)[2] == [("get_weather", {"city": "42", "days": 3, "note": "a b"})]
    # MiniMax-M2: the same typing; an invoke the generation ended inside is dropped, the whole ones count
    mm = '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">42</parameter>\n'
    mm += '<parameter name="days">3</parameter>\n</invoke>\n<invoke name="get_time">\n<param'
    assert split(MINIMAX_M2, mm) == ("", "", [("get_weather", {"city": "42", "days": 3})])
    # without tools in the request, calls stay in the content; reasoning is still split off
    r, c, calls = split_answer(OutputParser(GLM, use_tools=False), GLM_TEXT)
    assert r == "The user asks.\nCall it." and c.startswith("Sure.\n<tool_call>get_weather") and not calls
    # Qwen's answers pass through as before: <think> stays in the content
    assert split_answer(OutputParser(QWEN, use_tools=False), "<think>a</think>b") == ("", "<think>a</think>b", [])


# ------------------------------------------------------------------------------ through the server


def family_tokenizer(name: str, special: list[str], eos: str, think_special: bool = False) -> Tokenizer:
    """The tiny test vocabulary plus a family's marker tokens (control tokens, as in the real GGUFs where
    llama.cpp's converter marks them special; <think> and </think> too with think_special) and its real chat
    template."""
    md = build_tiny_bpe_metadata()
    tokens, types = list(md["tokenizer.ggml.tokens"]), list(md["tokenizer.ggml.token_type"])
    for t in special:
        tokens.append(t)
        types.append(CONTROL if think_special or t not in ("<think>", "</think>") else USER_DEFINED)
    merges = md["tokenizer.ggml.merges"]
    return Tokenizer(
        tokens,
        types,
        merges,
        pre="qwen2",
        eos_id=tokens.index(eos),
        chat_template=template(name),
    )


DS_SPECIAL = ["<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", *DEEPSEEK.tool_markers, "<think>", "</think>"]
GLM_SPECIAL = ["<|user|>", "<|assistant|>", "<|observation|>", "[gMASK]", "<sop>", *GLM.tool_markers]
GLM_SPECIAL += ["<think>", "</think>"]
MINIMAX_SPECIAL = ["]~!b[", "]~b]", "[e~[", *MINIMAX_M2.tool_markers, "<think>", "</think>"]


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


@pytest.mark.parametrize(
    ("name", "special", "eos", "script", "reasoning", "content"),
    [
        ("deepseek-r1", DS_SPECIAL, "<｜end▁of▁sentence｜>", R1_TEXT, CASES["r1"][3], "Checking."),
        ("glm-4.5", GLM_SPECIAL, "<|user|>", GLM_TEXT, CASES["glm"][3], "Sure."),
        ("minimax-m2", MINIMAX_SPECIAL, "[e~[", MINIMAX_TEXT, CASES["minimax-m2"][3], "Sure."),
    ],
)
def test_server_reasoning_and_tool_calls(
    name: str, special: list[str], eos: str, script: str, reasoning: str, content: str
) -> None:
    tok = family_tokenizer(name, special, eos)
    assert all(tok.is_special(tok.encode(m)[0]) for m in special if m not in ("<think>", "</think>"))
    with _running(create_app(ScriptedEngine(tok, script, ctx=8192), "fam")) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        kw: dict[str, Any] = dict(model="fam", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS)
        r = c.chat.completions.create(**kw)
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls"
        assert (m.reasoning_content, m.content) == (reasoning, content)
        assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == WEATHER_AND_TIME
        assert _stream(c, **kw) == (reasoning, content, "tool_calls", WEATHER_AND_TIME)

        # the client sends the calls and results back: the template renders them (DeepSeek's needs the
        # arguments as text and content null) and the next answer is parsed again
        follow = [
            *kw["messages"],
            m.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "22C"},
        ]
        r2 = c.chat.completions.create(model="fam", messages=follow, tools=TOOLS)
        assert [t.function.name for t in r2.choices[0].message.tool_calls] == ["get_weather", "get_time"]

        # without tools: reasoning still split off; the calls' special tokens are not written
        r3 = c.chat.completions.create(model="fam", messages=kw["messages"])
        assert r3.choices[0].message.reasoning_content == reasoning
        assert r3.choices[0].finish_reason == "stop" and not r3.choices[0].message.tool_calls
        assert "<｜tool▁call▁begin｜>" not in r3.choices[0].message.content


def test_deepseek_prompt_carries_the_tools() -> None:
    """DeepSeek's templates never write the request's tools: the server puts them in the system prompt,
    with the call format the template itself writes (V3.1's differs from R1's)."""
    for name, call in (
        ("deepseek-r1", "function<｜tool▁sep｜>tool_call_name\n```json"),
        ("deepseek-v3.1", "<｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>"),
    ):
        tok = family_tokenizer(name, DS_SPECIAL, "<｜end▁of▁sentence｜>")
        svc = create_app(ScriptedEngine(tok, "x", ctx=8192), "fam").state.service
        req = ChatRequest.model_validate(
            {
                "model": "fam",
                "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                "tools": TOOLS,
            }
        )
        ids, parser = svc.chat_prompt(req)
        text = tok.decode(ids)
        assert text.startswith("Be brief.\n\n## Tools\nYou have access to the following tools:\n\n### get_weather\n")
        assert call in text and parser.use_tools
        assert parser.state == ("reasoning" if name == "deepseek-r1" else "start")


def test_chat_keeps_a_thinking_answer_as_its_template_splits_it() -> None:
    """`moestream chat` keeps a MiniMax-M2 answer with its </think> (a special token here), so the next
    prompt drops that turn's reasoning as the template does for earlier turns."""
    from moestream.engine.sampling import Sampler
    from moestream.serving.chat import ChatSession

    tok = family_tokenizer("minimax-m2", MINIMAX_SPECIAL, "[e~[", think_special=True)
    assert tok.is_special(tok.encode("</think>")[0])
    engine = ScriptedEngine(tok, "Say hi.\n</think>\n\nHi there.", ctx=4096)
    session = ChatSession(engine, Sampler())
    shown: list[str] = []
    assert session.ask("Hi", shown.append, lambda: False) == "Say hi.\n</think>\n\nHi there."
    session.messages.append({"role": "user", "content": "Again"})
    text = tok.decode(session._prompt())
    assert text.endswith("]~b]user\nHi[e~[\n]~b]ai\nHi there.[e~[\n]~b]user\nAgain[e~[\n]~b]ai\n<think>\n")
