"""The engine: one model file, its resident weights, the expert cache behind a budget, and generation."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moestream.compute import linear, native
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler
from moestream.errors import BudgetError, ContextError, ModelFileError
from moestream.formats import quants
from moestream.formats.gguf_file import GGUFFile
from moestream.models import ARCHITECTURES, common
from moestream.models.loader import GGUFWeights, config_from_gguf
from moestream.streaming.budget import (
    MB,
    UBATCH_CHOICES,
    BudgetPlan,
    choose_ubatch,
    peak_rss_bytes,
    plan_slots,
    release_free_heap,
    rss_bytes,
)
from moestream.streaming.expert_cache import ExpertCache
from moestream.streaming.expert_store import ExpertStore
from moestream.streaming.mlock import LockReport, lock_dense, routed_nbytes
from moestream.streaming.read_ahead import AHEAD_MIN_LAYERS, ahead_experts, ahead_reads, decode_slots, prompt_slots
from moestream.streaming.reader import ALIGN, ExpertReader, run_length

DEFAULT_UBATCH = 128  # SDQ seed 5.1: small micro-batches keep compute buffers and the expert union small
# What the runtime itself grows by while loading (kernels and the C library initialised on first use, heap
# left over from reading tensors, which release_free_heap mostly returns): measured 13-15 MB in a warm venv
# and ~28 MB in a fresh one (CI), so the pre-check never names a minimum below the final plan's.
LOAD_SLACK = 40 * MB
FLOAT_TYPES = {0, 1}  # F32, F16: computed in float32 (exact mode)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0
    prompt_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    read_wait_s: float = 0.0
    decode_bytes_read: int = 0
    decode_read_wait_s: float = 0.0
    n_slots: int = 0
    peak_rss: int = 0
    finish_reason: str = "length"

    @property
    def prompt_tps(self) -> float:
        computed = self.prompt_tokens - self.reused_tokens
        return computed / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def line(self) -> str:
        per_tok = self.decode_bytes_read / MB / self.decode_tokens if self.decode_tokens else 0.0
        wait_ms = 1e3 * self.decode_read_wait_s / self.decode_tokens if self.decode_tokens else 0.0
        tok_ms = 1e3 * self.decode_s / self.decode_tokens if self.decode_tokens else 0.0
        return (
            f"prompt {self.prompt_tokens} tok @ {self.prompt_tps:.1f} tok/s | "
            f"decode {self.decode_tokens} tok @ {self.decode_tps:.2f} tok/s "
            f"({tok_ms:.1f} ms/tok, {wait_ms:.1f} waiting on reads) | "
            f"expert hit rate {100 * self.hit_rate:.1f}% | disk {per_tok:.1f} MB/tok | "
            f"cache slots {self.n_slots} | peak RSS {self.peak_rss / MB:.0f} MB"
        )


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)


def _is_float_model(f: GGUFFile) -> bool:
    return all(t.ggml_type in FLOAT_TYPES for t in f.tensors.values() if len(t.shape) >= 2)


def _check_types(f: GGUFFile) -> None:
    for t in f.tensors.values():
        if t.ggml_type not in quants.SUPPORTED_TYPES:
            raise ModelFileError(
                f"{f.path}: tensor {t.name} has weight type {t.type_name}, which moestream does not support yet "
                "(supported: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K); use a Q4_K_M, Q5_K_M, Q6_K or Q8_0 file"
            )


class Engine:
    def __init__(self, model_path: str, options: EngineOptions | None = None):
        o = self.options = options or EngineOptions()
        ram_budget_mb, ctx, threads, io_threads = o.ram_budget_mb, o.ctx, o.threads, o.io_threads
        direct, exact, ubatch, n_slots, reserve_mb = o.direct, o.exact, o.ubatch, o.n_slots, o.reserve_mb
        trace_path, route_trace, admit_prompt, read_ahead = o.trace_path, o.route_trace, o.admit_prompt, o.read_ahead
        run_reads, min_hits, growth_slots, pin_profile = o.run_reads, o.min_hits, o.growth_slots, o.pin_profile
        pin_mb, keep_free_mb, progress, mlock = o.pin_mb, o.keep_free_mb, o.progress, o.mlock
        if threads:
            torch.set_num_threads(threads)
        self.threads = threads or torch.get_num_threads()
        native.set_threads(self.threads)  # the lane kernels' own pool
        common.WIDE_THREADS = self.threads
        # Small activations times small weights produce denormals, which cost the CPU kernels ~10x.
        torch.set_flush_denormal(True)
        self.gguf = f = GGUFFile(model_path)
        model_cls = ARCHITECTURES.get(f.arch)
        if model_cls is None:
            raise ModelFileError(
                f"{model_path}: architecture {f.arch or '(none)'!r} is not supported "
                f"(supported: {', '.join(sorted(ARCHITECTURES))})"
            )
        _check_types(f)
        self.exact = _is_float_model(f) if exact is None else exact
        self.ubatch = ubatch or DEFAULT_UBATCH
        # the read-ahead admits what it reads, so admission rules that can turn a miss away switch it off
        read_ahead = read_ahead and admit_prompt and min_hits == 0
        cfg = config_from_gguf(model_cls, f)
        self.ctx = min(ctx or min(cfg.context_length, 4096), cfg.context_length)
        self.store = ExpertStore(f, cfg.n_layers, cfg.n_experts, self.exact)
        # Until the micro-batch is chosen, plan with the smallest one it could be, and without the read-ahead's
        # buffers (added below where the budget leaves the cache room to read ahead at all).
        kw = _plan_args(
            model_cls, cfg, self.store, self.ctx, io_threads, ubatch or UBATCH_CHOICES[-1], ram_budget_mb, False
        )
        if reserve_mb is not None:
            kw["reserve_mb"] = reserve_mb
        self._tokenizer = _tokenizer_if_any(f)  # built before sizing: ~50 MB for a 150k vocabulary
        if n_slots is None:
            # Refuse before loading anything if the dense weights alone break the budget.
            estimate = _dense_estimate(f, self.exact) + model_cls.kv_nbytes(cfg, self.ctx, self.exact) + LOAD_SLACK
            plan_slots(resident=rss_bytes() + estimate, **kw)

        self.model = model_cls(cfg, GGUFWeights(f, self.exact))
        release_free_heap()  # the loader's freed read buffers would otherwise be measured as resident
        # Locked before sizing, so the budget measures the locked skeleton (mlock leaves RSS as it is).
        self.lock_report: LockReport = lock_dense(self.model, routed_nbytes(f), enabled=mlock is not False)
        self.cfg = self.model.cfg
        self.kv = self.model.new_kv(self.ctx)
        self._kv_tokens: list[int] = []
        if n_slots is None:
            if ubatch is None:
                fit = {k: v for k, v in kw.items() if k not in ("compute", "max_slots")}
                self.ubatch = choose_ubatch(
                    resident=rss_bytes(), compute_for=lambda u: model_cls.compute_nbytes(cfg, u, self.ctx), **fit
                )
                kw["compute"] = model_cls.compute_nbytes(cfg, self.ubatch, self.ctx)
            self.plan: BudgetPlan | None = plan_slots(resident=rss_bytes(), **kw)
            # the read-ahead's buffers only where the cache keeps room to read ahead with them; else the
            # memory stays with the slots
            with_ahead = None
            if read_ahead and self.plan.n_slots >= AHEAD_MIN_LAYERS * cfg.n_experts:
                kw["reader"] = _reader_nbytes(cfg, self.store, io_threads, True, run_reads)
                with_ahead = plan_slots(resident=rss_bytes(), **kw)
            read_ahead = with_ahead is not None and with_ahead.n_slots >= AHEAD_MIN_LAYERS * cfg.n_experts
            if read_ahead:
                self.plan = with_ahead
            n_slots = self.plan.n_slots
        else:
            self.plan = None
        single, runs = _read_buffers(self.cfg, self.store, io_threads, read_ahead, run_reads)
        self.reader = ExpertReader(
            f.path,
            self.store.max_segment_nbytes,
            threads=io_threads,
            direct=direct,
            buffers=single,
            run_buffers=runs,
            run_len=run_length(self.store.max_segment_nbytes, self.cfg.n_experts),
        )
        # Admission rules that can turn a miss away need scratch slots for it (carved out of the budget).
        scratch = self.cfg.top_k if (not admit_prompt or min_hits > 0) else 0
        if n_slots - scratch < self.cfg.top_k:
            raise BudgetError(
                f"with --no-prompt-admit or --admit-min-hits the cache needs {self.cfg.top_k} scratch slots on top "
                f"of {self.cfg.top_k} LRU slots, but the budget buys {n_slots}; raise --ram-budget-mb"
            )
        self.cache = ExpertCache(self.store, self.reader, n_slots, scratch_slots=scratch)
        self.model.experts = self.cache
        if route_trace is not None:
            from moestream.analysis.routes import RouteTrace

            self.model.route_hook = RouteTrace(route_trace, self.cfg.n_experts, self.cfg.top_k)
        if ram_budget_mb is not None:
            self.cache.prefault()
        self.cache.min_slots = self.cfg.top_k
        self.cache.prompt_slots, self.cache.decode_slots = growth_slots or (
            prompt_slots(self.cfg.n_experts),
            decode_slots(self.cfg.top_k),
        )
        self.cache.admit_prompt = admit_prompt
        self.cache.read_ahead = read_ahead
        self.cache.min_hits = min_hits
        if pin_profile is not None:
            self._pin_from_profile(pin_profile, pin_mb, progress)
        self.elastic = None
        if keep_free_mb is not None:
            from moestream.streaming.elastic import ElasticWatcher

            self.elastic = ElasticWatcher(self.cache, keep_free_mb).start()

        self._step = 0  # forward calls so far: one per prompt micro-batch or decoded token
        self._torch_threads = 0  # set by the first forward call
        self._spin_us = 0
        self._token = 0  # session index of the first token of the current forward call
        self._trace = None
        if trace_path is not None:
            from moestream.analysis.trace import TraceWriter

            self._trace = TraceWriter(
                trace_path,
                {
                    "model": os.path.basename(model_path),
                    "n_slots": n_slots - scratch,
                    "scratch_slots": scratch,
                    "policy": "lru",
                    "admit_prompt": admit_prompt,
                    "read_ahead": read_ahead,
                    "read_run_len": self.reader.run_len,
                    "prompt_slots": self.cache.prompt_slots,
                    "decode_slots": self.cache.decode_slots,
                    "min_hits": min_hits,
                    "layers": self.cfg.n_layers,
                    "experts": self.cfg.n_experts,
                    "top_k": self.cfg.top_k,
                    "expert_bytes": max(self.store.expert_file_nbytes),
                },
            )
            self.cache.trace = self._trace_record

    def preload(self) -> int:
        """Read experts into the LRU until it is full, layer by layer (benchmarks: compute without reads).
        A trace does not record these reads: they are not the model's accesses."""
        n = 0
        trace, self.cache.trace = self.cache.trace, None
        try:
            for layer in range(self.cfg.n_layers):
                room = min(self.cfg.n_experts, self.cache.capacity - self.cache.pinned_slots - n)
                if room <= 0:
                    break
                for _e, _w in self.cache.fetch(layer, list(range(room))):
                    n += 1
        finally:
            self.cache.trace = trace
        return n

    def _pin_from_profile(self, path: str, pin_mb: int | None, progress: bool) -> None:
        """The profile part of the RAM tier: the hottest experts of a profile, loaded now, never evicted."""
        from moestream.analysis.profile import load_profile

        keys = [(int(layer), int(e)) for layer, e in load_profile(path).ranked()]
        keys = [k for k in keys if k[0] < self.cfg.n_layers and k[1] < self.cfg.n_experts]
        n = len(keys) if pin_mb is None else pin_mb * MB // self.store.slot_nbytes
        self.cache.pin(keys[:n], progress=progress)

    def _trace_record(self, layer: int, expert: int, rank: int, source: str, nbytes: int, latency: float) -> None:
        assert self._trace is not None
        self._trace.record(self._token, self.cache.phase, self._step, layer, expert, rank, source, nbytes, latency)

    def _torch_threads_for(self, n_tokens: int) -> int:
        """torch's thread count for a step. A decode step whose heavy matmuls all run in the lane kernels gives
        torch one thread: its idle OpenMP threads spin for a while after each op and take the cores the lane
        pool needs (measured: decode 30 tok/s with both pools at 2 threads, 65-71 with torch at 1). Prompt
        steps keep every thread: qwen35moe's chunked DeltaNet runs in torch (its prefill: 4.95 tok/s at one
        thread, 6.95 at two; qwen3moe's was the same either way)."""
        if n_tokens == 1 and native.lane_ok() and getattr(self.model, "lane_decode", False):
            return 1
        return self.threads

    def _forward(self, tokens: list[int], pos: int):
        want = self._torch_threads_for(len(tokens))
        if want != self._torch_threads:
            torch.set_num_threads(want)
            self._torch_threads = want
        # the lane pool's idle workers spin between a decode step's back-to-back calls, but not through a
        # prompt micro-batch, whose reader threads need the cores to pack what they read
        spin = 2000 if len(tokens) == 1 else 100
        if spin != self._spin_us:
            native.set_spin_us(spin)
            self._spin_us = spin
        self._step += 1
        self._token = pos
        self.cache.begin_step()
        return self.model.forward(tokens, self.kv, pos)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from moestream.formats.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_metadata(self.gguf.metadata)
        return self._tokenizer

    def reset(self) -> None:
        """Forget the conversation held in the KV cache."""
        self._kv_tokens = []
        self.kv.truncate(0)

    def generate(
        self,
        prompt: list[int],
        max_new_tokens: int,
        sampler: Sampler | None = None,
        stop_ids: set[int] | None = None,
        on_token: Callable[[int], bool | None] | None = None,
    ) -> Generation:
        """Greedy/sampled generation; on_token(id) returning True stops early (a client went away)."""
        if not prompt:
            raise ContextError("the prompt is empty; give at least one token of text")
        if len(prompt) >= self.ctx:
            raise ContextError(
                f"the prompt has {len(prompt)} tokens but the context holds {self.ctx}; "
                "shorten the prompt or raise --ctx"
            )
        sampler = sampler or Sampler()
        stop_ids = stop_ids or set()
        max_new_tokens = min(max_new_tokens, self.ctx - len(prompt))
        gen = Generation()
        st = gen.stats
        cs = self.cache.stats
        h0, m0, b0, w0 = cs.hits, cs.misses, cs.bytes_read, cs.read_wait_s

        # Reuse the KV cache for the longest prefix this prompt shares with what it holds.
        common = 0
        for a, b in zip(self._kv_tokens, prompt, strict=False):  # they differ in length
            if a != b:
                break
            common += 1
        common = min(common, len(prompt) - 1)  # the last prompt token must run to give logits
        # A recurrent state can only go back to a checkpoint, so the state says where it really resumes.
        common = self.kv.truncate(common)
        self._kv_tokens = list(prompt[:common])
        st.prompt_tokens = len(prompt)
        st.reused_tokens = common

        t0 = time.perf_counter()
        self.cache.phase = "prompt"
        logits = None
        pos = common
        with torch.inference_mode(), self.cache.generation():
            while pos < len(prompt):
                chunk = prompt[pos : pos + self.ubatch]
                logits = self._forward(chunk, pos)
                pos += len(chunk)
                self._kv_tokens.extend(chunk)
            st.prompt_s = time.perf_counter() - t0
            self.cache.phase = "decode"
            b1, w1 = cs.bytes_read, cs.read_wait_s
            t1 = time.perf_counter()
            assert logits is not None
            while len(gen.tokens) < max_new_tokens:
                tok = sampler(logits)
                gen.tokens.append(tok)
                stop = tok in stop_ids
                if on_token is not None and on_token(tok):
                    st.finish_reason = "cancelled"
                    break
                if stop:
                    st.finish_reason = "stop"
                    break
                if len(gen.tokens) >= max_new_tokens:
                    break
                logits = self._forward([tok], pos)
                self._kv_tokens.append(tok)
                pos += 1
            st.decode_tokens = len(gen.tokens)
            st.decode_s = time.perf_counter() - t1
        st.hits, st.misses = cs.hits - h0, cs.misses - m0
        st.bytes_read = cs.bytes_read - b0
        st.read_wait_s = cs.read_wait_s - w0
        st.decode_bytes_read = cs.bytes_read - b1
        st.decode_read_wait_s = cs.read_wait_s - w1
        st.n_slots = self.cache.n_slots
        st.peak_rss = peak_rss_bytes()
        return gen

    def close(self) -> None:
        if getattr(self, "elastic", None) is not None:
            self.elastic.stop()
        if self._trace is not None:
            self._trace.close()
            self._trace = None
        self.lock_report.unlock()
        self.cache.close()
        self.reader.close()
        self.gguf.close()


