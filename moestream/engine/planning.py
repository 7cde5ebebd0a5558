"""How the engine spends a RAM budget: the reader's buffers, the prompt micro-batch and the expert slots.

The budget is checked twice: from the file's tensor table before any weight is loaded (a refusal costs
nothing), then against the measured resident size once the dense weights and the KV cache are in place.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from moestream.engine.model_file import OpenModel, dense_estimate, open_model, trunk_blocks
from moestream.engine.options import EngineOptions
from moestream.streaming.budget import (
    DEFAULT_RESERVE_MB,
    MB,
    SPAN_SHARE,
    UBATCH_CHOICES,
    BudgetPlan,
    budget_bytes,
    choose_span,
    choose_ubatch,
    plan_slots,
    rss_bytes,
)
from moestream.streaming.expert_cache import ORDERED_ROOM
from moestream.streaming.expert_store import ExpertStore
from moestream.streaming.read_ahead import AHEAD_MIN_LAYERS, ahead_experts, ahead_reads
from moestream.streaming.reader import ALIGN

# The prompt cache serve and chat keep by default, where it takes at most PROMPT_CACHE_SHARE of the room the
# expert slots would have beyond their minimum (else none: under that much memory pressure slots matter more).
PROMPT_CACHE_DEFAULT_MB = 512
PROMPT_CACHE_SHARE = 0.25
# Sequences serve decodes together by default, where their KV caches take at most BATCH_KV_SHARE of the room
# the expert slots would have beyond their minimum (each sequence holds a KV cache at the full context).
DEFAULT_BATCH = 8
BATCH_KV_SHARE = 0.25
DEFAULT_UBATCH = 128  # small micro-batches keep compute buffers and the expert union small
# What the runtime itself grows by while loading (kernels and the C library initialised on first use, heap
# left over from reading tensors, which release_free_heap mostly returns), so that the pre-check never names
# a minimum below the final plan's.
LOAD_SLACK = 40 * MB
# Run buffers per reader thread that a prompt's own run reads cycle through, besides the read-ahead's. They
# hold what the disk read while the model's thread computes instead of packing; with too few the reader
# threads of a long prompt under memory pressure wait for a free buffer while the disk idles.
RUN_BUFFERS_PER_THREAD = 8


def read_buffers(
    cfg: Any, store: ExpertStore, io_threads: int, read_ahead: bool, run_reads: bool = False, lookahead: bool = False
) -> tuple[int, int]:
    """The reader's buffers, (segment buffers, run buffers): a decode token's misses (3 segments x top-k) and
    at least two per thread; with the router lookahead, a token's guessed next-layer experts more (they wait
    in buffers until that layer's fetch); with the read-ahead, buffers for what it holds until the next layer
    takes it, and (run reads) RUN_BUFFERS_PER_THREAD more for the prompt's own runs to cycle through; see
    ExpertReader."""
    single = max(3 * cfg.top_k, 2 * io_threads) + (3 * cfg.top_k if lookahead else 0)
    if not read_ahead:
        return single, 0
    if not run_reads:
        return single + 3 * ahead_experts(cfg.n_experts), 0
    run_len = store.run_len
    return single, ahead_reads(cfg.n_experts, run_len) + RUN_BUFFERS_PER_THREAD * io_threads


def reader_nbytes(
    cfg: Any, store: ExpertStore, io_threads: int, read_ahead: bool, run_reads: bool = False, lookahead: bool = False
) -> int:
    single, runs = read_buffers(cfg, store, io_threads, read_ahead, run_reads, lookahead)
    seg = store.max_segment_nbytes
    return single * (seg + 3 * ALIGN) + runs * (store.run_len * seg + 3 * ALIGN)


def _plan_args(
    model: OpenModel, ctx: int, io_threads: int, ubatch: int, budget_mb: int | None, lookahead: bool = False
) -> dict:
    """plan_slots' arguments besides the resident size, without the read-ahead's buffers."""
    cfg = model.cfg
    return dict(
        budget_mb=budget_mb,
        compute=model.arch.memory(cfg).compute_nbytes(ubatch, ctx),
        reader=reader_nbytes(cfg, model.store, io_threads, False, lookahead=lookahead),
        slot_nbytes=model.store.slot_nbytes,
        min_slots=cfg.top_k,
        max_slots=cfg.n_layers * cfg.n_experts,
    )


class SlotPlanner:
    """Sizes the expert cache for one engine: refuse() before loading, plan() after."""

    def __init__(self, model: OpenModel, ctx: int, options: EngineOptions):
        self.model, self.ctx, self.options = model, ctx, options
        self.memory = model.arch.memory(model.cfg)
        # Until the micro-batch is chosen, plan with the smallest one it could be, and without the read-ahead's
        # buffers (added in plan() where the budget leaves the cache room to read ahead at all).
        self.kw = _plan_args(
            model,
            ctx,
            options.io_threads,
            options.ubatch or UBATCH_CHOICES[-1],
            options.ram_budget_mb,
            options.lookahead is True,
        )
        self.lookahead = "on" if options.lookahead else "off"  # plan() may turn 'auto' on
        self.base_reserve_mb = DEFAULT_RESERVE_MB if options.reserve_mb is None else options.reserve_mb
        self.base_reader = self.kw["reader"]
        self._chunk: int | None = None  # attention's query chunk, once plan() has chosen the micro-batch
        self._ordered = False  # whether a long span's MoE sums as its experts come (plan())
        # the prompt cache grows into its MB as conversations are saved, so the plan holds them for it
        pc = options.prompt_cache_mb
        self.prompt_cache_mb = PROMPT_CACHE_DEFAULT_MB if pc is None else pc  # plan() may lower the default
        self.kw["reserve_mb"] = self.base_reserve_mb + (pc or 0)

    def refuse(self, batch: int = 1) -> None:
        """Raise BudgetError before loading anything if the dense weights and `batch` KV caches alone break
        the budget."""
        plan_slots(resident=self._estimate(batch), **self.kw)

    def batch_size(self) -> int:
        """The sequences that decode together: the option's, or up to DEFAULT_BATCH where the KV caches of
        all but the first take at most BATCH_KV_SHARE of the slots' room (estimated before loading)."""
        if self.options.max_batch is not None:
            return self.options.max_batch
        kw, one = self.kw, self._estimate(1)
        fixed = one + kw["compute"] + kw["reader"] + kw["reserve_mb"] * MB + kw["min_slots"] * kw["slot_nbytes"]
        room = budget_bytes(kw["budget_mb"], one) - fixed
        kv = max(1, self.memory.kv_nbytes(self.ctx, self.model.exact))
        return max(1, min(DEFAULT_BATCH, 1 + int(BATCH_KV_SHARE * room) // kv))

    def _estimate(self, batch: int) -> int:
        """The resident size once the dense weights and `batch` KV caches are loaded, from the header."""
        m = self.model
        dense = dense_estimate(m.gguf, m.exact, trunk_blocks(m.cfg))
        return rss_bytes() + dense + batch * self.memory.kv_nbytes(self.ctx, m.exact) + LOAD_SLACK

    def plan(self, read_ahead: bool) -> tuple[BudgetPlan, int, bool]:
        """(the plan, the micro-batch, whether the read-ahead runs), measured with the weights loaded; the
        plan's span is the prompt span (choose_span, or the one the options give).

        A long span's MoE sums its experts as they come where its fetch keeps their order (ExpertCache: the
        cache may hold ORDERED_ROOM times a layer's request, and admits what the prompt reads), and its
        attention runs a micro-batch of queries at a time: the span's activations are counted so, unless the
        plan that comes of it leaves too few slots for the order, when they are counted as held."""
        m, o, kw = self.model, self.options, self.kw
        if o.prompt_cache_mb is None:
            self.prompt_cache_mb = self._default_prompt_cache()
            kw["reserve_mb"] = self.base_reserve_mb + self.prompt_cache_mb
        ubatch = o.ubatch or DEFAULT_UBATCH
        if o.ubatch is None:
            fit = {k: v for k, v in kw.items() if k not in ("compute", "max_slots")}
            ubatch = choose_ubatch(resident=rss_bytes(), compute_for=self._compute, **fit)
        self._chunk = ubatch
        self._ordered = o.admit_prompt and o.min_hits == 0
        plan, ahead = self._fit(ubatch, read_ahead)
        if self.lookahead_mode(plan.n_slots) == "auto":  # its guesses' buffers, from the slots
            self.lookahead = "auto"
            self.base_reader = reader_nbytes(m.cfg, m.store, o.io_threads, False, lookahead=True)
            plan, ahead = self._fit(ubatch, read_ahead)
        if self._ordered and plan.n_slots < ORDERED_ROOM * m.cfg.n_experts:
            self._ordered = False
            plan, ahead = self._fit(ubatch, read_ahead)
        return plan, ubatch, ahead

    def lookahead_mode(self, n_slots: int) -> str:
        """The router lookahead's mode for a cache of n_slots: the option's ('on' / 'off'); by default 'auto'
        (its guesses wait on the decode's misses, ahead.GuessSwitch) where the cache cannot hold every routed
        expert, else 'off'. A traced run keeps it off by default: the trace does not record its reads, and a
        replay of the trace should reproduce the run."""
        o, store = self.options, self.model.store
        if o.lookahead is not None:
            return "on" if o.lookahead else "off"
        if o.trace_path is not None or n_slots >= store.n_layers * store.n_experts:
            return "off"
        return "auto"

    def _fit(self, ubatch: int, read_ahead: bool) -> tuple[BudgetPlan, bool]:
        """The prompt span and the slots beside it, and whether the read-ahead runs, for this micro-batch."""
        m, o, kw = self.model, self.options, self.kw
        fit = {k: v for k, v in kw.items() if k not in ("compute", "max_slots")}
        longest = min(self.ctx, o.longest_prompt or self.ctx)
        span = o.prefill_span or choose_span(
            resident=rss_bytes(), compute_for=self._compute, ubatch=ubatch, longest=longest, **fit
        )
        # the span's activations (a span shorter than the micro-batch still runs the micro-batch's chunks)
        kw["compute"] = self._compute(max(span, ubatch))
        kw["reader"] = self.base_reader
        plan = replace(plan_slots(resident=rss_bytes(), **kw), span=span)
        # the read-ahead's buffers only where the cache keeps room to read ahead with them; else the memory
        # stays with the slots
        room = AHEAD_MIN_LAYERS * m.cfg.n_experts
        if not read_ahead or not room or plan.n_slots < room:  # no room with no experts: nothing to read
            return plan, False
        kw["reader"] = reader_nbytes(m.cfg, m.store, o.io_threads, True, o.run_reads, self.lookahead != "off")
        with_ahead = replace(plan_slots(resident=rss_bytes(), **kw), span=span)
        if with_ahead.n_slots < room:
            kw["reader"] = self.base_reader
            return plan, False
        return with_ahead, True

    def _default_prompt_cache(self) -> int:
        """PROMPT_CACHE_DEFAULT_MB where it takes at most PROMPT_CACHE_SHARE of the slots' room, else 0."""
        kw, resident = self.kw, rss_bytes()
        fixed = resident + kw["compute"] + kw["reader"] + self.base_reserve_mb * MB
        room = budget_bytes(kw["budget_mb"], resident) - fixed - kw["min_slots"] * kw["slot_nbytes"]
        return PROMPT_CACHE_DEFAULT_MB if PROMPT_CACHE_DEFAULT_MB * MB <= PROMPT_CACHE_SHARE * room else 0

    def _compute(self, tokens: int) -> int:
        """Compute buffers of a forward call over `tokens` prompt tokens: its attention by micro-batch chunks
        of queries once the micro-batch is chosen, its MoE summed as the experts come where plan() allows."""
        return self.memory.compute_nbytes(tokens, self.ctx, chunk=self._chunk, ordered=self._ordered)


def budget_for_slots(
    model_path: str, n_slots: int, *, ctx: int | None = None, io_threads: int = 4, ubatch: int = DEFAULT_UBATCH
) -> int:
    """Estimated --ram-budget-mb that buys at least `n_slots` expert slots for this model (from the header
    alone). The prompt span may take SPAN_SHARE of the room beyond the minimum slots, so that room is sized for
    the slots to keep the rest."""
    m = open_model(model_path, check_types=False)
    try:
        cfg = m.cfg
        ctx = min(ctx or min(cfg.context_length, 4096), cfg.context_length)
        kw = _plan_args(m, ctx, io_threads, ubatch, None)
        total = (
            rss_bytes()
            + dense_estimate(m.gguf, m.exact, trunk_blocks(cfg))
            + m.arch.memory(cfg).kv_nbytes(ctx, m.exact)
            + kw["compute"]
            + kw["reader"]
            + DEFAULT_RESERVE_MB * MB
            + cfg.top_k * m.store.slot_nbytes
            + int(max(0, n_slots - cfg.top_k) * m.store.slot_nbytes / (1 - SPAN_SHARE))
        )
        return total // MB + 64  # slack: the runtime grows a little while loading
    finally:
        m.close()
