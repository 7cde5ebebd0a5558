"""Dense models (models/dense.py) through the engine and the CLI: the expert tier is there, empty, and every
summary says there is nothing to stream (the math against transformers is tests/test_models.py's)."""

from __future__ import annotations

import pytest

from moestream.cli.main import main
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler
from moestream.errors import BudgetError
from moestream.serving.chat import ChatSession
from moestream.streaming.budget import plan_slots
from tests.hf_gguf import one_torch_thread
from tests.hf_gguf_dense import LLAMA, QWEN3

pytest.importorskip("transformers")
one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)


@pytest.fixture(scope="module", params=[LLAMA, QWEN3], ids=lambda a: a.id)
def dense(request, tmp_path_factory) -> str:
    arch = request.param
    path = str(tmp_path_factory.mktemp(arch.id) / "d.gguf")
    arch.write(arch.hf_model(seed=3, tie_word_embeddings=True), path, dense_type="Q8_0")
    return path


def test_a_budget_plans_no_expert_slots(dense):
    eng = Engine(dense, EngineOptions(ram_budget_mb=2048, ctx=256))
    try:
        assert eng.store.n_layers == 0 and eng.store.slot_nbytes == 0
        assert eng.plan is not None and eng.plan.n_slots == 0
        assert "no expert slots (a dense model: nothing to stream)" in eng.plan.describe()
        assert eng.cache.n_slots == 0
        gen = eng.generate([5, 6, 7, 8], 6)
        assert len(gen.tokens) == 6 and gen.stats.misses == gen.stats.hits == gen.stats.bytes_read == 0
        assert "no experts to stream" in gen.stats.line()
    finally:
        eng.close()


def test_a_budget_too_small_names_no_experts():
    with pytest.raises(BudgetError) as err:
        plan_slots(budget_mb=100, resident=200 << 20, compute=0, reader=0, slot_nbytes=0, min_slots=0, max_slots=0)
    assert "experts" not in str(err.value) and "--ram-budget-mb" in str(err.value)


def test_run_says_nothing_streams(dense, capsys):
    rc = main(["run", "-m", dense, "-p", "hello", "-n", "4", "--ram-budget-mb", "2048", "--ctx", "256"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "nothing to stream" in err and "no experts to stream" in err and "no routed experts" in err


def test_chat_stats_say_nothing_streams(dense):
    eng = Engine(dense, EngineOptions(ram_budget_mb=2048, ctx=256))
    try:
        session = ChatSession(eng, Sampler(), max_tokens=3)
        session.ask("hello", lambda _text: None, lambda: False)
        text = session.stats_text()
    finally:
        eng.close()
    assert "session: no experts to stream | RSS" in text and "hit rate" not in text
