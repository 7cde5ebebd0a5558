"""micro.py's layer cases: a prompt's attention (attention), the Gated DeltaNet's delta rule and convolution
(deltanet), RMSNorm over a span (norm); torch's way or another tree's native library against this checkout's
native loops, on random inputs of the Qwen3.6-35B-A3B shape (and the Qwen3-30B-A3B shape's attention).
"""

from __future__ import annotations

import argparse
import math
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from harness import Case, Suite
from micro_kernels import build_tree

from moestream.models import attention, deltanet, kv_cache, ops

ATTENTION_SHAPES = {"qwen3.6": (16, 2, 256), "qwen3-30b": (32, 4, 128)}  # query heads, key heads, head size
NORM_CASES = {  # rows, width: a span's hidden rows, and the DeltaNet output norm of a 128-token chunk
    "span 2,048 x 2,048": (2048, 2048),
    "span 8,192 x 2,048": (8192, 2048),
    "DeltaNet chunk 4,096 x 128": (4096, 128),
}


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def before_library(args: argparse.Namespace, entry: str) -> object | None:
    """--before's native library with `entry`, on --threads threads; None without --before."""
    if not args.before:
        return None
    library = build_tree(args.before, Path(tempfile.mkdtemp(prefix="micro-")), (entry,))
    library.ms_set_threads(args.threads)
    return library


# ---- attention: a prompt's attention over the cache, query chunk by query chunk ------------------


def attention_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--lengths", type=int_list, default=[2048, 8192], help="prompt tokens, comma-separated")
    ap.add_argument("--shapes", type=lambda s: s.split(","), default=list(ATTENTION_SHAPES),
                    help=", ".join(ATTENTION_SHAPES))  # fmt: skip
    ap.add_argument("--chunk", type=int, default=128, help="queries a call (the engine's micro-batch)")
    ap.add_argument("--before", help="a source tree whose native attention is the baseline instead of torch's SDPA")


