"""The mixture-of-experts FFN every architecture here uses: a router picks the top-k routed experts
(streamed in by the expert provider), each a SwiGLU (down(silu(gate(x)) * up(x))); optionally one always-on
shared expert, optionally scaled by a sigmoid gate of its own.

The router is a softmax over all experts (Qwen) or, as DeepSeek-V2/V3 and their kin configure it
(Routing), a softmax or sigmoid whose top-k is chosen within the best groups of experts, optionally after
adding a correction bias that steers the choice but not the weights, the weights renormalised and scaled.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from moestream.compute.experts import ClampedAct, ExpertWeights
from moestream.models.common import Fused
from moestream.models.layer import Step
from moestream.models.loader import Weights
from moestream.models.ops import f32_matmul
from moestream.models.routed import run_routed
from moestream.models.routing import Routing, route, route_general
from moestream.models.rows import Spans, blockwise, f32_rows, fused_rows, linear_rows, per_row, per_row_pair


@dataclass(frozen=True, eq=False)
class ClampedSwiGLU:
    """GPT-OSS's expert: biases on gate, up and down (resident [E, rows]: small next to the weights), the gate
    clamped from above and up from both sides at `limit`, and down(g * sigmoid(alpha * g) * (u + 1))."""

    gate_bias: torch.Tensor  # [E, F]
    up_bias: torch.Tensor  # [E, F]
    down_bias: torch.Tensor  # [E, hidden]
    alpha: float
    limit: float

    def __call__(self, e: int, expert: ExpertWeights, x: torch.Tensor) -> torch.Tensor:
        """Expert e on x (in the expert's compute dtype) -> float32 [T, hidden]."""
        a, b = (t.float() for t in expert.gate_up(x))
        down = expert.down
        a = (a + self.gate_bias[e]).clamp(max=self.limit)
        b = (b + self.up_bias[e]).clamp(min=-self.limit, max=self.limit)
        h = a * torch.sigmoid(a * self.alpha) * (b + 1)
        return down.mm(h.to(down.dtype)).float() + self.down_bias[e]

    def lane(self, ids: list[int]) -> ClampedAct:
        """The same experts' biases and activation for lane_swiglu (one native call for a group)."""
        biases = [(self.gate_bias[e], self.up_bias[e], self.down_bias[e]) for e in ids]
        return ClampedAct(biases, self.alpha, self.limit)


@dataclass(frozen=True, eq=False)
class ClippedSwiGLU:
    """DeepSeek-V4's and GLM-5.3-Flash's expert: down(silu(min(gate, limit)) * clamp(up, -limit, limit)).
    Lane-form experts (MXFP4 and the other quantized types) run it in the lane kernel's clamped activation
    (alpha 1, no +1 on up, zero biases); others in torch. `hidden`, `ffn`: the experts' sizes (the zero
    biases)."""

    limit: float
    hidden: int = 0
    ffn: int = 0

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)

    def __call__(self, e: int, expert: Any, x: torch.Tensor) -> torch.Tensor:
        a, b = (t.float() for t in expert.gate_up(x))
        down = expert.down
        return down.mm(self.act(a, b).to(down.dtype)).float()

    def lane(self, ids: list[int]) -> ClampedAct:
        zeros = _zero_biases(self.ffn, self.hidden)
        return ClampedAct([zeros] * len(ids), 1.0, self.limit, up_shift=0.0)


