"""`moestream chat` with a GPT-OSS model: the analysis channel shown as reasoning, tool calls shown as such,
and only the final channel's text (with the calls) kept in the history that the next turn renders."""

from __future__ import annotations

import pytest

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler
from moestream.serving.chat import DIM, PLAIN, ChatSession
from moestream.synth.shapes import write_synth
from tests.test_harmony import CASES, harmony_tokenizer
from tests.test_server import ScriptedEngine

FINAL = CASES["final"][0] + "<|return|>"  # analysis, then the final channel
CALL = CASES["call in channel"][0] + "<|call|>"  # analysis, then a call to functions.get_weather


def _ask(session: ChatSession, text: str) -> tuple[str, str]:
    shown: list[str] = []
    kept = session.ask(text, shown.append, lambda: False)
    return kept, "".join(shown)


def _prompt_text(session: ChatSession) -> str:
    return session.tok.decode(session._render(session.messages), skip_special=False)


def test_reasoning_is_shown_and_only_the_final_answer_is_kept() -> None:
    engine = ScriptedEngine(harmony_tokenizer(), FINAL, ctx=4096)
    session = ChatSession(engine, Sampler())
    kept, shown = _ask(session, "Weather in Paris?")
    assert kept == "It is 22C <in Paris> |end|."
    assert shown == "thinking: The user asks. Call it.\nIt is 22C <in Paris> |end|."
    assert session.messages[-1] == {"role": "assistant", "content": kept}
    # the next turn renders the answer on the final channel, its reasoning gone
    session.messages.append({"role": "user", "content": "And tomorrow?"})
    text = _prompt_text(session)
    assert "<|start|>assistant<|channel|>final<|message|>It is 22C <in Paris> |end|.<|end|>" in text
    assert "The user asks" not in text and text.endswith(
        "<|start|>user<|message|>And tomorrow?<|end|><|start|>assistant"
    )


def test_tool_call_is_shown_as_such_and_kept_as_a_call() -> None:
    engine = ScriptedEngine(harmony_tokenizer(), CALL, ctx=4096)
    session = ChatSession(engine, Sampler())
    kept, shown = _ask(session, "Weather in Paris?")
    assert kept == ""
    assert shown == 'thinking: The user asks. Call it.\n[tool call] get_weather({"city": "Paris"})\n'
    msg = session.messages[-1]
    assert msg["content"] == "" and [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]
    assert msg["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    session.messages.append({"role": "user", "content": "Thanks"})
    assert 'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>' in (
        _prompt_text(session)
    )


def test_reasoning_is_dimmed_on_a_terminal() -> None:
    engine = ScriptedEngine(harmony_tokenizer(), FINAL, ctx=4096)
    _, shown = _ask(ChatSession(engine, Sampler(), dim=True), "Weather in Paris?")
    assert shown == f"{DIM}thinking: The user asks. Call it.{PLAIN}\nIt is 22C <in Paris> |end|."


def test_an_answer_cut_inside_the_reasoning_closes_it() -> None:
    tok = harmony_tokenizer()
    cut = len(tok.encode("<|channel|>analysis<|message|>The user", add_bos=False))
    session = ChatSession(ScriptedEngine(tok, FINAL, ctx=4096), Sampler(), max_tokens=cut, dim=True)
    kept, shown = _ask(session, "Weather in Paris?")
    assert kept == "" and shown == f"{DIM}thinking: The user{PLAIN}\n"
    assert session.messages[-1] == {"role": "assistant", "content": ""}


@pytest.fixture(scope="module")
def oss_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_synth("tiny-gpt-oss", "Q8_0", tmp_path_factory.mktemp("oss") / "oss.gguf", progress=False)


def test_a_synthetic_gpt_oss_model_chats_in_harmony(oss_path: str) -> None:
    """synth's gpt-oss files carry harmony's tokens and template: the session renders harmony prompts and
    keeps only final-channel text (a random model rarely writes any, so mostly nothing) in its history."""
    engine = Engine(oss_path, EngineOptions(n_slots=64, threads=1))
    try:
        session = ChatSession(engine, Sampler(), max_tokens=12)
        assert session.harmony and len(session.keep) == 5
        for question in ("Hello there", "And again"):
            kept, _ = _ask(session, question)
            assert session.messages[-1]["content"] == kept
        text = _prompt_text(session)
        assert text.startswith("<|start|>system<|message|>Reasoning: medium")
        assert "<|start|>user<|message|>Hello there<|end|>" in text and text.count("<|start|>user") == 2
    finally:
        engine.close()
