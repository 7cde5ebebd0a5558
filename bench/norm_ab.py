"""A prompt span's RMSNorm, torch against the native loop on the lane pool, in one process, call by call.

    python bench/norm_ab.py --threads 2 --rounds 11

Times, on random float32 inputs of the Qwen3.6-35B-A3B shape's norms (a span's hidden rows of 2,048 values at
2,048 and 8,192 tokens; the DeltaNet output norm of a 128-token chunk: 4,096 rows of 128), one call of
torch's `F.rms_norm` (at --threads of torch's threads, as a prompt step runs it) and one of
`models.common.rms_norm` (the native loop on the lane pool's --threads), alternating, the order swapped every
round. Each call makes its output, as the model's calls do. Reports per case the median (min-max) over rounds
of torch / native (above 1: the native loop is faster), each side's median milliseconds, and the largest
difference between the outputs.

Writes bench/results/<date>-<name>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics

# as the engine runs torch (moestream sets it at import, which here would come after torch loads OpenMP)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from harness import add_results_args, alternate, log, median_range, save_rows  # noqa: E402

from moestream.compute import native  # noqa: E402
from moestream.models.common import rms_norm  # noqa: E402

CASES = {
    "span 2,048 x 2,048": (2048, 2048),
    "span 8,192 x 2,048": (8192, 2048),
    "DeltaNet chunk 4,096 x 128": (4096, 128),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=11)
    add_results_args(ap, "norm-ab")
    args = ap.parse_args()
    if args.rounds < 1 or args.threads < 1:
        raise SystemExit("norm_ab: --rounds and --threads must be at least 1")
    if native.lib() is None:
        raise SystemExit("norm_ab: the native library did not build here")
    torch.set_num_threads(args.threads)
    native.set_threads(args.threads)
    rows, lines = [], [
        f"{args.threads} threads (torch's and the lane pool's), {args.rounds} rounds",
        "",
        "| case | torch / native (median, min-max) | torch ms | native ms | largest difference |",
        "|---|---|---|---|---|",
    ]
    for name, (n, dim) in CASES.items():
        g = torch.Generator().manual_seed(n)
        x, w = 3 * torch.randn(n, dim, generator=g), torch.rand(dim, generator=g) + 0.5
        arms = {
            "torch": lambda x=x, w=w: F.rms_norm(x, w.shape, w, 1e-6),
            "native": lambda x=x, w=w: rms_norm(x, w, 1e-6),
        }
        times = alternate(arms, args.rounds)
        diff = (arms["torch"]() - arms["native"]()).abs().max().item()
        ratios = [a / b for a, b in zip(times["torch"], times["native"], strict=True)]
        ms = {arm: 1000 * statistics.median(t) for arm, t in times.items()}
        rows.append({"case": name, "rows": n, "dim": dim, **{f"{a}_s": t for a, t in times.items()}, "max_diff": diff})
        lines.append(f"| {name} | {median_range(ratios)}x | {ms['torch']:.2f} | {ms['native']:.2f} | {diff:.1e} |")
        log(f"{name}: {statistics.median(ratios):.2f}x")
    args.model = os.devnull  # random inputs: no model file
    save_rows(args, rows, lines)


if __name__ == "__main__":
    main()
