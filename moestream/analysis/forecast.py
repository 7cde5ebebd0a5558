"""Predict decode speed from the disk (a probe), the model's geometry, the cache's hit rate and compute.

Per decoded token, each MoE layer waits for its missing experts before it can finish, and layers run one
after another (the next layer's routing needs this layer's output). So

    time per token = compute (everything cached) + sum over layers of read_time(misses in that layer)

read_time(m): the engine reads an expert as three segments in parallel, so m misses are n = 3m reads with
q = min(io_threads, n) in flight; the probe measured the aggregate bandwidth bw(q) at that depth, and
read_time = n * segment_bytes / bw(q). The per-layer miss counts come from a replay of a trace (their
real distribution: bursts of misses cost less per expert than isolated ones) or, given only a hit rate,
from a binomial around it.

Left out, on purpose: the overlap of the hits' compute with the misses' reads (the engine computes cached
experts while the rest are read; it makes the forecast slightly pessimistic) and the CPU time of packing
a read expert (on few cores it competes with compute; it makes it optimistic).
"""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Any

from moestream.analysis.probe import ProbeResult
from moestream.errors import MoestreamError
from moestream.formats.checkpoint import open_model_file

ENGINE_IO_THREADS = 4  # the engine's default --io-threads


@dataclass
class Geometry:
    n_layers: int  # MoE layers
    top_k: int
    expert_bytes: int  # bytes one expert reads from disk (its three segments)
    n_experts: int = 0
    model: str = ""

    @property
    def segment_bytes(self) -> float:
        return self.expert_bytes / 3


def geometry_from_gguf(path: str) -> Geometry:
    f = open_model_file(path)
    try:
        arch = f.metadata.get("general.architecture", "")
        per_layer: dict[str, int] = {}
        n_experts = 0
        for t in f.tensors.values():
            if "_exps." in t.name and len(t.shape) == 3:
                layer = t.name.split(".")[1]
                per_layer[layer] = per_layer.get(layer, 0) + t.nbytes // t.shape[0]
                n_experts = t.shape[0]
        top_k = int(f.metadata.get(f"{arch}.expert_used_count", 0))
    finally:
        f.close()
    if not per_layer or top_k < 1:
        raise MoestreamError(f"{path} has no routed experts (or no expert_used_count); is it a MoE model?")
    return Geometry(
        len(per_layer), top_k, round(sum(per_layer.values()) / len(per_layer)), n_experts, os.path.basename(path)
    )


def geometry_from_meta(meta: dict[str, Any]) -> Geometry:
    """From a trace's metadata (the engine writes layers, experts, top_k and expert_bytes)."""
    try:
        return Geometry(
            int(meta["layers"]),
            int(meta["top_k"]),
            int(meta["expert_bytes"]),
            int(meta.get("experts", 0)),
            str(meta.get("model", "")),
        )
    except (KeyError, TypeError, ValueError):
        raise MoestreamError(
            "the trace's metadata lacks layers/top_k/expert_bytes; pass --model or --layers/--top-k/--expert-bytes"
        ) from None


def bandwidth(probe: ProbeResult, inflight: float, direct: bool, size: float | None = None) -> float:
    """Aggregate MB/s at `inflight` reads of `size` bytes (default: the probe's segment size), interpolated
    between depths and, for a size the probe did not measure, between the sizes it did."""
    mode = "direct" if direct else "buffered"
    want = probe.segment_bytes if size is None else size
    sizes = sorted({r.size for r in probe.rows if r.mode == mode and r.reads > 0})
    if size is None or want in sizes:
        return _bandwidth_at(probe, probe.segment_bytes if size is None else int(want), inflight, direct)
    # 4 KiB rows measure latency, not streaming: only sizes of 64 KiB and up bracket a read of experts
    big = [s for s in sizes if s >= 64 << 10]
    below, above = [s for s in big if s <= want], [s for s in big if s >= want]
    if not below or not above:  # outside the probed sizes: the nearest one
        nearest = below[-1] if below else above[0] if above else probe.segment_bytes
        return _bandwidth_at(probe, nearest, inflight, direct)
    lo, hi = below[-1], above[0]
    w = math.log(want / lo) / math.log(hi / lo)
    b0, b1 = _bandwidth_at(probe, lo, inflight, direct), _bandwidth_at(probe, hi, inflight, direct)
    return b0 + w * (b1 - b0)


def _bandwidth_at(probe: ProbeResult, size: int, inflight: float, direct: bool) -> float:
    mode = "direct" if direct else "buffered"
    rows = sorted((r.inflight, r.mb_s) for r in probe.rows if r.size == size and r.mode == mode and r.reads > 0)
    if not rows:
        other = "buffered" if direct else "direct"
        raise MoestreamError(
            f"the probe has no {mode} rows at the segment size; forecast with --{other} or probe again"
        )
    # The running maximum over depths: a short probe row can dip well below both its neighbours, and one such
    # row would otherwise set the whole forecast; the engine's reads at depth q did reach the shallower rows'
    # figure (bench/RESULTS.md, "Forecast vs measured").
    rows = [(q, max(b for _q, b in rows[: i + 1])) for i, (q, _b) in enumerate(rows)]
    if inflight <= rows[0][0]:
        return rows[0][1]
    for (q0, b0), (q1, b1) in itertools.pairwise(rows):
        if inflight <= q1:
            w = (math.log(inflight) - math.log(q0)) / (math.log(q1) - math.log(q0))
            return b0 + w * (b1 - b0)
    return rows[-1][1]


