"""The prefix kept across requests: conversations restored from the prompt cache answer exactly as a fresh
engine does, and the cache stays within its bytes."""

from __future__ import annotations

import pytest
import torch

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.prompt_cache import PromptCache
from moestream.errors import MoestreamError
from moestream.models.kv_cache import KVCache
from moestream.streaming.budget import MB
from moestream.synth.shapes import write_synth
from tests.hf_gguf import QWEN3MOE, QWEN35MOE, one_torch_thread, random_tokens
from tests.hf_gguf_deepseek import DEEPSEEK_V2_LITE

pytest.importorskip("transformers")

one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)


@pytest.fixture(scope="module", params=[QWEN3MOE, QWEN35MOE, DEEPSEEK_V2_LITE], ids=lambda a: a.id)
def tiny(request, tmp_path_factory) -> tuple[str, int]:
    arch = request.param
    model = arch.hf_model()
    path = str(tmp_path_factory.mktemp(arch.id) / "m.gguf")
    arch.write(model, path)
    return path, model.config.vocab_size


def _engine(path: str, prompt_cache_mb: int) -> Engine:
    return Engine(path, EngineOptions(n_slots=32, ubatch=16, prompt_cache_mb=prompt_cache_mb))


def test_interleaved_conversations_resume_from_the_cache_exactly(tiny):
    path, vocab = tiny
    a1, b1 = random_tokens(80, vocab, seed=1), random_tokens(70, vocab, seed=2)
    eng = _engine(path, 64)
    try:
        first_a = eng.generate(a1, 6)
        first_b = eng.generate(b1, 6)
        assert first_b.stats.reused_tokens == 0
        a2 = a1 + first_a.tokens + [9, 10]
        second_a = eng.generate(a2, 6)
        # the live cache holds B now: A's prefix came back from the prompt cache
        assert second_a.stats.reused_tokens >= len(a1)
        b2 = b1 + first_b.tokens + [11]
        second_b = eng.generate(b2, 6)
        assert second_b.stats.reused_tokens >= len(b1)
        eng_b_state = eng.kv
    finally:
        eng.close()
    fresh = _engine(path, 0)
    try:
        assert fresh.prompt_cache is None
        want_a = fresh.generate(a2, 6)
        fresh.reset()
        want_b = fresh.generate(b2, 6)
        assert want_a.stats.reused_tokens == want_b.stats.reused_tokens == 0
        assert second_a.tokens == want_a.tokens
        assert second_b.tokens == want_b.tokens
        _assert_same_state(eng_b_state, fresh.kv)  # the state greedy tokens of a tiny model may hide
        # without a prompt cache, B's turn in between leaves nothing of A to reuse
        fresh.generate(a1, 6)
        fresh.generate(b1, 6)
        assert fresh.generate(a2, 6).stats.reused_tokens == 0
    finally:
        fresh.close()


def _assert_same_state(got, want) -> None:
    assert got.length == want.length
    n = got.length
    for g, w in zip(got.rows(), want.rows(), strict=True):
        torch.testing.assert_close(g[:n].float(), w[:n].float(), rtol=1e-3, atol=1e-4)
    for i in getattr(want, "ssm", {}):
        torch.testing.assert_close(got.ssm[i], want.ssm[i], rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(got.conv[i], want.conv[i], rtol=1e-3, atol=1e-4)


def _kv_snapshot(length: int):
    kv = KVCache([2, 2], 8, 64, torch.float32)
    kv.advance(length)
    return kv.snapshot(length)


def test_lru_stays_within_its_bytes_and_evicts_the_least_recently_used():
    one = _kv_snapshot(10).nbytes
    pc = PromptCache(3 * one)
    for i in range(3):
        assert pc.save([i] * 10, _kv_snapshot(10))
    assert pc.nbytes == 3 * one
    assert pc.lookup([0] * 12, 11).resume == 10  # entry 0 is now the most recently used
    assert pc.save([3] * 10, _kv_snapshot(10))
    assert pc.nbytes <= pc.max_bytes and len(pc) == 3
    assert pc.lookup([1] * 12, 11) is None  # entry 1 was the least recently used
    assert pc.lookup([0] * 12, 11) is not None
    assert not pc.save([4] * 40, _kv_snapshot(40))  # larger than the whole cache: not kept
    assert pc.nbytes <= pc.max_bytes
    # an extension of a saved conversation replaces it
    assert pc.save([0] * 10 + [5] * 2, _kv_snapshot(12))
    assert pc.lookup([0] * 11, 10).resume == 10 and pc.nbytes <= pc.max_bytes
    assert tuple([0] * 10) not in pc.entries


def test_the_plan_counts_the_prompt_cache(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    write_synth("tiny", "Q4_0", path, layers=2, progress=False)
    plans = {}
    for mb in (0, 128):
        eng = Engine(path, EngineOptions(ram_budget_mb=4096, ctx=512, prompt_cache_mb=mb))
        try:
            plans[mb] = eng.plan
            assert (eng.prompt_cache is not None) == (mb > 0)
        finally:
            eng.close()
    assert plans[128].reserve - plans[0].reserve == 128 * MB
    with pytest.raises(MoestreamError, match="--prompt-cache-mb"):
        EngineOptions(prompt_cache_mb=-1)
