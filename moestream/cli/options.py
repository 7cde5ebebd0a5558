"""The command-line options every engine command shares, and the EngineOptions/Sampler built from them."""

from __future__ import annotations

import argparse
import sys

from moestream.cli import values
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler
from moestream.errors import MoestreamError
from moestream.streaming.budget import MB, total_ram


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-m",
        "--model",
        required=True,
        type=values.model_path,
        help="GGUF model file; for a split model (NAME-00001-of-0000N.gguf) any of its parts or their directory",
    )
    _add_memory_args(p)
    _add_read_args(p)
    _add_cache_policy_args(p)
    _add_ray_args(p)


def _add_ray_args(p: argparse.ArgumentParser) -> None:
    """The remote expert tier: routed experts held and computed in Ray actors' RAM (docs/ray.md)."""
    p.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="the Ray cluster (HOST:PORT of `ray start --head`, or `local` to start Ray here) whose actors hold "
        "routed experts in their RAM and compute them (with --expert-workers); the output stays bit-identical",
    )
    p.add_argument(
        "--expert-workers",
        type=values.whole(1, 256),
        default=None,
        metavar="N",
        help="Ray actors that hold the routed experts, spread over the cluster's machines (with --ray)",
    )
    p.add_argument(
        "--expert-worker-mb",
        type=values.megabytes,
        default=None,
        help="MiB of experts each worker holds (default: all experts, split between the workers); the experts "
        "no worker holds stream from this machine's disk",
    )


