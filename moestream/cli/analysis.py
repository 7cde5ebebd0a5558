"""`moestream probe | replay | stats | profile | forecast`: measure the disk and the workload first.

Each command prints a human table by default and JSON with --json; every user error is a MoestreamError.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from moestream.analysis import forecast as fc
from moestream.analysis import prefill_forecast as pf
from moestream.analysis import probe as pr
from moestream.analysis import replay as rp
from moestream.analysis.profile import build_profile, load_profile, write_profile
from moestream.analysis.trace import read_trace
from moestream.analysis.workload import format_report, workload_stats
from moestream.cli import forecast_prefill as fp
from moestream.cli import values
from moestream.engine.calibrate import measure_compute_ms, measure_pack_ms
from moestream.errors import MoestreamError


def _ints(text: str, what: str, most: int = values.INT_MAX) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise MoestreamError(f"{what} must be comma-separated whole numbers, got {text!r}") from None
    if not out or min(out) < 1 or max(out) > most:
        raise MoestreamError(f"{what} must be whole numbers from 1 to {most}, got {text!r}")
    return out


def _size(text: str, what: str) -> int:
    """A byte size like 4G, 576K, at most 1 TiB (a larger read is a typo)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B").rstrip("KMGT")
    try:
        ok = math.isfinite(float(t))
    except ValueError:
        ok = True  # parse_size words its own error
    if not ok:
        raise MoestreamError(f"{what} must be a size like 4G or 512M, got {text!r}")
    try:
        size = pr.parse_size(text)
    except MoestreamError as exc:
        raise MoestreamError(f"{what}: {exc}") from None
    if not 1 <= size <= 1 << 40:
        raise MoestreamError(f"{what} must be between 1 byte and 1T, got {text!r}")
    return size


def _rate(text: str) -> float:
    """'0.7', '70', '70%' -> 0.7."""
    t = text.strip().rstrip("%")
    try:
        v = float(t)
    except ValueError:
        raise MoestreamError(f"cannot read the hit rate {text!r}; write e.g. 0.7 or 70%") from None
    if text.strip().endswith("%") or v > 1:
        v /= 100
    if not 0 <= v <= 1:
        raise MoestreamError(f"the hit rate must be between 0% and 100%, got {text!r}")
    return v


def _load_trace(path: str):
    meta, rows = read_trace(path)
    if not len(rows):
        raise MoestreamError(f"{path} has no accesses; record a session that generates tokens")
    return meta, rows


def _print_json(obj: object) -> None:
    json.dump(obj, sys.stdout, indent=1)
    sys.stdout.write("\n")


# ---- probe ---------------------------------------------------------------------------------------


def cmd_probe(args: argparse.Namespace) -> int:
    if bool(args.file) == bool(args.dir):
        raise MoestreamError("give the model to probe with --file MODEL.gguf, or a directory with --dir DIR")
    modes = ("buffered", "direct")
    if args.buffered_only or args.direct_only:
        modes = ("buffered",) if args.buffered_only else ("direct",)
    kw = dict(
        inflight=tuple(_ints(args.inflight, "--inflight", most=1024)),
        modes=modes,
        reads_per_row=args.reads_per_row,
        seconds_per_row=args.seconds_per_row,
        progress=not args.json and sys.stderr.isatty(),
    )
    if args.sizes:
        kw["sizes"] = tuple(_size(x, "--sizes") for x in args.sizes.split(",") if x.strip())
        if not kw["sizes"]:
            raise MoestreamError(f"--sizes must list sizes like 576K,4M, got {args.sizes!r}")
    if args.file:
        result = pr.probe_file(args.file, **kw)
    else:
        result = pr.probe_dir(args.dir, _size(args.size, "--size"), **kw)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(result.to_dict(), f, indent=1)
    if args.json:
        _print_json(result.to_dict())
    else:
        print(pr.format_probe(result))
        if args.output:
            print(f"saved to {args.output} (moestream forecast --probe {args.output} ...)")
    return 0


# ---- replay --------------------------------------------------------------------------------------


def _replay_plot_path(args: argparse.Namespace) -> str:
    plot = args.plot or os.path.splitext(args.trace)[0] + ".replay.png"
    try:
        values.check_writable(plot)
    except values.Bad as exc:
        raise MoestreamError(f"cannot write the plot: {exc}; give --plot FILE or --no-plot") from None
    return plot


