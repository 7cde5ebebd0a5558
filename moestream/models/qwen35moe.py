"""Qwen3.5/3.6 MoE (GGUF arch `qwen35moe`): Qwen3.5-35B-A3B, Qwen3.6-35B-A3B, Qwen3.5-122B-A10B.

A hybrid decoder: three of every four layers mix tokens with a Gated DeltaNet (linear attention with a
fixed-size recurrent state), every fourth with gated full attention. Every layer's FFN is a MoE with a
gated shared expert.

Decoder layer: x += Mixer(RMSNorm(x)); x += MoE(RMSNorm(x)).
Gated DeltaNet, per value head h (which reads key head h % n_k: the converter stores value heads tiled):
    q, k, v = split(silu(causal_depthwise_conv(attn_qkv(x))))      kernel 4, the state keeps 3 inputs
    q, k L2-normalised, q /= sqrt(dk);  beta = sigmoid(ssm_beta(x));  g = ssm_a * softplus(ssm_alpha(x) + dt)
    S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q               S: [dk, dv] per head
    out = ssm_out(RMSNorm(o) * silu(attn_gate(x)))
Gated attention: attn_q gives [q | gate] per head; RMSNorm on each q and k head; NeoX RoPE on the first
rope.dimension_count dims only; out = attn_output(attention * sigmoid(gate)).
MoE: softmax router, top-k renormalised, SwiGLU experts (streamed); plus sigmoid(w_s x) * SwiGLU_shared(x).

Norms: Qwen3.5 computes x_hat * (1 + w); the converter stores 1 + w, so every norm here is plain
x_hat * w (the DeltaNet output norm has no offset on either side).
MRoPE: the file carries rope sections for images; for text all sections see the same position, so it is
ordinary rotary embedding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from moestream.analysis.routes import RouteTrace
from moestream.compute import linear
from moestream.compute.linear import QLinear
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
from moestream.models.qwen3moe import run_experts

CHUNK = 64  # DeltaNet prompt chunk (as transformers' torch_chunk_gated_delta_rule)
N_CHECKPOINTS = 3  # saved recurrent states per sequence: ~63 MB each for the 35B-A3B, so few
# A follow-up chat turn re-renders the previous answer (Qwen's template drops its thinking), so the new
# prompt usually parts from the old one a few tokens before the old prompt's end: keep a state there too.
TAIL = 8


@dataclass
class Qwen35MoeConfig:
    n_layers: int  # the trunk; MTP (nextn) blocks the converter appends are not run
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rot_dim: int  # rotary dims of each head (partial rotary: a quarter of head_dim)
    n_experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int
    vocab_size: int
    context_length: int
    recurrent: list[bool]  # per layer: True = Gated DeltaNet, False = full attention
    conv_kernel: int
    n_k_heads: int
    n_v_heads: int
    k_head_dim: int
    v_head_dim: int
    rope_theta: float = 10_000_000.0
    rms_eps: float = 1e-6

    @property
    def conv_dim(self) -> int:
        return 2 * self.n_k_heads * self.k_head_dim + self.n_v_heads * self.v_head_dim

    @property
    def n_linear(self) -> int:
        return sum(self.recurrent)

    @property
    def state_nbytes(self) -> int:
        """float32 conv + recurrent state of every DeltaNet layer: one sequence position's worth."""
        per_layer = (self.conv_kernel - 1) * self.conv_dim + self.n_v_heads * self.k_head_dim * self.v_head_dim
        return 4 * self.n_linear * per_layer

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> Qwen35MoeConfig:
        def req(key: str):
            v = f.arch_key(key)
            if v is None:
                raise ModelFileError(f"{f.path}: metadata {f.arch}.{key} is missing; the file is incomplete")
            return v

        def scalar(key: str, v):
            if isinstance(v, list):  # llama.cpp allows per-layer arrays; we run uniform layers only
                if len(set(v)) != 1:
                    raise ModelFileError(f"{f.path}: per-layer {f.arch}.{key} values are not supported")
                v = v[0]
            return v

        n_layers = int(req("block_count")) - int(f.arch_key("nextn_predict_layers", 0))
        recurrent = f.arch_key("attention.recurrent_layers")
        if recurrent is not None:
            recurrent = [bool(r) for r in recurrent[:n_layers]]
        else:
            interval = int(f.arch_key("full_attention_interval", 4))
            recurrent = [(i + 1) % interval != 0 for i in range(n_layers)]
        n_heads = int(req("attention.head_count"))
        hidden = int(req("embedding_length"))
        head_dim = int(f.arch_key("attention.key_length", hidden // n_heads))
        n_v_heads, n_k_heads = int(req("ssm.time_step_rank")), int(req("ssm.group_count"))
        if n_v_heads % n_k_heads:
            raise ModelFileError(f"{f.path}: {n_v_heads} value heads do not share {n_k_heads} key heads evenly")
        shared_ffn = f.arch_key("expert_shared_feed_forward_length")  # optional: else the tensors say
        if shared_ffn is None:
            shared_ffn = f.tensor("blk.0.ffn_gate_shexp.weight").shape[0]
        return cls(
            n_layers=n_layers,
            hidden=hidden,
            n_heads=n_heads,
            n_kv_heads=int(f.arch_key("attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            rot_dim=int(f.arch_key("rope.dimension_count", head_dim)),
            n_experts=int(req("expert_count")),
            top_k=int(req("expert_used_count")),
            expert_ffn=int(scalar("expert_feed_forward_length", req("expert_feed_forward_length"))),
            shared_ffn=int(shared_ffn),
            vocab_size=f.tensor("token_embd.weight").shape[0],
            context_length=int(f.arch_key("context_length", 4096)),
            recurrent=recurrent,
            conv_kernel=int(req("ssm.conv_kernel")),
            n_k_heads=n_k_heads,
            n_v_heads=n_v_heads,
            k_head_dim=int(req("ssm.state_size")),
            v_head_dim=int(req("ssm.inner_size")) // n_v_heads,
            rope_theta=float(f.arch_key("rope.freq_base", 10_000_000.0)),
            rms_eps=float(f.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
        )


# ---- per-sequence state --------------------------------------------------------------------------


@dataclass(eq=False)
class Checkpoint:
    """The DeltaNet states as they were after `pos` tokens; pos -1: empty (or being written)."""

    conv: dict[int, torch.Tensor]
    ssm: dict[int, torch.Tensor]
    pos: int = -1


@dataclass(eq=False)
class Cut:
    """Where, inside one forward call, a layer copies its states into a checkpoint."""

    offset: int  # tokens of the call processed when the copy is taken
    into: Checkpoint


class HybridCache(KVCache):
    """KV for the attention layers; conv and recurrent state for the DeltaNet layers; a few checkpoints.

    A recurrent state cannot be truncated, so prompt reuse goes back to the latest checkpoint at or before
    the shared prefix: `truncate` returns that position and the engine recomputes from there. Checkpoints
    are taken at the end of every multi-token call (the engine's prompt micro-batches) and TAIL tokens
    before it. Everything is allocated up front, like the KV cache, so the memory budget stays honest.
    """

    def __init__(self, cfg: Qwen35MoeConfig, ctx: int, dtype: torch.dtype, n_checkpoints: int = N_CHECKPOINTS):
        super().__init__([0 if r else cfg.n_kv_heads for r in cfg.recurrent], cfg.head_dim, ctx, dtype)
        self.cfg = cfg
        self.conv, self.ssm = self._states()
        self.checkpoints = [Checkpoint(*self._states()) for _ in range(n_checkpoints)]

    def _states(self) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        c = self.cfg
        lin = [i for i, r in enumerate(c.recurrent) if r]
        conv = {i: torch.zeros(c.conv_kernel - 1, c.conv_dim) for i in lin}
        ssm = {i: torch.zeros(c.n_v_heads, c.k_head_dim, c.v_head_dim) for i in lin}
        return conv, ssm

    @property
    def nbytes(self) -> int:
        return super().nbytes + (1 + len(self.checkpoints)) * self.cfg.state_nbytes

    def plan_cuts(self, pos: int, T: int) -> list[Cut]:
        """Checkpoints to take during a call of T tokens at pos (none for single tokens: decoding)."""
        if T < 2 or not self.checkpoints:
            return []
        cuts: list[Cut] = []
        for off in sorted({T - TAIL, T}):
            if off <= 0 or any(c.pos == pos + off for c in self.checkpoints):
                continue
            free = [c for c in self.checkpoints if all(c is not u.into for u in cuts)]
            if not free:
                break
            slot = min(free, key=lambda c: c.pos)  # empty slots (-1) first, then the oldest position
            slot.pos = -1  # invalid until the call completes
            cuts.append(Cut(off, slot))
        return cuts

    def commit(self, pos: int, cuts: list[Cut]) -> None:
        for c in cuts:
            c.into.pos = pos + c.offset

    def truncate(self, length: int) -> int:
        if length < self.length:
            self.rewind(length)
        return self.length

    def rewind(self, length: int) -> None:
        """Drop the live state for the latest checkpoint at or before `length` (zeros if there is none)."""
        for c in self.checkpoints:
            if c.pos > length:
                c.pos = -1
        best = max((c for c in self.checkpoints if c.pos >= 0), key=lambda c: c.pos, default=None)
        for i in self.conv:
            if best is None:
                self.conv[i].zero_()
                self.ssm[i].zero_()
            else:
                self.conv[i].copy_(best.conv[i])
                self.ssm[i].copy_(best.ssm[i])
        self.length = best.pos if best is not None else 0


# ---- layers --------------------------------------------------------------------------------------


class Fused:
    """Several projections of one input in as few matmuls as their compute forms allow (see linear.concat)."""

    def __init__(self, parts: list[QLinear]):
        self.groups: list[tuple[QLinear, list[int], list[int]]] = []  # (linear, which outputs, their sizes)
        by_form: dict[tuple[str, int], list[int]] = {}
        for j, p in enumerate(parts):
            by_form.setdefault((p.kind, p.in_features), []).append(j)
        for idx in by_form.values():
            joined = linear.concat([parts[j] for j in idx]) if len(idx) > 1 else None
            if joined is not None:
                self.groups.append((joined, idx, [parts[j].out_features for j in idx]))
            else:
                self.groups += [(parts[j], [j], [parts[j].out_features]) for j in idx]
        self.n = len(parts)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if len(self.groups) == 1:
            lin, _, sizes = self.groups[0]
            return list(lin(x).split(sizes, dim=-1))
        out: list[torch.Tensor] = [x] * self.n
        for lin, idx, sizes in self.groups:
            for j, y in zip(idx, lin(x).split(sizes, dim=-1), strict=True):
                out[j] = y
        return out


@dataclass
class Weights:
    """Reads dense tensors into their compute form and counts the bytes they take."""

    f: GGUFFile
    exact: bool
    nbytes: int = 0
    linears: list[QLinear] = field(default_factory=list)

    def vector(self, name: str) -> torch.Tensor:
        """Norms, routers, conv kernels, per-head constants: small, kept in float32."""
        info = self.f.tensor(name)
        t = torch.from_numpy(quants.dequantize(self.f.read(name), info.ggml_type, info.shape).copy())
        self.nbytes += t.numel() * 4
        return t

    def linear(self, name: str) -> QLinear:
        info = self.f.tensor(name)
        n, k = info.shape
        lin = linear.from_gguf(self.f.read(name), info.ggml_type, n, k, self.exact)
        self.nbytes += lin.nbytes
        self.linears.append(lin)
        return lin

    def fused(self, names: list[str]) -> Fused:
        return Fused([self.linear(n) for n in names])


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, S: torch.Tensor
) -> torch.Tensor:
    """One token: q, k [1, H, dk], v [1, H, dv], g, beta [1, H]; S [H, dk, dv] updated in place; o [1, H, dv]."""
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, 1, d]
    S.mul_(g.exp().view(-1, 1, 1))
    delta = (v - torch.bmm(k, S)) * beta.view(-1, 1, 1)  # what the state mispredicts for v, times beta
    S.baddbmm_(k.transpose(1, 2), delta)
    return torch.bmm(q, S).transpose(0, 1)


def chunk_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, S: torch.Tensor
) -> torch.Tensor:
    """L tokens at once: q, k [H, L, dk], v [H, L, dv], g, beta [H, L]; S updated in place; o [H, L, dv].

    Within a chunk the L sequential rank-1 updates collapse, by the UT transform (DeltaNet paper), into a
    triangular solve and a few matmuls; chunks then pass the state along. Same algebra as transformers'
    torch_chunk_gated_delta_rule, for one sequence.
    """
    H, L, dk = k.shape
    C = min(CHUNK, L)
    pad = -L % C
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (L + pad) // C
    q, k, v = (t.reshape(H, n, C, -1) for t in (q, k, v))
    g, beta = g.reshape(H, n, C), beta.reshape(H, n, C, 1)
    k_beta, v_beta = k * beta, v * beta
    cum = g.cumsum(-1)  # log decay from the chunk's start through each position
    # decay[i, j] = prod of the gates over j < t <= i (0 above the diagonal: the future)
    upper = torch.ones(C, C, dtype=torch.bool).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay  # unit lower triangular once its diagonal is ignored
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * cum.exp()[..., None]  # reads the state as it was at the chunk's start, decayed to each i
    last = cum[..., -1:]
    k_dec = k * (last - cum).exp()[..., None]  # what each token leaves in the state by the chunk's end
    out = torch.empty(H, n, C, v.shape[-1])
    for c in range(n):
        v_new = u[:, c] - w[:, c] @ S
        out[:, c] = q_dec[:, c] @ S + intra[:, c] @ v_new
        S.mul_(last[:, c, :, None].exp()).add_(k_dec[:, c].transpose(-1, -2) @ v_new)
    return out.reshape(H, n * C, -1)[:, :L]


class GatedDeltaNet:
    def __init__(self, w: Weights, i: int, cfg: Qwen35MoeConfig):
        p = f"blk.{i}."
        # the four in-projections of x as one matmul: [qkv | z | beta | alpha]
        self.proj = w.fused([p + n + ".weight" for n in ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha")])
        self.conv = w.vector(p + "ssm_conv1d.weight")  # [conv_dim, kernel]
        self.dt_bias = w.vector(p + "ssm_dt.bias")
        self.a = w.vector(p + "ssm_a")  # -exp(A_log): the converter stores it negated and exponentiated
        self.norm = w.vector(p + "ssm_norm.weight")
        self.out = w.linear(p + "ssm_out.weight")
        self.cfg = cfg
        self.split = [2 * cfg.n_k_heads * cfg.k_head_dim, cfg.n_v_heads * cfg.v_head_dim]
        self.qk_scale = torch.ones(2 * cfg.n_k_heads, 1)
        self.qk_scale[: cfg.n_k_heads] = cfg.k_head_dim**-0.5

    def __call__(
        self, x: torch.Tensor, conv: torch.Tensor, S: torch.Tensor, cuts: list[tuple[int, torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """x [T, hidden]; conv [K-1, conv_dim] and S [Hv, dk, dv]: this layer's live state, updated in place.

        cuts: (offset, conv_into, S_into): copy the states as they are after `offset` of the T tokens.
        """
        cfg = self.cfg
        T, K = x.shape[0], cfg.conv_kernel
        Hk, Hv, dk, dv = cfg.n_k_heads, cfg.n_v_heads, cfg.k_head_dim, cfg.v_head_dim
        qkv, z, b, a = self.proj(x)
        # causal depthwise conv over the kept inputs followed by this call's
        buf = torch.cat([conv, qkv])
        mixed = F.silu((buf.unfold(0, K, 1) * self.conv).sum(-1))
        qk, v = mixed.split(self.split, dim=-1)
        qk = l2_normalize(qk.reshape(T, 2 * Hk, dk)) * self.qk_scale  # q heads also take 1/sqrt(dk)
        q, k = qk[:, :Hk], qk[:, Hk:]
        # value head h reads key head h % Hk: the converter reorders value heads to this tiled layout
        q, k = q.repeat(1, Hv // Hk, 1), k.repeat(1, Hv // Hk, 1)
        v = v.reshape(T, Hv, dv)
        beta = torch.sigmoid(b)
        g = self.a * F.softplus(a + self.dt_bias)
        if T == 1:
            o = delta_rule_step(q, k, v, g, beta, S)
        else:
            q, k, v, g, beta = (t.transpose(0, 1) for t in (q, k, v, g, beta))
            parts, start = [], 0
            for off, conv_into, S_into in cuts:  # run up to each checkpoint, copy the states there, go on
                sl = slice(start, off)
                parts.append(chunk_delta_rule(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], S))
                S_into.copy_(S)
                conv_into.copy_(buf[off : off + K - 1])
                start = off
            if start < T:
                sl = slice(start, T)
                parts.append(chunk_delta_rule(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], S))
            o = torch.cat(parts, dim=1).transpose(0, 1)
        conv.copy_(buf[T:])
        o = rms_norm(o, self.norm, cfg.rms_eps) * F.silu(z.reshape(T, Hv, dv))
        return self.out(o.reshape(T, Hv * dv))


class GatedAttention:
    def __init__(self, w: Weights, i: int, cfg: Qwen35MoeConfig):
        p = f"blk.{i}."
        self.qkv = w.fused([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"])
        self.o = w.linear(p + "attn_output.weight")
        self.q_norm = w.vector(p + "attn_q_norm.weight")
        self.k_norm = w.vector(p + "attn_k_norm.weight")
        self.cfg = cfg

    def __call__(self, x: torch.Tensor, layer: int, kv: KVCache, pos: int, rope: RoPE) -> torch.Tensor:
        cfg = self.cfg
        T, H, Hkv, D = x.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qg, k, v = self.qkv(x)
        qg = qg.view(T, H, 2, D)  # per head: D query dims, then D output-gate dims
        q = rope(rms_norm(qg[:, :, 0], self.q_norm, cfg.rms_eps), pos)
        k = rope(rms_norm(k.view(T, Hkv, D), self.k_norm, cfg.rms_eps), pos)
        keys, values = kv.update(layer, pos, k, v.view(T, Hkv, D))
        out = kv.attend(q, keys, values, pos) * torch.sigmoid(qg[:, :, 1])
        return self.o(out.reshape(T, H * D))


class SharedMoE:
    def __init__(self, w: Weights, i: int, cfg: Qwen35MoeConfig):
        p = f"blk.{i}."
        router = w.vector(p + "ffn_gate_inp.weight")  # [E, H] float32: routing stays exact
        shared_gate = w.vector(p + "ffn_gate_inp_shexp.weight").reshape(1, -1)
        self.gates = torch.cat([router, shared_gate])  # one matmul gives the router logits and the shared gate
        self.shared = w.fused([p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight"])
        self.shared_down = w.linear(p + "ffn_down_shexp.weight")
        self.layer = i
        self.cfg = cfg

    def __call__(self, x: torch.Tensor, experts: ExpertProvider, forced: torch.Tensor | None = None) -> torch.Tensor:
        """forced [T, k]: expert ids that replace the router's choice (route traces); weights stay its own."""
        E = self.cfg.n_experts
        logits = f32_matmul(x, self.gates)
        if forced is None:
            weights, ids = route_topk(logits[:, :E], self.cfg.top_k, norm=True)
        else:
            ids, weights = forced, torch.softmax(logits[:, :E], dim=-1).gather(-1, forced)
            weights = weights / weights.sum(dim=-1, keepdim=True)
        gate, up = self.shared(x)
        shared = self.shared_down(F.silu(gate) * up) * torch.sigmoid(logits[:, E:])
        return run_experts(x, weights, ids, self.layer, experts) + shared


# ---- the model -----------------------------------------------------------------------------------


class Qwen35Moe:
    """The resident part of the model plus the forward pass; routed experts come from `experts`."""

    arch = "qwen35moe"

    def __init__(self, f: GGUFFile, experts: ExpertProvider | None, exact: bool):
        self.cfg = cfg = Qwen35MoeConfig.from_gguf(f)
        self.exact = exact
        self.experts = experts
        w = Weights(f, exact)
        emb = f.tensor("token_embd.weight")
        self._embd_raw = f.read("token_embd.weight")  # rows decoded on lookup; never expanded to float
        self._embd_type = emb.ggml_type
        w.nbytes += self._embd_raw.nbytes
        self.layers = []
        for i in range(cfg.n_layers):
            mixer = GatedDeltaNet(w, i, cfg) if cfg.recurrent[i] else GatedAttention(w, i, cfg)
            self.layers.append(
                (
                    w.vector(f"blk.{i}.attn_norm.weight"),
                    mixer,
                    w.vector(f"blk.{i}.post_attention_norm.weight"),
                    SharedMoE(w, i, cfg),
                )
            )
        self.norm = w.vector("output_norm.weight")
        if "output.weight" in f.tensors:
            self.output = w.linear("output.weight")
        else:  # tied embeddings: the head reads the same bytes as the embedding table
            self.output = linear.from_gguf(self._embd_raw, emb.ggml_type, emb.shape[0], emb.shape[1], exact)
            w.nbytes += self.output.nbytes
        self.dense_nbytes = w.nbytes
        # the output head runs once a token, widened to every thread when it is not in the lane form (a
        # Q4_K_M's Q6_K head); the per-layer weights must all be lane for torch to stay at one thread
        self.lane_decode = linear.all_lane([lin for lin in w.linears if lin is not self.output])
        self.routes: RouteTrace | None = None  # router choices replayed from a trace (--route-trace)
        self.rope = RoPE(cfg.head_dim, cfg.rope_theta, cfg.rot_dim, max_pos=min(cfg.context_length, 4096))

    @staticmethod
    def config_from_gguf(f: GGUFFile) -> Qwen35MoeConfig:
        return Qwen35MoeConfig.from_gguf(f)

    @staticmethod
    def kv_nbytes(cfg: Qwen35MoeConfig, ctx: int, exact: bool) -> int:
        n_attn = cfg.n_layers - cfg.n_linear
        kv = 2 * n_attn * ctx * cfg.n_kv_heads * cfg.head_dim * (4 if exact else 2)
        return kv + (1 + N_CHECKPOINTS) * cfg.state_nbytes

    @staticmethod
    def compute_nbytes(cfg: Qwen35MoeConfig, ubatch: int, ctx: int) -> int:
        """Peak transient memory of one micro-batch of `ubatch` tokens at up to `ctx` positions.

        As Qwen3Moe.compute_nbytes (SDPA's flash kernel holds float keys, not scores), with the DeltaNet
        layer as the widest moment per token: the conv's [K, conv_dim] windows and its outputs, the q/k/v
        head copies of the chunked delta rule and its chunk-by-chunk decay matrices. Measured peaks on
        the qwen3.6-35b-a3b synth shape (ubatch 128 and 512, ctx 4096) were ~0.6x of this.
        """
        keys = 2 * ctx * cfg.n_kv_heads * cfg.head_dim * 4
        max_in = max(cfg.hidden, cfg.n_heads * cfg.head_dim, cfg.n_v_heads * cfg.v_head_dim, cfg.shared_ffn)
        scratch = linear.kernel_scratch_bytes(ubatch, cfg.top_k, cfg.hidden, cfg.expert_ffn, max_in)
        residual = 6 * cfg.hidden
        attn = 3 * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim  # the query comes with its gate
        head = max(cfg.k_head_dim, cfg.v_head_dim)
        deltanet = (cfg.conv_kernel + 3) * cfg.conv_dim + cfg.n_v_heads * (12 * head + 3 * min(CHUNK, ubatch))
        # X and Y of the routed experts (qwen3moe.run_experts), the router, one expert's and the shared
        # expert's intermediates
        moe = 2 * cfg.top_k * cfg.hidden + cfg.n_experts + (cfg.hidden + 3 * cfg.expert_ffn) // 2 + 3 * cfg.shared_ffn
        per_token = 4 * (residual + max(attn, deltanet, moe)) * 3 // 2
        runtime = 4 * 1024 * 1024  # SDPA's per-thread blocks, masks, rope tables
        return keys + scratch + ubatch * per_token + cfg.vocab_size * 4 * 2 + runtime

    def new_kv(self, ctx: int, dtype: torch.dtype | None = None) -> HybridCache:
        dtype = dtype or (torch.float32 if self.exact else torch.bfloat16)
        return HybridCache(self.cfg, ctx, dtype)

    def embed(self, tokens: list[int]) -> torch.Tensor:
        rows = quants.dequantize_rows(self._embd_raw, self._embd_type, self.cfg.hidden, np.asarray(tokens))
        return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))

    def forward(self, tokens: list[int], kv: HybridCache, pos: int, all_logits: bool = False) -> torch.Tensor:
        """Run tokens at positions pos..pos+T-1; returns logits of the last position ([V]) or all ([T, V])."""
        assert self.experts is not None, "no expert provider attached"
        if pos != kv.length:
            raise ValueError(
                f"the recurrent state holds {kv.length} positions but the call starts at {pos}; "
                "truncate the cache first"
            )
        eps = self.cfg.rms_eps
        cuts = kv.plan_cuts(pos, len(tokens))
        x = self.embed(tokens)
        try:
            for i, (attn_norm, mixer, ffn_norm, moe) in enumerate(self.layers):
                h = rms_norm(x, attn_norm, eps)
                if isinstance(mixer, GatedDeltaNet):
                    h = mixer(h, kv.conv[i], kv.ssm[i], [(c.offset, c.into.conv[i], c.into.ssm[i]) for c in cuts])
                else:
                    h = mixer(h, i, kv, pos, self.rope)
                x = x + h
                forced = self.routes.ids(i, pos, len(tokens)) if self.routes is not None else None
                x = x + moe(rms_norm(x, ffn_norm, eps), self.experts, forced)
        except BaseException:  # a read error, Ctrl-C: the layers run so far moved their states past pos
            kv.rewind(pos)
            raise
        kv.advance(pos + len(tokens))
        kv.commit(pos, cuts)
        if not all_logits:
            x = x[-1:]
        with wide_torch():
            logits = self.output(rms_norm(x, self.norm, eps))
        return logits if all_logits else logits[0]
