"""GPT-OSS's experts, one layer's group: expert by expert (two lane matmuls each, the biases and the clamped
activation in torch: ClampedSwiGLU) vs one native call (lane_swiglu with ClampedAct: ms_moe_ffn_clamped).

    python bench/clamped_ffn_ab.py                # GPT-OSS shape: hidden 2880, ffn 2880, top-4, MXFP4
    python bench/clamped_ffn_ab.py --rows 1,16

One process, the two arms alternated call by call (a shared machine's load hits both alike); per arm and
row count the median and min-max of the per-call times. Writes bench/results/<date>-clamped-ffn-ab.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from harness import RESULTS_DIR

from moestream.compute import linear, native
from moestream.formats import quants
from moestream.models.moe import ClampedSwiGLU


def make_experts(n: int, hidden: int, ffn: int, rng: np.random.Generator) -> tuple[list, ClampedSwiGLU]:
    experts = []
    for _ in range(n):
        gu = linear.from_gguf(quants.random_gguf(T.MXFP4, 2 * ffn * hidden, rng), T.MXFP4, 2 * ffn, hidden, False)
        down = linear.from_gguf(quants.random_gguf(T.MXFP4, hidden * ffn, rng), T.MXFP4, hidden, ffn, False)
        experts.append((gu, None, down))
    biases = [torch.from_numpy(rng.standard_normal((n, r)).astype(np.float32)) for r in (ffn, ffn, hidden)]
    return experts, ClampedSwiGLU(*biases, alpha=1.702, limit=7.0)


def per_expert(experts: list, ffn: ClampedSwiGLU, x: torch.Tensor, outs: list[torch.Tensor]) -> None:
    """The old path: each expert's gate/up and down lane matmuls, the biases and activation in torch."""
    for e, expert in enumerate(experts):
        outs[e].copy_(ffn(e, expert, x))


def one_call(experts: list, ffn: ClampedSwiGLU, x: torch.Tensor, outs: list[torch.Tensor]) -> None:
    """The group in one native call (ms_moe_ffn_clamped)."""
    linear.lane_swiglu(experts, [x] * len(experts), outs, ffn.lane(list(range(len(experts)))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2880)
    ap.add_argument("--ffn", type=int, default=2880)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--rows", default="1,16", help="rows per expert (1: a decode step)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--results-dir", default=RESULTS_DIR)
    args = ap.parse_args()
    if not native.lane_ok():
        raise SystemExit("needs AVX-512 VNNI and the native library")
    torch.set_num_threads(1)
    native.lib().ms_set_threads(args.threads)
    experts, ffn = make_experts(args.experts, args.hidden, args.ffn, np.random.default_rng(0))
    ids = list(range(args.experts))
    result = {"meta": {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "args": vars(args)}, "rows": []}
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn(m, args.hidden) * 2
        outs = [torch.empty(m, args.hidden) for _ in ids]

        arms = {"per expert (torch activation)": per_expert, "one native call": one_call}
        times: dict[str, list[float]] = {name: [] for name in arms}
        for _ in range(10):
            for fn in arms.values():
                fn(experts, ffn, x, outs)
        for _ in range(args.reps):
            for name, fn in arms.items():
                t0 = time.perf_counter()
                fn(experts, ffn, x, outs)
                times[name].append(time.perf_counter() - t0)
        for name, t in times.items():
            row = {"rows": m, "arm": name, "median_us": 1e6 * statistics.median(t), "min_us": 1e6 * min(t),
                   "max_us": 1e6 * max(t), "reps": len(t)}  # fmt: skip
            result["rows"].append(row)
            print(f"rows {m:3d}  {name:30s} median {row['median_us']:8.0f} us  (min {row['min_us']:.0f}, "
                  f"max {row['max_us']:.0f})", flush=True)  # fmt: skip
    out = Path(args.results_dir) / f"{time.strftime('%Y-%m-%d')}-clamped-ffn-ab.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