# Run buffers per reader thread that a prompt's own run reads cycle through, besides the read-ahead's. They
# hold what the disk read while the model's thread computes instead of packing; with 4 the reader threads of a
# 98-token Qwen3.6 prompt under pressure waited up to 14 s (summed) for a free buffer, the disk idle meanwhile.
RUN_BUFFERS_PER_THREAD = 8


def _read_buffers(
    cfg, store: ExpertStore, io_threads: int, read_ahead: bool, run_reads: bool = False
) -> tuple[int, int]:
    """The reader's buffers, (segment buffers, run buffers): a decode token's misses (3 segments x top-k) and
    at least two per thread; with the read-ahead, buffers for what it holds until the next layer takes it,
    and (run reads) RUN_BUFFERS_PER_THREAD more for the prompt's own runs to cycle through; see ExpertReader."""
    single = max(3 * cfg.top_k, 2 * io_threads)
    if not read_ahead:
        return single, 0
    if not run_reads:
        return single + 3 * ahead_experts(cfg.n_experts), 0
    run_len = run_length(store.max_segment_nbytes, cfg.n_experts)
    return single, ahead_reads(cfg.n_experts, run_len) + RUN_BUFFERS_PER_THREAD * io_threads


def _reader_nbytes(cfg, store: ExpertStore, io_threads: int, read_ahead: bool, run_reads: bool = False) -> int:
    single, runs = _read_buffers(cfg, store, io_threads, read_ahead, run_reads)
    seg = store.max_segment_nbytes
    return single * (seg + 3 * ALIGN) + runs * (run_length(seg, cfg.n_experts) * seg + 3 * ALIGN)


