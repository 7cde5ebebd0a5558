"""micro.py's matmul cases: two trees' lane matmuls (kernel), a span's expert inputs gathered or prepared
(moe-inputs), GPT-OSS's clamped experts one by one or in one call (clamped-ffn), an FP8 weight decoded to bf16
or computed in its FP8 form (fp8); and build_tree, which the
cases with --before share.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from harness import Case, Suite
from lane_rows import parse_shapes

from moestream.compute import experts as experts_mod
from moestream.compute import linear, native
from moestream.compute.experts import FusedExpert
from moestream.formats import quants
from moestream.models.moe import ClampedSwiGLU
from moestream.models.routed import row_batches

SOURCE_DIR = Path("moestream/compute/native")
NO_LANES = "this CPU runs no lane kernels (they need AVX-512 VNNI, or AVX2 + FMA + F16C)"


def build_tree(
    tree: str, out_dir: Path, entries: tuple[str, ...] = ("ms_qmm",), extra_flags: tuple[str, ...] = ()
) -> ctypes.CDLL:
    """The tree's native library, compiled from its own C sources with this checkout's flags (and `extra_flags`);
    `entries` (and ms_set_threads) declared, all an older tree needs to have. One thread until the caller sets
    more."""
    src = Path(tree) / SOURCE_DIR
    if not any(src.glob("*.c")):
        raise SystemExit(f"micro: {src} holds no C sources (is {tree} a moestream source tree?)")
    try:
        path = native.build_library((*native.BASE_FLAGS, *native.cpu_flags(), *extra_flags), out_dir, source_dir=src)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        raise SystemExit(f"micro: building {src} failed: {str(exc)[-500:]}") from None
    library = native.load_library(path, only=(*entries, "ms_set_threads"))
    library.ms_set_threads(1)
    return library


def same_bits(a: torch.Tensor | list[torch.Tensor], b: torch.Tensor | list[torch.Tensor]) -> str:
    pairs = zip(a, b, strict=True) if isinstance(a, list) else [(a, b)]
    return "same bits" if all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in pairs) else "NO"


# ---- kernel: two source trees' lane matmuls ------------------------------------------------------


def kernel_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--before", required=True, help="source tree of the baseline (holds moestream/)")
    ap.add_argument("--after", default=".", help="source tree measured against it")
    ap.add_argument("--before-flags", default="", help="compiler flags added to the baseline's build (-mno-avx512f)")
    ap.add_argument("--types", type=lambda s: s.split(","), default=["Q4_K", "Q5_K", "Q6_K"])
    ap.add_argument("--shapes", type=parse_shapes, default=[(8192, 2048), (2048, 4096)], help="NxK,...")
    ap.add_argument("--m", type=int, default=256, help="activation rows (tokens) per call")


def kernel_header(args: argparse.Namespace) -> str:
    extra = f"; before built with {args.before_flags}" if args.before_flags else ""
    return f"lane matmuls of {args.before} (before) and {args.after} (after), {args.threads} threads, m={args.m}{extra}"


def kernel_cases(args: argparse.Namespace) -> Iterator[Case]:
    """One ms_qmm call of each tree per round; the weights are packed once by this checkout's packing code (both
    trees must share the lane layout)."""
    if native.lane_isa() is None:
        raise SystemExit(f"micro: {NO_LANES}")
    out_dir = Path(tempfile.mkdtemp(prefix="micro-kernel-"))
    flags = {"before": tuple(args.before_flags.split()), "after": ()}
    libs = {arm: build_tree(getattr(args, arm), out_dir / arm, extra_flags=flags[arm]) for arm in flags}
    for lib in libs.values():
        lib.ms_set_threads(args.threads)
    rng = np.random.default_rng(0)
    for name in args.types:
        t = GGMLQuantizationType[name]
        for n, k in args.shapes:
            lin = linear.from_gguf(quants.random_gguf(t, n * k, rng), t, n, k, False)
            x = torch.from_numpy(rng.standard_normal((args.m, k)).astype(np.float32))
            outs = {arm: torch.empty(args.m, n) for arm in libs}

            def call(arm: str, lin=lin, x=x, outs=outs, n=n, k=k) -> Callable[[], object]:
                return lambda: libs[arm].ms_qmm(lin.ggml_type, lin.weight.data_ptr(), n, k, x.data_ptr(), args.m,
                                                k, outs[arm].data_ptr(), n)  # fmt: skip

            arms = {arm: call(arm) for arm in libs}
            for fn in arms.values():
                fn()
            yield Case(f"{name} {n}x{k} m={args.m}", arms, same_bits(outs["before"], outs["after"]),
                       n * k * args.m, "GMAC/s")  # fmt: skip


# ---- moe-inputs: a span's expert inputs gathered per expert vs read from one quantization ----------


def moe_inputs_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--gate-up-type", default="Q4_K")
    ap.add_argument("--down-type", default="Q6_K")


def moe_inputs_cases(args: argparse.Namespace) -> Iterator[Case]:
    """One MoE layer (the Qwen3.6-35B-A3B shape by default, random weights in RAM), a span routed at random, run
    in batches as the MoE executor runs them: `gathered` copies each batch's rows out of x (one torch gather)
    and quantizes them per (token, expert) row in the native call; `prepared` quantizes x once for the span
    (experts.PreparedRows) and the native call copies each batch's rows from it (experts.RowsOf)."""
    if min(args.tokens, args.experts, args.top_k) < 1 or args.top_k > args.experts:
        raise SystemExit("micro: --tokens, --experts and --top-k (at most --experts) must be at least 1")
    if not native.lane_ok():
        raise SystemExit(f"micro: {NO_LANES}")
    rng = np.random.default_rng(0)
    h, f = args.hidden, args.ffn
    gt, dt = GGMLQuantizationType[args.gate_up_type], GGMLQuantizationType[args.down_type]
    experts = [
        FusedExpert(linear.from_gguf(quants.random_gguf(gt, 2 * f * h, rng), gt, 2 * f, h, False),
                    linear.from_gguf(quants.random_gguf(dt, h * f, rng), dt, h, f, False))
        for _ in range(args.experts)
    ]  # fmt: skip
    x = torch.from_numpy(rng.standard_normal((args.tokens, h)).astype(np.float32))
    ids = np.stack([rng.choice(args.experts, args.top_k, replace=False) for _ in range(args.tokens)])
    order = np.argsort(ids.reshape(-1), kind="stable")
    counts = np.bincount(ids.reshape(-1), minlength=args.experts).tolist()
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rows = [order[s : s + n] // args.top_k for s, n in zip(starts, counts, strict=True)]
    groups = [[e for e, _ in b] for b in row_batches([(e, None) for e in range(args.experts)], dict(enumerate(counts)))]
    outs = {arm: [torch.empty(n, h) for n in counts] for arm in ("gathered", "prepared")}

    def gathered() -> None:
        for g in groups:
            xs = list(x[torch.from_numpy(np.concatenate([rows[e] for e in g]))].split([counts[e] for e in g]))
            experts_mod.lane_swiglu([experts[e] for e in g], xs, [outs["gathered"][e] for e in g])

    def prepared() -> None:
        prep = experts_mod.PreparedRows(x)
        for g in groups:
            experts_mod.lane_swiglu([experts[e] for e in g], experts_mod.RowsOf(prep, [rows[e] for e in g]),
                               [outs["prepared"][e] for e in g])  # fmt: skip

    gathered(), prepared()
    name = f"{args.tokens} tokens, {args.experts} experts of {f} (top {args.top_k}), {gt.name}/{dt.name}"
    yield Case(name, {"gathered": gathered, "prepared": prepared}, same_bits(outs["gathered"], outs["prepared"]),
               3 * f * h * args.tokens * args.top_k, "GMAC/s")  # fmt: skip


# ---- clamped-ffn: GPT-OSS's experts one by one vs one native call ---------------------------------


def clamped_ffn_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--hidden", type=int, default=2880)
    ap.add_argument("--ffn", type=int, default=2880)
    ap.add_argument("--experts", type=int, default=4, help="experts of one layer's group (GPT-OSS: top-4)")
    ap.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")], default=[1, 16],
                    help="rows per expert (1: a decode step)")  # fmt: skip


