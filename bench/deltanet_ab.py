"""The Gated DeltaNet's prompt path, torch against the native loop, in one process, call by call.

    python bench/deltanet_ab.py --lengths 128,2048 --threads 2
    python bench/deltanet_ab.py --before /tmp/main-tree --lengths 2048   # two trees' native loops

Times, on random inputs of the Qwen3.6-35B-A3B shape (16 key heads, 32 value heads, 128-dim heads; other
shapes by flag), one call of `chunk_delta_rule` (torch, at --threads of torch's threads, as a prompt step runs
it) and one of `delta_rule_span` (compute/native/deltanet.c on the lane pool's --threads), alternating and the
order swapped every round, then the causal depthwise convolution before it the same way (torch's
unfold-multiply-sum against `causal_conv`). A round's ratio compares calls made milliseconds apart, which a
noisy shared VM cannot blur. Reports per case the median (min-max) over rounds of torch / native (above 1:
the native loop is faster), each side's median milliseconds, and the relative difference of the outputs.
With --before TREE the baseline is that source tree's native delta rule instead of torch (built from its C
sources with this machine's flags, as bench/kernel_ab.py does; the conv is not timed then), and the
difference column says whether both trees give the same bits.

Writes bench/results/<date>-<name>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import ctypes
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
from moestream.models import deltanet  # noqa: E402


def delta_case(
    L: int, Hk: int, Hv: int, d: int, before: ctypes.CDLL | None = None
) -> tuple[dict[str, Callable[[], torch.Tensor]], float]:
    """The arms of one delta-rule case and their outputs' relative difference (with `before`: 0.0 for the
    same bits, 1.0 otherwise; the output and the state compared)."""
    g = torch.Generator().manual_seed(L)
    qk = torch.nn.functional.normalize(torch.randn(L, 2 * Hk, d, generator=g), dim=-1)
    v = torch.randn(L, Hv, d, generator=g)
    decay, beta = -torch.rand(L, Hv, generator=g) * 0.5, torch.rand(L, Hv, generator=g)
    S0 = torch.randn(Hv, d, d, generator=g) * 0.1
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
        return {"before": old, "native": new}, 0.0 if same else 1.0
    q, k = deltanet.value_heads(qk, Hk, Hv)
    heads_first = [t.transpose(0, 1) for t in (q, k, v, decay, beta)]
    arms = {
        "torch": lambda: deltanet.chunk_delta_rule(*heads_first, S0.clone()).transpose(0, 1),
        "native": lambda: deltanet.delta_rule_span(qk, v, decay, beta, S0.clone(), Hk),
    }
    a, b = arms["torch"](), arms["native"]()
    return arms, float((a - b).norm() / a.norm())


def conv_case(L: int, channels: int, K: int) -> tuple[dict[str, Callable[[], torch.Tensor]], float]:
    g = torch.Generator().manual_seed(L)
    buf, w_t = torch.randn(L + K - 1, channels, generator=g), torch.randn(K, channels, generator=g)
    arms = {
        "torch": lambda: (buf.unfold(0, K, 1) * w_t.T).sum(-1),
        "native": lambda: deltanet.causal_conv(buf, w_t),
    }
    a, b = arms["torch"](), arms["native"]()
    return arms, float((a - b).norm() / a.norm())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[128, 2048])
    ap.add_argument("--key-heads", type=int, default=16)
    ap.add_argument("--value-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--conv-channels", type=int, default=8192, help="the conv's width (q, k and v heads)")
    ap.add_argument("--conv-kernel", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--before", help="a source tree whose native delta rule is the baseline instead of torch")
    add_results_args(ap, "deltanet-ab")
    args = ap.parse_args()
    if min(args.lengths) < 1 or args.rounds < 1 or args.threads < 1:
        raise SystemExit("deltanet_ab: --lengths, --rounds and --threads must be at least 1")
    lib = native.lib()
    if lib is None:
        raise SystemExit("deltanet_ab: the native library is not available here (no C compiler?)")
    torch.set_num_threads(args.threads)
    native.set_threads(args.threads)
    before = None
    if args.before:
        before = build_tree(args.before, Path(tempfile.mkdtemp(prefix="deltanet-ab-")), ("ms_delta_rule",))
        before.ms_set_threads(args.threads)
    base = "before" if before is not None else "torch"
    rows: list[dict] = []
    lines = [
        f"{args.threads} threads (torch's and the lane pool's), {args.rounds} rounds"
        + (f"; baseline: the native loop of {args.before}" if before is not None else ""),
        "",
        f"| case | {base}/native (median, min-max over rounds) | {base} ms | native ms | relative difference |",
        "|---|---|---|---|---|",
    ]
    cases = [(f"delta rule, {L} tokens", *delta_case(L, args.key_heads, args.value_heads, args.head_dim, before))
             for L in args.lengths]  # fmt: skip
    if before is None:
        cases += [(f"causal conv, {L} tokens", *conv_case(L, args.conv_channels, args.conv_kernel))
                  for L in args.lengths]  # fmt: skip
    for name, arms, diff in cases:
        with torch.inference_mode():
            times = alternate(arms, args.rounds)
        ratios = [a / b for a, b in zip(times[base], times["native"], strict=True)]
        rows.append({"case": name, "relative_difference": diff, **{f"{a}_s": t for a, t in times.items()}})
        lines.append(
            f"| {name} | {median_range(ratios, 2)}x | {statistics.median(times[base]) * 1e3:.2f} | "
            f"{statistics.median(times['native']) * 1e3:.2f} | {diff:.1e} |"
        )
        log(f"{name}: {statistics.median(ratios):.2f}x")
    args.model = os.devnull  # random inputs: no model file
    save_rows(args, rows, lines)


if __name__ == "__main__":
    main()
