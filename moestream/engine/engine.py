"""The engine: one model file, its resident weights, the expert cache behind a budget, and generation."""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Generator, Iterator
from contextlib import nullcontext
from typing import Any

import torch

from moestream.analysis.routes import RouteTrace
from moestream.engine.expert_tier import open_cache, open_reader, preload
from moestream.engine.model_file import load_resident, open_model, tokenizer_if_any
from moestream.engine.options import EngineOptions
from moestream.engine.planning import DEFAULT_UBATCH, SlotPlanner
from moestream.engine.prompt_cache import Conversation, PromptCache
from moestream.engine.sampling import Sampler
from moestream.engine.scheduler import Scheduler
from moestream.engine.stats import EngineSnapshot, Generation, GenerationStats, GenerationStep
from moestream.engine.threads import StepThreads
from moestream.errors import ContextError
from moestream.formats.tokenizer import Tokenizer
from moestream.streaming.budget import MB, BudgetPlan, peak_rss_bytes, reset_peak_rss
from moestream.streaming.elastic import ElasticWatcher
from moestream.streaming.heap import FreedHeap


class Engine:
    def __init__(self, model_path: str, options: EngineOptions | None = None, tokenizer: Tokenizer | None = None):
        """tokenizer: one already built from this file's metadata (run builds it to count its prompt first)."""
        o = self.options = options or EngineOptions()
        reset_peak_rss()
        self.threads = StepThreads(o.threads)
        self.file = open_model(model_path, o.exact)
        self.gguf, self.store, self.exact, self.model_path = (
            self.file.gguf,
            self.file.store,
            self.file.exact,
            model_path,
        )
        cfg = self.file.cfg
        self.ctx = min(o.ctx or min(cfg.context_length, 4096), cfg.context_length)
        # built before sizing: ~50 MB for a 150k vocabulary
        self._tokenizer = tokenizer or tokenizer_if_any(self.gguf)
        # the read-ahead admits what it reads, so admission rules that can turn a miss away switch it off
        read_ahead = o.read_ahead and o.admit_prompt and o.min_hits == 0
        planner = SlotPlanner(self.file, self.ctx, o)
        self.max_batch = planner.batch_size()
        if o.n_slots is None:
            planner.refuse(self.max_batch)
        self.model, self.lock_report = load_resident(self.file, o)
        self.cfg = self.model.cfg
        self.kv = self.model.new_kv(self.ctx)
        self.conversation = Conversation(self.kv)
        # the other sequences a batch decodes with this one, allocated (and so measured by the plan) up front
        self.batch_kvs = [self.model.new_kv(self.ctx) for _ in range(self.max_batch - 1)]
        self.plan: BudgetPlan | None = None
        self.ubatch, n_slots = o.ubatch or DEFAULT_UBATCH, o.n_slots
        self.prompt_span = o.prefill_span or self.ctx  # without a budget to fit: the whole prompt
        if n_slots is None:
            self.plan, self.ubatch, read_ahead = planner.plan(read_ahead)
            n_slots, self.prompt_span = self.plan.n_slots, self.plan.span
        # conversations kept across requests, in the MB the plan counted (without a budget: the option's)
        cache_mb = planner.prompt_cache_mb
        self.prompt_cache = PromptCache(cache_mb * MB) if cache_mb else None
        for kv in [self.kv, *self.batch_kvs]:  # a span's attention runs a micro-batch of queries at a time
            kv.query_chunk = self.ubatch
        lookahead = planner.lookahead if self.plan is not None else planner.lookahead_mode(n_slots)
        self.reader = open_reader(self.file, self.cfg, o, read_ahead, lookahead != "off")
        self.cache, self.trace = open_cache(
            self.file, self.reader, self.cfg, o, n_slots, read_ahead, model_path, lookahead
        )
        # what the model's steps ask for experts: the cache, or the cache behind the workers' remote tier
        self.experts, self.remote = self.cache, None
        if o.expert_workers is not None:
            from moestream.distributed.remote_experts import open_remote

            self.experts = open_remote(self.file, self.cache, o, model_path, self.model)
            self.remote = self.experts.remote
        # router choices replayed from a trace (--route-trace), handed to every forward step
        self.route_hook = None
        if o.route_trace is not None:
            moe_layers = cfg.n_layers - getattr(cfg, "first_moe_block", 0)
            name = os.path.basename(model_path)
            self.route_hook = RouteTrace(o.route_trace, cfg.n_experts, cfg.top_k, moe_layers, name)
        # what a prompt step frees is kept for its next layers, within the activations' room the plan counts
        self.heap = FreedHeap(self.plan.compute) if self.plan is not None else None
        self.elastic = ElasticWatcher(self.cache, o.keep_free_mb).start() if o.keep_free_mb is not None else None
        # the generation a stream() consumer has not finished yet; weak, so that a consumer's `break` drops
        # the last reference and ends it at once
        self._active: weakref.ref[Generator] | None = None
        # The loaded model's objects live as long as the engine: out of the cyclic collector's view, its full
        # collections (a prompt span makes thousands of short-lived futures and tensors) no longer walk them.
        # Garbage is collected first (frozen, it would never be), and close() hands them back.
        gc.collect()
        gc.freeze()

    # -- what front-ends see ----------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = Tokenizer.from_metadata(self.gguf.metadata)
        return self._tokenizer

    def snapshot(self) -> EngineSnapshot:
        """The cache's and the reader's counters since the engine started."""
        cs, r = self.cache.stats, self.reader
        return EngineSnapshot(
            model_path=self.model_path,
            ctx=self.ctx,
            hits=cs.hits,
            misses=cs.misses,
            bytes_read=cs.bytes_read,
            used_slots=self.cache.used_slots,
            n_slots=self.cache.n_slots,
            slot_nbytes=self.cache.slot_nbytes,
            pinned_slots=self.cache.pinned_slots,
            pinned_hits=cs.pinned_hits,
            read_ahead=self.cache.read_ahead,
            ahead_reads=cs.ahead_reads,
            ahead_unused=cs.ahead_unused,
            io_direct=r.direct,
            io_threads=r.threads,
            read_busy_s=r.busy_s,
            read_busy_mb_s=r.busy_bandwidth / 1e6,
            read_run_len=r.run_len,
            read_buffer_wait_s=r.buffer_wait_s,
            prompt_cache_entries=len(self.prompt_cache) if self.prompt_cache is not None else 0,
            prompt_cache_bytes=self.prompt_cache.nbytes if self.prompt_cache is not None else 0,
        )

    def preload(self) -> int:
        """Fill the expert cache before a prompt (benchmarks: compute without disk reads); the experts read."""
        return preload(self.cache, self.reader, self.cfg)

    def reset(self) -> None:
        """Forget the conversation held in the KV cache."""
        self._finish_active()
        self.conversation.forget()

    # -- generation -------------------------------------------------------------------------------------

    def stream(
        self,
        prompt: list[int],
        max_new_tokens: int,
        sampler: Sampler | None = None,
        stop_ids: set[int] | None = None,
    ) -> Iterator[GenerationStep]:
        """Generate token by token: one GenerationStep per token, its finish_reason set on the last one.

        A consumer may stop at any step (`break`, close()): the generation then ends as "cancelled", with
        the KV cache holding what was computed. Starting another generation ends an unfinished one."""
        self.check_prompt(prompt)
        self._finish_active()
        steps = self._steps(prompt, max_new_tokens, sampler or Sampler(), stop_ids or set(), GenerationStats())
        self._active = weakref.ref(steps)
        return steps

    def generate(
        self,
        prompt: list[int],
        max_new_tokens: int,
        sampler: Sampler | None = None,
        stop_ids: set[int] | None = None,
    ) -> Generation:
        """The whole generation at once (greedy unless a sampler says otherwise)."""
        self.check_prompt(prompt)
        self._finish_active()
        gen = Generation()
        for step in self._steps(prompt, max_new_tokens, sampler or Sampler(), stop_ids or set(), gen.stats):
            gen.tokens.append(step.token)
        return gen

    def scheduler(self) -> Scheduler:
        """Sequences that generate together (serve): up to max_batch at a time, each in its own KV cache."""
        self._finish_active()
        return Scheduler(self)

    def check_model_file(self) -> None:
        """Raise DiskError if the model file was truncated, rewritten or replaced since it was opened: the
        experts still to be read would no longer be the ones the resident weights belong to."""
        self.reader.check_file()

    def check_prompt(self, prompt: list[int]) -> None:
        self.check_model_file()
        if not prompt:
            raise ContextError("the prompt is empty; give at least one token of text")
        if len(prompt) >= self.ctx:
            raise ContextError(
                f"the prompt has {len(prompt)} tokens but the context holds {self.ctx}; "
                "shorten the prompt or raise --ctx"
            )

    def _finish_active(self) -> None:
        steps = self._active() if self._active is not None else None
        self._active = None
        if steps is not None:
            steps.close()

    def _steps(
        self, prompt: list[int], max_new_tokens: int, sampler: Sampler, stop_ids: set[int], st: GenerationStats
    ) -> Generator[GenerationStep, None, None]:
        """One sequence generating alone: the scheduler serve runs, with this engine's own conversation as its
        one slot."""
        scheduler = Scheduler(self, slots=[self.conversation])
        seq = scheduler.add(prompt, max_new_tokens, sampler, stop_ids, stats=st)
        counters = _Counters(self.cache.stats, st)
        held: int | None = None  # the token sampled last, yielded once the next step has been asked for
        try:
            with self.cache.generation():  # the whole generation, not step by step: no prefault in between
                while seq.finish_reason is None:
                    events = scheduler.step()
                    if counters.b1 is None and not seq.prefilling:
                        counters.decode_begins()
                    counters.update()
                    for ev in events:
                        if ev.finish_reason is not None:
                            held = ev.token
                            break
                        try:
                            yield GenerationStep(ev.token, st)
                        except GeneratorExit:
                            scheduler.cancel(seq)
                            raise
        finally:
            counters.update()
            st.n_slots = self.cache.n_slots
            st.peak_rss = peak_rss_bytes()
        if held is not None:
            # the last token after the generation's context closed: a consumer that stops here changes nothing
            yield GenerationStep(held, st, st.finish_reason)

    def forward(self, tokens: list[int], pos: int, kv: Any = None, all_logits: bool = False) -> torch.Tensor:
        """Run `tokens` of one sequence at positions pos.. in `kv` (the engine's own conversation by default):
        the step of a batch of one. The last position's logits [V] (all_logits: every position's [T, V])."""
        logits = self.step([tokens], [self.kv if kv is None else kv], [pos], len(tokens) > 1, all_logits)
        return logits if all_logits else logits[0]

    def step(
        self, blocks: list[list[int]], kvs: list[Any], positions: list[int], prompt: bool, all_logits: bool = False
    ) -> torch.Tensor:
        """One forward step of several sequences: block b (the token it decodes, or its next prompt span) at
        positions[b] in kvs[b]; each block's last logits [B, V]. Each layer's experts are fetched once for the
        union of what all blocks route to. prompt: the step holds a prompt span, and so reads as a prompt
        micro-batch does."""
        longest, total = max(len(b) for b in blocks), sum(len(b) for b in blocks)
        phase = "prompt" if prompt else "decode"
        self.threads.begin_step(longest, self.model.lane_decode)
        # the cache's growth allowance counts the micro-batches of all the step's tokens
        units = -(-total // self.ubatch)
        if self.trace is not None:
            self.trace.begin_step(units, positions[0], phase)
        self.cache.begin_step(units, phase)
        # a prompt step keeps what its layers free for the next ones (FreedHeap); a decode step leaves it
        heap = self.heap.prompt_step() if prompt and total > 1 and self.heap is not None else nullcontext()
        with heap:
            return self.model.step(
                blocks, kvs, positions, self.experts, route_hook=self.route_hook, all_logits=all_logits
            )

    def close(self) -> None:
        self._finish_active()
        if self.elastic is not None:
            self.elastic.stop()
        if self.trace is not None:
            self.trace.close()
            self.trace = None
        self.lock_report.unlock()
        if self.remote is not None:
            self.remote.close()
        self.cache.close()
        self.reader.close()
        self.gguf.close()
        gc.unfreeze()  # this engine's objects (and any other's) collectable again once dropped


class _Counters:
    """A generation's share of the cache's counters: the difference since it began (and since decode began)."""

    def __init__(self, cache_stats, st: GenerationStats):
        self.cs, self.st = cache_stats, st
        cs = cache_stats
        self.h0, self.m0, self.b0, self.w0 = cs.hits, cs.misses, cs.bytes_read, cs.read_wait_s
        self.b1: int | None = None
        self.w1 = 0.0

    def decode_begins(self) -> None:
        self.b1, self.w1 = self.cs.bytes_read, self.cs.read_wait_s

    def update(self) -> None:
        cs, st = self.cs, self.st
        st.hits, st.misses = cs.hits - self.h0, cs.misses - self.m0
        st.bytes_read = cs.bytes_read - self.b0
        st.read_wait_s = cs.read_wait_s - self.w0
        if self.b1 is not None:
            st.decode_bytes_read = cs.bytes_read - self.b1
            st.decode_read_wait_s = cs.read_wait_s - self.w1
