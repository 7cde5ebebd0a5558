"""Memory tiers: the non-admitting prompt path, min-hits admission, the pinned profile part, the elastic
cache; and the output staying the same across every tier configuration."""

from __future__ import annotations

import re

import numpy as np
import pytest

from moestream.analysis.replay import Admission, accesses_from_trace, live_result, replay
from moestream.analysis.trace import read_trace
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler
from moestream.errors import BudgetError
from moestream.streaming.elastic import ElasticWatcher
from moestream.synth.shapes import write_synth

PROMPT_A = list(range(5, 45))
PROMPT_B = list(range(300, 340))
N = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiers") / "tiny.gguf")
    write_synth("tiny", "Q4_0", path, progress=False)
    return path


@pytest.fixture(scope="module")
def baseline(tiny) -> list[int]:
    eng = Engine(tiny, EngineOptions(n_slots=64))
    try:
        return eng.generate(PROMPT_A, N, Sampler()).tokens
    finally:
        eng.close()


@pytest.mark.parametrize("admit_prompt", [False, True])
def test_prompt_path_leaves_decode_lru_alone_when_not_admitting(tiny, admit_prompt):
    eng = Engine(tiny, EngineOptions(n_slots=12, admit_prompt=admit_prompt, ubatch=8))
    try:
        eng.generate(PROMPT_A, N, Sampler())
        before = eng.cache.cached_keys()
        eng.generate(PROMPT_B, 1, Sampler())  # one token: the prompt path only, no decode step
        after = eng.cache.cached_keys()
        assert (before == after) == (not admit_prompt)
    finally:
        eng.close()


@pytest.mark.parametrize("admit_prompt,min_hits", [(False, 0), (True, 2), (False, 1)])
def test_replay_reproduces_live_hits_under_admission_rules(tiny, tmp_path, admit_prompt, min_hits):
    path = str(tmp_path / "t.csv")
    opts = EngineOptions(n_slots=24, admit_prompt=admit_prompt, min_hits=min_hits, trace_path=path, ubatch=8)
    eng = Engine(tiny, opts)
    eng.generate(PROMPT_A, N, Sampler())
    eng.generate(PROMPT_B, N, Sampler())
    eng.close()
    meta, rows = read_trace(path)
    acc = accesses_from_trace(meta, rows)
    live = live_result(acc)
    adm = "all" if admit_prompt else "decode-only"
    if min_hits:
        adm += f"+min-hits:{min_hits}"
    got = replay(acc, "lru", int(meta["n_slots"]), admission=Admission.parse(adm))
    assert (got.decode_hits, got.prompt_hits) == (live.decode_hits, live.prompt_hits)


def test_pinned_profile_part_is_loaded_and_serves_hits(tiny, tmp_path, baseline):
    trace = str(tmp_path / "t.csv")
    eng = Engine(tiny, EngineOptions(n_slots=64, trace_path=trace))
    eng.generate(PROMPT_A, N, Sampler())
    eng.close()
    from moestream.analysis.profile import build_profile, write_profile

    meta, rows = read_trace(trace)
    profile = str(tmp_path / "p.txt")
    write_profile(build_profile(meta, rows), profile)
    eng = Engine(tiny, EngineOptions(n_slots=24, pin_profile=profile, pin_mb=1))
    try:
        pinned = eng.cache.pinned_slots
        assert 0 < pinned <= 24 - eng.cfg.top_k
        gen = eng.generate(PROMPT_A, N, Sampler())
        assert eng.cache.stats.pinned_hits > 0
        assert gen.tokens == baseline
        assert eng.cache.pinned_slots == pinned  # never evicted
    finally:
        eng.close()


def test_elastic_cache_shrinks_below_the_floor_and_grows_back(tiny, baseline):
    avail = [10 << 30]
    eng = Engine(tiny, EngineOptions(n_slots=48))
    try:
        eng.generate(PROMPT_A, N, Sampler())
        w = ElasticWatcher(
            eng.cache, keep_free_mb=1024, available=lambda: avail[0], grow_step_mb=1, cooldown_s=0.0, overshoot_slots=0
        )
        assert w.step() == 0 or eng.cache.capacity == 48  # plenty free: nothing to give back
        used_before = eng.cache.used_slots
        avail[0] = 1024 * 2**20 - 20 * eng.cache.slot_nbytes  # a program took memory: 20 slots short
        released = -w.step()
        assert released == 20
        assert eng.cache.capacity == 28 and eng.cache.used_slots <= min(used_before, 28)
        avail[0] = 0  # far below: shrinks to the floor, never below what one token needs
        w.step()
        assert eng.cache.capacity == eng.cfg.top_k
        eng.reset()
        assert eng.generate(PROMPT_A, N, Sampler()).tokens == baseline
        assert eng.cache.used_slots <= eng.cfg.top_k
        avail[0] = 10 << 30  # memory is back: grows a step at a time
        grown = w.step()
        assert grown > 0 and eng.cache.capacity == eng.cfg.top_k + grown
        while w.step():
            pass
        assert eng.cache.capacity == 48
        assert eng.cache.stats.shrinks == 2 and eng.cache.stats.grows >= 1
    finally:
        eng.close()


