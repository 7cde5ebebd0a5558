"""Batched decode: one new token for each of B sequences in one forward step, each row's result bit-identical
to that sequence's own `forward` of one token.

Exactness rule: an op runs on all B rows at once only where its per-row result cannot depend on the other
rows: the lane kernels (ms_qmm, ms_moe_ffn and ms_moe_ffn_clamped: each output row is its own dot products
over its own quantized activations, whatever m is), the float32 gemv of the routers (ms_gemv_f32: one row at
a time) and the native RMSNorm (a loop over rows), each at the row counts where the one-row call takes the
same code path. Torch's matmuls (f32, bf16, int4) pick kernels by shape, and its vectorized transcendental ops
may round a tail differently, so those run per row. tests/test_batch.py holds the kernels to this.

What the rows share is the expensive part: each layer's routed experts are fetched once for the union of the
rows' choices and run once on all rows routed to each, and every weight in the lane form (the projections of
most quantized models) is read once a step.
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
from moestream.models.common import SMALL_OP, ExpertProvider, Fused, f32_matmul, rms_norm
from moestream.models.moe import ClampedSwiGLU, DenseFFN, MoE, lane_act, swiglu

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
    """rms_norm of each row of x [B, dim], each through the path it takes alone (the native loop over rows
    takes as many rows as stay under its size limit)."""
    dim = x.shape[-1]
    if native.lib() is None or x.dtype != torch.float32 or w.dtype != torch.float32 or dim > SMALL_OP:
        return per_row(lambda r: rms_norm(r, w, eps), x)
    step = SMALL_OP // dim
    return torch.cat([rms_norm(x[a : a + step], w, eps) for a in range(0, x.shape[0], step)])


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
    """The mixer on T tokens of one sequence (forward)."""
    return mixer.output(mixer.core(mixer.project(x, ALONE), layer, kv, pos, rope), ALONE)


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


def moe_rows(moe: MoE, x: torch.Tensor, experts: ExpertProvider, forced: list[torch.Tensor | None]) -> torch.Tensor:
    """The MoE block on rows of x [B, hidden], each row routed (and forced) on its own; the union of their
    experts fetched once and each expert run once on all the rows routed to it."""
    E = moe.n_experts
    logits = moe.router_logits(f32_rows(x, moe.gates))
    routes = [moe.route(logits[b : b + 1], forced[b]) for b in range(x.shape[0])]
    mixed = routed_rows(x, routes, moe.expert_layer, experts, moe.ffn)
    if moe.shared is None:
        return torch.cat(mixed)
    gate, up = fused_rows(moe.shared, x)
    shared = linear_rows(moe.shared_down, per_row_pair(gate, up))
    out = []
    for b, m in enumerate(mixed):
        s = shared[b : b + 1]
        if moe.shared_gate:
            s = s * torch.sigmoid(logits[b : b + 1, E:])
        out.append(m + s)
    return torch.cat(out)


def routed_rows(
    x: torch.Tensor,
    routes: list[tuple[torch.Tensor, torch.Tensor]],
    layer: int,
    experts: ExpertProvider,
    ffn: ClampedSwiGLU | None,
) -> list[torch.Tensor]:
    """Each row's sum_k w_k * expert_k(x_b) [1, hidden], as run_experts computes it for one token: each row's
    expert outputs in its own buffer by expert id, reduced by one fixed-order product per row. The union of
    all rows' experts (in first-seen order) is fetched in one call."""
    H = x.shape[1]
    weights, union, slots = [], {}, 0  # union: expert -> [(row, its slot in the rows' flat buffer)]
    for b, (w, ids) in enumerate(routes):
        id_list, w_list = ids[0].tolist(), w[0].tolist()
        by_id = sorted(range(len(id_list)), key=id_list.__getitem__)
        order = {id_list[p]: slots + r for r, p in enumerate(by_id)}
        weights.append(torch.tensor([w_list[p] for p in by_id], dtype=x.dtype))
        slots += len(id_list)
        for e in id_list:
            if e in order:
                union.setdefault(e, []).append((b, order.pop(e)))
    outs = torch.empty(slots, H)
    for group in experts.fetch_groups(layer, list(union)):
        if all(linear.lane_swiglu_ok(w) for _, w in group):
            # the group's rows gathered in expert order: each expert's inputs and outputs one contiguous slice
            pairs = [pair for e, _ in group for pair in union[e]]
            xg = x[[b for b, _ in pairs]]
            yg = torch.empty(len(pairs), H)
            ends = list(itertools.accumulate(len(union[e]) for e, _ in group))
            spans = list(zip([0, *ends[:-1]], ends, strict=True))
            linear.lane_swiglu([w for _, w in group], [xg[a:b] for a, b in spans], [yg[a:b] for a, b in spans],
                               lane_act(ffn, [e for e, _ in group]))  # fmt: skip
            outs.index_copy_(0, torch.tensor([r for _, r in pairs]), yg)
            continue
        for e, expert in group:
            for b, r in union[e]:
                xb = x[b : b + 1].to(expert[0].dtype)
                outs[r] = ffn(e, expert, xb)[0] if ffn is not None else swiglu(expert, xb)[0].float()
    mixed, first = [], 0
    for w in weights:
        mixed.append((w @ outs[first : first + len(w)])[None])
        first += len(w)
    return mixed


def ffn_rows(
    ffn: MoE | DenseFFN, x: torch.Tensor, experts: ExpertProvider, forced: list[torch.Tensor | None]
) -> torch.Tensor:
    """A block's feed-forward (routed or dense) on rows of x [B, hidden]."""
    if isinstance(ffn, MoE):
        return moe_rows(ffn, x, experts, forced)
    return swiglu_rows(ffn, x)