def layer_read_s(probe: ProbeResult, geom: Geometry, misses: int, io_threads: int, direct: bool) -> float:
    if misses <= 0:
        return 0.0
    n = 3 * misses
    return n * geom.segment_bytes / (bandwidth(probe, min(io_threads, n), direct) * 1e6)


def _binomial(n: int, p: float) -> list[float]:
    return [math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(n + 1)]


@dataclass
class Forecast:
    hit_rate: float
    hit_source: str  # where the hit rate came from
    misses_per_token: float
    mb_per_token: float
    read_ms: float
    compute_ms: float
    tok_s: float
    io_threads: int
    direct: bool
    measured_tok_s: float | None = None

    @property
    def error(self) -> float | None:
        """(forecast - measured) / measured."""
        if not self.measured_tok_s:
            return None
        return (self.tok_s - self.measured_tok_s) / self.measured_tok_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"error": self.error}


# Of the compute of a layer with every expert cached, the share spent in the routed experts (profiled on
# the Qwen3-30B-A3B shape: 24 of the 26 int4 matmuls of a layer; the rest is attention and the router).
EXPERT_SHARE = 0.7
# Packing one expert that was read on the model's thread, when the forecast cannot measure it
# (engine.calibrate.measure_pack_ms): about what the torch int4 form takes, the slower of the two forms (the
# lane form packs faster), so that a forecast without a measurement errs on the slow side.
DEFAULT_PACK_MS = 0.5


def _layer_ms(geom: Geometry, compute_ms: float, misses: int, read_ms: float, pack_ms: float) -> float:
    """One layer as the engine runs it: the cached experts are computed while the misses are read; each
    miss is packed and computed as it lands, so the layer ends when both the reads (plus the last miss's
    work) and all the CPU work are done."""
    layer = compute_ms / geom.n_layers
    per_expert = EXPERT_SHARE * layer / geom.top_k
    dense = layer - per_expert * geom.top_k
    if misses == 0:
        return layer
    cpu = (geom.top_k - misses) * per_expert + misses * (per_expert + pack_ms)
    return dense + max(read_ms + per_expert + pack_ms, cpu)


def forecast(
    probe: ProbeResult,
    geom: Geometry,
    compute_ms: float,
    *,
    hit_rate: float | None = None,
    miss_hist: list[int] | None = None,
    hit_source: str = "",
    io_threads: int = ENGINE_IO_THREADS,
    direct: bool | None = None,
    pack_ms: float = DEFAULT_PACK_MS,
) -> Forecast:
    """Decode tok/s for one cache. miss_hist[m] = decode (token, layer) groups that missed m experts
    (ReplayResult.miss_hist); else hit_rate with misses spread binomially."""
    if direct is None:
        direct = any(r.mode == "direct" for r in probe.rows)
    if miss_hist and sum(miss_hist):
        total = sum(miss_hist)
        probs = [c / total for c in miss_hist]
        misses = sum(m * c for m, c in enumerate(miss_hist)) / total * geom.n_layers
        if hit_rate is None:
            hit_rate = 1 - misses / (geom.n_layers * geom.top_k)
    elif hit_rate is not None:
        if not 0 <= hit_rate <= 1:
            raise MoestreamError(f"the hit rate must be between 0 and 1 (or 0% and 100%), got {hit_rate}")
        probs = _binomial(geom.top_k, 1 - hit_rate)
        misses = geom.n_layers * geom.top_k * (1 - hit_rate)
    else:
        raise MoestreamError("give a hit rate (--hit-rate) or a trace to replay (--trace)")
    read_s = sum(p * layer_read_s(probe, geom, m, io_threads, direct) for m, p in enumerate(probs))
    read_ms = 1e3 * read_s * geom.n_layers
    layer_ms = sum(
        p * _layer_ms(geom, compute_ms, m, 1e3 * layer_read_s(probe, geom, m, io_threads, direct), pack_ms)
        for m, p in enumerate(probs)
    )
    total_ms = layer_ms * geom.n_layers
    return Forecast(
        hit_rate=hit_rate,
        hit_source=hit_source,
        misses_per_token=misses,
        mb_per_token=misses * geom.expert_bytes / 1e6,
        read_ms=read_ms,
        compute_ms=compute_ms,
        tok_s=1e3 / total_ms if total_ms > 0 else float("inf"),
        io_threads=io_threads,
        direct=direct,
    )


