"""`moestream demo`: the main job in one command, on a synthetic model bigger than the budget it runs in.

No model hub is needed: the first run writes a Qwen3-30B-A3B-shaped model (random weights, fewer layers so
it takes seconds) under the data dir and reuses it afterwards. The run then gets a RAM budget that holds
the dense weights but only part of the experts, so the rest stream from disk while it decodes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

from moestream.errors import MoestreamError
from moestream.streaming.budget import MB

DEFAULT_SHAPE = "qwen3-30b-a3b"
DEFAULT_LAYERS = 8
# Of the experts' bytes, the share the cache may hold: small enough that decoding has to read the disk.
CACHE_SHARE = 0.33


def data_dir() -> str:
    base = os.environ.get("MOESTREAM_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "moestream"
    )
    return os.path.join(base, "models")


def ensure_model(shape: str, quant: str, layers: int | None, directory: str) -> str:
    """Path of the demo model, written first if it is not there yet (fewer layers if the disk is short)."""
    from moestream.analysis.synth import SHAPES, synth_nbytes, write_synth

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
                print(
                    f"only {free / 1e9:.1f} GB free in {directory}: using {n} layers instead of {want}", file=sys.stderr
                )
            print(
                f"writing a synthetic {shape} model ({n} layers, {quant}, {need / 1e9:.2f} GB) to {path} "
                "(once; later runs reuse it)",
                file=sys.stderr,
            )
            write_synth(shape, quant, path, layers=n, progress=True)
            return path
    raise MoestreamError(
        f"not enough free disk in {directory} ({free / 1e9:.2f} GB) for even a 1-layer {shape}; "
        "free some space or set MOESTREAM_HOME to a bigger disk"
    )


def cmd_demo(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from moestream.engine.engine import Engine, budget_for_slots
    from moestream.engine.options import EngineOptions
    from moestream.engine.sampling import Sampler

    path = ensure_model(args.shape, args.quant, args.layers, args.data_dir or data_dir())
    file_bytes = os.path.getsize(path)
    budget_mb = args.ram_budget_mb
    if budget_mb is None:
        # Dense weights and buffers, plus a third of the experts: the model does not fit, by design.
        from moestream.formats.gguf_file import GGUFFile
        from moestream.models import ARCHITECTURES

        f = GGUFFile(path)
        cfg = ARCHITECTURES[f.arch].config_from_gguf(f)
        f.close()
        budget_mb = budget_for_slots(path, int(CACHE_SHARE * cfg.n_layers * cfg.n_experts))
    engine = Engine(path, EngineOptions(ram_budget_mb=budget_mb, threads=args.threads))
    try:
        tok = engine.tokenizer
        prompt = tok.encode(args.prompt)
        n_total = engine.cfg.n_layers * engine.cfg.n_experts
        print(
            f"model {os.path.basename(path)}: {file_bytes / 1e9:.2f} GB on disk, {engine.cfg.n_layers} layers x "
            f"{engine.cfg.n_experts} experts (top-{engine.cfg.top_k})",
            file=sys.stderr,
        )
        assert engine.plan is not None
        print(engine.plan.describe(), file=sys.stderr)
        bar = tqdm(total=args.tokens, unit="tok", desc="decoding", file=sys.stderr, dynamic_ncols=True)
        cs = engine.cache.stats
        t_start = time.perf_counter()

        def on_token(_t: int) -> None:
            bar.update(1)
            bar.set_postfix(
                hit=f"{100 * cs.hit_rate:.0f}%",
                read=f"{cs.bytes_read / 1e9:.2f}GB",
                slots=f"{engine.cache.used_slots}/{engine.cache.n_slots}",
            )

        gen = engine.generate(prompt, args.tokens, Sampler(temperature=0.8, top_p=0.95, seed=0), on_token=on_token)
        bar.close()
        st = gen.stats
        elapsed = time.perf_counter() - t_start
        print(st.line(), file=sys.stderr)
        held = engine.cache.n_slots / n_total
        print(
            f"\nWhat happened: the model is {file_bytes / 1e9:.2f} GB but this run was allowed {budget_mb} MB of RAM. "
            f"The dense weights (attention, router, embeddings) stayed resident; the cache held {engine.cache.n_slots} "
            f"of {n_total} experts ({100 * held:.0f}%), and every other expert the router picked was read from "
            f"disk on demand: {st.bytes_read / 1e9:.2f} GB in {elapsed:.1f} s, "
            f"{st.decode_bytes_read / 1e6 / max(1, st.decode_tokens):.0f} MB per decoded token, "
            f"{100 * st.hit_rate:.0f}% of expert requests served from RAM. Peak RSS {st.peak_rss / MB:.0f} MB "
            f"stayed under the budget. The weights are random, so the text is not meant to read well; "
            "run a real GGUF with `moestream run -m MODEL.gguf -p ...`.",
            file=sys.stderr,
        )
        if st.peak_rss > budget_mb * MB:
            raise MoestreamError(f"peak RSS {st.peak_rss / MB:.0f} MB went over the {budget_mb} MB budget (a bug)")
    finally:
        engine.close()
    return 0


def add_demo_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the main job on a built-in synthetic model bigger than its RAM budget")
    p.add_argument("--shape", default=DEFAULT_SHAPE, help=f"synthetic model shape (default {DEFAULT_SHAPE})")
    p.add_argument("--layers", type=int, default=DEFAULT_LAYERS, help=f"layers to keep (default {DEFAULT_LAYERS})")
    p.add_argument("--quant", default="Q4_0", help="expert weight type (default Q4_0)")
    p.add_argument("--tokens", type=int, default=48, help="tokens to generate (default 48)")
    p.add_argument(
        "--ram-budget-mb",
        type=int,
        default=None,
        help="RAM budget (default: dense weights plus a third of the experts)",
    )
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--prompt", default="Explain how a computer streams data from a disk into memory.")
    p.add_argument("--data-dir", default=None, help="where the demo model is kept (default ~/.cache/moestream)")
    p.set_defaults(func=cmd_demo)
