"""One layer's attention over a long prompt span, the way a layer-major prefill runs it, and two variants.

    python bench/attention_chunks.py --tokens 8192 --repeat 5

A diagnosis of where an 8K-token prompt's time goes, not an engine speed: the prompt's queries attend in
chunks over the keys up to each chunk's last position (bf16 KV cache, float32 compute, 2 threads), at the
Qwen3-30B-A3B shape (32 query heads, 4 KV heads of 128). Arms, alternated within each fresh process:
  engine      KVCache.attend itself, a query chunk of --chunk at a time (what by_query_chunks gives it)
  contiguous  the same chunks with the keys converted into a contiguous [heads, positions, dim] float block
  chunk-N     contiguous keys and N queries a chunk (--wide-chunks)
Reports per arm the median (min-max) seconds for the layer over the processes, GFLOP/s (the causal
attention's 4 * T^2/2 * heads * dim), and the largest difference from the engine arm's output.

Writes bench/results/<date>-<name>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from harness import add_results_args, log, median_range, save_rows

HEADS, KV_HEADS, DIM = 32, 4, 128


def one(tokens: int, chunk: int, wide: list[int], threads: int) -> dict:
    import torch
    import torch.nn.functional as F

    from moestream.models.common import KVCache, causal_mask, query_chunks

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    kv = KVCache([KV_HEADS], DIM, tokens, torch.bfloat16)
    kv.query_chunk = chunk
    kv.update(0, 0, torch.randn(tokens, KV_HEADS, DIM), torch.randn(tokens, KV_HEADS, DIM))
    q = torch.randn(tokens, HEADS, DIM)
    keys, values = kv.k[0], kv.v[0]
    assert keys is not None and values is not None

    def engine() -> torch.Tensor:
        out = torch.empty(tokens, HEADS, DIM)
        for a, b in query_chunks(tokens, chunk):
            out[a:b] = kv.attend(q[a:b], keys[:b], values[:b], a)
        return out

    def contiguous(n: int) -> torch.Tensor:
        out = torch.empty(tokens, HEADS, DIM)
        for a, b in query_chunks(tokens, n):
            kh = keys[:b].transpose(0, 1).float().unsqueeze(0)
            vh = values[:b].transpose(0, 1).float().unsqueeze(0)
            qh = q[a:b].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_mask(b - a, b, a), enable_gqa=True)
            out[a:b] = o.squeeze(0).transpose(0, 1)
        return out

    arms = {"engine": engine, "contiguous": lambda: contiguous(chunk)}
    arms.update({f"chunk-{n}": (lambda n=n: contiguous(n)) for n in wide})
    result: dict = {"load_avg": os.getloadavg()[0], "s": {}, "max_diff": {}}
    reference = None
    for name, fn in arms.items():
        t0 = time.perf_counter()
        out = fn()
        result["s"][name] = time.perf_counter() - t0
        if reference is None:
            reference = out
        result["max_diff"][name] = float((out - reference).abs().max())
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192, help="prompt span (default 8192)")
    ap.add_argument("--chunk", type=int, default=128, help="the engine's query chunk (default 128: its micro-batch)")
    ap.add_argument("--wide-chunks", default="512,1024", help="query chunks of the chunk-N arms (default 512,1024)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5, help="fresh processes (default 5)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    add_results_args(ap, "attention-chunks")
    args = ap.parse_args(argv)
    args.model = "."  # no model file: run_meta reads the disk of the working directory
    wide = [int(x) for x in args.wide_chunks.split(",") if x]
    if args.one:
        print(json.dumps(one(args.tokens, args.chunk, wide, args.threads)))
        return 0
    runs = []
    for i in range(args.repeat):
        cmd = [sys.executable, __file__, "--one", "--tokens", str(args.tokens), "--chunk", str(args.chunk),
               "--wide-chunks", args.wide_chunks, "--threads", str(args.threads)]  # fmt: skip
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
        log(f"process {i + 1}/{args.repeat}: " + ", ".join(f"{k} {v:.2f}s" for k, v in runs[-1]["s"].items()))
    flops = 4 * args.tokens * args.tokens / 2 * HEADS * DIM
    lines = [
        f"One layer's attention over a {args.tokens}-token span ({HEADS} heads, {KV_HEADS} KV heads of {DIM}, "
        f"bf16 cache, float32 compute, {args.threads} threads), {args.repeat} fresh processes:",
        "",
        "| arm | s per layer | GFLOP/s | max diff from engine |",
        "|---|---|---|---|",
    ]
    for name in runs[0]["s"]:
        secs = [r["s"][name] for r in runs]
        rates = [flops / s / 1e9 for s in secs]
        lines.append(f"| {name} | {median_range(secs)} | {median_range(rates, 0)} | "
                     f"{max(r['max_diff'][name] for r in runs):.2g} |")  # fmt: skip
    lines.append(f"\nload average seen: {median_range([r['load_avg'] for r in runs])}")
    rows = [{"tokens": args.tokens, "chunk": args.chunk, "threads": args.threads, **r} for r in runs]
    path = save_rows(args, rows, lines)
    print("\n".join(lines))
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