def _add_memory_args(p: argparse.ArgumentParser) -> None:
    """The budget, the context and what runs at once: threads, micro-batches, prompt spans, locking."""
    p.add_argument(
        "--ram-budget-mb",
        type=values.megabytes,
        default=None,
        help="RAM the whole process may use, in MiB (2**20 bytes, as every --*-mb option); experts are cached "
        "in what is left (default: what the machine has available, minus 1 GiB)",
    )
    p.add_argument("--ctx", type=values.positive, default=None, help="context length (default: min(model's, 4096))")
    p.add_argument(
        "--exact",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compute in float32 with a float32 KV cache, every weight widened to float32 (experts take 4-8x "
        "the memory of a quantized file's): logits within 1e-3 of the model's own float32 forward (default: on "
        "for F32/F16 files; a quantized file runs its weights at their own bits with int8 activations and a "
        "float16 KV cache, as llama.cpp does)",
    )
    p.add_argument("--threads", type=values.threads, default=None, help="compute threads (default: all cores)")
    p.add_argument("--io-threads", type=values.io_threads, default=4, help="parallel reads in flight (default 4)")
    p.add_argument(
        "--ubatch",
        type=values.whole(1, 4096),
        default=None,
        help="prompt tokens per micro-batch (default: the largest of 128/64/32/16 that fits the budget)",
    )
    p.add_argument(
        "--prefill-span",
        type=values.whole(1, 1 << 20),
        default=None,
        help="prompt tokens that run through every layer at once, each layer's experts read once for all of "
        "them (default: the longest span the budget holds, and for `run` no longer than its prompt; "
        "--prefill-span equal to --ubatch runs the prompt micro-batch by micro-batch)",
    )
    p.add_argument(
        "--mlock",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="lock the dense weights in RAM so memory pressure cannot evict them; routed experts are never "
        "locked (default: on where RLIMIT_MEMLOCK allows, else a line says which limit to raise)",
    )


def _add_read_args(p: argparse.ArgumentParser) -> None:
    """How experts are read from disk, and what is recorded or replayed of the routes."""
    p.add_argument("--buffered", action="store_true", help="read experts with buffered I/O instead of O_DIRECT")
    p.add_argument(
        "--trace",
        default=None,
        type=values.output_file,
        metavar="FILE",
        help="write one CSV row per expert access (see moestream/analysis/trace.py for the format)",
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
        "per GiB read); --no-run-reads reads one matrix at a time (default on)",
    )
    p.add_argument(
        "--lookahead",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode: each MoE layer guesses the next layer's experts with that layer's router and starts "
        "reading the uncached ones while it computes (the output is the same). Default: automatic where the "
        "expert cache cannot hold every expert, guessing while recent decode steps miss an expert a layer or "
        "more; off with --trace (its guessed reads are not in the trace, so a replay would not reproduce the "
        "run). --lookahead: always; --no-lookahead: never",
    )
    p.add_argument(
        "--route-trace",
        default=None,
        type=values.input_file,
        metavar="FILE",
        help="take the router's top-k choices from a recorded trace (benchmarks on synthetic models)",
    )


def _add_cache_policy_args(p: argparse.ArgumentParser) -> None:
    """What the expert cache keeps: pinned profiles, admission, elasticity."""
    p.add_argument(
        "--pin-profile",
        default=None,
        type=values.input_file,
        metavar="PROFILE",
        help="pin the hottest experts of a profile (moestream profile) in RAM at start",
    )
    p.add_argument("--pin-mb", type=values.megabytes, default=None, help="MiB of the cache for the pinned profile part")
    p.add_argument(
        "--prompt-admit",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="let prompt processing admit and refresh experts in the decode LRU (default on)",
    )
    p.add_argument(
        "--admit-min-hits",
        type=values.count,
        default=0,
        help="admit an expert to the LRU only after it was requested N times (default 0: always)",
    )
    p.add_argument(
        "--keep-free-mb",
        type=values.megabytes,
        default=None,
        help="elastic cache: give expert slots back when available RAM falls below this many MiB",
    )


def add_prompt_cache_arg(p: argparse.ArgumentParser) -> None:
    """serve and chat: keep earlier conversations' KV cache for a request that extends one."""
    p.add_argument(
        "--prompt-cache-mb",
        type=values.whole(0, values.MB_MAX),
        default=0,
        help="MiB of the budget that keep recent conversations' KV cache, so that a request extending one of "
        "several interleaved conversations prefills only its new tokens (default 0: only the last "
        "conversation's KV cache is kept; the MiB come out of the expert cache)",
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temp", type=values.temperature, default=0.0, help="temperature (0 = greedy, the default)")
    p.add_argument("--top-k", type=values.top_k, default=0, help="keep the K most likely tokens (0 = off)")
    p.add_argument("--top-p", type=values.top_p, default=1.0, help="keep the smallest set of this mass (1 = off)")
    p.add_argument("--seed", type=values.seed, default=None, help="random seed, 0 to 2**64-1 (default: random)")
    p.add_argument("--min-p", type=values.min_p, default=0.0, help="keep tokens this fraction as likely as the top one")
    p.add_argument(
        "--presence-penalty",
        type=values.penalty,
        default=0.0,
        help="subtract this from the logit of every token generated already (OpenAI's, -2..2; 0 = off)",
    )
    p.add_argument(
        "--frequency-penalty",
        type=values.penalty,
        default=0.0,
        help="subtract this times its count from the logit of every token generated already (OpenAI's; 0 = off)",
    )
    p.add_argument(
        "--repeat-penalty",
        type=values.repeat_penalty,
        default=1.0,
        help="divide the positive logits (multiply the negative ones) of tokens in the prompt or generated already "
        "by this (llama.cpp's; 1 = off)",
    )


def engine_options(args: argparse.Namespace) -> EngineOptions:
    """The engine's options from the command line (EngineOptions checks the values)."""
    return EngineOptions(
        ram_budget_mb=args.ram_budget_mb,
        ctx=args.ctx,
        exact=args.exact,
        threads=args.threads,
        io_threads=args.io_threads,
        ubatch=args.ubatch,
        prefill_span=args.prefill_span,
        mlock=args.mlock,
        direct=False if args.buffered else None,
        trace_path=args.trace,
        route_trace=args.route_trace,
        admit_prompt=args.prompt_admit,
        read_ahead=args.read_ahead,
        run_reads=args.run_reads,
        lookahead=args.lookahead,
        min_hits=args.admit_min_hits,
        pin_profile=args.pin_profile,
        pin_mb=args.pin_mb,
        keep_free_mb=args.keep_free_mb,
        prompt_cache_mb=getattr(args, "prompt_cache_mb", 0),  # run and the analyses keep none
        max_batch=getattr(args, "max_batch", 1),  # only serve decodes several sequences together
        progress=True,
        ray_address=args.ray,
        expert_workers=args.expert_workers,
        expert_worker_mb=args.expert_worker_mb,
    )


def open_engine(args: argparse.Namespace) -> Engine:
    check_budget(args)
    engine = Engine(args.model, engine_options(args))
    say_caps(args, engine)
    return engine


def check_budget(args: argparse.Namespace) -> None:
    """Before loading: a --ram-budget-mb beyond what this machine has is allowed (the kernel may find room by
    swapping) but is likely a typo or a unit slip, so a line says so."""
    if args.ram_budget_mb is None:
        return
    ram, kind = total_ram()
    if args.ram_budget_mb * MB > ram:
        print(
            f"warning: --ram-budget-mb {args.ram_budget_mb} is more than this machine's RAM ({ram // MB} MiB, "
            f"{kind}); the process may be swapped out or killed, give at most {ram // MB}",
            file=sys.stderr,
        )


def say_caps(args: argparse.Namespace, engine: Engine) -> None:
    """A value the engine lowered to what the model allows is said, not silently used."""
    if args.ctx is not None and engine.ctx < args.ctx:
        print(f"note: --ctx {args.ctx} is more than the model's context; capped at {engine.ctx}", file=sys.stderr)


def sampler(args: argparse.Namespace) -> Sampler:
    try:
        return Sampler(
            temperature=args.temp,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            min_p=args.min_p,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            repetition_penalty=args.repeat_penalty,
        )
    except ValueError as exc:
        raise MoestreamError(f"{exc} (--temp, --top-k, --top-p, --min-p, the penalties)") from None