def cmd_replay(args: argparse.Namespace) -> int:
    if not args.no_plot:
        _replay_plot_path(args)  # before the work, not after it
    meta, rows = _load_trace(args.trace)
    acc = rp.accesses_from_trace(meta, rows, phases=args.phases)
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    for p in policies:
        if p not in rp.POLICIES:
            raise MoestreamError(f"unknown policy {p!r}; choose from {', '.join(rp.POLICIES)}")
    slots = rp.parse_slots(args.slots, meta) if args.slots else rp.default_slots(acc)
    admission = rp.Admission.parse(args.admission, meta)
    profile = None
    if args.profile:
        profile = load_profile(args.profile).ranked()
    results = rp.replay_many(
        acc,
        policies,
        slots,
        per_layer=args.per_layer,
        admission=admission,
        progress=not args.json and sys.stderr.isatty(),
        half_life=args.half_life,
        pin_fraction=args.pin_fraction,
        profile=profile,
    )
    live = rp.live_result(acc) if args.phases == "all" else None
    check = None
    if live is not None and live.slots:
        own = rp.replay(acc, "lru", live.slots, admission=rp.Admission.parse("engine", meta))
        check = {"slots": live.slots, "live_hits": live.hits, "replay_hits": own.hits, "exact": live.hits == own.hits}
    plot = None
    if not args.no_plot:
        plot = _replay_plot_path(args)
        rp.plot_replay(results, plot, title=os.path.basename(args.trace), live=live)
    if args.json:
        _print_json(
            {
                "trace": args.trace,
                "phases": args.phases,
                "admission": str(admission),
                "results": [r.to_dict() for r in results],
                "live": live.to_dict() if live else None,
                "live_check": check,
                "plot": plot,
            }
        )
        return 0
    print(
        f"{args.trace}: {acc.decode_tokens} decode tokens, {len(acc.keys)} accesses replayed "
        f"({'prompt and decode' if args.phases == 'all' else 'decode only'}), admission {admission}"
    )
    print(rp.replay_table(results + ([live] if live is not None and live.slots else [])))
    if check is not None:
        verdict = "exact" if check["exact"] else f"differs by {check['replay_hits'] - check['live_hits']:+d}"
        print(
            f"engine's own policy (lru, {check['slots']} slots): replay {check['replay_hits']} hits, live "
            f"{check['live_hits']}: {verdict}"
        )
    if plot:
        print(f"plot: {plot}")
    return 0


# ---- stats ---------------------------------------------------------------------------------------


def cmd_stats(args: argparse.Namespace) -> int:
    meta, rows = _load_trace(args.trace)
    top = _ints(args.top, "--top") if args.top else None
    report = workload_stats(meta, rows, ks=tuple(_ints(args.k, "--k")), window=args.window, top_n=top)
    if args.json:
        _print_json(report)
    else:
        print(format_report(report))
    return 0


# ---- profile -------------------------------------------------------------------------------------


def cmd_profile(args: argparse.Namespace) -> int:
    meta, rows = _load_trace(args.trace)
    prof = build_profile(meta, rows, phases=args.phases, source=os.path.basename(args.trace))
    write_profile(prof, args.output)
    n = len(prof.entries)
    shares = ", ".join(f"top {k}: {100 * prof.coverage(k):.1f}%" for k in (64, 256, 1024, 4096) if k < n)
    print(
        f"{args.output}: {n} (layer, expert) pairs from {prof.total} {args.phases} accesses"
        + (f"; {shares}" if shares else "")
    )
    return 0


# ---- forecast ------------------------------------------------------------------------------------


def _forecast_geometry(args: argparse.Namespace, meta: dict) -> fc.Geometry:
    if args.layers or args.top_k or args.expert_bytes:
        if not (args.layers and args.top_k and args.expert_bytes):
            raise MoestreamError("give all of --layers, --top-k and --expert-bytes, or none")
        return fc.Geometry(args.layers, args.top_k, args.expert_bytes, model=args.model or "")
    if args.model:
        return fc.geometry_from_gguf(args.model)
    if meta:
        return fc.geometry_from_meta(meta)
    raise MoestreamError("give the model's geometry: --model MODEL.gguf, a --trace, or --layers/--top-k/--expert-bytes")


def _forecast_probe(args: argparse.Namespace) -> pr.ProbeResult:
    if args.probe:
        return pr.load_probe(args.probe)
    if not args.model:
        raise MoestreamError("give a disk probe: --probe PROBE.json, from moestream probe ... -o PROBE.json")
    print("no --probe given: probing the model file briefly (save a full one with moestream probe -o)", file=sys.stderr)
    return pr.probe_file(args.model, sizes=None, reads_per_row=32, seconds_per_row=1.0, progress=sys.stderr.isatty())


def _decode_compute_ms(args: argparse.Namespace, geom: fc.Geometry, pack_ms: float) -> float:
    if args.compute_ms is not None:
        compute_ms = args.compute_ms
    elif args.compute_from:
        got = fc.read_stats(args.compute_from)
        if "compute_ms" not in got:
            raise MoestreamError(f"{args.compute_from} has no decode_s and decode_read_wait_s to use")
        compute_ms = fc.cached_compute_ms(got, geom, pack_ms)
    elif args.measure_compute:
        if not args.model:
            raise MoestreamError("--measure-compute needs --model")
        compute_ms = measure_compute_ms(args.model)
    else:
        raise MoestreamError(
            "give the compute time per token: --compute-ms MS, --compute-from STATS.json "
            "(a run's decode time minus its read waits) or --measure-compute"
        )
    if not (math.isfinite(compute_ms) and compute_ms >= 0):
        raise MoestreamError(f"the compute time per token must be a finite number >= 0, got {compute_ms}")
    return compute_ms


