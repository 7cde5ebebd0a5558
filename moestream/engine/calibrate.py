"""Measurements on this machine that the decode forecast (analysis/forecast.py) takes as inputs."""

from __future__ import annotations

import time

import psutil
import torch

from moestream.compute import linear
from moestream.engine.engine import Engine
from moestream.engine.model_file import open_model
from moestream.engine.options import EngineOptions
from moestream.errors import MoestreamError


def measure_pack_ms(model_path: str, repeats: int = 9) -> float:
    """ms to pack one expert read from disk into its compute form, on this machine: the median of packing
    the first layer's expert 0 (its three segments, as the cache does) into slot memory that has been
    touched once (the engine prefaults its arena when given a budget)."""
    m = open_model(model_path, exact=False, check_types=False)
    try:
        store = m.store
        segs = store.segments(0, 0)
        raws = [m.gguf.read_range(s.offset, s.nbytes, s.part) for s in segs]
        raws = [r if s.convert is None else s.convert(r) for r, s in zip(raws, segs, strict=True)]
    finally:
        m.close()
    layout = store.layouts[0]
    slot = linear.aligned_empty(store.slot_nbytes)
    slot.fill_(0)
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            for s, raw, off, size in zip(segs, raws, layout.offsets, layout.packed, strict=True):
                linear.pack_into(raw, s.ggml_type, s.n, s.k, slot[off : off + size], False)
            times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


def measure_compute_ms(model_path: str, tokens: int = 16, threads: int | None = None) -> float:
    """Decode ms/token with every expert the run touches already cached: generate once to fill the cache,
    then again with the same prompt (greedy, so the same experts) and time it without the read waits."""
    m = open_model(model_path, exact=False, check_types=False)
    try:
        cfg = m.cfg
        need = m.store.slot_nbytes * cfg.n_layers * cfg.n_experts
    finally:
        m.close()
    if need > 0.7 * psutil.virtual_memory().available:
        raise MoestreamError(
            f"caching every expert takes {need / 2**30:.1f} GiB, more than this machine has free; give the "
            "compute time with --compute-ms, or --compute-from the stats JSON of a run with a large budget"
        )
    engine = Engine(model_path, EngineOptions(n_slots=cfg.n_layers * cfg.n_experts, threads=threads))
    try:
        prompt = list(range(1, 9))
        engine.generate(prompt, tokens)
        engine.reset()
        st = engine.generate(prompt, tokens).stats
        steps = max(1, st.decode_tokens - 1)  # the first token comes from the prompt's logits
        return 1e3 * (st.decode_s - st.decode_read_wait_s) / steps
    finally:
        engine.close()