@pytest.mark.parametrize("kw", [dict(admit_prompt=False), dict(min_hits=2), dict(keep_free_mb=1)])
def test_output_identical_across_tier_configurations(tiny, baseline, kw):
    eng = Engine(tiny, EngineOptions(n_slots=10, **kw))
    try:
        assert eng.generate(PROMPT_A, N, Sampler()).tokens == baseline
    finally:
        eng.close()


@pytest.mark.parametrize("run_reads", [False, True], ids=["segments", "runs"])
def test_prompt_read_ahead_reads_the_next_layer_and_changes_no_output(tiny, baseline, tmp_path, run_reads):
    path = str(tmp_path / "t.csv")
    # 4 layers of 16 experts: the rule allows it
    eng = Engine(tiny, EngineOptions(n_slots=64, ubatch=64, trace_path=path, run_reads=run_reads))
    try:
        assert (eng.reader.run_len > 1) == run_reads
        assert eng.generate(PROMPT_A, N, Sampler()).tokens == baseline
        s = eng.cache.stats
        assert s.ahead_reads > 0 and s.ahead_unused <= s.ahead_reads
        # every expert read ahead is a miss of the layer that asked for it, or unused: never read twice
        assert s.misses + s.ahead_unused >= s.ahead_reads
    finally:
        eng.close()
    meta, rows = read_trace(path)
    acc = accesses_from_trace(meta, rows)
    live = live_result(acc)
    got = replay(acc, "lru", int(meta["n_slots"]))
    assert (got.decode_hits, got.prompt_hits) == (live.decode_hits, live.prompt_hits)
    off = Engine(tiny, EngineOptions(n_slots=64, ubatch=64, read_ahead=False))
    try:
        assert off.generate(PROMPT_A, N, Sampler()).tokens == baseline
        assert off.cache.stats.ahead_reads == 0
    finally:
        off.close()


def test_read_ahead_buffers_are_budgeted_only_where_the_cache_can_read_ahead(tiny):
    from moestream.engine.planning import RUN_BUFFERS_PER_THREAD, budget_for_slots
    from moestream.streaming.read_ahead import AHEAD_MIN_LAYERS, ahead_experts, ahead_reads

    # the smallest budget the engine takes (its own refusal names it) and a roomy one
    with pytest.raises(BudgetError) as refused:
        Engine(tiny, EngineOptions(ram_budget_mb=64))
    least = int(re.search(r"use at least --ram-budget-mb (\d+)", str(refused.value)).group(1))
    roomy = budget_for_slots(tiny, 200)
    for mb, kw in ((least + 1, {}), (roomy, {"run_reads": False}), (roomy, {}), (roomy, {"min_hits": 1})):
        eng = Engine(tiny, EngineOptions(ram_budget_mb=mb, **kw))
        try:
            top_k, E = eng.cfg.top_k, eng.cfg.n_experts
            if eng.cache.read_ahead and kw.get("run_reads", True):
                assert eng.cache.n_slots >= AHEAD_MIN_LAYERS * E
                assert eng.reader.n_buffers == max(3 * top_k, 8)
                assert eng.reader.n_run_buffers == ahead_reads(E, eng.reader.run_len) + RUN_BUFFERS_PER_THREAD * 4
                assert eng.reader.run_len > 1
            elif eng.cache.read_ahead:
                assert eng.cache.n_slots >= AHEAD_MIN_LAYERS * E and kw == {"run_reads": False}
                assert eng.reader.n_buffers == 3 * top_k + 3 * ahead_experts(E) and eng.reader.n_run_buffers == 0
            else:
                assert eng.reader.n_buffers == max(3 * top_k, 8) and eng.reader.n_run_buffers == 0
            assert eng.plan is not None and eng.plan.reader >= eng.reader.buffers_nbytes
            if mb > least + 1 and "min_hits" not in kw:
                assert eng.cache.read_ahead
        finally:
            eng.close()


