"""`moestream` command line. Every user error ends as one line on stderr and a non-zero exit."""

from __future__ import annotations

import argparse
import os
import sys

from moestream.errors import MoestreamError

EXIT_USER_ERROR = 2


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", required=True, help="GGUF model file")
    p.add_argument(
        "--ram-budget-mb",
        type=int,
        default=None,
        help="RAM the whole process may use; experts are cached in what is left (default: what the "
        "machine has available, minus 1 GB)",
    )
    p.add_argument("--ctx", type=int, default=None, help="context length (default: min(model's, 4096))")
    p.add_argument("--threads", type=int, default=None, help="compute threads (default: all cores)")
    p.add_argument("--io-threads", type=int, default=4, help="parallel reads in flight (default 4)")
    p.add_argument(
        "--ubatch",
        type=int,
        default=None,
        help="prompt tokens per micro-batch (default: the largest of 128/64/32/16 that fits the budget)",
    )
    p.add_argument(
        "--mlock",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="lock the dense weights in RAM so memory pressure cannot evict them; routed experts are never "
        "locked (default: on where RLIMIT_MEMLOCK allows, else a line says which limit to raise)",
    )
    p.add_argument("--buffered", action="store_true", help="read experts with buffered I/O instead of O_DIRECT")
    p.add_argument(
        "--trace",
        default=None,
        metavar="FILE",
        help="write one CSV row per expert access (see moestream/trace.py for the format)",
    )
    p.add_argument(
        "--pin-profile",
        default=None,
        metavar="PROFILE",
        help="pin the hottest experts of a profile (moestream profile) in RAM at start",
    )
    p.add_argument("--pin-mb", type=int, default=None, help="MB of the cache for the pinned profile part")
    p.add_argument(
        "--prompt-admit",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="let prompt processing admit and refresh experts in the decode LRU (default on)",
    )
    p.add_argument(
        "--read-ahead",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="prompt micro-batches that need nearly every expert read the next layer's experts ahead (default on)",
    )
    p.add_argument(
        "--run-reads",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with the read-ahead, a prompt reads adjacent experts' matrices in one read of up to 4 MiB (less CPU "
        "per GB; on this VM's disk prefill 1.13x); --no-run-reads reads one matrix at a time (default on)",
    )
    p.add_argument(
        "--admit-min-hits",
        type=int,
        default=0,
        help="admit an expert to the LRU only after it was requested N times (default 0: always)",
    )
    p.add_argument(
        "--keep-free-mb",
        type=int,
        default=None,
        help="elastic cache: give expert slots back when available RAM falls below this",
    )
    p.add_argument(
        "--route-trace",
        default=None,
        metavar="FILE",
        help="take the router's top-k choices from a recorded trace (benchmarks on synthetic models)",
    )


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temp", type=float, default=0.0, help="temperature (0 = greedy, the default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def _positive(name: str, value: int | None) -> None:
    if value is not None and value <= 0:
        raise MoestreamError(f"{name} must be a positive number, got {value}")


def open_engine(args: argparse.Namespace):
    from moestream.engine.engine import Engine
    from moestream.engine.options import EngineOptions

    _positive("--ram-budget-mb", args.ram_budget_mb)
    _positive("--ctx", args.ctx)
    _positive("--threads", args.threads)
    _positive("--io-threads", args.io_threads)
    _positive("--ubatch", args.ubatch)
    _positive("--pin-mb", args.pin_mb)
    _positive("--keep-free-mb", args.keep_free_mb)
    if args.admit_min_hits < 0:
        raise MoestreamError(f"--admit-min-hits must be 0 or more, got {args.admit_min_hits}")
    return Engine(
        args.model,
        EngineOptions(
        ram_budget_mb=args.ram_budget_mb,
        ctx=args.ctx,
        threads=args.threads,
        io_threads=args.io_threads,
        ubatch=args.ubatch,
        mlock=args.mlock,
        direct=False if args.buffered else None,
        trace_path=args.trace,
        route_trace=args.route_trace,
        admit_prompt=args.prompt_admit,
        read_ahead=args.read_ahead,
        run_reads=args.run_reads,
        min_hits=args.admit_min_hits,
        pin_profile=args.pin_profile,
        pin_mb=args.pin_mb,
        keep_free_mb=args.keep_free_mb,
        progress=True,
        ),
    )


def cmd_run(args: argparse.Namespace) -> int:
    from moestream.engine.sampling import Sampler

    _positive("-n", args.n)
    engine = open_engine(args)
    print(engine.lock_report.line(), file=sys.stderr)
    try:
        tok = engine.tokenizer
        prompt = args.prompt
        if args.chat:
            from moestream.formats.chat_template import render_chat

            if not tok.chat_template:
                raise MoestreamError("this model has no chat template; drop --chat")
            prompt = render_chat(tok.chat_template, [{"role": "user", "content": prompt}])
        ids = tok.encode(prompt)
        if args.preload:
            n = engine.preload()
            engine.reader.busy_s, engine.reader.bytes_read = 0.0, 0  # the stats are about the generation
            print(f"preloaded {n} experts", file=sys.stderr)
        sampler = Sampler(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        decoder = tok.stream(skip_special=True)
        out = sys.stdout

        def on_token(t: int) -> None:
            if t in tok.stop_ids:
                return
            text = decoder.add(t)
            if text:
                out.write(text)
                out.flush()

        stop_ids = set() if args.ignore_eos else tok.stop_ids
        gen = engine.generate(ids, args.n, sampler, stop_ids=stop_ids, on_token=on_token)
        out.write(decoder.flush() + "\n")
        if engine.plan is not None:
            print(engine.plan.describe(), file=sys.stderr)
        print(gen.stats.line(), file=sys.stderr)
        if engine.cache.pinned_slots:
            st = engine.cache.stats
            print(f"pinned profile part: {engine.cache.pinned_slots} experts, {st.pinned_hits} hits", file=sys.stderr)
        if engine.elastic is not None:
            print(engine.elastic.summary(), file=sys.stderr)
        if args.stats_json:
            write_stats_json(args.stats_json, engine, gen)
    finally:
        engine.close()
    return 0


def write_stats_json(path: str, engine, gen) -> None:
    """Machine-readable stats of one generation (what bench/ scripts collect)."""
    import dataclasses
    import json

    st = gen.stats
    doc = dataclasses.asdict(st)
    doc.update(
        prompt_tps=st.prompt_tps,
        decode_tps=st.decode_tps,
        hit_rate=st.hit_rate,
        decode_mb_per_token=st.decode_bytes_read / 2**20 / max(1, st.decode_tokens),
        io_direct=engine.reader.direct,
        io_threads=engine.reader.threads,
        read_busy_s=engine.reader.busy_s,
        read_busy_mb_s=engine.reader.busy_bandwidth / 1e6,
        read_run_len=engine.reader.run_len,  # experts a prompt's run read takes at most (1: no run reads)
        read_buffer_wait_s=engine.reader.buffer_wait_s,  # reads waiting for a free buffer, summed
        # the prompt read-ahead over the engine's life (experts started, and those the next layer never used)
        read_ahead=engine.cache.read_ahead,
        ahead_reads=engine.cache.stats.ahead_reads,
        ahead_unused=engine.cache.stats.ahead_unused,
        model=engine.gguf.path,
        ctx=engine.ctx,
        plan=dataclasses.asdict(engine.plan) if engine.plan is not None else None,
    )
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def cmd_synth(args: argparse.Namespace) -> int:
    import shutil

    from moestream.analysis.synth import SHAPES, synth_nbytes, write_synth

    if args.shape not in SHAPES:
        raise MoestreamError(f"unknown shape {args.shape!r}; choose one of: {', '.join(SHAPES)}")
    if args.layers is not None:
        _positive("--layers", args.layers)
    try:
        need = synth_nbytes(args.shape, args.quant, args.layers)
    except (KeyError, ValueError) as exc:
        raise MoestreamError(f"cannot make {args.shape} in {args.quant}: {exc}") from None
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        raise MoestreamError(f"output directory {out_dir} does not exist")
    free = shutil.disk_usage(out_dir).free
    if need > free:
        raise MoestreamError(
            f"{args.shape} in {args.quant} needs {need / 1e9:.1f} GB but {out_dir} has "
            f"{free / 1e9:.1f} GB free; use --layers to make a shallower model"
        )
    write_synth(args.shape, args.quant, args.output, layers=args.layers, seed=args.seed, progress=True)
    print(f"wrote {args.output} ({os.path.getsize(args.output) / 1e9:.2f} GB)", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moestream", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="generate text from a prompt")
    _add_engine_args(p)
    _add_sampling_args(p)
    p.add_argument("-p", "--prompt", required=True)
    p.add_argument("-n", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--stats-json", default=None, help="also write the stats as JSON to this file")
    p.add_argument("--ignore-eos", action="store_true", help="generate all -n tokens (benchmarks)")
    p.add_argument(
        "--preload",
        action="store_true",
        help="fill the expert cache before the prompt (benchmarks: compute without disk reads)",
    )
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("synth", help="write a synthetic model with random weights at a real shape")
    p.add_argument("--shape", required=True, help="tiny, qwen3-30b-a3b, qwen3.6-35b-a3b-moe, ...")
    p.add_argument(
        "--quant",
        default="Q4_0",
        help="expert weight type: Q4_0, Q4_K, Q4_K_M (Q4_K with llama.cpp's Q6_K exceptions), Q6_K, Q8_0, F16 "
        "(default Q4_0)",
    )
    p.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(func=cmd_synth)

    from moestream.cli.demo import add_demo_command

    add_demo_command(sub)

    from moestream.serving.server import add_serve_commands

    add_serve_commands(sub)  # serve, chat

    from moestream.cli.analysis import add_analysis_commands

    add_analysis_commands(sub)  # probe, replay, stats, profile, forecast
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except MoestreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except MemoryError:
        print("error: out of memory; lower --ram-budget-mb or --ctx", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