def _plan_args(
    model_cls,
    cfg,
    store: ExpertStore,
    ctx: int,
    io_threads: int,
    ubatch: int,
    budget_mb: int | None,
    read_ahead: bool = True,
) -> dict:
    return dict(
        budget_mb=budget_mb,
        compute=model_cls.compute_nbytes(cfg, ubatch, ctx),
        reader=_reader_nbytes(cfg, store, io_threads, read_ahead),
        slot_nbytes=store.slot_nbytes,
        min_slots=cfg.top_k,
        max_slots=cfg.n_layers * cfg.n_experts,
    )


def budget_for_slots(
    model_path: str, n_slots: int, *, ctx: int | None = None, io_threads: int = 4, ubatch: int = DEFAULT_UBATCH
) -> int:
    """Estimated --ram-budget-mb that buys `n_slots` expert slots for this model (from the header alone)."""
    from moestream.streaming.budget import DEFAULT_RESERVE_MB

    f = GGUFFile(model_path)
    try:
        model_cls = ARCHITECTURES.get(f.arch)
        if model_cls is None:
            raise ModelFileError(f"{model_path}: architecture {f.arch!r} is not supported")
        exact = _is_float_model(f)
        cfg = config_from_gguf(model_cls, f)
        ctx = min(ctx or min(cfg.context_length, 4096), cfg.context_length)
        store = ExpertStore(f, cfg.n_layers, cfg.n_experts, exact)
        kw = _plan_args(model_cls, cfg, store, ctx, io_threads, ubatch, None)
        total = (
            rss_bytes()
            + _dense_estimate(f, exact)
            + model_cls.kv_nbytes(cfg, ctx, exact)
            + kw["compute"]
            + kw["reader"]
            + DEFAULT_RESERVE_MB * MB
            + n_slots * store.slot_nbytes
        )
        return total // MB + 64  # slack: the runtime grows a little while loading
    finally:
        f.close()


def _tokenizer_if_any(f: GGUFFile):
    """The file's tokenizer, or None when it has none (the `tokenizer` property then says why, if asked)."""
    from moestream.errors import MoestreamError
    from moestream.formats.tokenizer import Tokenizer

    if "tokenizer.ggml.model" not in f.metadata:
        return None
    try:
        return Tokenizer.from_metadata(f.metadata)
    except MoestreamError:
        return None


def _dense_estimate(f: GGUFFile, exact: bool) -> int:
    """Bytes the resident weights will take, from the tensor table alone (checked before loading)."""
    total = 0
    for t in f.tensors.values():
        if "_exps." in t.name:
            continue
        if len(t.shape) != 2 or "ffn_gate_inp" in t.name:
            total += _numel(t.shape) * 4  # norms, routers: float32
        elif t.name == "token_embd.weight":
            total += t.nbytes
            if "output.weight" not in f.tensors:
                total += linear.packed_nbytes(t.ggml_type, t.shape[0], t.shape[1], exact)
        else:
            total += linear.packed_nbytes(t.ggml_type, t.shape[0], t.shape[1], exact)
    return total


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def default_threads() -> int:
    return max(1, os.cpu_count() or 1)
