"""The prompt (prefill) part of `moestream forecast`: its options and the forecast they ask for."""

from __future__ import annotations

import argparse

import numpy as np

from moestream.analysis import forecast as fc
from moestream.analysis import prefill_forecast as pf
from moestream.analysis import replay as rp
from moestream.analysis.probe import ProbeResult
from moestream.cli import values
from moestream.errors import MoestreamError
from moestream.streaming.read_ahead import AHEAD_MIN_LAYERS
from moestream.streaming.reader import run_length

COMPUTE_HINT = (
    "give the compute per prompt token with every expert cached: --prefill-compute-ms-per-token MS, or "
    "--prefill-compute-from STATS.json of `moestream run --preload ... --stats-json STATS.json` "
    "(its prompt_s / prompt_tokens)"
)


def add_prefill_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prompt-tokens",
        type=values.positive,
        help="forecast the prefill of a prompt this long (default: the trace's prompt, when a prefill compute "
        "is given)",
    )
    c = p.add_mutually_exclusive_group()
    c.add_argument(
        "--prefill-compute-ms-per-token",
        type=values.real(0),
        help="prompt compute per token with every expert cached (a --preload run's prompt_s / prompt_tokens)",
    )
    c.add_argument(
        "--prefill-compute-from",
        type=values.input_file,
        help="stats JSON of a run with --preload: its prompt time per token without read waits",
    )
    p.add_argument(
        "--prefill-span",
        type=values.positive,
        help="prompt tokens per span (default: the trace's first span, else the whole prompt; `moestream run` "
        "prints the span its budget gives)",
    )


def wanted(args: argparse.Namespace) -> bool:
    return any(
        v is not None for v in (args.prompt_tokens, args.prefill_compute_ms_per_token, args.prefill_compute_from)
    )


def compute_ms_per_token(args: argparse.Namespace) -> float:
    """The prompt's all-cached compute per token from the options (checked before any other work)."""
    if args.prefill_compute_ms_per_token is not None:
        return args.prefill_compute_ms_per_token
    if args.prefill_compute_from:
        got = fc.read_stats(args.prefill_compute_from)
        if "prompt_ms_per_token" not in got:
            raise MoestreamError(f"{args.prefill_compute_from} has no prompt_tokens and prompt_s; {COMPUTE_HINT}")
        return got["prompt_ms_per_token"]
    raise MoestreamError(COMPUTE_HINT)


def prefill_case(
    args: argparse.Namespace,
    probe: ProbeResult,
    geom: fc.Geometry,
    meta: dict,
    rows: np.ndarray | None,
    ms_per_token: float,
    measured: dict[str, float],
    **kw,
) -> pf.PrefillForecast:
    """The prompt's forecast: from the trace's prompt replayed at the slot count, else uniform routing."""
    if rows is not None:
        spans, source = _replayed(args, meta, rows)
        tokens = args.prompt_tokens or sum(s.tokens for s in spans)
        span = args.prefill_span or spans[0].tokens
        if tokens != sum(s.tokens for s in spans) or span != spans[0].tokens:
            spans = pf.respan(spans, tokens, span, geom)
            source += f", reshaped to {tokens} tokens in spans of {span}"
        note = ""
    else:
        if args.prompt_tokens is None:
            raise MoestreamError("give the prompt's length with --prompt-tokens N, or a --trace of a run")
        tokens = args.prompt_tokens
        span = args.prefill_span or tokens
        slots = args.slots
        ahead = slots is not None and geom.n_experts > 0 and slots >= AHEAD_MIN_LAYERS * geom.n_experts
        run_len = run_length(int(geom.segment_bytes), geom.n_experts) if ahead else 1
        spans = pf.uniform_spans(tokens, span, geom, run_len, slots)
        source = "uniform routing" + (f", {slots} slots" if slots else ", a cache that streams")
        note = pf.UNIFORM_NOTE
    out = pf.prefill_forecast(probe, geom, spans, ms_per_token, source=source, note=note, **kw)
    if "prompt_s" in measured:
        out.measured_s, out.measured_tokens = measured["prompt_s"], measured["prompt_tokens"]
        out.measured_mb = measured.get("prompt_mb")
    return out


def _replayed(args: argparse.Namespace, meta: dict, rows: np.ndarray) -> tuple[list[pf.Span], str]:
    acc = rp.accesses_from_trace(meta, rows)
    slots = args.slots or int(meta.get("n_slots") or 0)
    if slots < 1:
        raise MoestreamError("the trace has no n_slots in its metadata; give --slots")
    groups: list[rp.GroupMisses] = []
    rp.replay(acc, args.policy, slots, group_misses=groups)
    run_len = int(meta.get("read_run_len") or 1)
    spans = pf.replay_spans(acc, groups, pf.trace_spans(rows), run_len)
    return spans, f"the trace's prompt replayed ({args.policy} @{slots})"
