"""Batched steps: blocks of tokens of B sequences in one forward step (one new token of each decoding
sequence, a prompt span of each joining one), each block's result bit-identical to that sequence's own
`forward` of those tokens.

Exactness rule: an op runs on all B rows at once only where its per-row result cannot depend on the other
rows: the lane kernels (ms_qmm, ms_moe_ffn and ms_moe_ffn_clamped: each output row is its own dot products
over its own quantized activations, whatever m is), the float32 gemv of the routers (ms_gemv_f32: one row at
a time) and the native RMSNorm (a loop over rows), each at the row counts where the one-row call takes the
same code path. Torch's matmuls (f32, bf16, int4) pick kernels by shape, and its vectorized transcendental ops
may round a tail differently, so those run per row. tests/test_batch.py holds the kernels to this.

A block of several tokens (a prompt span) runs everything that is not row-invariant at its size (torch's
GEMMs, the router past GEMV_ROWS rows, norms past the native size limit, attention) as forward runs it on
that block alone; the one-token blocks run together as rows.

What the rows and blocks share is the expensive part: each layer's routed experts are fetched once for the
union of all blocks' choices and each lane expert runs once on all rows routed to it; every weight in the
lane form (the projections of most quantized models) is read once a step for the one-token rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from moestream.compute import linear, native
from moestream.compute.linear import QLinear
from moestream.models.common import ExpertProvider, Fused, by_query_chunks, f32_matmul, rms_norm
from moestream.models.moe import (
    ClampedSwiGLU,
    DenseFFN,
    InOrderSum,
    MoE,
    lane_act,
    row_batches,
    summed_as_they_come,
    swiglu,
)

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
    if native.lib() is None or x.dtype != torch.float32 or w.dtype != torch.float32:
        return per_row(lambda r: rms_norm(r, w, eps), x)
    return rms_norm(x, w, eps)


def f32_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """f32_matmul of each row of x [B, K] (routers), up to GEMV_ROWS rows a call where one row takes the
    native gemv."""
    if native.lib() is None or x.dtype != torch.float32 or not w.is_contiguous():
        return per_row(lambda r: f32_matmul(r, w), x)
    return torch.cat([f32_matmul(x[a : a + GEMV_ROWS], w) for a in range(0, x.shape[0], GEMV_ROWS)])


@dataclass(frozen=True)
class Ops:
    """How a mixer's row-wise parts run: `mm(linear, x)` and `norm(x, weight, eps)`. ALONE is forward's (the
    tokens of one sequence), ROWS the batched step's (one token of each of several sequences)."""

    mm: Callable[[Any, torch.Tensor], Any]
    norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


ALONE = Ops(lambda lin, x: lin(x), rms_norm)
ROWS = Ops(linear_rows, norm_rows)


class SplitMixer(Protocol):
    """A mixer whose projections (row-wise: shared by a batched step's rows) are split from what each
    sequence does over its own cache at its own position."""

    def project(self, x: torch.Tensor, ops: Ops) -> tuple[torch.Tensor, ...]: ...

    def core(self, parts: tuple[torch.Tensor, ...], layer: int, kv: Any, pos: int, rope: Any) -> torch.Tensor: ...

    def output(self, a: torch.Tensor, ops: Ops) -> torch.Tensor: ...


def split_call(mixer: SplitMixer, x: torch.Tensor, layer: int, kv: Any, pos: int, rope: Any) -> torch.Tensor:
    """The mixer on T tokens of one sequence (forward); a long span a query chunk at a time (by_query_chunks)."""

    def run(xc: torch.Tensor, p: int) -> torch.Tensor:
        return mixer.output(mixer.core(mixer.project(xc, ALONE), layer, kv, p, rope), ALONE)

    return by_query_chunks(x, kv, pos, run)


def split_rows(mixer: SplitMixer, x: torch.Tensor, layer: int, kvs: list, positions: list[int], rope: Any):
    """The mixer on one token of each of B sequences: projections on all rows at once, the core per row."""
    parts = mixer.project(x, ROWS)
    cores = [mixer.core(tuple(t[b : b + 1] for t in parts), layer, kvs[b], p, rope) for b, p in enumerate(positions)]
    return mixer.output(torch.cat(cores), ROWS)


