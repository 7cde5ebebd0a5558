"""Two source trees' lane matmuls in one process, call by call: a kernel A/B that a noisy shared VM cannot blur.

    python bench/kernel_ab.py --before /tmp/main-tree --after . --types Q4_K,Q5_K,Q6_K --shapes 8192x2048 --m 256
    python bench/kernel_ab.py --before . --before-flags=-mno-avx512f   # this CPU's AVX2 kernels against its VNNI ones

bench/lane_rows.py runs each tree in its own process; on a VM whose neighbours take the CPU by the second,
two identical trees then differ by up to 1.5x from one process to the next. Here one process builds both
trees' native libraries (their C sources, this machine's flags), packs each weight once (the packing code of
this checkout: both trees must share the lane layout) and times one ms_qmm call of each tree in turn, the
order swapped every round, one thread. A round's ratio compares calls made a few milliseconds apart. It
reports, per case, the median (min-max) over rounds of before/after time (above 1: after is faster), each
tree's best GMAC/s, and whether both trees gave the same bits.

Writes bench/results/<date>-<name>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from harness import add_results_args, alternate, log, median_range, save_rows
from lane_rows import parse_shapes

from moestream.compute import linear, native
from moestream.formats import quants

SOURCE_DIR = Path("moestream/compute/native")


def build_tree(
    tree: str, out_dir: Path, entries: tuple[str, ...] = ("ms_qmm",), extra_flags: tuple[str, ...] = ()
) -> ctypes.CDLL:
    """The tree's native library, compiled from its own C sources with this checkout's flags (and `extra_flags`);
    `entries` (and ms_set_threads) declared, all an older tree needs to have. One thread until the caller sets
    more."""
    src = Path(tree) / SOURCE_DIR
    if not any(src.glob("*.c")):
        raise SystemExit(f"kernel_ab: {src} holds no C sources (is {tree} a moestream source tree?)")
    try:
        path = native.build_library((*native.BASE_FLAGS, *native.cpu_flags(), *extra_flags), out_dir, source_dir=src)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        raise SystemExit(f"kernel_ab: building {src} failed: {str(exc)[-500:]}") from None
    library = native.load_library(path, only=(*entries, "ms_set_threads"))
    library.ms_set_threads(1)
    return library


def time_case(libs: dict[str, ctypes.CDLL], lin: linear.QLinear, x: torch.Tensor, rounds: int) -> dict:
    """Per-call seconds of each library, alternating, and whether their outputs are bit-identical."""
    m, (n, k) = x.shape[0], lin.shape
    outs = {arm: torch.empty(m, n) for arm in libs}

    def call(arm: str) -> Callable[[], None]:
        return lambda: libs[arm].ms_qmm(lin.ggml_type, lin.weight.data_ptr(), n, k, x.data_ptr(), m, k,
                                        outs[arm].data_ptr(), n)  # fmt: skip

    times = alternate({arm: call(arm) for arm in libs}, rounds)
    same = torch.equal(outs["before"].view(torch.int32), outs["after"].view(torch.int32))
    return {"before_s": times["before"], "after_s": times["after"], "same_bits": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="source tree of the baseline (holds moestream/)")
    ap.add_argument("--after", default=".", help="source tree measured against it")
    ap.add_argument("--before-flags", default="", help="compiler flags added to the baseline's build (-mno-avx512f)")
    ap.add_argument("--types", type=lambda s: s.split(","), default=["Q4_K", "Q5_K", "Q6_K"])
    ap.add_argument("--shapes", type=parse_shapes, default=[(8192, 2048), (2048, 4096)])
    ap.add_argument("--m", type=int, default=256, help="activation rows (tokens) per call")
    ap.add_argument("--rounds", type=int, default=21)
    add_results_args(ap, "kernel-ab")
    args = ap.parse_args()
    if args.m < 1 or args.rounds < 1:
        raise SystemExit("kernel_ab: --m and --rounds must be at least 1")
    if native.lane_isa() is None:
        raise SystemExit("kernel_ab: this CPU runs no lane kernels (they need AVX-512 VNNI, or AVX2 + FMA + F16C)")
    out_dir = Path(tempfile.mkdtemp(prefix="kernel-ab-"))
    flags = {"before": tuple(args.before_flags.split()), "after": ()}
    libs = {arm: build_tree(getattr(args, arm), out_dir / arm, extra_flags=flags[arm]) for arm in ("before", "after")}
    rng = np.random.default_rng(0)
    rows = []
    lines = [
        f"lane kernels: before {native.lane_isa(libs['before'])}, after {native.lane_isa(libs['after'])}, one thread, "
        f"m={args.m}, {args.rounds} rounds" + (f"; before built with {args.before_flags}" if args.before_flags else ""),
        "",
        "| case | before/after (median, min-max over rounds) | best GMAC/s before | best GMAC/s after | same bits |",
        "|---|---|---|---|---|",
    ]
    for name in args.types:
        t = GGMLQuantizationType[name]
        for n, k in args.shapes:
            lin = linear.from_gguf(quants.random_gguf(t, n * k, rng), t, n, k, False)
            x = torch.from_numpy(rng.standard_normal((args.m, k)).astype(np.float32))
            res = time_case(libs, lin, x, args.rounds)
            ratios = [b / a for b, a in zip(res["before_s"], res["after_s"], strict=True)]
            macs = n * k * args.m
            best = {arm: macs / min(res[f"{arm}_s"]) / 1e9 for arm in libs}
            rows.append({"case": f"{name} {n}x{k} m={args.m}", "macs": macs, **res})
            lines.append(
                f"| {name} {n}x{k} | {median_range(ratios, 3)}x | {best['before']:.1f} | {best['after']:.1f} | "
                f"{'yes' if res['same_bits'] else 'NO'} |"
            )
            log(f"{name} {n}x{k}: {statistics.median(ratios):.3f}x")
    args.model = os.devnull  # random weights: no model file
    save_rows(args, rows, lines)


if __name__ == "__main__":
    main()