def cached_compute_ms(stats: dict[str, float], geom: Geometry, pack_ms: float) -> float:
    """Compute per forward pass with every expert cached, from a run's stats (read_stats): its decode time
    minus its read waits still holds the packing of each expert it read, which the forecast adds per miss
    on its own; left in, a run that read experts would have its packing counted twice."""
    misses = stats.get("read_bytes_per_pass", 0.0) / geom.expert_bytes if geom.expert_bytes else 0.0
    return max(0.0, stats["compute_ms"] - misses * pack_ms)


def read_stats(path_or_value: str) -> dict[str, float]:
    """A measured run: a number (decode tok/s) or a JSON file with the engine's GenerationStats fields
    (decode_tokens, decode_s, decode_read_wait_s) or a decode_tps key, possibly under "stats"; rates are per
    forward pass. A stats JSON also gives the prompt's figures (prompt_stats)."""
    try:
        return {"decode_tps": float(path_or_value)}
    except ValueError:
        pass
    try:
        with open(path_or_value, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as exc:
        raise MoestreamError(
            f"cannot read {path_or_value}: {exc.strerror}; give a tok/s number or a JSON file"
        ) from None
    except json.JSONDecodeError:
        raise MoestreamError(f"{path_or_value} is not JSON; give a tok/s number or the engine's stats JSON") from None
    if isinstance(doc, dict) and isinstance(doc.get("stats"), dict):
        doc = doc["stats"]
    if not isinstance(doc, dict):
        raise MoestreamError(f"{path_or_value}: expected a JSON object with decode_tokens and decode_s")
    out: dict[str, float] = {}
    # the first decoded token comes from the prompt's logits: decode_s times decode_tokens - 1 forward passes,
    # and the forecast is per forward pass
    passes = float(doc.get("decode_tokens") or 0) - 1
    if passes > 0 and doc.get("decode_s"):
        out["decode_tps"] = passes / float(doc["decode_s"])
        wait = float(doc.get("decode_read_wait_s", 0.0))
        out["compute_ms"] = 1e3 * (float(doc["decode_s"]) - wait) / passes
        out["read_bytes_per_pass"] = float(doc.get("decode_bytes_read", 0)) / passes
    elif "decode_tps" in doc:
        out["decode_tps"] = float(doc["decode_tps"])
    else:
        raise MoestreamError(f"{path_or_value}: no decode_tokens/decode_s or decode_tps in it")
    return out | prompt_stats(doc)


def prompt_stats(doc: dict[str, Any]) -> dict[str, float]:
    """The prompt's figures in a stats JSON: its computed tokens, seconds, ms per token without the read
    waits (the decode's waits are the rest of read_wait_s), and MB read (what decode did not read)."""
    try:
        tokens = float(doc.get("prompt_tokens") or 0) - float(doc.get("reused_tokens") or 0)
        seconds = float(doc.get("prompt_s") or 0)
        wait = float(doc.get("read_wait_s") or 0) - float(doc.get("decode_read_wait_s") or 0)
        read = float(doc.get("bytes_read") or 0) - float(doc.get("decode_bytes_read") or 0)
    except (TypeError, ValueError):
        return {}
    if tokens <= 0 or seconds <= 0:
        return {}
    return {
        "prompt_tokens": tokens,
        "prompt_s": seconds,
        "prompt_ms_per_token": 1e3 * max(0.0, seconds - wait) / tokens,
        "prompt_mb": read / 1e6,
    }


def format_forecast(geom: Geometry, probe: ProbeResult, rows: list[tuple[str, Forecast]]) -> str:
    lines = [
        f"model: {geom.model or '?'}: {geom.n_layers} MoE layers x top-{geom.top_k}, expert "
        f"{geom.expert_bytes / 1e6:.2f} MB (3 reads of {geom.segment_bytes / 1e6:.2f} MB)",
        f"disk: {probe.path} probe, read size {probe.segment_bytes / 1e6:.2f} MB"
        + ("" if probe.representative else " (not representative: see the probe's warning)"),
    ]
    if abs(probe.segment_bytes - geom.segment_bytes) > 0.5 * geom.segment_bytes:
        lines.append("warning: the probe's read size differs from this model's segments; probe the model")
    lines.append(
        f"  {'case':<24} {'hit %':>6} {'misses/tok':>10} {'MB/tok':>7} {'read ms':>8} "
        f"{'compute ms':>10} {'tok/s':>7} {'reader':>14}"
    )
    for name, fc in rows:
        reader = f"{fc.io_threads} {'direct' if fc.direct else 'buffered'}"
        lines.append(
            f"  {name:<24} {100 * fc.hit_rate:>6.1f} {fc.misses_per_token:>10.1f} "
            f"{fc.mb_per_token:>7.0f} {fc.read_ms:>8.1f} {fc.compute_ms:>10.1f} {fc.tok_s:>7.2f} "
            f"{reader:>14}"
        )
        if fc.measured_tok_s:
            lines.append(
                f"  {'  measured':<24} {'':>6} {'':>10} {'':>7} {'':>8} {'':>10} "
                f"{fc.measured_tok_s:>7.2f}   forecast {100 * (fc.error or 0):+.0f}%"
            )
    return "\n".join(lines)