def swiglu_rows(ffn: DenseFFN, x: torch.Tensor) -> torch.Tensor:
    """A dense SwiGLU (a leading dense block, a shared expert's parts) on rows of x [B, hidden]."""
    gate, up = fused_rows(ffn.gate_up, x)
    return linear_rows(ffn.down, per_row_pair(gate, up))


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
    blocks bs (the row-wise batched path), `block(b, x[a:e])` for each longer block alone, as forward runs
    that block's tokens."""
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


def ffn_blocks(
    ffn: MoE | DenseFFN, x: torch.Tensor, spans: Spans, experts: ExpertProvider, forced: list[torch.Tensor | None]
) -> torch.Tensor:
    """A block's feed-forward (routed or dense) on a step's blocks of x [N, hidden]."""
    if isinstance(ffn, MoE):
        return moe_blocks(ffn, x, spans, experts, forced)
    return blockwise(x, spans, lambda _bs, xr: swiglu_rows(ffn, xr), lambda _b, xb: ffn(xb))


def router_blocks(moe: MoE, x: torch.Tensor, spans: Spans) -> list[torch.Tensor]:
    """Each block's router logits [T_b, E(+1)]: the one-token blocks' rows together (gemv row-invariant),
    a longer block's as forward computes them (torch's GEMM past GEMV_ROWS rows)."""
    singles = [a for a, e in spans if e - a == 1]
    if singles:
        rows = moe.router_logits(f32_rows(x if len(singles) == x.shape[0] else x[singles], moe.gates))
    out, j = [], 0
    for a, e in spans:
        if e - a == 1:
            out.append(rows[j : j + 1])
            j += 1
        else:
            out.append(moe.router_logits(f32_matmul(x[a:e], moe.gates)))
    return out


def moe_blocks(
    moe: MoE, x: torch.Tensor, spans: Spans, experts: ExpertProvider, forced: list[torch.Tensor | None]
) -> torch.Tensor:
    """The MoE block on a step's blocks of x [N, hidden]: each block routed (and forced) as forward routes it,
    the union of all blocks' experts fetched once and each expert run once on all the rows routed to it."""
    E, B = moe.n_experts, len(spans)
    logits = router_blocks(moe, x, spans)
    routes = [moe.route(logits[b], forced[b]) for b in range(B)]
    mixed = routed_blocks(x, spans, routes, moe.expert_layer, experts, moe.ffn)
    fused = moe.shared
    if fused is None:
        return mixed[0] if B == 1 else torch.cat(mixed)

    def shared_block(_b: int, xb: torch.Tensor) -> torch.Tensor:
        gate, up = fused(xb)
        return moe.shared_down(F.silu(gate) * up)

    def shared_rows(_bs: list[int], xr: torch.Tensor) -> torch.Tensor:
        gate, up = fused_rows(fused, xr)
        return linear_rows(moe.shared_down, per_row_pair(gate, up))

    shared = blockwise(x, spans, shared_rows, shared_block)
    out = []
    for b, ((a, e), m) in enumerate(zip(spans, mixed, strict=True)):
        s = shared[a:e]
        if moe.shared_gate:
            s = s * torch.sigmoid(logits[b][:, E:])
        out.append(m + s)
    return out[0] if B == 1 else torch.cat(out)


@dataclass
class _Block:
    """How one block's results are summed as forward sums them: one token by a fixed-order product over its
    experts sorted by id (its rows of the step's buffer Y, from `first`), several by adding each expert's
    weighted rows in id order (`summed`, an InOrderSum over the block's sorted (token, slot) pairs)."""

    first: int  # one token: its first row of Y
    weights: torch.Tensor | None  # one token: [k] by expert id
    summed: InOrderSum | None  # several tokens


Runs = dict[int, list[tuple[int, list[int], list[int]]]]  # expert -> per block: (block, its rows of x, dst)


