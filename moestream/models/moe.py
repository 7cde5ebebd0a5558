"""The mixture-of-experts FFN every architecture here uses: a router picks the top-k routed experts
(streamed in by the expert provider), each a SwiGLU (down(silu(gate(x)) * up(x))); optionally one always-on
shared expert, optionally scaled by a sigmoid gate of its own.

The router is a softmax over all experts (Qwen) or, as DeepSeek-V2/V3 and their kin configure it
(Routing), a softmax or sigmoid whose top-k is chosen within the best groups of experts, optionally after
adding a correction bias that steers the choice but not the weights, the weights renormalised and scaled.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from moestream.compute import linear
from moestream.errors import ModelFileError
from moestream.models.common import ExpertProvider, Fused, add_weighted_rows, f32_matmul, route_topk
from moestream.models.loader import Weights

# (token, expert) pairs past which a call's experts are fetched in id order and summed as they come: a
# micro-batch's pairs are few, a long span's would otherwise all be held until the last expert arrives
ORDERED_MIN_PAIRS = 1024

# llama.cpp clamps the sum of the chosen weights to the smallest normal F16 before dividing by it
MIN_WEIGHT_SUM = 6.103515625e-5


@dataclass(frozen=True)
class Routing:
    """How a router turns its logits into (weights, experts); the default is the plain softmax top-k."""

    # "softmax" over all experts, an independent "sigmoid" per expert, or "softmax_topk": the top-k logits
    # chosen first and the softmax taken over those k only (GPT-OSS)
    gating: str = "softmax"
    norm: bool = True  # renormalise the k chosen weights to sum to 1
    scale: float = 1.0  # then multiply them by this (routed_scaling_factor)
    n_group: int = 1  # experts split into this many groups of consecutive ids
    topk_group: int = 1  # the top-k is taken only within this many best groups
    # a group's score: "top2", the sum of its two best (biased) scores (DeepSeek-V3's noaux_tc, and what
    # llama.cpp computes), or "max", its best one (DeepSeek-V2's group_limited_greedy)
    group_score: str = "top2"

    @property
    def plain(self) -> bool:
        return self.gating == "softmax" and self.scale == 1.0 and self.n_group == 1


def route_general(
    logits: torch.Tensor,
    k: int,
    r: Routing,
    bias: torch.Tensor | None = None,
    forced: torch.Tensor | None = None,
    layer: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) [T, k] under any Routing. `bias` [E] is added to the scores for choosing only; the
    weights are the unbiased scores of the chosen experts. Groups left out are masked with -inf (as
    llama.cpp and DeepSeek's reference code do), so a negative biased score never loses to a masked one."""
    if not torch.isfinite(logits).all():
        where = "" if layer is None else f"layer {layer}: "
        raise ModelFileError(
            f"{where}the router's output is not finite (NaN/inf); "
            "the model file is broken (corrupted weights or hyperparameters)"
        )
    T, E = logits.shape
    if r.gating == "softmax_topk":
        ids = logits.topk(k, dim=-1).indices if forced is None else forced
        weights = torch.softmax(logits.gather(-1, ids), dim=-1)
        return (weights * r.scale if r.scale != 1.0 else weights), ids
    probs = torch.sigmoid(logits) if r.gating == "sigmoid" else torch.softmax(logits, dim=-1)
    if forced is None:
        select = probs if bias is None else probs + bias
        if r.n_group > 1:
            groups = select.view(T, r.n_group, E // r.n_group)
            if r.group_score == "max":
                score = groups.max(dim=-1).values
            else:
                score = groups.topk(min(2, E // r.n_group), dim=-1).values.sum(dim=-1)
            keep = torch.zeros(T, r.n_group, dtype=torch.bool)
            keep.scatter_(1, score.topk(r.topk_group, dim=-1).indices, True)
            select = select.masked_fill(~keep.repeat_interleave(E // r.n_group, dim=1), float("-inf"))
        ids = select.topk(k, dim=-1).indices
    else:
        ids = forced
    weights = probs.gather(-1, ids)
    if r.norm:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(MIN_WEIGHT_SUM)
    if r.scale != 1.0:
        weights = weights * r.scale
    return weights, ids


def route(
    logits: torch.Tensor, k: int, norm: bool, forced: torch.Tensor | None = None, layer: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) [T, k] of the top-k experts; `forced` [T, k] replaces the choice (a route trace) while
    the weights stay the router's own probabilities for those experts, renormalised over the k when norm."""
    if forced is None:
        return route_topk(logits, k, norm, layer=layer)
    weights = torch.softmax(logits, dim=-1).gather(-1, forced)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, forced


def swiglu(expert, x: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) with x already in the expert's compute dtype; the cache may hand gate and
    up over as one fused matrix (gate_up, None, down)."""
    gate, up, down = expert
    if up is None:
        a, b = gate.mm(x).chunk(2, dim=-1)
    else:
        a, b = gate.mm(x), up.mm(x)
    return down.mm((F.silu(a) * b).to(down.dtype))


@dataclass(frozen=True, eq=False)
class ClampedSwiGLU:
    """GPT-OSS's expert: biases on gate, up and down (resident [E, rows]: small next to the weights), the gate
    clamped from above and up from both sides at `limit`, and down(g * sigmoid(alpha * g) * (u + 1))."""

    gate_bias: torch.Tensor  # [E, F]
    up_bias: torch.Tensor  # [E, F]
    down_bias: torch.Tensor  # [E, hidden]
    alpha: float
    limit: float

    def __call__(self, e: int, expert, x: torch.Tensor) -> torch.Tensor:
        """Expert e on x (in the expert's compute dtype) -> float32 [T, hidden]."""
        gate, up, down = expert
        if up is None:
            a, b = gate.mm(x).float().chunk(2, dim=-1)
        else:
            a, b = gate.mm(x).float(), up.mm(x).float()
        a = (a + self.gate_bias[e]).clamp(max=self.limit)
        b = (b + self.up_bias[e]).clamp(min=-self.limit, max=self.limit)
        h = a * torch.sigmoid(a * self.alpha) * (b + 1)
        return down.mm(h.to(down.dtype)).float() + self.down_bias[e]

    def lane(self, ids: list[int]) -> linear.ClampedAct:
        """The same experts' biases and activation for lane_swiglu (one native call for a group)."""
        biases = [(self.gate_bias[e], self.up_bias[e], self.down_bias[e]) for e in ids]
        return linear.ClampedAct(biases, self.alpha, self.limit)


def lane_act(ffn: ClampedSwiGLU | None, ids: list[int]) -> linear.ClampedAct | None:
    """lane_swiglu's `act` for experts `ids`: None for the plain SwiGLU."""
    return None if ffn is None else ffn.lane(ids)


def run_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    layer: int,
    experts: ExpertProvider,
    ffn: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """sum_k w_k * expert_k(x) for each token, experts taken in whatever order the provider delivers them.

    Results are summed in a fixed order (by expert id) once all are in, so the output does not depend on
    which experts were cached: streaming must never change the result. Each group the provider hands over
    (the cached experts, then misses as their reads complete) runs as one native call when the experts are in
    the lane form; otherwise expert by expert, activations kept in the experts' compute dtype. `ffn` replaces
    the plain SwiGLU (GPT-OSS's clamped one, its biases passed to the native call).
    """
    T = x.shape[0]
    if T == 1:
        id_list, w_list = ids[0].tolist(), weights[0].tolist()
        by_id = sorted(range(len(id_list)), key=id_list.__getitem__)
        order = {id_list[p]: r for r, p in enumerate(by_id)}
        w_sorted = torch.tensor([w_list[p] for p in by_id], dtype=x.dtype)
        outs = torch.empty(len(id_list), x.shape[1])
        xc = x.contiguous()
        for group in experts.fetch_groups(layer, id_list):
            if all(linear.lane_swiglu_ok(w) for _, w in group):  # written straight into their rows of outs
                linear.lane_swiglu(
                    [w for _, w in group], [xc] * len(group), [outs[order[e] : order[e] + 1] for e, _ in group],
                    lane_act(ffn, [e for e, _ in group]),
                )  # fmt: skip
                continue
            for e, expert in group:
                xe = x.to(expert[0].dtype)
                outs[order[e]] = ffn(e, expert, xe)[0] if ffn is not None else swiglu(expert, xe)[0].float()
        return (w_sorted @ outs)[None]  # one fixed-order reduction over the experts, whatever came first
    # Every (token, slot) pair grouped by expert: expert e's rows are one contiguous range of the sorted
    # order, its inputs one gather of x, and the final sum an index_add per expert in id order.
    k = ids.shape[1]
    order = torch.argsort(ids.reshape(-1), stable=True)
    needed_t, counts_t = torch.unique_consecutive(ids.reshape(-1)[order], return_counts=True)
    needed, counts = needed_t.tolist(), counts_t.tolist()
    starts = dict(zip(needed, itertools.accumulate([0, *counts[:-1]]), strict=True))
    count = dict(zip(needed, counts, strict=True))
    rows = order // k
    rows_np = rows.numpy()
    total = InOrderSum(torch.zeros_like(x), needed, rows, weights.reshape(-1)[order, None], starts, count)
    prepared: linear.PreparedRows | None = None  # x quantized once, when the first lane-form batch comes
    for group in experts.fetch_groups(layer, needed, ordered=summed_as_they_come(rows.shape[0])):
        for part in row_batches(group, count):
            spans = [(starts[e], starts[e] + count[e]) for e, _ in part]
            if all(linear.lane_swiglu_ok(w) for _, w in part):  # the native call copies its rows of `prepared`
                prepared = prepared or linear.PreparedRows(x.contiguous())
                sizes = [b - a for a, b in spans]
                ys = list(torch.empty(sum(sizes), x.shape[1]).split(sizes))  # one allocation for the batch
                inputs = linear.RowsOf(prepared, [rows_np[a:b] for a, b in spans])
                linear.lane_swiglu([w for _, w in part], inputs, ys, lane_act(ffn, [e for e, _ in part]))
            else:
                # one gather for the batch (each torch op wakes its thread pool), then a view per expert
                gathered = x[torch.from_numpy(np.concatenate([rows_np[a:b] for a, b in spans]))]
                xs = list(gathered.split([b - a for a, b in spans]))
                ys = [ffn(e, expert, xe.to(expert[0].dtype)) if ffn is not None
                      else swiglu(expert, xe.to(expert[0].dtype)).float()
                      for (e, expert), xe in zip(part, xs, strict=True)]  # fmt: skip
            for (e, _), ye in zip(part, ys, strict=True):
                total.add(e, ye)
    return total.result()


def summed_as_they_come(pairs: int) -> bool:
    """Whether a call of this many (token, expert) pairs asks for its experts in order and sums each as it
    comes (ORDERED_MIN_PAIRS): a micro-batch keeps computing cached experts while the misses are read."""
    return pairs > ORDERED_MIN_PAIRS


class InOrderSum:
    """sum_k w_k * expert_k(x_t) for each token t, added expert by expert in ascending id order (the order the
    sorted pairs give), however the experts arrive: an expert's weighted rows wait only while an earlier id
    is missing. With the experts yielded in order nothing waits, so a prompt span holds its output and one
    batch of rows, not a row for every (token, expert) pair."""

    def __init__(
        self,
        out: torch.Tensor,
        needed: list[int],
        rows: torch.Tensor,
        weights: torch.Tensor,
        starts: dict[int, int],
        count: dict[int, int],
    ):
        self.out, self.needed, self.rows, self.weights = out, needed, rows, weights
        self.starts, self.count = starts, count
        self.waiting: dict[int, torch.Tensor] = {}
        self.next = 0

    def add(self, e: int, y: torch.Tensor) -> None:
        """Expert e's outputs for its rows of the sorted pairs (held until the earlier ids are in)."""
        self.waiting[e] = y
        while self.next < len(self.needed) and self.needed[self.next] in self.waiting:
            e = self.needed[self.next]
            a, b = self.starts[e], self.starts[e] + self.count[e]
            add_weighted_rows(self.out, self.rows[a:b], self.waiting.pop(e), self.weights[a:b])
            self.next += 1

    def result(self) -> torch.Tensor:
        assert not self.waiting and self.next == len(self.needed), "an expert was never delivered"
        return self.out


def row_batches(group: list, count: dict[int, int]) -> list[list]:
    """A group's experts in consecutive batches of at most SWIGLU_MAX_ROWS rows (an expert with more alone),
    as lane_swiglu splits its calls: the rows gathered for one batch bound the inputs held at once."""
    batches: list[list] = []
    rows = 0
    for item in group:
        n = count[item[0]]
        if not batches or rows + n > linear.SWIGLU_MAX_ROWS:
            batches.append([])
            rows = 0
        batches[-1].append(item)
        rows += n
    return batches


def expect_experts(w: Weights, p: str, n_experts: int, ffn: int, hidden: int) -> None:
    """The routed experts are streamed by the provider; their shapes are checked here all the same: merged
    `ffn_*_exps` [E, rows, cols], or (older llama-arch Mixtral files) one `ffn_*.E` tensor per expert."""
    if not w.has(p + "ffn_gate_exps.weight") and w.has(p + "ffn_gate.0.weight"):
        for e in range(n_experts):
            w.expect(f"{p}ffn_gate.{e}.weight", (ffn, hidden))
            w.expect(f"{p}ffn_up.{e}.weight", (ffn, hidden))
            w.expect(f"{p}ffn_down.{e}.weight", (hidden, ffn))
        return
    w.expect(p + "ffn_gate_exps.weight", (n_experts, ffn, hidden))
    w.expect(p + "ffn_up_exps.weight", (n_experts, ffn, hidden))
    w.expect(p + "ffn_down_exps.weight", (n_experts, hidden, ffn))


class MoE:
    """One layer's MoE FFN. The router ([E, hidden] float32: routing stays exact) and, when there is one,
    the shared expert's sigmoid gate run as one matmul."""

    def __init__(
        self,
        w: Weights,
        layer: int,
        *,
        hidden: int,
        n_experts: int,
        expert_ffn: int,
        top_k: int,
        norm_topk: bool,
        shared_ffn: int = 0,
        shared_gate: bool = False,
        routing: Routing | None = None,
        expert_layer: int | None = None,
        clamped_swiglu: tuple[float, float] | None = None,
    ):
        """layer: the block (tensor names); expert_layer: the index the expert provider and route traces
        know the layer's experts by (the MoE layers counted from 0 where leading blocks are dense).
        routing: None for the plain softmax top-k (renormalised when norm_topk); a file with a correction
        bias (`exp_probs_b.bias`) has it added to the scores for choosing; a router bias (`ffn_gate_inp.bias`)
        is added to the logits. clamped_swiglu: GPT-OSS's (alpha, limit); its experts carry biases
        (`ffn_{gate,up,down}_exps.bias`)."""
        p = f"blk.{layer}."
        self.layer, self.n_experts, self.top_k, self.norm_topk = layer, n_experts, top_k, norm_topk
        self.expert_layer = layer if expert_layer is None else expert_layer
        self.bias = w.vector(p + "exp_probs_b.bias", n_experts) if w.has(p + "exp_probs_b.bias") else None
        plain = routing is None or (routing.plain and routing.norm == norm_topk)
        # the plain softmax keeps its native top-k (one C call a decode step)
        self.routing = None if plain and self.bias is None else (routing or Routing(norm=norm_topk))
        gates = w.matrix(p + "ffn_gate_inp.weight", n_experts, hidden)
        if shared_gate:
            gates = torch.cat([gates, w.vector(p + "ffn_gate_inp_shexp.weight", hidden).reshape(1, -1)])
        self.gates = gates
        self.shared_gate = shared_gate
        has_bias = w.has(p + "ffn_gate_inp.bias")
        self.router_bias = w.vector(p + "ffn_gate_inp.bias", n_experts) if has_bias else None
        self.ffn: ClampedSwiGLU | None = None
        if clamped_swiglu is not None:
            biases = [w.array(f"{p}ffn_{proj}_exps.bias", (n_experts, rows))
                      for proj, rows in (("gate", expert_ffn), ("up", expert_ffn), ("down", hidden))]  # fmt: skip
            self.ffn = ClampedSwiGLU(*biases, *clamped_swiglu)
        expect_experts(w, p, n_experts, expert_ffn, hidden)
        self.shared: Fused | None = None
        if shared_ffn:
            self.shared = w.fused([(p + "ffn_gate_shexp.weight", shared_ffn, hidden),
                                   (p + "ffn_up_shexp.weight", shared_ffn, hidden)])  # fmt: skip
            self.shared_down = w.linear(p + "ffn_down_shexp.weight", hidden, shared_ffn)

    def router_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """x @ gates.T -> the router's logits [T, E] (+ the shared gate's column), its bias added in place."""
        if self.router_bias is not None:
            logits[:, : self.n_experts] += self.router_bias
        return logits

    def route(self, logits: torch.Tensor, forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, ids) [T, k] from the router's logits."""
        E = self.n_experts
        if self.routing is None:
            return route(logits[:, :E], self.top_k, self.norm_topk, forced, self.layer)
        return route_general(logits[:, :E], self.top_k, self.routing, self.bias, forced, self.layer)

    def __call__(self, x: torch.Tensor, experts: ExpertProvider, forced: torch.Tensor | None = None) -> torch.Tensor:
        """forced [T, k]: expert ids that replace the router's choice (route traces); weights stay its own."""
        E = self.n_experts
        logits = self.router_logits(f32_matmul(x, self.gates))
        weights, ids = self.route(logits, forced)
        if self.shared is None:
            return run_experts(x, weights, ids, self.expert_layer, experts, self.ffn)
        gate, up = self.shared(x)
        shared = self.shared_down(F.silu(gate) * up)
        if self.shared_gate:
            shared = shared * torch.sigmoid(logits[:, E:])
        return run_experts(x, weights, ids, self.expert_layer, experts, self.ffn) + shared


class DenseFFN:
    """A leading block's SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, w: Weights, i: int, hidden: int, ffn: int):
        p = f"blk.{i}."
        self.gate_up = w.fused([(p + "ffn_gate.weight", ffn, hidden), (p + "ffn_up.weight", ffn, hidden)])
        self.down = w.linear(p + "ffn_down.weight", hidden, ffn)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down(F.silu(gate) * up)


def dense_or_moe(w: Weights, i: int, cfg: Any) -> DenseFFN | MoE:
    """Block i's feed-forward in a model whose first `cfg.first_moe_block` blocks are dense (DeepSeek, GLM):
    a dense SwiGLU there, the routed MoE block (its expert layer counted from the first MoE block) after."""
    if i < cfg.first_moe_block:
        return DenseFFN(w, i, cfg.hidden, cfg.dense_ffn)
    return MoE(w, i, hidden=cfg.hidden, n_experts=cfg.n_experts, expert_ffn=cfg.expert_ffn, top_k=cfg.top_k,
               norm_topk=cfg.routing.norm, shared_ffn=cfg.shared_ffn, routing=cfg.routing,
               expert_layer=i - cfg.first_moe_block)  # fmt: skip