def attention_case(T: int, heads: int, kv_heads: int, d: int, chunk: int, before: object | None) -> Case:
    """One layer over a prompt of T tokens run the way the engine runs it: the queries in chunks, each over the
    cache up to its last position. Baseline: `attention.attend_sdpa` (torch's SDPA with a causal mask per chunk,
    keys and values made float first), or --before's `ms_attn_prefill` called the same way; measured: this
    checkout's `KVCache.attend`."""
    g = torch.Generator().manual_seed(T)
    kv = kv_cache.KVCache([kv_heads], d, T, torch.bfloat16)
    q = torch.randn(T, heads, d, generator=g)
    keys, values = kv.update(0, 0, torch.randn(T, kv_heads, d, generator=g), torch.randn(T, kv_heads, d, generator=g))

    def by_chunks(attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
        return torch.cat([attend(q[a:b], keys[:b], values[:b], a) for a, b in attention.query_chunks(T, chunk)])

    def tree(qc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int) -> torch.Tensor:
        qc, out = qc.contiguous(), torch.empty_like(qc)
        before.ms_attn_prefill(qc.data_ptr(), k.data_ptr(), v.data_ptr(), qc.shape[0], k.shape[0], heads, kv_heads,
                               d, pos, 1, 1.0 / math.sqrt(d), out.data_ptr())  # fmt: skip
        return out

    def sdpa(qc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int) -> torch.Tensor:
        return attention.attend_sdpa(qc, k, v, pos, chunk)

    base, baseline = ("before", tree) if before is not None else ("sdpa", sdpa)
    arms = {base: lambda: by_chunks(baseline), "native": lambda: by_chunks(kv.attend)}
    with torch.inference_mode():
        diff = float((arms[base]() - arms["native"]()).abs().max())
    return Case(f"{heads}/{kv_heads} heads of {d}, {T} tokens", arms, f"largest difference {diff:.1e}",
                4 * T * T / 2 * heads * d)  # fmt: skip


def attention_cases(args: argparse.Namespace) -> Iterator[Case]:
    unknown = [s for s in args.shapes if s not in ATTENTION_SHAPES]
    if unknown or min(args.lengths) < 1 or args.chunk < 1:
        raise SystemExit(f"micro: shapes are {', '.join(ATTENTION_SHAPES)}; --lengths and --chunk at least 1")
    before = before_library(args, "ms_attn_prefill")
    for shape in args.shapes:
        for T in args.lengths:
            yield attention_case(T, *ATTENTION_SHAPES[shape], args.chunk, before)


# ---- attention-chunks: the engine's attention against torch's SDPA over wider query chunks --------


def attention_chunks_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tokens", type=int, default=8192, help="prompt span (default 8192)")
    ap.add_argument("--chunk", type=int, default=128, help="the engine's query chunk (its micro-batch)")
    ap.add_argument("--wide-chunks", type=int_list, default=[128, 512, 1024],
                    help="query chunks of the SDPA arm, one case each")  # fmt: skip


def attention_chunks_cases(args: argparse.Namespace) -> Iterator[Case]:
    """One layer of the Qwen3-30B-A3B shape (32 query heads on 4 KV heads of 128, a bf16 cache) over a whole
    span, a diagnosis of the span's attention rather than an engine speed: `engine` is `KVCache.attend` a query
    chunk of --chunk at a time; `sdpa` converts the keys into one contiguous float block and runs torch's SDPA
    with a causal mask over query chunks of N."""
    if min(args.tokens, args.chunk, *args.wide_chunks) < 1:
        raise SystemExit("micro: --tokens, --chunk and --wide-chunks must be at least 1")
    heads, kv_heads, d = ATTENTION_SHAPES["qwen3-30b"]
    T = args.tokens
    g = torch.Generator().manual_seed(0)
    kv = kv_cache.KVCache([kv_heads], d, T, torch.bfloat16)
    q = torch.randn(T, heads, d, generator=g)
    keys, values = kv.update(0, 0, torch.randn(T, kv_heads, d, generator=g), torch.randn(T, kv_heads, d, generator=g))

    def engine() -> torch.Tensor:
        return torch.cat([kv.attend(q[a:b], keys[:b], values[:b], a) for a, b in attention.query_chunks(T, args.chunk)])

    def sdpa(n: int) -> torch.Tensor:
        out = torch.empty(T, heads, d)
        for a, b in attention.query_chunks(T, n):
            kh, vh = (t[:b].transpose(0, 1).float().unsqueeze(0) for t in (keys, values))
            mask = attention.causal_mask(b - a, b, a)
            o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1).unsqueeze(0), kh, vh, attn_mask=mask,
                                               enable_gqa=True)  # fmt: skip
            out[a:b] = o.squeeze(0).transpose(0, 1)
        return out

    with torch.inference_mode():
        reference = engine()
    for n in args.wide_chunks:
        arms = {"engine": engine, f"sdpa-{n}": lambda n=n: sdpa(n)}
        with torch.inference_mode():
            diff = float((arms[f"sdpa-{n}"]() - reference).abs().max())
        yield Case(f"{T} tokens, SDPA over {n} queries a chunk", arms, f"largest difference {diff:.1e}",
                   4 * T * T / 2 * heads * d)  # fmt: skip


# ---- deltanet: the Gated DeltaNet's prompt path ---------------------------------------------------


def deltanet_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--lengths", type=int_list, default=[128, 2048], help="span tokens, comma-separated")
    ap.add_argument("--key-heads", type=int, default=16)
    ap.add_argument("--value-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--conv-channels", type=int, default=8192, help="the conv's width (q, k and v heads)")
    ap.add_argument("--conv-kernel", type=int, default=4)
    ap.add_argument("--before", help="a source tree whose native delta rule is the baseline instead of torch "
                    "(the conv is not timed then)")  # fmt: skip