def test_the_prefault_commits_while_idle_or_while_the_model_waits_on_reads(tiny, monkeypatch):
    """The background commit of the cache's memory runs outside a generation, and inside one only while the model
    thread blocks on a prompt's expert reads (its core is free then); it works ahead of the fills, skipping
    filled slots."""
    from moestream.streaming import arena as arena_mod

    eng = Engine(tiny, EngineOptions(n_slots=16))
    try:
        arena = eng.cache.arena
        gate = arena.gate
        assert gate.may_commit.is_set()
        eng.generate(PROMPT_A, 2, Sampler())  # fills some slots
        with eng.cache.generation():
            assert not gate.may_commit.is_set()
            with gate.waiting_on_reads():
                assert gate.may_commit.is_set()
                with gate.waiting_on_reads():  # two model threads
                    pass
                assert gate.may_commit.is_set()
            assert not gate.may_commit.is_set()
        assert gate.may_commit.is_set()
        committed: list[tuple[int, int]] = []
        real = arena_mod.libc.madvise

        def recorded(addr: int, n: int, advice: int) -> int:
            committed.append((addr, n))
            return real(addr, n, advice)

        monkeypatch.setattr(arena_mod.libc, "madvise", recorded)
        arena.prefault(background=False)
        base = arena_mod.libc.memory_of(arena.memory)[0]
        slots = {(a - base) // arena.slot_nbytes for a, _ in committed}
        filled = {s for s in range(arena.n_slots) if arena.experts[s] is not None}
        assert filled and slots == set(range(arena.n_slots)) - filled
        assert sum(n for _, n in committed) == len(slots) * arena.slot_nbytes
    finally:
        eng.close()


def test_while_generating_each_step_grows_the_cache_by_its_allowance(tiny, baseline, tmp_path):
    """A fresh cache grows by at most prompt_slots per prompt micro-batch and decode_slots per token while the
    model generates (committing the whole cache under a running model slowed it most); outside a generation
    nothing limits it. Output and replay are unchanged."""
    path = str(tmp_path / "t.csv")
    eng = Engine(tiny, EngineOptions(n_slots=64, trace_path=path, growth_slots=(20, 3), ubatch=64))
    try:
        cache = eng.cache
        with cache.generation():
            assert not cache.arena.gate.idle.is_set()  # the prefault waits while the model runs
        assert cache.arena.gate.idle.is_set()
        eng.generate(PROMPT_A, 1, Sampler())  # one prompt step
        assert cache.used_slots == 20 and cache.stats.evictions > 0
        eng.reset()
        assert eng.generate(PROMPT_A, N, Sampler()).tokens == baseline
        # one more prompt step's and N - 1 decode steps' allowance (the tiny model has 64 experts in all)
        assert 20 < cache.used_slots <= min(64, 20 + 20 + 3 * (N - 1))
        eng.preload()  # outside a generation the cache fills up
        assert cache.used_slots == 64
    finally:
        eng.close()
    meta, rows = read_trace(path)
    assert (int(meta["prompt_slots"]), int(meta["decode_slots"])) == (20, 3)
    acc = accesses_from_trace(meta, rows)
    live = live_result(acc)
    got = replay(acc, "lru", int(meta["n_slots"]))
    assert (got.decode_hits, got.prompt_hits) == (live.decode_hits, live.prompt_hits)
    unruled = {k: v for k, v in meta.items() if k not in ("prompt_slots", "decode_slots")}
    old = replay(accesses_from_trace(unruled, rows), "lru", 64)
    assert (old.decode_hits, old.prompt_hits) != (live.decode_hits, live.prompt_hits)  # the rule matters here


def test_a_long_prompt_span_grows_by_its_micro_batches_and_replays_exactly(tiny, tmp_path):
    """A 200-token prompt runs as one span of 25 micro-batches: its step number advances by 25 and the cache
    may grow by 25 prompt allowances in it, the micro-batch-major path giving the same tokens. The replay reads
    the units back from the step numbers and reproduces the live hits exactly; one that counts each step as a
    single micro-batch does not."""
    long_prompt = list(range(5, 205))
    path = str(tmp_path / "t.csv")
    opts = dict(n_slots=48, growth_slots=(1, 2), ubatch=8)
    eng = Engine(tiny, EngineOptions(trace_path=path, **opts))
    try:
        first = eng.generate(long_prompt, N, Sampler()).tokens
        second = eng.generate(PROMPT_B, N, Sampler()).tokens  # a span of 5 after the decode steps
        assert eng.prompt_span == eng.ctx and 25 < eng.cache.used_slots <= 48
    finally:
        eng.close()
    micro = Engine(tiny, EngineOptions(prefill_span=8, **opts))
    try:
        assert micro.generate(long_prompt, N, Sampler()).tokens == first
        assert micro.generate(PROMPT_B, N, Sampler()).tokens == second
    finally:
        micro.close()
    meta, rows = read_trace(path)
    prompt_steps = sorted(set(rows["step"][rows["phase"] == 0].tolist()))
    assert prompt_steps == [25, 25 + N - 1 + 5]  # 25 units, N - 1 decode steps, then 5 units
    acc = accesses_from_trace(meta, rows)
    live = live_result(acc)
    got = replay(acc, "lru", int(meta["n_slots"]))
    assert (got.decode_hits, got.prompt_hits) == (live.decode_hits, live.prompt_hits)
    one_unit = rows.copy()
    one_unit["step"] = np.unique(rows["step"], return_inverse=True)[1] + 1  # every step one micro-batch
    old = replay(accesses_from_trace(meta, one_unit), "lru", int(meta["n_slots"]))
    assert (old.decode_hits, old.prompt_hits) != (live.decode_hits, live.prompt_hits)