def cmd_forecast(args: argparse.Namespace) -> int:
    prefill_ms = fp.compute_ms_per_token(args) if fp.wanted(args) else None
    meta, rows = _load_trace(args.trace) if args.trace else ({}, None)
    geom = _forecast_geometry(args, meta)
    probe = _forecast_probe(args)
    measured = fc.read_stats(args.measured) if args.measured else {}
    direct = False if args.buffered else (True if args.direct else None)
    pack_ms = args.pack_ms
    if pack_ms is None:
        pack_ms = measure_pack_ms(args.model) if args.model else fc.DEFAULT_PACK_MS
    if not (math.isfinite(pack_ms) and pack_ms >= 0):
        raise MoestreamError(f"the pack time must be a finite number >= 0, got {pack_ms}")
    compute_ms = _decode_compute_ms(args, geom, pack_ms)
    kw = dict(io_threads=args.io_threads, direct=direct, pack_ms=pack_ms)
    cases: list[tuple[str, fc.Forecast]] = [
        ("no cache hits", fc.forecast(probe, geom, compute_ms, hit_rate=0.0, **kw)),
    ]
    if rows is not None:
        acc = rp.accesses_from_trace(meta, rows)
        slots = args.slots or int(meta.get("n_slots") or 0)
        if slots < 1:
            raise MoestreamError("the trace has no n_slots in its metadata; give --slots")
        r = rp.replay(acc, args.policy, slots)
        name = f"replay {args.policy} @{slots}"
        cases.append((name, fc.forecast(probe, geom, compute_ms, miss_hist=r.miss_hist, hit_source=name, **kw)))
    if args.hit_rate is not None:
        h = _rate(args.hit_rate)
        name = f"hit rate {100 * h:.1f}%"
        cases.append((name, fc.forecast(probe, geom, compute_ms, hit_rate=h, hit_source="given", **kw)))
    cases.append(("all cached", fc.forecast(probe, geom, compute_ms, hit_rate=1.0, **kw)))
    if len(cases) == 2 and prefill_ms is None:
        raise MoestreamError("give a --trace to replay or an assumed --hit-rate")
    if measured and len(cases) > 2:
        cases[-2][1].measured_tok_s = measured["decode_tps"]
    prefill = None
    if prefill_ms is not None:
        prefill = fp.prefill_case(args, probe, geom, meta, rows, prefill_ms, measured, **kw)
    if args.json:
        _print_json(
            {
                "geometry": vars(geom),
                "probe": probe.path,
                "cases": [{"case": n, **f.to_dict()} for n, f in cases],
                "prefill": prefill.to_dict() if prefill is not None else None,
            }
        )
    else:
        print(fc.format_forecast(geom, probe, cases))
        if prefill is not None:
            print(pf.format_prefill(prefill))
    return 0


# ---- wiring --------------------------------------------------------------------------------------


def add_arguments(command: str, p: argparse.ArgumentParser) -> None:
    adders = {
        "probe": _probe_args,
        "replay": _replay_args,
        "stats": _stats_args,
        "profile": _profile_args,
        "forecast": _forecast_args,
    }
    adders[command](p)


def add_analysis_commands(sub: argparse._SubParsersAction) -> None:
    """The analysis commands on a subparsers object, for programs that embed them."""
    for name in ("probe", "replay", "stats", "profile", "forecast"):
        add_arguments(name, sub.add_parser(name))