def delta_case(L: int, Hk: int, Hv: int, d: int, before: object | None) -> Case:
    """`chunk_delta_rule` (torch) or --before's `ms_delta_rule` against this checkout's `delta_rule_span`; with
    --before the outputs and the states must have the same bits."""
    g = torch.Generator().manual_seed(L)
    qk = torch.nn.functional.normalize(torch.randn(L, 2 * Hk, d, generator=g), dim=-1)
    v = torch.randn(L, Hv, d, generator=g)
    decay, beta = -torch.rand(L, Hv, generator=g) * 0.5, torch.rand(L, Hv, generator=g)
    S0 = torch.randn(Hv, d, d, generator=g) * 0.1
    name = f"delta rule, {L} tokens"
    if before is not None:
        states = {"before": S0.clone(), "native": S0.clone()}

        def old() -> torch.Tensor:
            S, out = states["before"].copy_(S0), torch.empty(L, Hv, d)
            before.ms_delta_rule(L, Hk, Hv, d, d, qk.data_ptr(), qk[:, Hk:].data_ptr(), 2 * Hk * d, v.data_ptr(),
                                 decay.data_ptr(), beta.data_ptr(), S.data_ptr(), out.data_ptr())  # fmt: skip
            return out

        def new() -> torch.Tensor:
            return deltanet.delta_rule_span(qk, v, decay, beta, states["native"].copy_(S0), Hk)

        a, b = old(), new()
        same = torch.equal(a.view(torch.int32), b.view(torch.int32)) and torch.equal(
            states["before"].view(torch.int32), states["native"].view(torch.int32)
        )
        return Case(name, {"before": old, "native": new}, "same bits" if same else "NO")
    q, k = deltanet.value_heads(qk, Hk, Hv)
    heads_first = [t.transpose(0, 1) for t in (q, k, v, decay, beta)]
    arms = {
        "torch": lambda: deltanet.chunk_delta_rule(*heads_first, S0.clone()).transpose(0, 1),
        "native": lambda: deltanet.delta_rule_span(qk, v, decay, beta, S0.clone(), Hk),
    }
    a, b = arms["torch"](), arms["native"]()
    return Case(name, arms, f"relative difference {float((a - b).norm() / a.norm()):.1e}")


def conv_case(L: int, channels: int, K: int) -> Case:
    """The causal depthwise convolution before the delta rule: torch's unfold-multiply-sum against `causal_conv`."""
    g = torch.Generator().manual_seed(L)
    buf, w_t = torch.randn(L + K - 1, channels, generator=g), torch.randn(K, channels, generator=g)
    arms = {
        "torch": lambda: (buf.unfold(0, K, 1) * w_t.T).sum(-1),
        "native": lambda: deltanet.causal_conv(buf, w_t),
    }
    a, b = arms["torch"](), arms["native"]()
    return Case(f"causal conv, {L} tokens", arms, f"relative difference {float((a - b).norm() / a.norm()):.1e}")


def deltanet_cases(args: argparse.Namespace) -> Iterator[Case]:
    if min(args.lengths) < 1:
        raise SystemExit("micro: --lengths must be at least 1")
    before = before_library(args, "ms_delta_rule")
    for L in args.lengths:
        yield delta_case(L, args.key_heads, args.value_heads, args.head_dim, before)
    if before is None:
        for L in args.lengths:
            yield conv_case(L, args.conv_channels, args.conv_kernel)


# ---- norm: RMSNorm over a span --------------------------------------------------------------------


def norm_cases(args: argparse.Namespace) -> Iterator[Case]:
    """torch's `F.rms_norm` against `models.ops.rms_norm` (the native loop on the lane pool); each call makes
    its output, as the model's calls do."""
    for name, (n, dim) in NORM_CASES.items():
        g = torch.Generator().manual_seed(n)
        x, w = 3 * torch.randn(n, dim, generator=g), torch.rand(dim, generator=g) + 0.5
        arms = {
            "torch": lambda x=x, w=w: F.rms_norm(x, w.shape, w, 1e-6),
            "native": lambda x=x, w=w: ops.rms_norm(x, w, 1e-6),
        }
        diff = (arms["torch"]() - arms["native"]()).abs().max().item()
        yield Case(name, arms, f"largest difference {diff:.1e}")


# ---- kv-dtype: the same cache held in bf16 (earlier versions' default) and in float16 (today's) --------


def kv_dtype_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--lengths", type=int_list, default=[2048, 8192], help="cached tokens, comma-separated")