@functools.lru_cache(maxsize=4)
def _zero_biases(ffn: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.zeros(ffn), torch.zeros(ffn), torch.zeros(hidden)


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
        self.lookahead: tuple[MoE, torch.Tensor] | None = None  # link_lookahead: the next MoE, the norms' ratio
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

    def route(
        self, logits: torch.Tensor, forced: torch.Tensor | None, tokens: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, ids) [T, k] from the router's logits (`tokens`: the block's token ids, for routers that
        choose by them)."""
        E = self.n_experts
        if self.routing is None:
            return route(logits[:, :E], self.top_k, self.norm_topk, forced, self.layer)
        return route_general(logits[:, :E], self.top_k, self.routing, self.bias, forced, self.layer)

    def __call__(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """The block on a step's blocks of x [N, hidden] (normed): each block routed (or its recorded routes
        taken: the weights stay the router's own), the union of all blocks' experts run once (routed.py)."""
        E, spans = self.n_experts, step.spans
        logits = self.router_blocks(x, spans)
        forced = step.forced(self.expert_layer)
        tokens = step.tokens
        routes = [self.route(logits[b], forced[b], None if tokens is None else tokens[a:e])
                  for b, (a, e) in enumerate(spans)]  # fmt: skip
        if self.lookahead is not None and len(spans) == x.shape[0] and all(f is None for f in forced):
            self._guess_next(x, step)
        mixed = run_routed(x, spans, routes, self.expert_layer, step.experts, self.ffn)
        if self.shared is None:
            return mixed[0] if len(spans) == 1 else torch.cat(mixed)
        shared = blockwise(x, spans, lambda _bs, xr: self._shared_rows(xr), lambda _b, xb: self._shared(xb))
        out = []
        for b, ((a, e), m) in enumerate(zip(spans, mixed, strict=True)):
            s = shared[a:e]
            if self.shared_gate:
                s = s * torch.sigmoid(logits[b][:, E:])
            out.append(m + s)
        return out[0] if len(spans) == 1 else torch.cat(out)

    def _guess_next(self, x: torch.Tensor, step: Step) -> None:
        """Decode rows: the next MoE layer's experts as its router would choose them from this layer's input
        (rescaled from this layer's norm to that layer's), handed to the provider to read ahead."""
        if self.lookahead is None or not getattr(step.experts, "lookahead", False):
            return  # the provider takes no guesses: no router matmul for nothing
        nxt, ratio = self.lookahead
        logits = nxt.router_logits(f32_rows(x * ratio, nxt.gates))
        ids = {int(e) for b in range(x.shape[0]) for e in nxt.route(logits[b : b + 1], None)[1][0]}
        step.experts.guess(nxt.expert_layer, sorted(ids))

    def router_blocks(self, x: torch.Tensor, spans: Spans) -> list[torch.Tensor]:
        """Each block's router logits [T_b, E(+1)]: the one-token blocks' rows together (the gemv is
        row-invariant), a longer block's alone (torch's GEMM past GEMV_ROWS rows)."""
        singles = [a for a, e in spans if e - a == 1]
        if singles:
            rows = self.router_logits(f32_rows(x if len(singles) == x.shape[0] else x[singles], self.gates))
        out, j = [], 0
        for a, e in spans:
            if e - a == 1:
                out.append(rows[j : j + 1])
                j += 1
            else:
                out.append(self.router_logits(f32_matmul(x[a:e], self.gates)))
        return out

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        assert self.shared is not None
        gate, up = self.shared(x)
        return self.shared_down(F.silu(gate) * up)

    def _shared_rows(self, x: torch.Tensor) -> torch.Tensor:
        assert self.shared is not None
        gate, up = fused_rows(self.shared, x)
        return linear_rows(self.shared_down, per_row_pair(gate, up))


class ClippedMoE(MoE):
    """The MoE block with ClippedSwiGLU experts, routed (`limit`) and shared (`shared_limit`) alike."""

    def __init__(self, w: Weights, layer: int, *, limit: float, shared_limit: float, **kw: Any):
        super().__init__(w, layer, **kw)
        self.ffn = ClippedSwiGLU(limit, kw["hidden"], kw["expert_ffn"])  # type: ignore[assignment]
        self.shared_act = ClippedSwiGLU(shared_limit)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        assert self.shared is not None
        gate, up = self.shared(x)
        return self.shared_down(self.shared_act.act(gate, up))

    def _shared_rows(self, x: torch.Tensor) -> torch.Tensor:
        assert self.shared is not None
        gate, up = fused_rows(self.shared, x)
        act = per_row(lambda r: self.shared_act.act(*r.chunk(2, dim=1)), torch.cat([gate, up], dim=1))
        return linear_rows(self.shared_down, act)


class DenseFFN:
    """A leading block's SwiGLU: down(silu(gate(x)) * up(x)); with `limit`, ClippedSwiGLU's clipped one."""

    def __init__(self, w: Weights, i: int, hidden: int, ffn: int, limit: float | None = None):
        p = f"blk.{i}."
        self.gate_up = w.fused([(p + "ffn_gate.weight", ffn, hidden), (p + "ffn_up.weight", ffn, hidden)])
        self.down = w.linear(p + "ffn_down.weight", hidden, ffn)
        self.clip = None if limit is None else ClippedSwiGLU(limit)

    def __call__(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        return blockwise(x, step.spans, lambda _bs, xr: self._rows(xr), lambda _b, xb: self._alone(xb))

    def _alone(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down(F.silu(gate) * up if self.clip is None else self.clip.act(gate, up))

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = fused_rows(self.gate_up, x)
        if self.clip is None:
            return linear_rows(self.down, per_row_pair(gate, up))
        clip = self.clip
        return linear_rows(self.down, per_row(lambda r: clip.act(*r.chunk(2, dim=1)), torch.cat([gate, up], dim=1)))


def dense_or_moe(w: Weights, i: int, cfg: Any) -> DenseFFN | MoE:
    """Block i's feed-forward in a model whose first `cfg.first_moe_block` blocks are dense (DeepSeek, GLM):
    a dense SwiGLU there, the routed MoE block (its expert layer counted from the first MoE block) after."""
    if i < cfg.first_moe_block:
        return DenseFFN(w, i, cfg.hidden, cfg.dense_ffn)
    return MoE(w, i, hidden=cfg.hidden, n_experts=cfg.n_experts, expert_ffn=cfg.expert_ffn, top_k=cfg.top_k,
               norm_topk=cfg.routing.norm, shared_ffn=cfg.shared_ffn, routing=cfg.routing,
               expert_layer=i - cfg.first_moe_block)  # fmt: skip


def link_lookahead(layers: list[Any]) -> None:
    """Give each MoE block the next block's MoE (where that one routes by its router, not by token ids) and the
    ratio of the two FFN norms, for the router lookahead (MoE._guess_next)."""
    moes = [(layer.ffn, layer.ffn_norm) for layer in layers if isinstance(layer.ffn, MoE)]
    for (moe, norm), (nxt, nxt_norm) in zip(moes, moes[1:], strict=False):
        if getattr(nxt, "tid2eid", None) is not None:
            continue
        w = norm.float()
        moe.lookahead = (nxt, torch.where(w != 0, nxt_norm.float() / w, torch.zeros_like(w)))
