"""How the engine spends a RAM budget: the reader's buffers, the prompt micro-batch and the expert slots.

The budget is checked twice: from the file's tensor table before any weight is loaded (a refusal costs
nothing), then against the measured resident size once the dense weights and the KV cache are in place.
"""

from __future__ import annotations

from typing import Any

from moestream.engine.model_file import OpenModel, dense_estimate, open_model, trunk_blocks
from moestream.engine.options import EngineOptions
from moestream.streaming.budget import (
    DEFAULT_RESERVE_MB,
    MB,
    UBATCH_CHOICES,
    BudgetPlan,
    choose_ubatch,
    plan_slots,
    rss_bytes,
)
from moestream.streaming.expert_store import ExpertStore
from moestream.streaming.read_ahead import AHEAD_MIN_LAYERS, ahead_experts, ahead_reads
from moestream.streaming.reader import ALIGN

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
    cfg: Any, store: ExpertStore, io_threads: int, read_ahead: bool, run_reads: bool = False
) -> tuple[int, int]:
    """The reader's buffers, (segment buffers, run buffers): a decode token's misses (3 segments x top-k) and
    at least two per thread; with the read-ahead, buffers for what it holds until the next layer takes it,
    and (run reads) RUN_BUFFERS_PER_THREAD more for the prompt's own runs to cycle through; see ExpertReader."""
    single = max(3 * cfg.top_k, 2 * io_threads)
    if not read_ahead:
        return single, 0
    if not run_reads:
        return single + 3 * ahead_experts(cfg.n_experts), 0
    run_len = store.run_len
    return single, ahead_reads(cfg.n_experts, run_len) + RUN_BUFFERS_PER_THREAD * io_threads


def reader_nbytes(cfg: Any, store: ExpertStore, io_threads: int, read_ahead: bool, run_reads: bool = False) -> int:
    single, runs = read_buffers(cfg, store, io_threads, read_ahead, run_reads)
    seg = store.max_segment_nbytes
    return single * (seg + 3 * ALIGN) + runs * (store.run_len * seg + 3 * ALIGN)


def _plan_args(model: OpenModel, ctx: int, io_threads: int, ubatch: int, budget_mb: int | None) -> dict:
    """plan_slots' arguments besides the resident size, without the read-ahead's buffers."""
    cfg = model.cfg
    return dict(
        budget_mb=budget_mb,
        compute=model.arch.compute_nbytes(cfg, ubatch, ctx),
        reader=reader_nbytes(cfg, model.store, io_threads, False),
        slot_nbytes=model.store.slot_nbytes,
        min_slots=cfg.top_k,
        max_slots=cfg.n_layers * cfg.n_experts,
    )


class SlotPlanner:
    """Sizes the expert cache for one engine: refuse() before loading, plan() after."""

    def __init__(self, model: OpenModel, ctx: int, options: EngineOptions):
        self.model, self.ctx, self.options = model, ctx, options
        # Until the micro-batch is chosen, plan with the smallest one it could be, and without the read-ahead's
        # buffers (added in plan() where the budget leaves the cache room to read ahead at all).
        self.kw = _plan_args(
            model, ctx, options.io_threads, options.ubatch or UBATCH_CHOICES[-1], options.ram_budget_mb
        )
        if options.reserve_mb is not None:
            self.kw["reserve_mb"] = options.reserve_mb

    def refuse(self) -> None:
        """Raise BudgetError before loading anything if the dense weights alone break the budget."""
        m = self.model
        dense = dense_estimate(m.gguf, m.exact, trunk_blocks(m.cfg))
        estimate = dense + m.arch.kv_nbytes(m.cfg, self.ctx, m.exact) + LOAD_SLACK
        plan_slots(resident=rss_bytes() + estimate, **self.kw)

    def plan(self, read_ahead: bool) -> tuple[BudgetPlan, int, bool]:
        """(the plan, the micro-batch, whether the read-ahead runs), measured with the weights loaded."""
        m, o, kw = self.model, self.options, self.kw
        ubatch = o.ubatch or DEFAULT_UBATCH
        if o.ubatch is None:
            fit = {k: v for k, v in kw.items() if k not in ("compute", "max_slots")}
            ubatch = choose_ubatch(
                resident=rss_bytes(), compute_for=lambda u: m.arch.compute_nbytes(m.cfg, u, self.ctx), **fit
            )
            kw["compute"] = m.arch.compute_nbytes(m.cfg, ubatch, self.ctx)
        plan = plan_slots(resident=rss_bytes(), **kw)
        # the read-ahead's buffers only where the cache keeps room to read ahead with them; else the memory
        # stays with the slots
        room = AHEAD_MIN_LAYERS * m.cfg.n_experts
        if not read_ahead or plan.n_slots < room:
            return plan, ubatch, False
        kw["reader"] = reader_nbytes(m.cfg, m.store, o.io_threads, True, o.run_reads)
        with_ahead = plan_slots(resident=rss_bytes(), **kw)
        if with_ahead.n_slots < room:
            return plan, ubatch, False
        return with_ahead, ubatch, True


def budget_for_slots(
    model_path: str, n_slots: int, *, ctx: int | None = None, io_threads: int = 4, ubatch: int = DEFAULT_UBATCH
) -> int:
    """Estimated --ram-budget-mb that buys `n_slots` expert slots for this model (from the header alone)."""
    m = open_model(model_path, check_types=False)
    try:
        cfg = m.cfg
        ctx = min(ctx or min(cfg.context_length, 4096), cfg.context_length)
        kw = _plan_args(m, ctx, io_threads, ubatch, None)
        total = (
            rss_bytes()
            + dense_estimate(m.gguf, m.exact, trunk_blocks(cfg))
            + m.arch.kv_nbytes(cfg, ctx, m.exact)
            + kw["compute"]
            + kw["reader"]
            + DEFAULT_RESERVE_MB * MB
            + n_slots * m.store.slot_nbytes
        )
        return total // MB + 64  # slack: the runtime grows a little while loading
    finally:
        m.close()