def kv_dtype_cases(args: argparse.Namespace) -> Iterator[Case]:
    """Each read of the KV cache with the cache in bf16 (baseline) and in float16 (measured), over the same
    keys and values: a prompt's attention (the native flash attention, chunk by chunk), one decode token's
    (the native decode loop), and GPT-OSS's attention with sinks (torch, which widens the cache first)."""
    if min(args.lengths) < 1:
        raise SystemExit("micro: --lengths must be at least 1")
    for T in args.lengths:
        yield from _kv_dtype_case(T, *ATTENTION_SHAPES["qwen3-30b"], "qwen3-30b")
        yield from _kv_dtype_case(T, 64, 8, 64, "gpt-oss-120b", sinks=True)


def _kv_dtype_case(T: int, heads: int, kv_heads: int, d: int, label: str, sinks: bool = False) -> Iterator[Case]:
    g = torch.Generator().manual_seed(T)
    k, v = torch.randn(T, kv_heads, d, generator=g), torch.randn(T, kv_heads, d, generator=g)
    q = torch.randn(T, heads, d, generator=g)
    caches = {}
    for name, dtype in (("bf16", torch.bfloat16), ("f16", torch.float16)):
        kv = kv_cache.KVCache([kv_heads], d, T, dtype)
        caches[name] = (kv, *kv.update(0, 0, k, v))
    if sinks:
        s = torch.randn(heads, generator=g)

        def decode(name: str) -> torch.Tensor:
            _, keys, values = caches[name]
            return attention.attend_with_sinks(q[-1:], keys, values, T - 1, s)

        yield Case(f"{label} decode with sinks, {T} cached", {n: lambda n=n: decode(n) for n in caches}, "-")
        _, keys, values = caches["f16"]
        arms = {
            "torch": lambda: attention.sinks_torch(q[-1:], keys, values, T - 1, s),
            "native": lambda: attention.attend_with_sinks(q[-1:], keys, values, T - 1, s),
        }
        diff = float((arms["torch"]() - arms["native"]()).abs().max())
        yield Case(f"{label} decode with sinks, {T} cached: torch vs native", arms, f"largest difference {diff:.1e}")
        return

    def prompt(name: str) -> torch.Tensor:
        kv, keys, values = caches[name]
        return torch.cat([kv.attend(q[a:b], keys[:b], values[:b], a) for a, b in attention.query_chunks(T, 128)])

    def decode(name: str) -> torch.Tensor:
        kv, keys, values = caches[name]
        return kv.attend(q[-1:], keys, values, T - 1)

    yield Case(f"{label} prompt of {T}", {n: lambda n=n: prompt(n) for n in caches}, "-", 4 * T * T / 2 * heads * d)
    yield Case(f"{label} decode, {T} cached", {n: lambda n=n: decode(n) for n in caches}, "-")


def threads_header(args: argparse.Namespace) -> str:
    base = f"; baseline: the native library of {args.before}" if getattr(args, "before", None) else ""
    return f"{args.threads} threads (torch's and the lane pool's){base}"


def _no_args(ap: argparse.ArgumentParser) -> None:
    del ap


LAYER_SUITES = {
    "attention": Suite(
        "a prompt's attention: torch's SDPA (or --before's native attention) vs the native flash attention",
        5,
        2,
        attention_args,
        lambda args: threads_header(args) + f", queries {args.chunk} a call",
        attention_cases,
    ),
    "attention-chunks": Suite(
        "one layer's attention over a long span: the engine's against torch's SDPA over wider query chunks",
        5,
        2,
        attention_chunks_args,
        lambda args: threads_header(args) + f", the engine's queries {args.chunk} a call",
        attention_chunks_cases,
    ),
    "deltanet": Suite(
        "the Gated DeltaNet's delta rule and conv: torch (or --before's native loop) vs the native loops",
        21,
        2,
        deltanet_args,
        threads_header,
        deltanet_cases,
    ),
    "norm": Suite("a span's RMSNorm: torch vs the native loop", 11, 2, _no_args, threads_header, norm_cases),
    "kv-dtype": Suite(
        "the KV cache's reads with the cache in bf16 (baseline) and float16 (measured); GPT-OSS's decode with "
        "sinks in torch (baseline) and native (measured)",
        21,
        2,
        kv_dtype_args,
        threads_header,
        kv_dtype_cases,
    ),
}
