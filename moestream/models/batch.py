"""Batched decode: one new token for each of B sequences in one forward step, each row's result bit-identical
to that sequence's own `forward` of one token.

Exactness rule: an op runs on all B rows at once only where its per-row result cannot depend on the other
rows: the lane kernels (ms_qmm, ms_moe_ffn: each output row is its own dot products over its own quantized
activations, whatever m is), the float32 gemv of the routers (ms_gemv_f32: one row at a time) and the native
RMSNorm (a loop over rows), each at the row counts where the one-row call takes the same code path. Torch's
matmuls (f32, bf16, int4) pick kernels by shape, and its vectorized transcendental ops may round a tail
differently, so those run per row. tests/test_batch.py holds the kernels to this.

What the rows share is the expensive part: each layer's routed experts are fetched once for the union of the
rows' choices and run once on all rows routed to each, and every weight in the lane form (the projections of
most quantized models) is read once a step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moestream.compute import linear, native
from moestream.compute.linear import QLinear
from moestream.models.common import SMALL_OP, ExpertProvider, Fused, f32_matmul, rms_norm
from moestream.models.moe import ClampedSwiGLU, DenseFFN, MoE, swiglu

GEMV_ROWS = 4  # rows up to which f32_matmul takes the native gemv (one row at a time) instead of torch


def per_row(fn, x: torch.Tensor) -> torch.Tensor:
    """fn on each row of x [B, ...] alone, stacked."""
    return torch.cat([fn(x[b : b + 1]) for b in range(x.shape[0])])


def linear_rows(lin: QLinear, x: torch.Tensor) -> torch.Tensor:
    """lin(x) for rows of x [B, K]: one call (the weight read once) where the kernel is row-invariant."""
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
    if native.lib() is None or x.dtype != torch.float32 or dim > SMALL_OP:
        return per_row(lambda r: rms_norm(r, w, eps), x)
    step = SMALL_OP // dim
    return torch.cat([rms_norm(x[a : a + step], w, eps) for a in range(0, x.shape[0], step)])


def f32_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """f32_matmul of each row of x [B, K] (routers), up to GEMV_ROWS rows a call where one row takes the
    native gemv."""
    if native.lib() is None or x.dtype != torch.float32 or not w.is_contiguous():
        return per_row(lambda r: f32_matmul(r, w), x)
    return torch.cat([f32_matmul(x[a : a + GEMV_ROWS], w) for a in range(0, x.shape[0], GEMV_ROWS)])


def swiglu_rows(ffn: DenseFFN, x: torch.Tensor) -> torch.Tensor:
    """A dense SwiGLU (a leading dense block, a shared expert's parts) on rows of x [B, hidden]."""
    gate, up = fused_rows(ffn.gate_up, x)
    return linear_rows(ffn.down, per_row_pair(gate, up))


def per_row_pair(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, row by row (torch's vectorized silu may round a row differently within a batch)."""
    return torch.cat([F.silu(gate[b : b + 1]) * up[b : b + 1] for b in range(gate.shape[0])])


def moe_rows(
    moe: MoE, x: torch.Tensor, experts: ExpertProvider, forced: list[torch.Tensor | None]
) -> torch.Tensor:
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
    outs, weights, union = [], [], {}  # union: expert -> [(row, its slot in that row's buffer)]
    for b, (w, ids) in enumerate(routes):
        id_list, w_list = ids[0].tolist(), w[0].tolist()
        by_id = sorted(range(len(id_list)), key=id_list.__getitem__)
        order = {id_list[p]: r for r, p in enumerate(by_id)}
        weights.append(torch.tensor([w_list[p] for p in by_id], dtype=x.dtype))
        outs.append(torch.empty(len(id_list), H))
        for e in id_list:
            if e in order:
                union.setdefault(e, []).append((b, order.pop(e)))
    for group in experts.fetch_groups(layer, list(union)):
        if ffn is None and all(linear.lane_swiglu_ok(w) for _, w in group):
            xs = [x[[b for b, _ in union[e]]].contiguous() for e, _ in group]
            ys = [torch.empty(len(union[e]), H) for e, _ in group]
            linear.lane_swiglu([w for _, w in group], xs, ys)
            for (e, _), y in zip(group, ys, strict=True):
                for (b, r), row in zip(union[e], y, strict=True):
                    outs[b][r] = row
            continue
        for e, expert in group:
            for b, r in union[e]:
                xb = x[b : b + 1].to(expert[0].dtype)
                outs[b][r] = ffn(e, expert, xb)[0] if ffn is not None else swiglu(expert, xb)[0].float()
    return [(w @ o)[None] for w, o in zip(weights, outs, strict=True)]


def ffn_rows(
    ffn: MoE | DenseFFN, x: torch.Tensor, experts: ExpertProvider, forced: list[torch.Tensor | None]
) -> torch.Tensor:
    """A block's feed-forward (routed or dense) on rows of x [B, hidden]."""
    if isinstance(ffn, MoE):
        return moe_rows(ffn, x, experts, forced)
    return swiglu_rows(ffn, x)
