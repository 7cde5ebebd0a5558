"""`moestream run | synth | demo`: generate from a prompt, write a synthetic model, the one-command demo.

The demo needs no model hub: the first run writes a Qwen3-30B-A3B-shaped model (random weights, fewer
layers so it takes seconds) under the cache directory and reuses it afterwards. The run then gets a RAM
budget that holds the dense weights but only part of the experts, so the rest stream from disk while it
decodes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time

from tqdm import tqdm

from moestream.cli import values
from moestream.cli.options import add_engine_args, add_sampling_args, check_budget, engine_options, sampler, say_caps
from moestream.engine.engine import Engine
from moestream.engine.model_file import open_model
from moestream.engine.options import EngineOptions
from moestream.engine.planning import budget_for_slots
from moestream.engine.sampling import Sampler
from moestream.engine.stats import GenerationStats
from moestream.errors import MoestreamError
from moestream.formats.chat_template import render_chat
from moestream.formats.tokenizer import Tokenizer
from moestream.paths import cache_dir
from moestream.serving.text import TextStream, stream_text
from moestream.streaming.budget import MB
from moestream.synth.shapes import SHAPES, SynthShape, llama_cpp_loads, synth_nbytes, write_synth, write_synth_parts
from moestream.units import fmt_bytes, gib, mib

DEFAULT_SHAPE = "qwen3-30b-a3b"
DEFAULT_LAYERS = 8
# Of the experts' bytes, the share the demo's cache may hold: small enough that decoding has to read the disk.
CACHE_SHARE = 0.33

DEMO_PROMPT = "Explain how a computer streams data from a disk into memory."

# ---- run -----------------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    pick = sampler(args)
    text = prompt_text(args)
    check_budget(args)
    tok, ids = prompt_ids(args, text)
    # the plan sets aside prompt buffers for this prompt only (the rest: expert slots, the read-ahead's buffers)
    engine = Engine(args.model, dataclasses.replace(engine_options(args), longest_prompt=len(ids) or None), tok)
    say_caps(args, engine)
    print(engine.lock_report.line(), file=sys.stderr)
    try:
        if args.preload:
            print(f"preloaded {engine.preload()} experts", file=sys.stderr)
        stop_ids = set() if args.ignore_eos else tok.stop_ids
        stats = GenerationStats()
        for step in stream_text(engine.stream(ids, args.n, pick, stop_ids), TextStream(engine.tokenizer)):
            sys.stdout.write(step.text)
            sys.stdout.flush()
            stats = step.stats
        sys.stdout.write("\n")
        if engine.plan is not None:
            print(engine.plan.describe(), file=sys.stderr)
        print(stats.line(), file=sys.stderr)
        snap = engine.snapshot()
        if snap.pinned_slots:
            print(f"pinned profile part: {snap.pinned_slots} experts, {snap.pinned_hits} hits", file=sys.stderr)
        if engine.elastic is not None:
            print(engine.elastic.summary(), file=sys.stderr)
        if args.stats_json:
            write_stats_json(args.stats_json, engine, stats)
    finally:
        engine.close()
    return 0


def prompt_text(args: argparse.Namespace) -> str:
    """The prompt from -p TEXT, -p - (standard input) or -f FILE, checked before anything is loaded."""
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            why = getattr(exc, "strerror", None) or "not UTF-8 text"
            raise MoestreamError(f"cannot read --prompt-file {args.prompt_file}: {why}") from None
    elif args.prompt == "-":
        text = sys.stdin.read()
    else:
        text = args.prompt
    if not text.strip():
        raise MoestreamError("the prompt is empty; give text with -p TEXT, -p - (standard input) or -f FILE")
    return text


def prompt_ids(args: argparse.Namespace, prompt: str) -> tuple[Tokenizer, list[int]]:
    """The file's tokenizer, read from the model's header before the engine loads it, and the prompt (in the
    file's chat template with --chat) in its tokens."""
    model = open_model(args.model, check_types=False)
    try:
        tok = Tokenizer.from_metadata(model.gguf.metadata)
    finally:
        model.close()
    if args.chat:
        if not tok.chat_template:
            raise MoestreamError("this model has no chat template; drop --chat")
        prompt = render_chat(tok.chat_template, [{"role": "user", "content": prompt}])
    return tok, tok.encode(prompt)


def write_stats_json(path: str, engine: Engine, st: GenerationStats) -> None:
    """Machine-readable stats of one generation (what bench/ scripts collect)."""
    snap = engine.snapshot()
    doc = dataclasses.asdict(st)
    doc.update(
        prompt_tps=st.prompt_tps,
        decode_tps=st.decode_tps,
        hit_rate=st.hit_rate,
        decode_mb_per_token=st.decode_bytes_read / 2**20 / max(1, st.decode_tokens),
        io_direct=snap.io_direct,
        io_threads=snap.io_threads,
        read_busy_s=snap.read_busy_s,
        read_busy_mb_s=snap.read_busy_mb_s,
        read_run_len=snap.read_run_len,
        read_buffer_wait_s=snap.read_buffer_wait_s,
        # the prompt read-ahead over the engine's life (experts started, and those the next layer never used)
        read_ahead=snap.read_ahead,
        ahead_reads=snap.ahead_reads,
        ahead_unused=snap.ahead_unused,
        model=snap.model_path,
        ctx=snap.ctx,
        plan=dataclasses.asdict(engine.plan) if engine.plan is not None else None,
    )
    try:
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
    except OSError as exc:
        raise MoestreamError(f"cannot write --stats-json {path}: {exc.strerror or exc}") from None


# ---- synth ---------------------------------------------------------------------------------------


def cmd_synth(args: argparse.Namespace) -> int:
    if args.shape not in SHAPES:
        raise MoestreamError(f"unknown shape {args.shape!r}; choose one of: {', '.join(SHAPES)}")
    try:
        need = synth_nbytes(args.shape, args.quant, args.layers)
    except (KeyError, ValueError) as exc:
        raise MoestreamError(f"cannot make {args.shape} in {args.quant}: {exc}") from None
    n_experts = SHAPES[args.shape].n_experts
    if args.top_k is not None and args.top_k > n_experts:
        raise MoestreamError(f"--top-k must be at most the {n_experts} experts of {args.shape}, got {args.top_k}")
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        raise MoestreamError(f"output directory {out_dir} does not exist")
    free = shutil.disk_usage(out_dir).free
    if need > free:
        raise MoestreamError(
            f"{args.shape} in {args.quant} needs {gib(need, 1)} but {out_dir} has "
            f"{gib(free, 1)} free; use --layers to make a shallower model"
        )
    paths = write_synth_parts(
        args.shape,
        args.quant,
        args.output,
        layers=args.layers,
        seed=args.seed,
        split_max_size=args.split_max_size or 0,
        top_k=args.top_k,
    )
    written = sum(os.path.getsize(p) for p in paths)
    what = paths[0] if len(paths) == 1 else f"{len(paths)} parts {paths[0]} ... {os.path.basename(paths[-1])}"
    print(f"wrote {what} ({gib(written)})", file=sys.stderr)
    shape = SHAPES[args.shape]
    if not isinstance(shape, SynthShape) and not llama_cpp_loads(
        dataclasses.replace(shape, n_layers=args.layers or shape.n_layers)
    ):
        print("note: llama.cpp loads a deepseek2 file without q LoRA only at 26 or 27 blocks", file=sys.stderr)
    return 0


# ---- demo ----------------------------------------------------------------------------------------


def demo_model(shape: str, quant: str, layers: int | None, directory: str) -> str:
    """Path of the demo model, written first if it is not there yet (fewer layers if the disk is short)."""
    if shape not in SHAPES:
        raise MoestreamError(f"unknown shape {shape!r}; choose one of: {', '.join(SHAPES)}")
    os.makedirs(directory, exist_ok=True)
    full = SHAPES[shape].n_layers
    want = min(layers or full, full)
    free = shutil.disk_usage(directory).free
    for n in range(want, 0, -1):
        path = os.path.join(directory, f"{shape}-{quant}-L{n}.gguf")
        if os.path.exists(path):
            return path
        need = synth_nbytes(shape, quant, n)
        if need + 512 * MB < free:
            if n < want:
                print(f"only {gib(free, 1)} free in {directory}: using {n} layers instead of {want}", file=sys.stderr)
            print(
                f"writing a synthetic {shape} model ({n} layers, {quant}, {gib(need)}) to {path} "
                "(once; later runs reuse it)",
                file=sys.stderr,
            )
            write_synth(shape, quant, path, layers=n, progress=True)
            return path
    raise MoestreamError(
        f"not enough free disk in {directory} ({gib(free)}) for even a 1-layer {shape}; "
        "free some space or set MOESTREAM_HOME to a bigger disk"
    )


def demo_budget_mb(path: str) -> int:
    """Dense weights and buffers, plus a share of the experts: the model does not fit, by design."""
    m = open_model(path)
    cfg = m.cfg
    m.close()
    return budget_for_slots(path, int(CACHE_SHARE * cfg.n_layers * cfg.n_experts))


def cmd_demo(args: argparse.Namespace) -> int:
    if not args.prompt.strip():
        raise MoestreamError("the prompt is empty; give text with --prompt, or leave it out for the default")
    path = demo_model(args.shape, args.quant, args.layers, args.data_dir or str(cache_dir() / "models"))
    file_bytes = os.path.getsize(path)
    check_budget(args)
    budget_mb = args.ram_budget_mb if args.ram_budget_mb is not None else demo_budget_mb(path)
    engine = Engine(path, EngineOptions(ram_budget_mb=budget_mb, threads=args.threads))
    try:
        cfg = engine.cfg
        print(
            f"model {os.path.basename(path)}: {fmt_bytes(file_bytes)} on disk, {cfg.n_layers} layers x "
            f"{cfg.n_experts} experts (top-{cfg.top_k})",
            file=sys.stderr,
        )
        assert engine.plan is not None
        print(engine.plan.describe(), file=sys.stderr)
        t_start = time.perf_counter()
        text, st = demo_generate(engine, args.prompt, args.tokens)
        elapsed = time.perf_counter() - t_start
        print(st.line(), file=sys.stderr)
        print("\ngenerated text (random weights, so it is not meaningful text):", file=sys.stderr, flush=True)
        print(text, flush=True)
        print(demo_summary(engine, file_bytes, budget_mb, st, elapsed), file=sys.stderr)
        if st.peak_rss > budget_mb * MB:
            raise MoestreamError(f"peak RSS {mib(st.peak_rss)} went over the {budget_mb} MiB budget (a bug)")
    finally:
        engine.close()
    return 0


def demo_generate(engine: Engine, prompt: str, tokens: int) -> tuple[str, GenerationStats]:
    """Generate with a progress bar that says "prompt" until the first token, then "decoding" from there, its
    clock restarted so that its tok/s is the decode rate the stats line gives (the prompt's time left out)."""
    ids = engine.tokenizer.encode(prompt)
    bar = tqdm(total=tokens, unit="tok", desc=f"prompt ({len(ids)} tok)", file=sys.stderr, dynamic_ncols=True,
               smoothing=0)  # fmt: skip
    pieces: list[str] = []
    st = GenerationStats()
    sampling = Sampler(temperature=0.8, top_p=0.95, seed=0)
    for step in stream_text(engine.stream(ids, tokens, sampling), TextStream(engine.tokenizer)):
        if not pieces:
            bar.set_description("decoding")
            bar.reset(total=tokens)
            bar.start_t -= step.stats.decode_s  # the stats' decode clock started at the prompt's end, not here
        pieces.append(step.text)
        snap = engine.snapshot()
        bar.update(1)
        slots = f"{snap.used_slots}/{snap.n_slots}"
        bar.set_postfix(hit=f"{100 * snap.hit_rate:.0f}%", read=fmt_bytes(snap.bytes_read), slots=slots)
        st = step.stats
    bar.close()
    return "".join(pieces), st


def demo_summary(engine: Engine, file_bytes: int, budget_mb: int, st: GenerationStats, elapsed: float) -> str:
    """The closing paragraph: what streamed, in the run's own numbers."""
    n_slots, n_total = engine.snapshot().n_slots, engine.cfg.n_layers * engine.cfg.n_experts
    return (
        f"\nWhat happened: the model is {fmt_bytes(file_bytes)} but this run was allowed {budget_mb} MiB of RAM. "
        f"The dense weights (attention, router, embeddings) stayed resident; the cache held {n_slots} "
        f"of {n_total} experts ({100 * n_slots / n_total:.0f}%), and every other expert the router picked was "
        f"read from disk on demand: {fmt_bytes(st.bytes_read)} in {elapsed:.1f} s, "
        f"{fmt_bytes(st.decode_bytes_read // max(1, st.decode_tokens))} per decoded token, "
        f"{100 * st.hit_rate:.0f}% of expert requests served from RAM. Peak RSS {mib(st.peak_rss)} "
        "stayed under the budget. The weights are random, so the text above is not meant to read well; "
        "run a real GGUF with `moestream run -m MODEL.gguf -p ...`."
    )


# ---- wiring --------------------------------------------------------------------------------------


def add_arguments(command: str, p: argparse.ArgumentParser) -> None:
    {"run": _run_args, "synth": _synth_args, "demo": _demo_args}[command](p)


def _run_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    add_sampling_args(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("-p", "--prompt", type=values.text, help="the prompt; - reads it from standard input")
    source.add_argument(
        "-f", "--prompt-file", type=values.input_file, metavar="FILE", help="read the prompt from this UTF-8 file"
    )
    p.add_argument("-n", type=values.positive, default=64, help="tokens to generate (default 64)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument(
        "--stats-json", default=None, type=values.output_file, help="also write the stats as JSON to this file"
    )
    p.add_argument("--ignore-eos", action="store_true", help="generate all -n tokens (benchmarks)")
    p.add_argument(
        "--preload",
        action="store_true",
        help="fill the expert cache before the prompt (benchmarks: compute without disk reads)",
    )
    p.set_defaults(func=cmd_run)


def _synth_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", required=True, help=f"one of: {', '.join(SHAPES)}")
    p.add_argument(
        "--quant",
        default="Q4_0",
        help="expert weight type: Q4_0, Q4_K, Q4_K_M (llama-quantize's per-tensor mix), Q6_K, Q8_0, F16, BF16, F32, "
        "MXFP4 (gpt-oss/mixtral/olmoe/qwen2 shapes: MXFP4 experts, Q8_0 elsewhere); gpt-oss shapes keep MXFP4 "
        "experts in every quantized mix (default Q4_0)",
    )
    p.add_argument(
        "--layers",
        type=values.positive,
        default=None,
        help="keep only the first N blocks (deepseek2/glm4moe: the leading dense ones count)",
    )
    p.add_argument("--seed", type=values.seed, default=0, help="seed of the random weights (default 0)")
    p.add_argument(
        "--top-k",
        type=values.positive,
        default=None,
        help="experts each token routes to (expert_used_count; default the shape's), e.g. to run route files "
        "recorded at another top-k",
    )
    p.add_argument("-o", "--output", required=True, type=values.output_file, help="the GGUF file to write")
    p.add_argument(
        "--split-max-size",
        type=values.byte_size,
        default=None,
        help="write a split model, as llama.cpp's gguf-split does: parts NAME-00001-of-0000N.gguf (after "
        "-o NAME.gguf) of at most this many tensor bytes each, e.g. 2G, 500M, 100K (x1000)",
    )
    p.set_defaults(func=cmd_synth)


def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default=DEFAULT_SHAPE, help=f"synthetic model shape (default {DEFAULT_SHAPE})")
    p.add_argument(
        "--layers", type=values.positive, default=DEFAULT_LAYERS, help=f"layers to keep (default {DEFAULT_LAYERS})"
    )
    p.add_argument("--quant", default="Q4_0", help="expert weight type (default Q4_0)")
    p.add_argument("--tokens", type=values.positive, default=48, help="tokens to generate (default 48)")
    p.add_argument(
        "--ram-budget-mb",
        type=values.megabytes,
        default=None,
        help="RAM budget in MiB (default: dense weights plus a third of the experts)",
    )
    p.add_argument("--threads", type=values.threads, default=None, help="compute threads (default: all cores)")
    p.add_argument(
        "--prompt", type=values.text, default=DEMO_PROMPT, help="the prompt to continue (default: a sentence on disks)"
    )
    p.add_argument(
        "--data-dir",
        default=None,
        type=values.text,
        help="where the demo model is kept (default: models/ in $MOESTREAM_HOME, else in ~/.cache/moestream)",
    )
    p.set_defaults(func=cmd_demo)
