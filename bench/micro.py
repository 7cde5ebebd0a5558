"""Microbenchmarks: two implementations of one piece of the engine, called in turn in one process.

    python bench/micro.py kernel --before /tmp/main-tree --types Q4_K,Q6_K --shapes 8192x2048 --m 256
    python bench/micro.py kernel --before . --before-flags=-mno-avx512f   # this CPU's AVX2 kernels vs its VNNI ones
    python bench/micro.py attention --lengths 2048,8192                  # torch's SDPA vs the native attention
    python bench/micro.py attention --before /tmp/main-tree              # two trees' native attention
    python bench/micro.py attention-chunks --tokens 8192                 # the engine's vs SDPA over wider chunks
    python bench/micro.py deltanet --lengths 128,2048                    # torch's delta rule and conv vs native
    python bench/micro.py norm                                           # torch's RMSNorm vs native
    python bench/micro.py moe-inputs --tokens 2048                       # a span's expert inputs gathered vs prepared
    python bench/micro.py clamped-ffn --rows 1,16                        # GPT-OSS's experts one by one vs one call
    python bench/micro.py kv-dtype --lengths 2048,8192                   # the KV cache read as bf16 vs float16
    python bench/micro.py fp8 --shapes 2048x7168 --m 1,4                 # an FP8 weight decoded to bf16 vs its FP8 form

Every case is a baseline arm and a measured arm on random inputs of a model's shape. The arms alternate call by
call and their order swaps every round (harness.alternate), so a round's ratio compares calls made milliseconds
apart, which the load of a shared VM cannot blur (two processes of the same code differ by up to 1.5x on one).
`--before TREE` (kernel, attention, deltanet) makes the baseline that source tree's native library, built from
its C sources with this machine's flags. The table gives per case the median (min-max) over rounds of baseline /
measured (above 1: the measured arm is faster), each arm's median milliseconds, the measured arm's rate where
the work per call is known, and how far the outputs are apart (same bits, or the largest or relative
difference). Writes bench/results/<date>-<name>.json (default name: <case>-ab) and prints the table.

Run `python bench/micro.py CASE --help` for a case's own options.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

# as the engine runs torch (moestream sets it at import, which here would come after torch loads OpenMP)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from harness import Suite, add_results_args, alternate, log, median_range, save_rows  # noqa: E402
from micro_kernels import KERNEL_SUITES  # noqa: E402
from micro_layers import LAYER_SUITES  # noqa: E402

from moestream.compute import native  # noqa: E402

SUITES: dict[str, Suite] = {**KERNEL_SUITES, **LAYER_SUITES}


def run_suite(suite: Suite, args: argparse.Namespace) -> tuple[list[dict], list[str]]:
    rows: list[dict] = []
    lines: list[str] = []
    for case in suite.cases(args):
        base, measured = list(case.arms)
        if not lines:
            lines = [
                suite.header(args) + f", {args.rounds} rounds",
                "",
                f"| case | {base}/{measured} (median, min-max over rounds) | {base} ms | {measured} ms | "
                f"{measured} rate | outputs |",
                "|---|---|---|---|---|---|",
            ]
        with torch.inference_mode():
            times = alternate(case.arms, args.rounds)
        ratios = [a / b for a, b in zip(times[base], times[measured], strict=True)]
        ms = {arm: 1e3 * statistics.median(t) for arm, t in times.items()}
        rate = f"{case.work / min(times[measured]) / 1e9:.1f} {case.unit} (best)" if case.work else "-"
        rows.append({"case": case.name, "work": case.work, "outputs": case.check,
                     **{f"{arm}_s": t for arm, t in times.items()}})  # fmt: skip
        lines.append(
            f"| {case.name} | {median_range(ratios, 3)}x | {ms[base]:.2f} | {ms[measured]:.2f} | {rate} | "
            f"{case.check} |"
        )
        log(f"{case.name}: {statistics.median(ratios):.3f}x, outputs: {case.check}")
    return rows, lines


def parse_args(argv: list[str] | None, table: dict[str, Suite]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="case", required=True, metavar="CASE")
    for name, suite in table.items():
        p = sub.add_parser(name, help=suite.help, description=suite.help)
        p.add_argument("--threads", type=int, default=suite.threads, help=f"threads (default {suite.threads})")
        p.add_argument("--rounds", type=int, default=suite.rounds, help=f"calls of each arm (default {suite.rounds})")
        suite.add_args(p)
        add_results_args(p, f"{name}-ab")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.threads < 1:
        ap.error("--rounds and --threads must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, SUITES)
    suite = SUITES[args.case]
    if native.lib() is None:
        raise SystemExit("micro: the native library is not available here (no C compiler?)")
    torch.set_num_threads(suite.torch_threads(args))
    native.set_threads(args.threads)
    rows, lines = run_suite(suite, args)
    args.model = os.devnull  # random inputs: no model file
    save_rows(args, rows, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
