"""Row-wise ops of a forward step: a step holds blocks of tokens of B sequences (one new token of each
decoding sequence, a prompt span of each joining one), and every block's result is bit-identical to that
sequence's step alone.

Exactness rule: an op runs on all B rows at once only where its per-row result cannot depend on the other
rows: the lane kernels (ms_qmm, ms_moe_ffn and ms_moe_ffn_clamped: each output row is its own dot products
over its own quantized activations, whatever m is), the float32 gemv of the routers (ms_gemv_f32: one row at
a time) and the native RMSNorm (a loop over rows), each at the row counts where the one-row call takes the
same code path. Torch's matmuls (f32, bf16, int4) pick kernels by shape, and its vectorized transcendental ops
may round a tail differently, so those run per row. tests/test_batch.py holds the kernels to this.

A block of several tokens (a prompt span) runs everything that is not row-invariant at its size (torch's
GEMMs, the router past GEMV_ROWS rows, norms past the native size limit, attention) as it runs alone; the
one-token blocks run together as rows (`blockwise`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from moestream.compute import kernels
from moestream.compute.linear import QLinear
from moestream.models.common import Fused
from moestream.models.ops import f32_matmul, rms_norm

GEMV_ROWS = 4  # rows up to which f32_matmul takes the native gemv (one row at a time) instead of torch


def per_row(fn, x: torch.Tensor) -> torch.Tensor:
    """fn on each row of x [B, ...] alone, stacked."""
    return torch.cat([fn(x[b : b + 1]) for b in range(x.shape[0])])


def linear_rows(lin: QLinear | Fused, x: torch.Tensor) -> Any:
    """lin(x) for rows of x [B, K]: one call (the weight read once) where the kernel is row-invariant."""
    if isinstance(lin, Fused):
        return fused_rows(lin, x)
    return lin(x) if lin.kind == "lane" else per_row(lin, x)


def fused_rows(f: Fused, x: torch.Tensor) -> list[torch.Tensor]:
    """Fused projections of x [B, K], as linear_rows."""
    if all(lin.kind == "lane" for lin, _, _ in f.groups):
        return f(x)
    rows = [f(x[b : b + 1]) for b in range(x.shape[0])]
    return [torch.cat(parts) for parts in zip(*rows, strict=True)]


def norm_rows(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm of each row of x [B, dim], each with the bits it gets alone (the native loop gives them in
    one call; torch's norm, without the library or for other dtypes, is taken a row at a time)."""
    if not kernels.available() or x.dtype != torch.float32 or w.dtype != torch.float32:
        return per_row(lambda r: rms_norm(r, w, eps), x)
    return rms_norm(x, w, eps)


def f32_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """f32_matmul of each row of x [B, K] (routers), up to GEMV_ROWS rows a call where one row takes the
    native gemv."""
    if not kernels.available() or x.dtype != torch.float32 or not w.is_contiguous():
        return per_row(lambda r: f32_matmul(r, w), x)
    if x.shape[0] <= GEMV_ROWS:
        return f32_matmul(x, w)
    return torch.cat([f32_matmul(x[a : a + GEMV_ROWS], w) for a in range(0, x.shape[0], GEMV_ROWS)])


@dataclass(frozen=True)
class Ops:
    """How a mixer's row-wise parts run: `mm(linear, x)` and `norm(x, weight, eps)`. ALONE for the tokens of one
    sequence, ROWS for one token of each of several sequences."""

    mm: Callable[[Any, torch.Tensor], Any]
    norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


ALONE = Ops(lambda lin, x: lin(x), rms_norm)
ROWS = Ops(linear_rows, norm_rows)


def per_row_pair(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, row by row (torch's vectorized silu may round a row differently within a batch)."""
    return torch.cat([F.silu(gate[b : b + 1]) * up[b : b + 1] for b in range(gate.shape[0])])


# ---- blocks: T_b tokens of each of B sequences in one step (a prompt chunk beside one-token rows) ---------

Spans = list[tuple[int, int]]  # block b's rows [a, e) of the step's x


def spans_of(lengths: list[int]) -> Spans:
    ends = list(itertools.accumulate(lengths))
    return list(zip([0, *ends[:-1]], ends, strict=True))


def blockwise(
    x: torch.Tensor,
    spans: Spans,
    rows: Callable[[list[int], torch.Tensor], torch.Tensor],
    block: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """An op over a step's blocks, in x's row order: `rows(bs, x[those rows])` once for all the one-token
    blocks bs (the row-wise batched path), `block(b, x[a:e])` for each longer block alone, as that block
    runs alone."""
    if len(spans) == x.shape[0]:  # every block one token (a decode step): x's rows are the blocks
        return rows(list(range(len(spans))), x)
    if len(spans) == 1:
        return block(0, x)
    singles = [b for b, (a, e) in enumerate(spans) if e - a == 1]
    parts: dict[int, torch.Tensor] = {}
    if singles:
        y = rows(singles, x[[spans[b][0] for b in singles]])
        parts = {b: y[j : j + 1] for j, b in enumerate(singles)}
    for b, (a, e) in enumerate(spans):
        if e - a > 1:
            parts[b] = block(b, x[a:e])
    return parts[0] if len(spans) == 1 else torch.cat([parts[b] for b in range(len(spans))])


def norm_blocks(x: torch.Tensor, spans: Spans, w: torch.Tensor, eps: float) -> torch.Tensor:
    return blockwise(x, spans, lambda _bs, xr: norm_rows(xr, w, eps), lambda _b, xb: rms_norm(xb, w, eps))
