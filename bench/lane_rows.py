"""The lane matmul (native qmm_vnni.c or qmm_avx2.c) at m activation rows, one thread, two source trees side by side.

    python bench/lane_rows.py --before /tmp/main-tree --after . --repeat 5

Each repeat runs one fresh process per tree (arms alternate); a process builds the tree's native library
(imported from the tree), packs random weights of each type and shape, and times lin(x) (activation quantization and
the matmul) per m: a warm-up call, then calls for at least --min-s, the mean per call. Shapes (--shapes) are by
default an expert's gate/up (n=768 outputs of k=2048) and down (n=2048 of k=768) at the Qwen3-30B size. Reports
the median (min-max) over repeats of ms per call and GMAC/s, the after/before speedup of each repeat's pair, and
the load average each process saw.

Writes bench/results/<date>-<name>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from harness import add_results_args, log, median_range, save_rows

SHAPES = ((768, 2048), (2048, 768))  # (n outputs, k inputs)
TYPES = ("Q4_0", "Q4_K")
MS = (1, 2, 4, 8, 16, 64, 256)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'8192x2048,2048x4096' -> [(8192, 2048), (2048, 4096)]"""
    try:
        return [(int(n), int(k)) for n, k in (part.lower().split("x") for part in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"shapes: expected NxK,... (e.g. 8192x2048), got {text!r}") from None


def timed(fn, min_s: float) -> tuple[float, float]:
    """ms per call of fn (after a warm-up call), wall and CPU time, over calls for at least min_s."""
    fn()
    calls, t0, c0 = 0, time.perf_counter(), time.process_time()
    while True:
        fn()
        calls += 1
        spent = time.perf_counter() - t0
        if spent >= min_s:
            return 1e3 * spent / calls, 1e3 * (time.process_time() - c0) / calls


def one(types: list[str], shapes: list[tuple[int, int]], ms: list[int], min_s: float, experts: int) -> dict:
    sys.path.insert(0, os.environ["LANE_ROWS_TREE"])  # ahead of the repository harness puts on the path
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType

    from moestream.compute import experts as experts_mod
    from moestream.compute import linear, native
    from moestream.compute.experts import FusedExpert
    from moestream.formats import quants

    native.set_threads(1)
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    out = {"load_avg": os.getloadavg()[0], "ms": {}, "cpu_ms": {}, "macs": {}, "library": native.lib()._name}

    def record(key: str, macs: int, fn) -> None:
        out["ms"][key], out["cpu_ms"][key] = timed(fn, min_s)
        out["macs"][key] = macs

    for name in types:
        t = GGMLQuantizationType[name]
        for n, k in shapes:
            lin = linear.from_gguf(quants.random_gguf(t, n * k, rng), t, n, k, False)
            assert lin.kind == "lane"
            for m in ms:
                x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
                record(f"{name} {n}x{k} m={m}", n * k * m, lambda lin=lin, x=x: lin(x))
        if not experts:
            continue
        # lane_swiglu (native ms_moe_ffn) over `experts` experts of m rows each, as an MoE layer runs them
        hidden, ffn = SHAPES[0][1], SHAPES[0][0]
        exps = []
        for _ in range(experts):
            gu = linear.from_gguf(quants.random_gguf(t, 2 * ffn * hidden, rng), t, 2 * ffn, hidden, False)
            down = linear.from_gguf(quants.random_gguf(t, hidden * ffn, rng), t, hidden, ffn, False)
            exps.append(FusedExpert(gu, down))
        for m in ms:
            xs = [torch.from_numpy(rng.standard_normal((m, hidden)).astype(np.float32)) for _ in exps]
            outs = [torch.empty(m, hidden) for _ in exps]
            record(
                f"{name} swiglu {experts} experts m={m}",
                3 * ffn * hidden * m * experts,
                lambda xs=xs, outs=outs, exps=exps: experts_mod.lane_swiglu(exps, xs, outs),
            )
    out["load_avg_end"] = os.getloadavg()[0]
    return out


def run_tree(tree: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, LANE_ROWS_TREE=os.path.abspath(tree))
    cmd = [
        sys.executable,
        __file__,
        "--one",
        "--types",
        ",".join(args.types),
        "--ms",
        ",".join(map(str, args.ms)),
        "--shapes",
        ",".join(f"{n}x{k}" for n, k in args.shapes),
        "--min-s",
        str(args.min_s),
        "--experts",
        str(args.experts),
    ]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"lane_rows: the run on {tree} failed: {res.stderr.strip().splitlines()[-1:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="", help="source tree of the baseline (holds moestream/)")
    ap.add_argument("--after", default=".", help="source tree measured against it")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--min-s", type=float, default=0.05, help="timed seconds per (shape, m) per process")
    ap.add_argument("--types", type=lambda s: s.split(","), default=list(TYPES))
    ap.add_argument(
        "--shapes",
        type=parse_shapes,
        default=list(SHAPES),
        help="NxK,... (n outputs of k inputs); default: a Qwen3-30B expert's gate/up and down",
    )
    ap.add_argument("--ms", type=lambda s: [int(v) for v in s.split(",")], default=list(MS))
    ap.add_argument("--experts", type=int, default=8, help="experts per lane_swiglu call (0: no swiglu rows)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    add_results_args(ap, "lane-rows")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.types, args.shapes, args.ms, args.min_s, args.experts)))
        return
    if not args.before:
        raise SystemExit("lane_rows: --before is required (a source tree holding moestream/)")
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for i in range(args.repeat):
        for arm in ("before", "after"):
            runs[arm].append(run_tree(getattr(args, arm), args))
            log(f"repeat {i + 1}/{args.repeat} {arm}: load {runs[arm][-1]['load_avg']:.2f} {runs[arm][-1]['library']}")
    rows, lines = [], []
    lines.append(
        "| case | before ms | after ms | before GMAC/s | after GMAC/s | speedup (pair by pair) | "
        "CPU GMAC/s before / after |"
    )
    lines.append("|---|---|---|---|---|---|---|")
    for key in runs["before"][0]["ms"]:
        m = int(key.split(" m=")[1])
        macs = runs["before"][0]["macs"][key]
        b = [r["ms"][key] for r in runs["before"]]
        a = [r["ms"][key] for r in runs["after"]]
        gb = [macs / (v * 1e6) for v in b]
        ga = [macs / (v * 1e6) for v in a]
        pairs = [vb / va for vb, va in zip(b, a, strict=True)]
        cb = [macs / (r["cpu_ms"][key] * 1e6) for r in runs["before"]]
        ca = [macs / (r["cpu_ms"][key] * 1e6) for r in runs["after"]]
        rows.append(
            {
                "case": key,
                "macs": macs,
                "m": m,
                "before_ms": b,
                "after_ms": a,
                "before_cpu_ms": [r["cpu_ms"][key] for r in runs["before"]],
                "after_cpu_ms": [r["cpu_ms"][key] for r in runs["after"]],
            }
        )
        lines.append(
            f"| {key} | {median_range(b, 3)} | {median_range(a, 3)} | {median_range(gb, 1)} | "
            f"{median_range(ga, 1)} | {median_range(pairs, 2)}x | "
            f"{statistics.median(cb):.1f} / {statistics.median(ca):.1f} |"
        )
    loads = [r["load_avg"] for arm in runs.values() for r in arm]
    lines.append("")
    lines.append(f"load average (1 min) at process start: {median_range(loads)}")
    rows.append(
        {
            "load_avg": {arm: [r["load_avg"] for r in v] for arm, v in runs.items()},
            "library": {arm: v[0]["library"] for arm, v in runs.items()},
        }
    )
    args.model = os.devnull  # synthetic weights: no model file
    save_rows(args, rows, lines)


if __name__ == "__main__":
    main()
