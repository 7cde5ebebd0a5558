"""render_chat vs. transformers' apply_chat_template on Qwen3's real chat template (built locally)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
from transformers import Qwen2Tokenizer

from moestream.errors import MoestreamError
from moestream.formats.chat_template import render_chat
from moestream.formats.tokenizer import TINY_CHAT_TEMPLATE

# Qwen3's chat template (Qwen/Qwen3-30B-A3B tokenizer_config.json), verbatim.
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""  # noqa: E501

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city — «quoted», <b>not</b> HTML-escaped",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Zürich"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]

SIMPLE = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello! 你好 🎉"},
]

MULTI_TURN = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nsimple sum\n</think>\n\n4"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6", "reasoning_content": "add again"},
    {"role": "user", "content": "Thanks"},
]

TOOL_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather and time in Zürich?"},
    {
        "role": "assistant",
        "content": None,  # as OpenAI clients send it
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}},
            },
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "sunny"}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
    {
        "role": "assistant",
        "content": "Let me check one more thing.",
        "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Bern"}}}],
    },
    {"role": "tool", "content": '{"temp": 19}'},
]


@pytest.fixture(scope="module")
def hf_tokenizer() -> Qwen2Tokenizer:
    vocab = {chr(c): i for i, c in enumerate(range(ord("a"), ord("z") + 1))}
    return Qwen2Tokenizer(vocab=vocab, merges=[], chat_template=QWEN3_TEMPLATE)


def hf_render(tok: Qwen2Tokenizer, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


CASES = [
    ("simple", SIMPLE, {}),
    ("simple-no-prompt", SIMPLE, {"add_generation_prompt": False}),
    ("no-thinking", SIMPLE, {"enable_thinking": False}),
    ("multi-turn", MULTI_TURN, {}),
    ("multi-turn-no-thinking", MULTI_TURN, {"enable_thinking": False}),
    ("ends-with-assistant", MULTI_TURN[:4], {"add_generation_prompt": False}),
    ("tools", TOOL_CONVERSATION, {"tools": TOOLS}),
    ("tools-no-thinking", TOOL_CONVERSATION, {"tools": TOOLS, "enable_thinking": False}),
    ("tools-no-system", TOOL_CONVERSATION[1:], {"tools": TOOLS}),
    ("tool-calls-without-tools", TOOL_CONVERSATION, {}),
]


@pytest.mark.parametrize(("messages", "kwargs"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_matches_transformers(hf_tokenizer, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> None:
    kwargs = {"add_generation_prompt": True, **kwargs}
    expected = hf_render(hf_tokenizer, messages, **kwargs)
    assert render_chat(QWEN3_TEMPLATE, messages, **kwargs) == expected


def test_tool_conversation_shape() -> None:
    text = render_chat(QWEN3_TEMPLATE, TOOL_CONVERSATION, tools=TOOLS, enable_thinking=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '"description": "City name, e.g. Zürich"' in text  # tojson: ensure_ascii=False
    assert "<b>not</b>" in text  # tojson: no HTML escaping
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", '
        '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
        "<|im_end|>\n"
    ) in text
    assert (
        '<|im_start|>user\n<tool_response>\n{"temp": 21, "sky": "sunny"}\n</tool_response>\n<tool_response>\n'
        "14:05\n</tool_response><|im_end|>\n"
    ) in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_tiny_template_agrees_with_qwen3_without_reasoning() -> None:
    # the compact template in build_tiny_bpe_metadata renders Qwen3's format; it only drops the
    # historic-reasoning handling, which these conversations do not exercise
    for messages, kwargs in [
        (SIMPLE, {}),
        (SIMPLE, {"enable_thinking": False}),
        (SIMPLE, {"add_generation_prompt": False}),
        (SIMPLE[1:], {}),
        (TOOL_CONVERSATION, {"tools": TOOLS}),
        (TOOL_CONVERSATION[1:], {"tools": TOOLS, "enable_thinking": False}),
        (TOOL_CONVERSATION, {}),
        ([*MULTI_TURN[:1], {"role": "assistant", "content": "4"}, MULTI_TURN[2]], {}),
    ]:
        assert render_chat(TINY_CHAT_TEMPLATE, messages, **kwargs) == render_chat(QWEN3_TEMPLATE, messages, **kwargs), (
            messages,
            kwargs,
        )


def test_messages_are_not_modified() -> None:
    messages = copy.deepcopy(TOOL_CONVERSATION)
    render_chat("{% set m = messages[0] %}{{ m.content }}", messages)
    render_chat(QWEN3_TEMPLATE, messages, tools=TOOLS)
    assert messages == TOOL_CONVERSATION


def test_hf_helpers_and_jinja_settings(hf_tokenizer) -> None:
    tpl = (
        "{% for m in messages %}\n"
        "  {% if loop.index > 2 %}{% break %}{% endif %}\n"
        "  {{ m.role }}:{{ m.content | tojson(indent=2) }}\n"
        "{% endfor %}"
        "{{ strftime_now('%Y') | length }}{{ custom }}"
        "{% generation %}[gen]{% endgeneration %}"
    )
    msgs = [{"role": "user", "content": ["é", 1]}, {"role": "assistant", "content": "b"}, {"role": "x"}]
    out = render_chat(tpl, msgs, custom="!")
    # trim_blocks/lstrip_blocks drop the block tags' lines; the indentation before {{ }} stays
    assert out == '  user:[\n  "é",\n  1\n]\n  assistant:"b"\n4![gen]'
    assert out == hf_tokenizer.apply_chat_template(msgs, chat_template=tpl, tokenize=False, custom="!")
    assert render_chat("{{ bos_token }}|{{ eos_token }}", [], bos_token="<s>", eos_token="</s>") == "<s>|</s>"


def test_dataclass_and_reasoning_aliases() -> None:
    @dataclasses.dataclass
    class Msg:
        role: str
        content: str
        reasoning: str | None = None

    out = render_chat(
        "{% for m in messages %}{{ m.role }}|{{ m.content }}|{{ m.reasoning_content }}|{{ m.thinking }};{% endfor %}",
        [Msg("user", "hi"), Msg("assistant", "ok", "because")],
    )
    assert out == "user|hi||;assistant|ok|because|because;"


def test_raise_exception_becomes_one_line_error() -> None:
    tpl = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation roles must\nalternate') }}{% endif %}"
    with pytest.raises(MoestreamError, match="rejected the conversation: Conversation roles must alternate$"):
        render_chat(tpl, [{"role": "assistant", "content": "x"}])


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("{% for m in messages %}{{ m.content }", "does not parse"),
        ("{{ messages[0].content.upper(1, 2, 3) }}", "TypeError"),
        ("{{ messages.append(1) }}", "SecurityError"),
        ("{% set ns = namespace(_x=1) %}", "SecurityError"),
        ("{{ ''.__class__.__mro__ }}", "SecurityError"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ],
)
def test_template_errors_are_moestream_errors(template: str, match: str) -> None:
    with pytest.raises(MoestreamError, match=match) as info:
        render_chat(template, [{"role": "user", "content": "x"}])
    assert "\n" not in str(info.value)
