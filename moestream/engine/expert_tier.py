"""The engine's expert tier, assembled from its options: the reader, the expert cache with its growth rule,
admission, read-ahead and pinned profile part, and the trace that records every access for the replay."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

from moestream.analysis.profile import load_profile
from moestream.analysis.trace import TraceWriter
from moestream.engine.options import EngineOptions
from moestream.engine.planning import read_buffers
from moestream.errors import BudgetError
from moestream.streaming.budget import MB
from moestream.streaming.expert_cache import ExpertCache
from moestream.streaming.read_ahead import decode_slots, prompt_slots
from moestream.streaming.reader import ExpertReader


def open_reader(file: Any, cfg: Any, options: EngineOptions, read_ahead: bool, lookahead: bool) -> ExpertReader:
    """The parallel reader over the model's files, its buffers sized for the cache's reads in flight (with
    the router lookahead: its guesses' too)."""
    store = file.store
    single, runs = read_buffers(cfg, store, options.io_threads, read_ahead, options.run_reads, lookahead)
    return ExpertReader(store.paths, store.max_segment_nbytes, threads=options.io_threads, direct=options.direct,
                        buffers=single, run_buffers=runs, run_len=store.run_len)  # fmt: skip


class StepTrace:
    """The access trace (--trace): one row per expert access, stamped with the forward step (in micro-batch
    units: the cache's growth allowance, which the replay reads back) and the step's first token."""

    def __init__(self, path: str, header: dict):
        self.writer = TraceWriter(path, header)
        self.step = 0  # forward steps so far in micro-batch units
        self.token = 0  # session index of the current step's first token
        self.phase = "decode"

    def begin_step(self, units: int, pos: int, phase: str) -> None:
        self.step += units
        self.token, self.phase = pos, phase

    def record(self, layer: int, expert: int, rank: int, source: str, nbytes: int, latency: float) -> None:
        self.writer.record(self.token, self.phase, self.step, layer, expert, rank, source, nbytes, latency)

    def close(self) -> None:
        self.writer.close()


def open_cache(
    file: Any,
    reader: ExpertReader,
    cfg: Any,
    options: EngineOptions,
    n_slots: int,
    read_ahead: bool,
    model_path: str,
    lookahead: str = "off",
) -> tuple[ExpertCache, StepTrace | None]:
    """The expert cache over n_slots slots as the options configure it (lookahead: the router lookahead's
    mode, SlotPlanner.lookahead_mode), and its trace where one is asked for."""
    o = options
    # Admission rules that can turn a miss away need scratch slots for it (carved out of the budget).
    scratch = cfg.top_k if (not o.admit_prompt or o.min_hits > 0) else 0
    if n_slots - scratch < cfg.top_k:
        raise BudgetError(
            f"with --no-prompt-admit or --admit-min-hits the cache needs {cfg.top_k} scratch slots on top "
            f"of {cfg.top_k} LRU slots, but the budget buys {n_slots}; raise --ram-budget-mb"
        )
    cache = ExpertCache(file.store, reader, n_slots, scratch_slots=scratch)
    if o.ram_budget_mb is not None:
        cache.prefault()
    growth = o.growth_slots or (prompt_slots(cfg.n_experts), decode_slots(cfg.top_k))
    trace = None
    if o.trace_path is not None:
        header = trace_header(o, model_path, cfg, file.store, reader, (n_slots - scratch, scratch), read_ahead, growth)
        trace = StepTrace(o.trace_path, header)
    cache.configure(
        min_slots=cfg.top_k,
        prompt_slots=growth[0],
        decode_slots=growth[1],
        admit_prompt=o.admit_prompt,
        read_ahead=read_ahead,
        lookahead=lookahead,
        min_hits=o.min_hits,
        trace=trace.record if trace is not None else None,
    )
    if o.pin_profile is not None:
        pin_from_profile(cache, cfg, file.store, o.pin_profile, o.pin_mb, o.progress)
    return cache, trace


def trace_header(
    options: EngineOptions,
    model_path: str,
    cfg: Any,
    store: Any,
    reader: ExpertReader,
    slots: tuple[int, int],
    read_ahead: bool,
    growth: tuple[int, int],
) -> dict:
    """The options, then what the run made of them (slots: LRU and scratch): replay reads these keys to
    reproduce the run."""
    return {
        **asdict(options),
        "model": os.path.basename(model_path),
        "n_slots": slots[0],
        "scratch_slots": slots[1],
        "policy": "lru",
        "read_ahead": read_ahead,
        "read_run_len": reader.run_len,
        "prompt_slots": growth[0],
        "decode_slots": growth[1],
        "layers": cfg.n_layers,
        "experts": cfg.n_experts,
        "top_k": cfg.top_k,
        "expert_bytes": max(store.expert_file_nbytes),
    }


def pin_from_profile(cache: ExpertCache, cfg: Any, store: Any, path: str, pin_mb: int | None, progress: bool) -> None:
    """The profile part of the RAM tier: the hottest experts of a profile, loaded now, never evicted."""
    keys = [(int(layer), int(e)) for layer, e in load_profile(path).ranked()]
    keys = [k for k in keys if k[0] < cfg.n_layers and k[1] < cfg.n_experts]
    n = len(keys) if pin_mb is None else pin_mb * MB // store.slot_nbytes
    cache.pin(keys[:n], progress=progress)


def preload(cache: ExpertCache, reader: ExpertReader, cfg: Any) -> int:
    """Read experts into the LRU until it is full, layer by layer (benchmarks: compute without reads). A
    trace does not record these reads, and the reader's counters start again after them: neither is the
    model's doing."""
    n = 0
    with cache.untraced():
        for layer in range(cfg.n_layers):
            room = min(cfg.n_experts, cache.capacity - cache.pinned_slots - n)
            if room <= 0:
                break
            for _e, _w in cache.fetch(layer, list(range(room))):
                n += 1
    reader.busy_s, reader.bytes_read = 0.0, 0
    return n
