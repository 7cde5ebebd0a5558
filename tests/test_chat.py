"""`moestream chat` driven through a pseudo-terminal: an exchange, /stats, Ctrl-C, /reset, quitting."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from typing import Any

import pexpect
import pytest

from moestream.engine.sampling import Sampler
from moestream.engine.stats import EngineSnapshot, GenerationStats, GenerationStep
from moestream.errors import MoestreamError
from moestream.formats.gguf_file import GGUFFile
from moestream.formats.tokenizer import Tokenizer
from moestream.serving.chat import ChatSession
from moestream.synth.shapes import write_synth

PROMPT = "\r\n> "


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_synth("tiny", "Q4_0", tmp_path_factory.mktemp("model") / "tiny.gguf", progress=False)


@pytest.fixture
def spawn(model_path: str) -> Iterator:
    children: list[pexpect.spawn] = []

    def start(*extra: str) -> pexpect.spawn:
        args = [
            "-m",
            "moestream",
            "chat",
            "-m",
            model_path,
            "--ram-budget-mb",
            "2000",
            "--ctx",
            "1024",
            *extra,
        ]
        child = pexpect.spawn(sys.executable, args, encoding="utf-8", timeout=60, dimensions=(50, 200))
        children.append(child)
        child.expect("Ctrl-C stops an answer")
        child.expect("> ")
        return child

    yield start
    for child in children:
        child.close(force=True)


def _stats(child: pexpect.spawn) -> dict[str, int]:
    child.sendline("/stats")
    child.expect(r"prompt (\d+) tok \((\d+) cached\).*decode (\d+) tok @ [\d.]+ tok/s")
    prompt, cached, decoded = (int(x) for x in child.match.groups())
    child.expect(r"session: expert hit rate [\d.]+% \| cache slots \d+/\d+ used .* RSS \d+ MiB")
    child.expect(r"conversation: (\d+) turns?")
    turns = int(child.match.group(1))
    child.expect(PROMPT)
    return {"prompt": prompt, "cached": cached, "decoded": decoded, "turns": turns}


def test_exchange_and_stats(spawn) -> None:
    child = spawn("-n", "6", "--temp", "0")
    child.sendline("Hello there")
    child.expect("Hello there\r\n")  # the terminal's echo; the answer streams after it
    child.expect(PROMPT)
    first = _stats(child)
    assert 1 <= first["decoded"] <= 6 and first["turns"] == 1

    # the follow-up renders the whole history, and the engine reuses the part it has already seen
    child.sendline("And then?")
    child.expect(PROMPT)
    second = _stats(child)
    assert second["turns"] == 2 and second["cached"] >= first["prompt"] - 1

    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_the_answer_not_the_chat(spawn) -> None:
    child = spawn("--temp", "0")  # no -n: the answer would run to the end of the context
    child.sendline("Tell me a long story")
    child.expect("story\r\n")
    child.expect(r"\S")  # the answer has begun
    child.sendintr()
    child.expect(r"\[stopped\]")
    child.expect(PROMPT)
    stats = _stats(child)
    assert stats["decoded"] < 900 and stats["turns"] == 1

    child.sendline("/reset")
    child.expect(r"conversation cleared")
    child.expect(PROMPT)
    assert _stats(child)["turns"] == 0
    child.sendline("/nonsense")
    child.expect("unknown command")
    child.expect(PROMPT)

    child.sendcontrol("d")  # Ctrl-D quits
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert re.search(r"Traceback", child.before or "") is None


class _EchoEngine:
    """Answers every prompt with the same few tokens; enough to test the session's bookkeeping."""

    def __init__(self, tokenizer: Tokenizer, ctx: int):
        self.tokenizer, self.ctx, self.resets = tokenizer, ctx, 0
        self.prompts: list[list[int]] = []

    def reset(self) -> None:
        self.resets += 1

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(ctx=self.ctx, n_slots=8)

    def stream(self, prompt: list[int], max_new: int, sampler: Any, stop_ids: set[int]) -> Iterator[GenerationStep]:
        self.prompts.append(prompt)
        st = GenerationStats(prompt_tokens=len(prompt))
        for t in [*self.tokenizer.encode(" the answer"), self.tokenizer.eos_id][:max_new]:
            st.decode_tokens += 1
            yield GenerationStep(t, st, "stop" if t in stop_ids else None)
            if t in stop_ids:
                return


def test_session_drops_oldest_turns_to_fit(model_path: str) -> None:
    f = GGUFFile(model_path)
    tok = Tokenizer.from_metadata(f.metadata)
    f.close()
    engine = _EchoEngine(tok, ctx=160)
    session = ChatSession(engine, Sampler(), system="Be brief.")
    out: list[str] = []
    for i in range(12):
        assert (
            session.ask(f"question number {i} about the weather in Paris", out.append, lambda: False) == " the answer"
        )
    assert session.dropped > 0 and session.messages[0] == {"role": "system", "content": "Be brief."}
    assert session.messages[1]["role"] == "user" and "question number 11" in session.messages[-2]["content"]
    assert all(len(p) <= engine.ctx - 40 for p in engine.prompts)
    with pytest.raises(MoestreamError, match="context holds"):
        session.ask("the weather " * 200, out.append, lambda: False)
    assert session.messages[-1] == {"role": "assistant", "content": " the answer"}  # the long one was not kept
    assert "oldest dropped" in session.stats_text()