def clamped_ffn_cases(args: argparse.Namespace) -> Iterator[Case]:
    """MXFP4 experts: `per expert` runs each expert's gate/up and down lane matmuls with the biases and the
    clamped activation in torch (ClampedSwiGLU); `one call` runs the group in one ms_moe_ffn_clamped call."""
    if not native.lane_ok():
        raise SystemExit(f"micro: {NO_LANES}")
    rng = np.random.default_rng(0)
    n, hidden, ffn_dim, mx = args.experts, args.hidden, args.ffn, GGMLQuantizationType.MXFP4
    experts = [
        FusedExpert(linear.from_gguf(quants.random_gguf(mx, 2 * ffn_dim * hidden, rng), mx, 2 * ffn_dim, hidden, False),
                    linear.from_gguf(quants.random_gguf(mx, hidden * ffn_dim, rng), mx, hidden, ffn_dim, False))
        for _ in range(n)
    ]  # fmt: skip
    biases = [torch.from_numpy(rng.standard_normal((n, r)).astype(np.float32)) for r in (ffn_dim, ffn_dim, hidden)]
    ffn = ClampedSwiGLU(*biases, alpha=1.702, limit=7.0)
    for m in args.rows:
        x = torch.randn(m, hidden) * 2
        outs = {arm: [torch.empty(m, hidden) for _ in range(n)] for arm in ("per expert", "one call")}

        def per_expert(x=x, outs=outs["per expert"]) -> None:
            for e, expert in enumerate(experts):
                outs[e].copy_(ffn(e, expert, x))

        def one_call(x=x, outs=outs["one call"]) -> None:
            experts_mod.lane_swiglu(experts, [x] * n, outs, ffn.lane(list(range(n))))

        per_expert(), one_call()
        diff = max(float((a - b).abs().max()) for a, b in zip(outs["per expert"], outs["one call"], strict=True))
        yield Case(f"{n} experts, {m} rows each", {"per expert": per_expert, "one call": one_call},
                   f"largest difference {diff:.1e}", 3 * ffn_dim * hidden * m * n, "GMAC/s")  # fmt: skip


