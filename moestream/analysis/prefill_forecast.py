"""Predict a prompt's (prefill) time from the decode forecast's inputs plus the reads its spans make.

The engine runs a prompt in spans: a span's tokens go through layer 0, then layer 1, and each layer fetches,
once for the whole span, every expert the span routes to. So a prompt's reads are per (span, layer): the
distinct experts that miss, read in file order with adjacent ones in one read (run reads); and its compute
grows with its tokens (each expert multiplies all its rows at once), which an all-cached run measures.

Why a layer takes the time it does:
- Its dense part (attention, the router) runs before its routing, and so its reads, are known: nothing
  overlaps it but reads that started earlier (the read-ahead below).
- Its experts' work (their GEMMs, and packing each read expert on the model's thread) runs while the rest
  are read: cached experts first, each miss as it lands. The layer ends at the later of "all that CPU work
  done" and "the last read landed, plus that expert's own work".
- With the read-ahead on (a cache of at least four layers' experts, a span that needs most of a layer), a
  fetch also starts reading the next layer's first uncached experts, queued behind its own reads, so the
  disk works through the next layer's dense part. With every read ahead a layer costs about
  max(compute, reads), plus the first layer's reads, which nothing can overlap.
The disk is one queue running at the probe's bandwidth for the read size and depth (the reader's threads in
flight, fewer when a layer has fewer reads).

Where the reads come from: a trace's prompt replayed at the engine's slot count (the replay reproduces the
live cache, read-ahead included), or without one uniform routing: T tokens x top_k picks over E experts
touch E(1 - (1 - k/E)^T) distinct experts of a layer. Real routing concentrates on fewer, so this is an upper
bound on reads (a floor on hits). Without a trace every span misses all it touches unless the cache holds
every expert: an LRU that sweeps the layers in order but holds less than all of them evicts a layer's
experts before the next span comes back to them.

Left out: the CPU the reader threads take from the compute on few cores, and the first touch of the
cache's fresh memory (both make the forecast optimistic).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from moestream.analysis.accesses import Accesses
from moestream.analysis.forecast import EXPERT_SHARE, Geometry, bandwidth
from moestream.analysis.probe import ProbeResult
from moestream.analysis.replay import GroupMisses
from moestream.analysis.trace import DECODE, PROMPT
from moestream.errors import MoestreamError
from moestream.streaming.read_ahead import ahead_experts, consecutive_runs, reads_ahead

UNIFORM_NOTE = "uniform routing: an upper bound on reads (real routing touches fewer experts)"


@dataclass
class LayerReads:
    experts: float  # distinct experts the span routes to in this layer
    misses: float  # of them, read by this layer's own fetch
    runs: float  # reads per matrix those misses take (adjacent experts in one read)
    ahead: float = 0.0  # experts of this layer the previous layer's fetch read ahead (asked for or not)
    ahead_runs: float = 0.0


@dataclass
class Span:
    tokens: int
    layers: list[LayerReads] = field(default_factory=list)

    @property
    def experts_read(self) -> float:
        return sum(r.misses + r.ahead for r in self.layers)


def uniform_distinct(tokens: float, top_k: int, n_experts: int) -> float:
    """Expected distinct experts of a layer that `tokens` tokens route to, top_k each, uniformly."""
    return n_experts * (1 - (1 - top_k / n_experts) ** tokens)


def expected_runs(n: int, p: float, run_len: int) -> float:
    """Expected run reads over n adjacent experts, each missed independently with probability p: a block of
    adjacent misses is read in pieces of at most run_len. An expert starts a piece when it is missed and the
    block of misses just before it is a multiple of run_len long (0 included)."""
    if p <= 0:
        return 0.0
    p = min(p, 1.0)
    total = 0.0
    for i in range(n):  # i experts before this one
        before = sum(p**j * (1 - p) for j in range(0, i, run_len)) + (p**i if i % run_len == 0 else 0.0)
        total += p * before
    return total


def uniform_spans(n_tokens: int, span: int, geom: Geometry, run_len: int, slots: int | None = None) -> list[Span]:
    """Spans under uniform routing. A cache of every expert misses each expert once over the prompt; a smaller
    one misses all a span touches. With `slots` large enough for the engine's read-ahead, each layer after
    the first has its first half read ahead (in runs), its other half read by its own fetch."""
    E, k = geom.n_experts, geom.top_k
    if E < 1:
        raise MoestreamError("the uniform-routing prefill forecast needs the number of experts: give --model")
    all_fit = slots is not None and slots >= geom.n_layers * E
    out, done = [], 0
    for start in range(0, n_tokens, span):
        t = min(span, n_tokens - start)
        d = uniform_distinct(t, k, E)
        miss = uniform_distinct(done + t, k, E) - uniform_distinct(done, k, E) if all_fit else d
        done += t
        ahead = slots is not None and miss > 0 and reads_ahead(round(d), E, slots)
        layers = []
        for layer in range(geom.n_layers):
            if ahead and layer > 0:
                half = ahead_experts(E)
                own = miss * (E - half) / E  # the routed share of the experts not read ahead
                layers.append(
                    LayerReads(d, own, expected_runs(E - half, own / (E - half), run_len), half, -(-half // run_len))
                )
            else:
                layers.append(LayerReads(d, miss, expected_runs(E, miss / E, run_len)))
        out.append(Span(t, layers))
    return out


def trace_spans(rows: np.ndarray) -> list[tuple[int, int]]:
    """(step, tokens) of each span of the trace's first prompt: its prompt steps before the first decode one;
    a span's length is the distance to the next span's first token (the last one's: to the first decoded)."""
    dec = rows[rows["phase"] == DECODE]
    if not len(dec):
        raise MoestreamError(
            "the trace has no decoded tokens, so its prompt's length is unknown; record a run with -n 1 or more"
        )
    first = int(dec["step"].min())
    end = int(dec[dec["step"] == first]["token"].min())
    p = rows[(rows["phase"] == PROMPT) & (rows["step"] < first)]
    if not len(p):
        raise MoestreamError("the trace has no prompt accesses; record the run from its start with --trace")
    steps = np.unique(p["step"])
    starts = [int(p[p["step"] == s]["token"].min()) for s in steps]
    ends = [*starts[1:], end]
    return [(int(s), b - a) for s, a, b in zip(steps, starts, ends, strict=True)]


def replay_spans(acc: Accesses, groups: list[GroupMisses], spans: list[tuple[int, int]], run_len: int) -> list[Span]:
    """The trace's spans with each layer's reads as the replay found them (groups: one per group of acc)."""
    tokens = dict(spans)
    out: dict[int, Span] = {s: Span(t, [LayerReads(0, 0, 0) for _ in range(acc.n_layers)]) for s, t in spans}
    for g, got in enumerate(groups):
        span = out.get(int(acc.group_step[g]))
        if span is None or acc.group_decode[g]:
            continue
        size = int(acc.starts[g + 1] - acc.starts[g])
        span.layers[int(acc.group_layer[g])] = LayerReads(
            size,
            len(got.missed),
            len(consecutive_runs(sorted(got.missed), run_len)),
            len(got.ahead),
            len(consecutive_runs(got.ahead, run_len)),
        )
    return [out[s] for s in sorted(tokens)]


def respan(templates: list[Span], n_tokens: int, span: int, geom: Geometry) -> list[Span]:
    """A prompt of n_tokens in spans of `span`, each shaped like a traced span: the trace's own span at that
    index where it has that length, else its last span of that length, else its longest, its reads scaled by
    the uniform-routing ratio of distinct experts (a partial span touches fewer)."""
    out = []
    for i, start in enumerate(range(0, n_tokens, span)):
        t = min(span, n_tokens - start)
        same = [s for s in templates if s.tokens == t]
        if i < len(templates) and templates[i].tokens == t:
            base = templates[i]
        else:
            base = same[-1] if same else max(templates, key=lambda s: s.tokens)
        f = 1.0
        if base.tokens != t and geom.n_experts:
            k, e = geom.top_k, geom.n_experts
            f = uniform_distinct(t, k, e) / uniform_distinct(base.tokens, k, e)
        out.append(Span(t, [LayerReads(*(f * v for v in asdict(r).values())) for r in base.layers]))
    return out


# ---- time -----------------------------------------------------------------------------------------


def read_ms(probe: ProbeResult, geom: Geometry, experts: float, runs: float, io_threads: int, direct: bool) -> float:
    """ms to read `experts` experts in `runs` runs: three reads per run (one per matrix), run-sized, at the
    depth the reader keeps in flight."""
    if experts <= 0 or runs <= 0:
        return 0.0
    size = experts / runs * geom.segment_bytes
    mb_s = bandwidth(probe, min(io_threads, 3 * runs), direct, size)
    return 1e3 * 3 * experts * geom.segment_bytes / (mb_s * 1e6)


def span_ms(span: Span, ms_per_token: float, pack_ms: float, read: Callable[[float, float], float]) -> float:
    """One span through every layer (the module's note): the model's thread and the disk as two clocks."""
    n = len(span.layers)
    layer = ms_per_token * span.tokens / n
    work = EXPERT_SHARE * layer
    dense = layer - work
    t = disk = ahead_done = 0.0
    for i, r in enumerate(span.layers):
        fetch = t + dense
        disk = max(disk, fetch) + read(r.misses, r.runs)
        landed = max(disk if r.misses else 0.0, ahead_done if r.ahead else 0.0)
        if i + 1 < n and span.layers[i + 1].ahead:
            nxt = span.layers[i + 1]
            disk += read(nxt.ahead, nxt.ahead_runs)  # queued behind this layer's own reads
            ahead_done = disk
        packs = r.misses + r.ahead
        tail = work / max(r.experts, 1.0) + pack_ms if packs else 0.0
        t = max(fetch + work + packs * pack_ms, landed + tail)
    return t


@dataclass
class PrefillForecast:
    tokens: int
    span: int
    spans: int
    source: str  # where the reads came from
    experts_read: float
    mb_read: float
    read_ms: float  # the disk's busy time
    compute_ms: float  # with every expert cached
    seconds: float
    tok_s: float
    io_threads: int
    direct: bool
    note: str = ""
    measured_s: float | None = None
    measured_tokens: float | None = None
    measured_mb: float | None = None

    @property
    def measured_tok_s(self) -> float | None:
        return self.measured_tokens / self.measured_s if self.measured_s and self.measured_tokens else None

    @property
    def error(self) -> float | None:
        """(forecast - measured) / measured, in tok/s."""
        m = self.measured_tok_s
        return (self.tok_s - m) / m if m else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"measured_tok_s": self.measured_tok_s, "error": self.error}