def _probe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--file",
        type=values.model_path,
        help="a GGUF model (reads its own expert segment size; a split model: any part, or its directory) or any "
        "large file",
    )
    p.add_argument("--dir", type=values.directory, help="write a temporary test file here, probe it and delete it")
    p.add_argument(
        "--size", default="4G", help="test file size with --dir (default 4G; twice the RAM is representative)"
    )
    p.add_argument("--inflight", default="1,2,4,8,16,32", help="reads in flight per row (default 1,2,4,8,16,32)")
    p.add_argument(
        "--reads-per-row",
        type=values.whole(1, 10**7),
        default=128,
        help="reads per row for the expert size, 4x that for 4 KiB (default 128)",
    )
    p.add_argument(
        "--seconds-per-row", type=values.real(0, 86400, above=True), default=2.0, help="time limit per row (default 2)"
    )
    p.add_argument(
        "--sizes",
        help="read sizes to probe, e.g. 576K,2M,4M (default: the model's expert segment and 4 KiB; a prompt's "
        "run reads take up to 4 MiB)",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--buffered-only", action="store_true", help="probe buffered reads only (not O_DIRECT)")
    g.add_argument("--direct-only", action="store_true", help="probe O_DIRECT reads only (not buffered)")
    p.add_argument(
        "-o", "--output", type=values.output_file, help="also save the result as JSON (for moestream forecast --probe)"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.set_defaults(func=cmd_probe)


def _replay_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", type=values.input_file, help="a trace written with --trace")
    p.add_argument(
        "--policy",
        default="lru,fifo,lfu-decay,s3fifo,pin,belady",
        help=f"comma-separated, from {', '.join(rp.POLICIES)} (belady is always added)",
    )
    p.add_argument(
        "--slots",
        help="sizes: 256,512,1024 or 256:4096 (powers of two) or engine (the trace's); "
        "default powers of two up to every expert",
    )
    p.add_argument("--per-layer", action="store_true", help="split the slots evenly per layer")
    p.add_argument(
        "--admission",
        default="engine",
        help="engine (as recorded), all, decode-only, min-hits:N, or decode-only+min-hits:N",
    )
    p.add_argument(
        "--phases",
        choices=("all", "decode"),
        default="all",
        help="replay the prompt's accesses too (default: they warm the cache) or decode only",
    )
    p.add_argument(
        "--profile", type=values.input_file, help="profile to pin from (default: the trace's own decode counts)"
    )
    p.add_argument(
        "--half-life", type=values.real(0, above=True), default=64.0, help="lfu-decay half-life in forward steps"
    )
    p.add_argument("--pin-fraction", type=values.real(0, 1), default=0.5, help="share of slots pinned by pin+lru")
    p.add_argument("--plot", type=values.output_file, help="PNG path (default: next to the trace, .replay.png)")
    p.add_argument("--no-plot", action="store_true", help="draw no plot")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.set_defaults(func=cmd_replay)


def _stats_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", type=values.input_file, help="a trace written with --trace")
    p.add_argument("--k", default="1,2,4,8,16,32", help="batch sizes for U(k) (default 1,2,4,8,16,32)")
    p.add_argument("--window", type=values.positive, default=48, help="window for singletons, in tokens (default 48)")
    p.add_argument("--top", help="N for the top-N coverage (default powers of two and the trace's slots)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the tables")
    p.set_defaults(func=cmd_stats)


def _profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", type=values.input_file, help="a trace written with --trace")
    p.add_argument(
        "-o", "--output", required=True, type=values.output_file, help="profile file (.json for JSON, else text)"
    )
    p.add_argument(
        "--phases", choices=("decode", "all"), default="decode", help="count decode accesses only (default) or all"
    )
    p.set_defaults(func=cmd_profile)


def _forecast_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--probe", type=values.input_file, help="JSON from moestream probe -o (default: a brief probe of --model)"
    )
    p.add_argument(
        "--model", type=values.model_path, help="GGUF model (or a split model's part): layers, top_k, expert bytes"
    )
    p.add_argument("--layers", type=values.positive, help="MoE layers (instead of --model)")
    p.add_argument("--top-k", type=values.positive, help="experts per token per layer")
    p.add_argument("--expert-bytes", type=values.whole(1, 1 << 40), help="bytes one expert reads from disk")
    p.add_argument(
        "--trace", type=values.input_file, help="replay this trace for the hit rate and its per-layer misses"
    )
    p.add_argument("--slots", type=values.positive, help="cache size to replay (default: the trace's)")
    p.add_argument("--policy", default="lru", choices=rp.POLICIES, help="policy to replay (default lru)")
    p.add_argument("--hit-rate", help="or an assumed hit rate, e.g. 70%%")
    c = p.add_mutually_exclusive_group()
    c.add_argument("--compute-ms", type=values.real(0), help="compute per token with every expert cached")
    c.add_argument(
        "--compute-from", type=values.input_file, help="stats JSON of a run: its decode time minus its read waits"
    )
    c.add_argument("--measure-compute", action="store_true", help="measure it: run --model fully cached")
    p.add_argument("--io-threads", type=values.io_threads, default=4, help="reader threads to forecast for (default 4)")
    p.add_argument(
        "--pack-ms",
        type=values.real(0),
        default=None,
        help="ms to pack one expert read from disk (default: measured on --model, else 0.5)",
    )
    m = p.add_mutually_exclusive_group()
    m.add_argument("--buffered", action="store_true", help="forecast buffered reads")
    m.add_argument("--direct", action="store_true", help="forecast O_DIRECT reads (default when probed)")
    p.add_argument(
        "--measured", help="measured decode tok/s, or a stats JSON (decode and prompt), to print beside the forecast"
    )
    fp.add_prefill_args(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.set_defaults(func=cmd_forecast)
