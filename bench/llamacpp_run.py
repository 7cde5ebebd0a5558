"""One llama.cpp generation (llama-cpp-python), measured the way `moestream run --stats-json` reports.

    python bench/llamacpp_run.py --model M.gguf --prompt TEXT -n 32 --threads 2 --json OUT.json

Loads the model (mmap by default, as llama.cpp does), evaluates the prompt in one call (prefill), then
decodes greedily token by token with `Llama.eval` and an argmax over the last logits, stopping at an
end-of-generation token like moestream does. Phases are timed with wall clocks here, not llama.cpp's
own counters. Disk bytes per phase come from /proc/self/io read_bytes (all threads, includes mmap page
faults and readahead), peak RSS from getrusage (ru_maxrss) and /proc/self/status.

Definitions match moestream's stats: decode_tokens counts every generated token, the first of which
comes from the prefill's logits, and decode_s runs from the end of the prefill to the last token, so it
holds decode_tokens - 1 forward passes.

`--repack off` sets llama_model_params.use_extra_bufts = False: the CPU backend then computes Q4_0 from
the mmap'd file instead of copying the weights into its interleaved ("repacked") layout in anonymous
memory, which doubles the memory a Q4_0 model needs and gets it OOM-killed when RAM is short.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from typing import Any

import numpy as np
from harness import proc_io, write_json


def proc_status() -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon, RssFile in bytes."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, rest = line.split(":", 1)
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    return out


class Meter:
    """Wall time, disk bytes (read_bytes) and major faults since the last mark."""

    def __init__(self) -> None:
        self.t = time.perf_counter()
        self.io = proc_io()["read_bytes"]
        self.majflt = resource.getrusage(resource.RUSAGE_SELF).ru_majflt

    def mark(self) -> tuple[float, int, int]:
        t, io = time.perf_counter(), proc_io()["read_bytes"]
        majflt = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
        out = (t - self.t, io - self.io, majflt - self.majflt)
        self.t, self.io, self.majflt = t, io, majflt
        return out


def load_llama(model: str, *, threads: int, ctx: int, mmap: bool, repack: bool) -> Any:
    import llama_cpp.llama_cpp as lib
    from llama_cpp import Llama

    if not repack:
        default_params = lib.llama_model_default_params

        def params_without_repack() -> Any:
            p = default_params()
            p.use_extra_bufts = False
            return p

        lib.llama_model_default_params = params_without_repack  # Llama() reads it from this module
    try:
        return Llama(
            model_path=model,
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=ctx,
            n_batch=512,
            use_mmap=mmap,
            logits_all=False,
            verbose=False,
        )
    finally:
        if not repack:
            lib.llama_model_default_params = default_params


def tokenize(model: str, text: str) -> list[int]:
    """The prompt's tokens as generate() makes them (vocabulary only: no weights loaded)."""
    from llama_cpp import Llama

    llm = Llama(model_path=model, vocab_only=True, verbose=False)
    try:
        return llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
    finally:
        llm.close()


def generate(model: str, prompt: str, n: int, *, threads: int, ctx: int, mmap: bool, repack: bool) -> dict[str, Any]:
    import llama_cpp.llama_cpp as lib

    meter = Meter()
    start_io = meter.io
    llm = load_llama(model, threads=threads, ctx=ctx, mmap=mmap, repack=repack)
    load_s, load_bytes, load_majflt = meter.mark()

    ids = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)  # the model's own BOS setting
    if not ids:
        raise SystemExit("error: the prompt is empty")
    if len(ids) + n > ctx:
        raise SystemExit(f"error: prompt {len(ids)} + {n} tokens exceed --ctx {ctx}")
    n_vocab = llm.n_vocab()
    vocab = lib.llama_model_get_vocab(llm.model)

    def last_argmax() -> int:
        logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        return int(logits.argmax())

    meter.mark()
    llm.eval(ids)
    prompt_s, prompt_bytes, prompt_majflt = meter.mark()

    tokens: list[int] = []
    finish = "length"
    while True:
        tok = last_argmax()
        tokens.append(tok)
        if lib.llama_vocab_is_eog(vocab, tok):
            finish = "stop"
            break
        if len(tokens) >= n:
            break
        llm.eval([tok])
    decode_s, decode_bytes, decode_majflt = meter.mark()

    status = proc_status()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    doc: dict[str, Any] = {
        "engine": "llama.cpp",
        "llama_cpp_version": _version(),
        "mmap": mmap,
        "repack": repack,
        "threads": threads,
        "ctx": ctx,
        "load_s": load_s,
        "load_bytes_read": load_bytes,
        "load_majflt": load_majflt,
        "prompt_tokens": len(ids),
        "prompt_s": prompt_s,
        "prompt_tps": len(ids) / prompt_s if prompt_s > 0 else 0.0,
        "prompt_bytes_read": prompt_bytes,
        "prompt_majflt": prompt_majflt,
        "decode_tokens": len(tokens),
        "decode_s": decode_s,
        "decode_tps": len(tokens) / decode_s if decode_s > 0 else 0.0,
        "decode_bytes_read": decode_bytes,
        "decode_mb_per_token": decode_bytes / 2**20 / max(1, len(tokens)),
        "decode_majflt": decode_majflt,
        "bytes_read": proc_io()["read_bytes"] - start_io,
        "peak_rss": ru.ru_maxrss * 1024,
        "vm_hwm": status.get("VmHWM", 0),
        "rss_anon": status.get("RssAnon", 0),
        "rss_file": status.get("RssFile", 0),
        "finish_reason": finish,
        "tokens": tokens,
        "text": llm.detokenize(tokens).decode("utf-8", errors="replace"),
    }
    llm.close()
    return doc


def _version() -> str:
    try:
        import llama_cpp

        return str(llama_cpp.__version__)
    except (ImportError, AttributeError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-p", "--prompt", required=True)
    ap.add_argument("-n", type=int, default=32, help="tokens to generate (default 32)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096, help="context length (default 4096, as moestream)")
    ap.add_argument("--no-mmap", action="store_true", help="read the whole model into RAM instead of mmap")
    ap.add_argument(
        "--repack",
        choices=("on", "off"),
        default="on",
        help="on: llama.cpp's default CPU weight repacking; off: use_extra_bufts=False",
    )
    ap.add_argument("--json", help="write the stats here (default: stdout)")
    args = ap.parse_args(argv)
    if not os.path.isfile(args.model):
        print(f"error: no such model file: {args.model}", file=sys.stderr)
        return 2
    doc = generate(
        args.model,
        args.prompt,
        args.n,
        threads=args.threads,
        ctx=args.ctx,
        mmap=not args.no_mmap,
        repack=args.repack == "on",
    )
    print(doc["text"])
    speeds = f"prompt {doc['prompt_tokens']} tok @ {doc['prompt_tps']:.1f} tok/s | decode {doc['decode_tokens']} tok @ "
    return finish(doc, f"llama.cpp {speeds}{doc['decode_tps']:.2f} tok/s", args.json)


def finish(doc: dict[str, Any], speeds: str, json_path: str | None) -> int:
    """A llama.cpp run's stats line on stderr (its speeds, then disk and RSS) and its JSON where asked."""
    print(
        f"{speeds} | disk {doc['decode_mb_per_token']:.1f} MB/tok | peak RSS {doc['peak_rss'] / 2**20:.0f} MB",
        file=sys.stderr,
    )
    if json_path:
        write_json(json_path, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
