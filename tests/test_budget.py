"""The RAM budget: slot planning, the automatic micro-batch, and peak RSS under the budget in a real run."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import pytest
import torch

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.errors import BudgetError
from moestream.models.qwen3moe import Qwen3Moe, Qwen3MoeConfig
from moestream.streaming import budget
from moestream.streaming.budget import MB, UBATCH_CHOICES, choose_span, choose_ubatch, plan_slots
from moestream.streaming.expert_cache import ORDERED_ROOM
from moestream.streaming.heap import FreedHeap, release_free_heap
from moestream.synth.shapes import write_synth

SLOT = 3 * MB
PLAN = dict(resident=300 * MB, compute=40 * MB, reader=10 * MB, slot_nbytes=SLOT, min_slots=8, max_slots=256)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("budget") / "tiny.gguf")
    write_synth("tiny", "Q4_0", path, layers=2, progress=False)
    return path


def test_plan_slots_fills_what_is_left_after_everything_else():
    plan = plan_slots(budget_mb=600, reserve_mb=100, **PLAN)
    assert plan.n_slots == (600 - 300 - 40 - 10 - 100) * MB // SLOT == 50
    assert plan.budget == 600 * MB and plan.explicit
    assert plan_slots(budget_mb=100_000, reserve_mb=100, **PLAN).n_slots == 256  # capped at every expert


def test_plan_slots_names_the_minimum_budget():
    with pytest.raises(BudgetError, match=r"use at least --ram-budget-mb 474\b"):
        plan_slots(budget_mb=400, reserve_mb=100, **PLAN)  # 300 + 40 + 10 + 100 + 8 x 3
    assert plan_slots(budget_mb=474, reserve_mb=100, **PLAN).n_slots == 8


def test_plan_slots_without_a_budget_leaves_ram_to_others(monkeypatch):
    monkeypatch.setattr(budget, "available_bytes", lambda: 2048 * MB)
    plan = plan_slots(budget_mb=None, reserve_mb=100, **PLAN)
    assert plan.budget == 300 * MB + 2048 * MB - budget.DEFAULT_KEEP_FREE_MB * MB and not plan.explicit


def _compute(ub: int) -> int:
    return ub * MB  # 1 MB per token of micro-batch


def test_choose_ubatch_takes_the_largest_that_fits_with_the_minimum_slots():
    kw = dict(resident=300 * MB, compute_for=_compute, reader=10 * MB, slot_nbytes=SLOT, min_slots=8, reserve_mb=100)
    floor = 300 + 10 + 100 + 8 * 3  # 434 MB before compute buffers
    assert choose_ubatch(budget_mb=floor + 128, **kw) == 128
    assert choose_ubatch(budget_mb=floor + 127, **kw) == 64
    assert choose_ubatch(budget_mb=floor + 40, **kw) == 32
    assert choose_ubatch(budget_mb=floor + 16, **kw) == 16
    assert choose_ubatch(budget_mb=floor, **kw) == 16  # nothing fits: the smallest, and plan_slots says why


def test_choose_span_takes_the_longest_whose_activations_fit_a_share_of_the_room():
    kw = dict(resident=300 * MB, compute_for=_compute, reader=10 * MB, slot_nbytes=SLOT, min_slots=8, reserve_mb=100)
    floor = 300 + 10 + 100 + 8 * 3 + 128  # 562 MB with the micro-batch's buffers
    # the span's buffers beyond the micro-batch's (1 MB a token) may take a quarter of the room above that
    assert choose_span(budget_mb=floor + 4 * 128, ubatch=128, longest=4096, **kw) == 256
    assert choose_span(budget_mb=floor + 4 * 127, ubatch=128, longest=4096, **kw) == 128  # 256 does not fit
    assert choose_span(budget_mb=floor + 4 * 384, ubatch=128, longest=4096, **kw) == 512
    assert choose_span(budget_mb=floor + 10**6, ubatch=128, longest=3000, **kw) == 3000  # the whole context
    assert choose_span(budget_mb=floor, ubatch=128, longest=4096, **kw) == 128  # no room: the micro-batch path


def test_compute_estimate_grows_with_the_micro_batch_not_with_a_score_matrix():
    cfg = Qwen3MoeConfig(48, 2048, 32, 4, 128, 128, 8, 768, 151936, 40960)
    sizes = [Qwen3Moe.memory(cfg).compute_nbytes(ub, 4096) for ub in (16, 32, 64, 128)]
    assert sizes == sorted(sizes)
    # SDPA's flash kernel never holds [T, S] scores: a 32k context costs its float keys, not T x S x heads.
    long_ctx = Qwen3Moe.memory(cfg).compute_nbytes(128, 32768)
    assert long_ctx - sizes[-1] == 2 * (32768 - 4096) * cfg.n_kv_heads * cfg.head_dim * 4


def test_engine_picks_the_micro_batch_the_budget_fits(tiny):
    with pytest.raises(BudgetError) as err:
        Engine(tiny, EngineOptions(ram_budget_mb=64, ctx=512))
    least = int(re.search(r"at least --ram-budget-mb (\d+)", str(err.value)).group(1))
    # A few MB over: in one process, the refused attempt leaves some heap behind that the next one measures.
    eng = Engine(tiny, EngineOptions(ram_budget_mb=least + 8, ctx=512))
    try:
        assert eng.ubatch in UBATCH_CHOICES and eng.plan.n_slots >= eng.cfg.top_k
        # the plan counts the prompt span's activations (a span of at least the micro-batch, at most the context)
        assert eng.ubatch <= eng.prompt_span == eng.plan.span <= 512
        # the span's attention by micro-batch chunks, its MoE summed in order where the cache keeps the order
        ordered = eng.plan.n_slots >= ORDERED_ROOM * eng.cfg.n_experts
        memory = Qwen3Moe.memory(eng.cfg)
        assert eng.plan.compute == memory.compute_nbytes(eng.prompt_span, 512, chunk=eng.ubatch, ordered=ordered)
        assert f"(prompt span {eng.prompt_span} tokens)" in eng.plan.describe()
    finally:
        eng.close()
    eng = Engine(tiny, EngineOptions(ram_budget_mb=least + 200, ctx=512))
    try:
        assert eng.ubatch == 128
    finally:
        eng.close()
    eng = Engine(tiny, EngineOptions(ram_budget_mb=least + 200, ctx=512, ubatch=64))  # the user's choice stands
    try:
        assert eng.ubatch == 64
    finally:
        eng.close()


def test_a_known_prompt_length_bounds_the_span_and_its_buffers(tiny, tmp_path):
    """run knows its prompt: the plan sets aside a span's buffers for that prompt only, and the slots get the
    rest; a longer prompt than announced still runs (in more spans) and gives the same tokens."""
    with pytest.raises(BudgetError) as err:
        Engine(tiny, EngineOptions(ram_budget_mb=64, ctx=1024))
    least = int(re.search(r"at least --ram-budget-mb (\d+)", str(err.value)).group(1))
    opts = EngineOptions(ram_budget_mb=least + 300, ctx=1024)
    prompt = list(range(3, 603))
    eng = Engine(tiny, opts)
    try:
        assert eng.prompt_span >= 512
        free_span, free_plan = eng.prompt_span, eng.plan
        want = eng.generate(prompt, 6).tokens
    finally:
        eng.close()
    eng = Engine(tiny, dataclasses.replace(opts, longest_prompt=40))
    try:
        assert eng.prompt_span == eng.ubatch and eng.plan.span == eng.prompt_span < free_span
        assert eng.plan.compute < free_plan.compute and eng.plan.n_slots >= free_plan.n_slots
        assert eng.generate(prompt, 6).tokens == want
    finally:
        eng.close()
    # `run` tokenizes its prompt before the engine plans, and tells it the length
    stats = tmp_path / "stats.json"
    cmd = [sys.executable, "-m", "moestream", "run", "-m", tiny, "-p", "hello there", "-n", "1", "--ctx", "1024"]
    cmd += ["--ram-budget-mb", str(least + 300), "--stats-json", str(stats)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert json.loads(stats.read_text())["plan"]["span"] <= 128 < free_span


@pytest.mark.slow
def test_peak_rss_stays_under_a_budget_close_to_the_minimum(tiny, tmp_path):
    """A long prompt then a long generation, in a fresh process (so ru_maxrss is this run's alone)."""
    prompt = " ".join(f"word{i} the quick brown fox" for i in range(36))  # ~600 tokens
    base = [sys.executable, "-m", "moestream", "run", "-m", tiny, "--ctx", "1024", "--threads", "2", "-p", prompt]
    refused = subprocess.run([*base, "--ram-budget-mb", "64", "-n", "1"], capture_output=True, text=True)
    assert refused.returncode == 2
    least = int(re.search(r"at least --ram-budget-mb (\d+)", refused.stderr).group(1))
    stats = tmp_path / "stats.json"
    run = subprocess.run(
        [*base, "--ram-budget-mb", str(least + 2), "-n", "200", "--stats-json", str(stats)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    doc = json.loads(stats.read_text())
    assert doc["prompt_tokens"] >= 500 and doc["decode_tokens"] == 200
    plan = doc["plan"]
    assert plan["budget"] == (least + 2) * MB
    assert plan["resident"] < doc["peak_rss"] <= plan["budget"], (doc["peak_rss"] / MB, plan)
    # where the budget let the cache read ahead, the prompt did, inside the same budget
    assert (doc["ahead_reads"] > 0) == doc["read_ahead"] and doc["ahead_unused"] <= doc["ahead_reads"]


@pytest.mark.skipif(not FreedHeap(256 * MB).active, reason="needs glibc's mallopt")
def test_a_prompt_step_keeps_its_freed_heap_and_gives_it_back_when_it_ends():
    """Inside a prompt step blocks over glibc's own mmap threshold (32 MiB at most) stay resident once freed,
    for the next layers to reuse instead of faulting fresh pages in; when the step ends they go back, and
    outside one a block larger than what the step left free is mapped and unmapped again. (A freed block does
    not always serve the next one of its size at once: torch's 64-byte alignment asks for a little more, until
    freed neighbours coalesce; so a run of them holds a few blocks, not one per layer.)"""
    heap = FreedHeap(256 * MB)
    assert heap.active and not FreedHeap(16 * MB).active  # a limit under glibc's own threshold changes nothing
    release_free_heap()
    base = budget.rss_bytes()
    with heap.prompt_step():
        block = torch.ones(48 * MB // 4)
        del block
        assert budget.rss_bytes() - base >= 40 * MB
        for _ in range(8):  # the next layers' blocks
            block = torch.ones(48 * MB // 4)
            del block
        assert budget.rss_bytes() - base < 4 * 48 * MB
    assert heap.trims == 1 and budget.rss_bytes() - base < 8 * MB
    # after the step the thresholds are glibc's again: a block larger than every free chunk the step left (its
    # heap held under 4 blocks) is mapped for itself and unmapped when freed. (A smaller one may reuse a free
    # chunk and keep its pages, as glibc decides: the step's trim gave them back, but the chunks stay free.)
    block = torch.ones(200 * MB // 4)
    del block
    assert budget.rss_bytes() - base < 8 * MB


@pytest.mark.skipif(not FreedHeap(256 * MB).active, reason="needs glibc's mallopt")
def test_the_engine_keeps_the_heap_through_prompt_steps_only(tiny):
    """Each prompt step runs inside FreedHeap.prompt_step (and gives its heap back at the end); decode steps
    are left to glibc."""
    eng = Engine(tiny, EngineOptions(ram_budget_mb=1200, ctx=2048))  # compute room over glibc's 32 MiB
    try:
        assert eng.heap is not None and eng.heap.active and eng.heap.limit == eng.plan.compute
        steps = -(-600 // eng.prompt_span)
        eng.generate(list(range(3, 603)), 5)
        assert eng.heap.trims == steps
    finally:
        eng.close()