def prefill_forecast(
    probe: ProbeResult,
    geom: Geometry,
    spans: list[Span],
    ms_per_token: float,
    *,
    io_threads: int,
    direct: bool | None = None,
    pack_ms: float = 0.0,
    source: str = "",
    note: str = "",
) -> PrefillForecast:
    """Prompt time and tok/s of `spans` (uniform_spans, or replay_spans / respan from a trace)."""
    if not spans:
        raise MoestreamError("a prefill forecast needs a prompt of at least one token")
    if not (math.isfinite(ms_per_token) and ms_per_token >= 0):
        raise MoestreamError(f"the compute per prompt token must be a finite number >= 0, got {ms_per_token}")
    if direct is None:
        direct = any(r.mode == "direct" for r in probe.rows)

    def read(experts: float, runs: float) -> float:
        return read_ms(probe, geom, experts, runs, io_threads, direct)

    total_ms = sum(span_ms(s, ms_per_token, pack_ms, read) for s in spans)
    disk_ms = sum(read(r.misses, r.runs) + read(r.ahead, r.ahead_runs) for s in spans for r in s.layers)
    tokens = sum(s.tokens for s in spans)
    experts = sum(s.experts_read for s in spans)
    return PrefillForecast(
        tokens=tokens,
        span=max(s.tokens for s in spans),
        spans=len(spans),
        source=source,
        experts_read=experts,
        mb_read=experts * geom.expert_bytes / 1e6,
        read_ms=disk_ms,
        compute_ms=ms_per_token * tokens,
        seconds=total_ms / 1e3,
        tok_s=1e3 * tokens / total_ms if total_ms > 0 else float("inf"),
        io_threads=io_threads,
        direct=direct,
        note=note,
    )


