"""A prompt's attention, torch's SDPA against the native flash attention, in one process, call by call.

    python bench/attention_ab.py --lengths 2048,8192 --threads 2
    python bench/attention_ab.py --before /tmp/main-tree              # two trees' native attention

Times one attention layer over a whole prompt of random inputs, run the way the engine runs it: the queries in
chunks of --chunk (the micro-batch), each chunk over the cache up to its last position. The baseline arm is
`common.attend_sdpa` (torch's SDPA with a causal mask per chunk, keys and values made float first: what
`KVCache.attend` ran for a prompt before `ms_attn_prefill`), the other `KVCache.attend` (the native loop on the
lane pool's --threads). With --before TREE the baseline is that source tree's `ms_attn_prefill` instead, called
the same way (built from its C sources with this checkout's flags; its outputs must have the same bits, or the
table says how far they are). The arms alternate and their order swaps every round; a round's ratio compares calls
made milliseconds apart, which a noisy shared VM cannot blur. Shapes: the Qwen3.6-35B-A3B shape's gated
attention (16 query heads on 2 key heads of 256, a bf16 cache) and the Qwen3-30B-A3B shape's (32 on 4, 128).

Reports per case the median (min-max) over rounds of baseline / native (above 1: the native loop is faster), each
side's median seconds, the effective rate of the native arm (4 T^2 H D / 2 flops, the causal count), and the
largest difference of the outputs. Writes bench/results/<date>-<name>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

# as the engine runs torch (moestream sets it at import, which here would come after torch loads OpenMP)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from harness import add_results_args, alternate, log, median_range, save_rows  # noqa: E402
from kernel_ab import build_tree  # noqa: E402

from moestream.compute import native  # noqa: E402
from moestream.models import common  # noqa: E402

SHAPES = {"qwen3.6": (16, 2, 256), "qwen3-30b": (32, 4, 128)}  # query heads, key heads, head size


def attention_case(
    T: int, heads: int, kv_heads: int, d: int, chunk: int, before: ctypes.CDLL | None = None
) -> tuple[dict[str, Callable[[], torch.Tensor]], float]:
    """The two arms over one layer's prompt of T tokens, and the largest absolute difference of their outputs."""
    g = torch.Generator().manual_seed(T)
    kv = common.KVCache([kv_heads], d, T, torch.bfloat16)
    q = torch.randn(T, heads, d, generator=g)
    keys, values = kv.update(0, 0, torch.randn(T, kv_heads, d, generator=g), torch.randn(T, kv_heads, d, generator=g))

    def by_chunks(attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
        return torch.cat([attend(q[a:b], keys[:b], values[:b], a) for a, b in common.query_chunks(T, chunk)])

    def tree(qc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int) -> torch.Tensor:
        assert before is not None
        qc, out = qc.contiguous(), torch.empty_like(qc)
        before.ms_attn_prefill(qc.data_ptr(), k.data_ptr(), v.data_ptr(), qc.shape[0], k.shape[0], heads, kv_heads,
                               d, pos, 1, 1.0 / math.sqrt(d), out.data_ptr())  # fmt: skip
        return out

    def sdpa(qc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int) -> torch.Tensor:
        return common.attend_sdpa(qc, k, v, pos, chunk)

    base, baseline = ("before", tree) if before is not None else ("sdpa", sdpa)
    arms = {base: lambda: by_chunks(baseline), "native": lambda: by_chunks(kv.attend)}
    a, b = arms[base](), arms["native"]()
    return arms, float((a - b).abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 8192])
    ap.add_argument("--shapes", type=lambda s: s.split(","), default=list(SHAPES), help=", ".join(SHAPES))
    ap.add_argument("--chunk", type=int, default=128, help="queries a call (the engine's micro-batch)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--before", help="a source tree whose native attention is the baseline instead of torch's SDPA")
    add_results_args(ap, "attention-ab")
    args = ap.parse_args()
    if min(args.lengths) < 1 or args.rounds < 1 or args.threads < 1 or args.chunk < 1:
        raise SystemExit("attention_ab: --lengths, --rounds, --chunk and --threads must be at least 1")
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        raise SystemExit(f"attention_ab: unknown shape {unknown[0]!r}; use one of {', '.join(SHAPES)}")
    if native.lib() is None:
        raise SystemExit("attention_ab: the native library is not available here (no C compiler?)")
    torch.set_num_threads(args.threads)
    native.set_threads(args.threads)
    before = None
    if args.before:
        before = build_tree(args.before, Path(tempfile.mkdtemp(prefix="attention-ab-")), ("ms_attn_prefill",))
        before.ms_set_threads(args.threads)
    base = "before" if before is not None else "sdpa"
    rows: list[dict] = []
    lines = [
        f"{args.threads} threads (torch's and the lane pool's), queries {args.chunk} a call, {args.rounds} rounds"
        + (f"; baseline: the native attention of {args.before}" if before is not None else ""),
        "",
        f"| shape | tokens | {base}/native (median, min-max over rounds) | {base} s | native s | native GFLOP/s "
        "| max difference |",
        "|---|---|---|---|---|---|---|",
    ]
    for shape in args.shapes:
        heads, kv_heads, d = SHAPES[shape]
        for T in args.lengths:
            arms, diff = attention_case(T, heads, kv_heads, d, args.chunk, before)
            with torch.inference_mode():
                times = alternate(arms, args.rounds)
            ratios = [a / b for a, b in zip(times[base], times["native"], strict=True)]
            native_s = statistics.median(times["native"])
            gflops = 4 * T * T / 2 * heads * d / native_s / 1e9
            rows.append({"shape": shape, "tokens": T, "max_difference": diff, "native_gflops": gflops,
                         **{f"{a}_s": t for a, t in times.items()}})  # fmt: skip
            lines.append(
                f"| {shape} | {T} | {median_range(ratios, 2)}x | {statistics.median(times[base]):.2f} | "
                f"{native_s:.2f} | {gflops:.0f} | {diff:.1e} |"
            )
            log(f"{shape} {T}: {statistics.median(ratios):.2f}x")
    args.model = os.devnull  # random inputs: no model file
    save_rows(args, rows, lines)


if __name__ == "__main__":
    main()