def routed_blocks(
    x: torch.Tensor,
    spans: Spans,
    routes: list[tuple[torch.Tensor, torch.Tensor]],
    layer: int,
    experts: ExpertProvider,
    ffn: ClampedSwiGLU | None,
) -> list[torch.Tensor]:
    """Each block's sum_k w_k * expert_k(x_t) [T_b, hidden], each expert output and each sum computed as
    run_experts computes them for that block alone. The union of all blocks' experts (in first-seen order,
    or by id where run_experts would ask in order) is fetched in one call; an expert's rows of every block
    run in one lane kernel call (row-invariant), any other expert per block, as forward runs it. dst: a
    one-token block's rows of Y (unused for several tokens, whose rows the block's InOrderSum knows)."""
    blocks: list[_Block] = []
    runs: Runs = {}
    singles = 0
    ordered = False
    for b, ((a, _e), (w, ids)) in enumerate(zip(spans, routes, strict=True)):
        T, k = ids.shape
        if T == 1:
            id_list, w_list = ids[0].tolist(), w[0].tolist()
            by_id = sorted(range(k), key=id_list.__getitem__)
            blocks.append(_Block(singles, torch.tensor([w_list[p] for p in by_id], dtype=x.dtype), None))
            slot = {p: singles + r for r, p in enumerate(by_id)}
            for p, ex in enumerate(id_list):  # fetched in the router's order, as forward fetches one token's
                runs.setdefault(ex, []).append((b, [a], [slot[p]]))
            singles += k
            continue
        order = torch.argsort(ids.reshape(-1), stable=True)
        needed_t, counts_t = torch.unique_consecutive(ids.reshape(-1)[order], return_counts=True)
        needed, counts = needed_t.tolist(), counts_t.tolist()
        rows = order // k
        starts = dict(zip(needed, itertools.accumulate([0, *counts[:-1]]), strict=True))
        count = dict(zip(needed, counts, strict=True))
        summed = InOrderSum(torch.zeros(T, x.shape[1], dtype=x.dtype), needed, rows, w.reshape(-1)[order, None],
                            starts, count)  # fmt: skip
        blocks.append(_Block(0, None, summed))
        ordered = ordered or summed_as_they_come(rows.shape[0])
        src = (rows + a).tolist()
        for ex in needed:
            runs.setdefault(ex, []).append((b, src[starts[ex] : starts[ex] + count[ex]], []))
    Y = torch.empty(singles, x.shape[1], dtype=x.dtype)
    for group in experts.fetch_groups(layer, sorted(runs) if ordered else list(runs), ordered=ordered):
        if all(linear.lane_swiglu_ok(w) for _, w in group):
            n_rows = {e: sum(len(src) for _, src, _ in runs[e]) for e, _ in group}  # every block's rows of e
            for part in row_batches(group, n_rows):
                _lane_part(x, Y, blocks, part, runs, ffn)
            continue
        for ex, expert in group:
            for b, src, dst in runs[ex]:
                xe = x[src].to(expert[0].dtype)
                _deliver(Y, blocks[b], ex, dst, ffn(ex, expert, xe) if ffn is not None else swiglu(expert, xe).float())
    out = []
    for blk in blocks:
        if blk.summed is not None:
            out.append(blk.summed.result())
        else:
            assert blk.weights is not None
            out.append((blk.weights @ Y[blk.first : blk.first + len(blk.weights)])[None])
    return out


def _deliver(Y: torch.Tensor, blk: _Block, ex: int, dst: list[int], y: torch.Tensor) -> None:
    """Expert ex's output rows for one block: into Y (one token) or the block's in-order sum."""
    if blk.summed is not None:
        blk.summed.add(ex, y)
    else:
        Y[dst] = y


def _lane_part(
    x: torch.Tensor, Y: torch.Tensor, blocks: list[_Block], part: list, runs: Runs, ffn: ClampedSwiGLU | None
) -> None:
    """One lane_swiglu call for a part's experts, each on its rows of every block (gathered in expert order:
    each expert's inputs and outputs one contiguous slice), each block's slice then delivered."""
    src = [r for ex, _ in part for _, s, _ in runs[ex] for r in s]
    xg = x[src]
    yg = torch.empty(len(src), x.shape[1], dtype=x.dtype)
    ends = list(itertools.accumulate(sum(len(s) for _, s, _ in runs[ex]) for ex, _ in part))
    spans = list(zip([0, *ends[:-1]], ends, strict=True))
    linear.lane_swiglu([w for _, w in part], [xg[a:b] for a, b in spans], [yg[a:b] for a, b in spans],
                       lane_act(ffn, [ex for ex, _ in part]))  # fmt: skip
    at = 0
    for ex, _ in part:
        for b, s, dst in runs[ex]:
            _deliver(Y, blocks[b], ex, dst, yg[at : at + len(s)])
            at += len(s)