def format_prefill(fc: PrefillForecast) -> str:
    reader = f"{fc.io_threads} {'direct' if fc.direct else 'buffered'}"
    lines = [
        f"prefill: {fc.tokens} prompt tokens in {fc.spans} span(s) of up to {fc.span}; reads from {fc.source}",
        f"  {'experts read':>12} {'MB read':>8} {'disk s':>7} {'compute s':>9} {'prompt s':>8} {'tok/s':>7} "
        f"{'reader':>14}",
        f"  {fc.experts_read:>12.0f} {fc.mb_read:>8.0f} {fc.read_ms / 1e3:>7.2f} {fc.compute_ms / 1e3:>9.2f} "
        f"{fc.seconds:>8.2f} {fc.tok_s:>7.1f} {reader:>14}",
    ]
    if fc.measured_s:
        mb = f"{fc.measured_mb:>8.0f}" if fc.measured_mb is not None else f"{'':>8}"
        lines.append(
            f"  {'measured':>12} {mb} {'':>7} {'':>9} {fc.measured_s:>8.2f} {fc.measured_tok_s or 0:>7.1f}"
            f"   forecast {100 * (fc.error or 0):+.0f}%"
        )
    if fc.note:
        lines.append(f"  note: {fc.note}")
    return "\n".join(lines)