# ---- fp8: an FP8 checkpoint weight computed at 1 byte a weight vs decoded to bf16 -----------------


def fp8_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--shapes", type=parse_shapes, default=[(2048, 7168), (7168, 2048)], help="NxK,... (K: x128)")
    ap.add_argument("--m", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4], help="rows per call")


def _fp8_fills(raw: np.ndarray, n: int, k: int, scales: np.ndarray) -> dict[str, Callable[[], linear.QLinear]]:
    """One cache fill of each arm: the checkpoint's bytes -> the QLinear the cache holds."""
    from moestream.compute import kernels

    bf16 = int(GGMLQuantizationType.BF16)
    return {
        "bf16": lambda: linear.from_gguf(kernels.fp8_block_decode(raw, n, k, scales, (128, 128), True), bf16, n, k,
                                         False),
        "fp8": lambda: linear.from_gguf(kernels.fp8_pack(raw, n, k, scales, 128), quants.FP8_B128, n, k, False),
    }  # fmt: skip


def fp8_cases(args: argparse.Namespace) -> Iterator[Case]:
    """An FP8 e4m3 weight with 128x128 block scales (DeepSeek-V3's expert shapes by default): `bf16` is the path
    before issue 44 (the checkpoint decoded to bf16 in C, QLinear's bf16 matmul: ms_gemv_bf16 for a few rows),
    `fp8` the FP8 form (1 byte a weight and a scale per 128, ms_fp8_mm). Then one cache fill of each: the
    decode to bf16 and its copy into a slot vs the FP8 packing and its copy."""
    rng = np.random.default_rng(0)
    for n, k in args.shapes:
        raw = rng.integers(0, 256, n * k, dtype=np.uint8)
        raw[(raw & 0x7F) == 0x7F] = 0
        scales = rng.uniform(1e-4, 1e-3, (-(-n // 128), k // 128)).astype(np.float32)
        fills = _fp8_fills(raw, n, k, scales)
        lins = {arm: fill() for arm, fill in fills.items()}
        for m in args.m:
            x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
            outs = {arm: lin(x) for arm, lin in lins.items()}
            rel = float((outs["fp8"] - outs["bf16"]).abs().max() / outs["bf16"].abs().max())
            arms = {arm: (lambda lin=lin, x=x: lin(x)) for arm, lin in lins.items()}
            yield Case(f"{n}x{k} m={m}", arms, f"relative difference {rel:.1e}", n * k * m, "GMAC/s")
        yield Case(f"{n}x{k} fill", fills, "-", n * k, "Gweights/s")


KERNEL_SUITES = {
    "fp8": Suite(
        "an FP8 block-scaled weight's matmul and cache fill: decoded to bf16 vs the FP8 form",
        41,
        1,
        fp8_args,
        lambda args: f"{args.threads} threads, FP8 e4m3 weights with 128x128 block scales",
        fp8_cases,
    ),
    "kernel": Suite(
        "two source trees' lane matmuls (ms_qmm), weights packed once", 21, 1, kernel_args, kernel_header, kernel_cases
    ),
    "moe-inputs": Suite(
        "a prompt span's routed experts, inputs gathered per batch vs quantized once for the span",
        11,
        2,
        moe_inputs_args,
        lambda args: f"{args.threads} threads, one MoE layer's routed experts",
        moe_inputs_cases,
    ),
    "clamped-ffn": Suite(
        "GPT-OSS's experts (MXFP4, clamped SwiGLU with biases) one by one vs one native call",
        200,
        2,
        clamped_ffn_args,
        lambda args: f"{args.threads} lane threads, torch on one thread",
        clamped_ffn_cases,
        torch_threads=lambda args: 1,
    ),
}
