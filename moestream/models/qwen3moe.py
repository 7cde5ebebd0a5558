"""Qwen3-MoE (GGUF arch `qwen3moe`): Qwen3-30B-A3B, Qwen3-235B-A22B.

Decoder layer: x += Attn(RMSNorm(x)); x += MoE(RMSNorm(x)).
Attention: grouped-query, RMSNorm on each head of q and k, NeoX-style RoPE (rotate halves), no biases.
MoE: softmax router over all experts, top-k, the k weights renormalised to sum to 1, SwiGLU experts
(down(silu(gate(x)) * up(x))). The routed experts come from an expert provider (the streaming cache);
everything else is resident.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from moestream.analysis.routes import RouteTrace
from moestream.compute import linear, native
from moestream.errors import ModelFileError
from moestream.formats import quants
from moestream.formats.gguf_file import GGUFFile
from moestream.models.common import (
    ExpertProvider,
    KVCache,
    RoPE,
    f32_matmul,
    rms_norm,
    route_topk,
    wide_torch,
)


@dataclass
class Qwen3MoeConfig:
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    expert_ffn: int
    vocab_size: int
    context_length: int
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    norm_topk_prob: bool = True

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> Qwen3MoeConfig:
        def req(key: str) -> int:
            v = f.arch_key(key)
            if v is None:
                raise ModelFileError(f"{f.path}: metadata {f.arch}.{key} is missing; the file is incomplete")
            return v

        hidden = int(req("embedding_length"))
        n_heads = int(req("attention.head_count"))
        emb = f.tensor("token_embd.weight")
        return cls(
            n_layers=int(req("block_count")),
            hidden=hidden,
            n_heads=n_heads,
            n_kv_heads=int(f.arch_key("attention.head_count_kv", n_heads)),
            head_dim=int(f.arch_key("attention.key_length", hidden // n_heads)),
            n_experts=int(req("expert_count")),
            top_k=int(req("expert_used_count")),
            expert_ffn=int(req("expert_feed_forward_length")),
            vocab_size=emb.shape[0],
            context_length=int(f.arch_key("context_length", 4096)),
            rope_theta=float(f.arch_key("rope.freq_base", 1_000_000.0)),
            rms_eps=float(f.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
            norm_topk_prob=bool(f.arch_key("expert_weights_norm", True)),
        )


class Attention:
    def __init__(self, f: GGUFFile, i: int, cfg: Qwen3MoeConfig, load):
        p = f"blk.{i}."
        q, k, v = (load(p + f"attn_{n}.weight") for n in "qkv")
        self.qkv = linear.concat([q, k, v])  # one matmul instead of three when the forms agree
        self.q, self.k, self.v = (None, None, None) if self.qkv is not None else (q, k, v)
        self.o = load(p + "attn_output.weight")
        self.q_norm = load(p + "attn_q_norm.weight", vector=True)
        self.k_norm = load(p + "attn_k_norm.weight", vector=True)
        self.cfg = cfg

    def fused_decode(self, x: torch.Tensor, norm: torch.Tensor, layer: int, kv: KVCache, pos: int, rope: RoPE):
        """The whole block for one token in one native call (norm included), or None when the forms don't allow."""
        lib = native.lib()
        qkv, o, cfg = self.qkv, self.o, self.cfg
        kc, vc = kv.k[layer], kv.v[layer]
        if (
            lib is None
            or qkv is None
            or qkv.kind != "lane"
            or o.kind != "lane"
            or kc is None
            or kc.dtype not in (torch.bfloat16, torch.float32)
            or pos >= kc.shape[0]
        ):
            return None
        rope.ensure(pos + 1)
        half = rope.rot_dim // 2
        x = x.contiguous()
        out = torch.empty_like(x)
        rc = lib.ms_attn_block_decode(
            x.data_ptr(), norm.data_ptr(), cfg.hidden, cfg.rms_eps, qkv.ggml_type, qkv.weight.data_ptr(),
            self.q_norm.data_ptr(), self.k_norm.data_ptr(), cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
            rope.cos_ptr(pos), rope.sin_ptr(pos), 2 * half, kc.data_ptr(), vc.data_ptr(),
            int(kc.dtype == torch.bfloat16), pos, o.ggml_type, o.weight.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"ms_attn_block_decode failed ({rc}) at layer {layer}")
        return out

    def __call__(self, x: torch.Tensor, layer: int, kv: KVCache, pos: int, rope: RoPE) -> torch.Tensor:
        cfg = self.cfg
        T = x.shape[0]
        nq, nkv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        if self.qkv is not None:
            q, k, v = self.qkv(x).split([nq, nkv, nkv], dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q = q.reshape(T, cfg.n_heads, cfg.head_dim)
        k = k.reshape(T, cfg.n_kv_heads, cfg.head_dim)
        v = v.reshape(T, cfg.n_kv_heads, cfg.head_dim)
        q = rope(rms_norm(q, self.q_norm, cfg.rms_eps), pos)
        k = rope(rms_norm(k, self.k_norm, cfg.rms_eps), pos)
        keys, values = kv.update(layer, pos, k, v)
        out = kv.attend(q, keys, values, pos)
        return self.o(out.reshape(T, cfg.n_heads * cfg.head_dim))


class MoE:
    def __init__(self, f: GGUFFile, i: int, cfg: Qwen3MoeConfig, load):
        self.router = load(f"blk.{i}.ffn_gate_inp.weight", vector=True)  # [E, H] float32: routing stays exact
        self.layer = i
        self.cfg = cfg
        # Synthetic files shaped like Qwen3.6's expert geometry carry one always-on shared expert.
        self.shared = None
        if f"blk.{i}.ffn_gate_shexp.weight" in f.tensors:
            self.shared = tuple(load(f"blk.{i}.ffn_{p}_shexp.weight") for p in ("gate", "up", "down"))

    def route(self, x: torch.Tensor, forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k experts and their weights per token; `forced` [T, k] replaces the choice (route traces)."""
        logits = f32_matmul(x, self.router)
        if forced is None:
            return route_topk(logits, self.cfg.top_k, self.cfg.norm_topk_prob)
        ids, weights = forced, torch.softmax(logits, dim=-1).gather(-1, forced)
        if self.cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def __call__(self, x: torch.Tensor, experts: ExpertProvider, forced: torch.Tensor | None = None) -> torch.Tensor:
        weights, ids = self.route(x, forced)
        out = run_experts(x, weights, ids, self.layer, experts)
        if self.shared is not None:
            gate, up, down = self.shared
            out = out + down(F.silu(gate(x)) * up(x))
        return out


def swiglu(expert, x: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) with x already in the expert's compute dtype; the cache may hand gate and
    up over as one fused matrix (gate_up, None, down)."""
    gate, up, down = expert
    if up is None:
        a, b = gate.mm(x).chunk(2, dim=-1)
    else:
        a, b = gate.mm(x), up.mm(x)
    return down.mm((F.silu(a) * b).to(down.dtype))


def run_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, layer: int, experts: ExpertProvider
) -> torch.Tensor:
    """sum_k w_k * expert_k(x) for each token, experts taken in whatever order the provider delivers them.

    Results are summed in a fixed order (by expert id) once all are in, so the output does not depend on
    which experts were cached: streaming must never change the result. Each group the provider hands over
    (the cached experts, then misses as their reads complete) runs as one native call when the experts are in
    the lane form; otherwise expert by expert, activations kept in the experts' compute dtype.
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
                    [w for _, w in group], [xc] * len(group), [outs[order[e] : order[e] + 1] for e, _ in group]
                )
                continue
            for e, expert in group:
                outs[order[e]] = swiglu(expert, x.to(expert[0].dtype))[0].float()
        return (w_sorted @ outs)[None]  # one fixed-order reduction over the experts, whatever came first
    # Every (token, slot) pair grouped by expert: expert e's rows are one contiguous range of the sorted
    # order, its inputs and outputs one slice of X and Y, and the final sum one index_add in that fixed order.
    k = ids.shape[1]
    order = torch.argsort(ids.reshape(-1), stable=True)
    needed_t, counts_t = torch.unique_consecutive(ids.reshape(-1)[order], return_counts=True)
    needed, counts = needed_t.tolist(), counts_t.tolist()
    starts = dict(zip(needed, itertools.accumulate([0, *counts[:-1]]), strict=True))
    count = dict(zip(needed, counts, strict=True))
    rows = order // k
    X = x[rows]
    Y = torch.empty_like(X)
    for group in experts.fetch_groups(layer, needed):
        spans = [(starts[e], starts[e] + count[e]) for e, _ in group]
        if all(linear.lane_swiglu_ok(w) for _, w in group):
            linear.lane_swiglu([w for _, w in group], [X[a:b] for a, b in spans], [Y[a:b] for a, b in spans])
            continue
        for (_e, expert), (a, b) in zip(group, spans, strict=True):
            Y[a:b] = swiglu(expert, X[a:b].to(expert[0].dtype)).float()
    out = torch.zeros_like(x)
    out.index_add_(0, rows, Y * weights.reshape(-1)[order, None])
    return out


class Qwen3Moe:
    """The resident part of the model plus the forward pass; routed experts come from `experts`."""

    arch = "qwen3moe"

    def __init__(self, f: GGUFFile, experts: ExpertProvider | None, exact: bool):
        self.cfg = cfg = Qwen3MoeConfig.from_gguf(f)
        self.exact = exact
        self.experts = experts
        self.dense_nbytes = 0
        linears: list[linear.QLinear] = []

        def load(name: str, vector: bool = False):
            info = f.tensor(name)
            raw = f.read(name)
            if vector:  # norms and routers: small, kept in float32
                t = torch.from_numpy(quants.dequantize(raw, info.ggml_type, info.shape).copy())
                self.dense_nbytes += t.numel() * 4
                return t
            n, k = info.shape
            lin = linear.from_gguf(raw, info.ggml_type, n, k, exact)
            self.dense_nbytes += lin.nbytes
            linears.append(lin)
            return lin

        emb = f.tensor("token_embd.weight")
        self._embd_raw = f.read("token_embd.weight")  # rows decoded on lookup; never expanded to float
        self._embd_type = emb.ggml_type
        self.dense_nbytes += self._embd_raw.nbytes
        self.layers = []
        for i in range(cfg.n_layers):
            self.layers.append(
                (
                    load(f"blk.{i}.attn_norm.weight", vector=True),
                    Attention(f, i, cfg, load),
                    load(f"blk.{i}.ffn_norm.weight", vector=True),
                    MoE(f, i, cfg, load),
                )
            )
        self.norm = load("output_norm.weight", vector=True)
        if "output.weight" in f.tensors:
            self.output = load("output.weight")
        else:  # tied embeddings: the head reads the same bytes as the embedding table
            self.output = linear.from_gguf(self._embd_raw, emb.ggml_type, emb.shape[0], emb.shape[1], exact)
            self.dense_nbytes += self.output.nbytes
        # the output head runs once a token, widened to every thread when it is not in the lane form (a
        # Q4_K_M's Q6_K head); the per-layer weights must all be lane for torch to stay at one thread
        self.lane_decode = linear.all_lane([lin for lin in linears if lin is not self.output])
        self.rope = RoPE(cfg.head_dim, cfg.rope_theta, max_pos=min(cfg.context_length, 4096))
        self.routes: RouteTrace | None = None  # router choices replayed from a trace (--route-trace)

    @staticmethod
    def config_from_gguf(f: GGUFFile) -> Qwen3MoeConfig:
        return Qwen3MoeConfig.from_gguf(f)

    @staticmethod
    def kv_nbytes(cfg: Qwen3MoeConfig, ctx: int, exact: bool) -> int:
        return 2 * cfg.n_layers * ctx * cfg.n_kv_heads * cfg.head_dim * (4 if exact else 2)

    @staticmethod
    def compute_nbytes(cfg: Qwen3MoeConfig, ubatch: int, ctx: int) -> int:
        """Peak transient memory of one micro-batch of `ubatch` tokens at up to `ctx` positions.

        Attention runs through SDPA's flash kernel, which never builds the [T, S] score matrix: what it
        holds is the layer's keys and values converted to float32. Per token, the widest moment is either
        attention (q, k, v and their normed/rotated copies) or the MoE (every chosen expert's output row
        kept until the fixed-order sum, the router, one expert's intermediates), on top of the residual
        stream and its norm temporaries. Measured peaks (first micro-batch in a fresh process, 1-8
        threads, ub 16..512, ctx 2048/4096, the qwen3-30b-a3b and qwen3.6 synth shapes) were 0.55-0.8x
        of this; the 1.5 on the per-token part keeps that margin.
        """
        keys = 2 * ctx * cfg.n_kv_heads * cfg.head_dim * 4
        scratch = linear.kernel_scratch_bytes(
            ubatch, cfg.top_k, cfg.hidden, cfg.expert_ffn, max(cfg.hidden, cfg.n_heads * cfg.head_dim)
        )
        residual = 6 * cfg.hidden
        attn = 3 * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
        moe = 2 * cfg.top_k * cfg.hidden + cfg.n_experts + (cfg.hidden + 3 * cfg.expert_ffn) // 2  # X and Y
        per_token = 4 * (residual + max(attn, moe)) * 3 // 2
        runtime = 4 * 1024 * 1024  # SDPA's per-thread blocks, masks, rope tables
        return keys + scratch + ubatch * per_token + cfg.vocab_size * 4 * 2 + runtime

    def new_kv(self, ctx: int, dtype: torch.dtype | None = None) -> KVCache:
        cfg = self.cfg
        dtype = dtype or (torch.float32 if self.exact else torch.bfloat16)
        return KVCache([cfg.n_kv_heads] * cfg.n_layers, cfg.head_dim, ctx, dtype)

    def embed(self, tokens: list[int]) -> torch.Tensor:
        rows = quants.dequantize_rows(self._embd_raw, self._embd_type, self.cfg.hidden, np.asarray(tokens))
        return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))

    def forward(self, tokens: list[int], kv: KVCache, pos: int, all_logits: bool = False) -> torch.Tensor:
        """Run tokens at positions pos..pos+T-1; returns logits of the last position ([V]) or all ([T, V])."""
        assert self.experts is not None, "no expert provider attached"
        x = self.embed(tokens)
        for i, (attn_norm, attn, ffn_norm, moe) in enumerate(self.layers):
            a = attn.fused_decode(x, attn_norm, i, kv, pos, self.rope) if len(tokens) == 1 else None
            if a is None:
                a = attn(rms_norm(x, attn_norm, self.cfg.rms_eps), i, kv, pos, self.rope)
            x = x + a
            forced = self.routes.ids(i, pos, len(tokens)) if self.routes is not None else None
            x = x + moe(rms_norm(x, ffn_norm, self.cfg.rms_eps), self.experts, forced)
        kv.advance(pos + len(tokens))
        if not all_logits:
            x = x[-1:]
        with wide_torch():
            logits = self.output(rms_norm(x, self.norm, self.cfg.rms_eps))
        return logits if all_logits else logits[0]
