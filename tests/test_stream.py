"""Engine.stream: the same tokens as generate, and a consumer that stops early leaves the engine consistent."""

from __future__ import annotations

import pytest

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.errors import MoestreamError
from moestream.synth.shapes import write_synth

PROMPT = list(range(3, 20))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_synth("tiny", "Q4_0", tmp_path_factory.mktemp("m") / "tiny.gguf", progress=False)
    eng = Engine(path, EngineOptions(n_slots=32))
    yield eng
    eng.close()


def test_stream_yields_what_generate_returns(engine):
    whole = engine.generate(PROMPT, 8)
    engine.reset()
    steps = list(engine.stream(PROMPT, 8))
    assert [s.token for s in steps] == whole.tokens
    assert [s.finish_reason for s in steps] == [None] * 7 + ["length"]
    st = steps[-1].stats
    assert st.decode_tokens == 8 and st.prompt_tokens == len(PROMPT) and st.hits + st.misses > 0
    assert all(s.stats is st for s in steps)  # one stats object, kept up to date


def test_a_consumer_that_stops_leaves_the_engine_consistent(engine):
    engine.reset()
    full = engine.generate(PROMPT, 8).tokens
    engine.reset()
    got = []
    for step in engine.stream(PROMPT, 8):
        got.append(step.token)
        if len(got) == 3:
            stats = step.stats
            break
    assert got == full[:3]
    assert stats.finish_reason == "cancelled" and stats.decode_tokens == 3 and stats.n_slots == 32
    assert not engine.cache.policy.growth.generating
    # the KV cache holds the prompt and the tokens that were fed back: a follow-up reuses them
    again = engine.generate(PROMPT + got, 4)
    assert again.stats.reused_tokens == len(PROMPT) + 2
    assert again.tokens == full[3:7]


def test_a_new_generation_ends_an_unfinished_stream(engine):
    engine.reset()
    steps = engine.stream(PROMPT, 8)
    first = next(steps)
    engine.generate(PROMPT, 2)
    assert first.stats.finish_reason == "cancelled" and first.stats.decode_tokens == 1
    with pytest.raises(StopIteration):
        next(steps)


def test_bad_prompts_fail_when_the_stream_is_asked_for(engine):
    with pytest.raises(MoestreamError, match="empty"):
        engine.stream([], 4)
    with pytest.raises(MoestreamError, match="context holds"):
        engine.stream([1] * engine.ctx, 4)


def test_bad_options_fail_before_the_model_loads():
    with pytest.raises(MoestreamError, match="--io-threads must be a positive number"):
        EngineOptions(io_threads=0)
    with pytest.raises(MoestreamError, match="--admit-min-hits"):
        EngineOptions(min_hits=-1)
