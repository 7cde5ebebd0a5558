"""Gated DeltaNet (Yang et al., "Gated Delta Networks"): linear attention whose fixed-size state is
corrected towards each new value (the delta rule) and decayed by a learned gate; and the per-sequence cache
of hybrid models that mix it with full attention.

Per value head h (which reads key head h % n_k: the converter stores value heads tiled):
    q, k, v = split(silu(causal_depthwise_conv(attn_qkv(x))))      kernel K, the state keeps K-1 inputs
    q, k L2-normalised, q /= sqrt(dk);  beta = sigmoid(ssm_beta(x));  g = ssm_a * softplus(ssm_alpha(x) + dt)
    S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q               S: [dk, dv] per head
    out = ssm_out(RMSNorm(o) * silu(attn_gate(x)))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from moestream.compute import kernels
from moestream.models.kv_cache import KVCache, KVSnapshot
from moestream.models.layer import Mixer
from moestream.models.loader import Weights
from moestream.models.ops import rms_norm

CHUNK = 64  # prompt chunk of the delta rule (as transformers' torch_chunk_gated_delta_rule)
N_CHECKPOINTS = 3  # saved recurrent states per sequence: ~63 MB each for the 35B-A3B, so few
# A follow-up chat turn re-renders the previous answer (Qwen's template drops its thinking), so the new
# prompt usually parts from the old one a few tokens before the old prompt's end: keep a state there too.
TAIL = 8


class DeltaNetConfig(Protocol):
    """The sizes a Gated DeltaNet layer and a hybrid cache read from their architecture's config."""

    hidden: int
    n_kv_heads: int
    head_dim: int
    recurrent: list[bool]  # per layer: True = Gated DeltaNet, False = full attention
    conv_kernel: int
    n_k_heads: int
    n_v_heads: int
    k_head_dim: int
    v_head_dim: int
    rms_eps: float

    @property
    def conv_dim(self) -> int: ...

    @property
    def state_nbytes(self) -> int: ...


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, S: torch.Tensor
) -> torch.Tensor:
    """One token: q, k [1, H, dk], v [1, H, dv], beta [1, H]; g [1, H] (a decay per head) or [1, H, dk] (per key
    channel: Kimi Delta Attention); S [H, dk, dv] updated in place; o [1, H, dv]."""
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, 1, d]
    S.mul_(g.exp().reshape(S.shape[0], -1, 1))
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


def causal_conv(buf: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """The causal depthwise convolution of buf [K - 1 + T, C] (the kept inputs, then the new ones) with the
    filter w_t [K, C]: [T, C]. A native loop over channels where it runs: torch's unfold-multiply-sum makes a
    [T, C, K] temporary and is several times slower (bench/RESULTS.md, "The Gated DeltaNet's prompt path in C").
    """
    K = w_t.shape[0]
    if kernels.available() and buf.dtype == w_t.dtype == torch.float32 and w_t.is_contiguous():
        return kernels.causal_conv(buf, w_t)
    return (buf.unfold(0, K, 1) * w_t.T).sum(-1)


def value_heads(qk: torch.Tensor, n_k: int, n_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, n_v, dk] of the query and key heads qk [T, 2 n_k, dk]: value head h reads key head h % n_k
    (the converter reorders value heads to this tiled layout)."""
    q, k = qk[:, :n_k], qk[:, n_k:]
    return q.repeat(1, n_v // n_k, 1), k.repeat(1, n_v // n_k, 1)


def delta_rule_span(
    qk: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, S: torch.Tensor, n_k: int
) -> torch.Tensor:
    """T tokens, token-major: qk [T, 2 n_k, dk] (query heads, then key heads), v [T, Hv, dv], g, beta [T, Hv];
    S [Hv, dk, dv] updated in place; o [T, Hv, dv]. The native loop (compute/native/deltanet.c: the cores of
    the pool, a head's chunk in cache) where it runs, else chunk_delta_rule in torch."""
    T, _, dk = qk.shape
    Hv, dv = v.shape[1:]
    if (
        kernels.available()
        and dk % 8 == 0
        and dv % 8 == 0
        and all(t.dtype == torch.float32 for t in (qk, v, g, beta, S))
        and S.is_contiguous()
    ):
        return kernels.delta_rule(qk, v, g, beta, S, n_k)
    q, k = value_heads(qk, n_k, Hv)
    o = chunk_delta_rule(*(t.transpose(0, 1) for t in (q, k, v, g, beta)), S)
    return o.transpose(0, 1)


class GatedDeltaNet(Mixer):
    def __init__(self, w: Weights, i: int, cfg: DeltaNetConfig):
        p = f"blk.{i}."
        H, nv, dv = cfg.hidden, cfg.n_v_heads, cfg.v_head_dim
        # the four in-projections of x as one matmul: [qkv | z | beta | alpha]
        self.proj = w.fused([(p + "attn_qkv.weight", cfg.conv_dim, H), (p + "attn_gate.weight", nv * dv, H),
                             (p + "ssm_beta.weight", nv, H), (p + "ssm_alpha.weight", nv, H)])  # fmt: skip
        self.conv_t = w.matrix(p + "ssm_conv1d.weight", cfg.conv_dim, cfg.conv_kernel).T.contiguous()  # [K, conv]
        self.dt_bias = w.vector(p + "ssm_dt.bias", nv)
        self.a = w.vector(p + "ssm_a", nv)  # -exp(A_log): the converter stores it negated and exponentiated
        self.norm = w.vector(p + "ssm_norm.weight", dv)
        self.out = w.linear(p + "ssm_out.weight", H, nv * dv)
        self.cfg = cfg
        self.split = [2 * cfg.n_k_heads * cfg.k_head_dim, cfg.n_v_heads * cfg.v_head_dim]
        self.qk_scale = torch.ones(2 * cfg.n_k_heads, 1)
        self.qk_scale[: cfg.n_k_heads] = cfg.k_head_dim**-0.5

    def __call__(self, h: torch.Tensor, layer: int, kv: HybridCache, pos: int, rope: Any = None) -> torch.Tensor:
        """T tokens of one sequence over its own recurrent state (the step's checkpoints taken on the way)."""
        return self.mix(h, kv.conv[layer], kv.ssm[layer], kv.layer_cuts(layer), kv.query_chunk)

    def mix(
        self,
        x: torch.Tensor,
        conv: torch.Tensor,
        S: torch.Tensor,
        cuts: list[tuple[int, torch.Tensor, torch.Tensor]],
        chunk: int | None = None,
    ) -> torch.Tensor:
        """x [T, hidden]; conv [K-1, conv_dim] and S [Hv, dk, dv]: this layer's live state, updated in place.

        cuts: (offset, conv_into, S_into): copy the states as they are after `offset` of the T tokens.
        chunk: tokens mixed at a time (a prompt span's DeltaNet buffers are then chunk x its widths, not T x
        them; the states carry from one chunk to the next, so the result is the one call's).
        """
        T = x.shape[0]
        if not chunk or T <= chunk:
            return self._mix(x, conv, S, cuts)
        out = torch.empty(T, self.out.out_features)
        for a in range(0, T, chunk):
            b = min(T, a + chunk)
            mine = [(off - a, c, s) for off, c, s in cuts if a < off <= b or off == a == 0]
            out[a:b] = self._mix(x[a:b], conv, S, mine)
        return out

    def _mix(
        self, x: torch.Tensor, conv: torch.Tensor, S: torch.Tensor, cuts: list[tuple[int, torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        cfg = self.cfg
        T, K = x.shape[0], cfg.conv_kernel
        Hk, Hv, dk, dv = cfg.n_k_heads, cfg.n_v_heads, cfg.k_head_dim, cfg.v_head_dim
        qkv, z, b, a = self.proj(x)
        # causal depthwise conv over the kept inputs followed by this call's
        buf = torch.cat([conv, qkv])
        mixed = F.silu(causal_conv(buf, self.conv_t))
        qk, v = mixed.split(self.split, dim=-1)
        qk = l2_normalize(qk.reshape(T, 2 * Hk, dk)) * self.qk_scale  # q heads also take 1/sqrt(dk)
        v = v.reshape(T, Hv, dv)
        beta = torch.sigmoid(b)
        g = self.a * F.softplus(a + self.dt_bias)
        if T == 1:
            q, k = value_heads(qk, Hk, Hv)
            o = delta_rule_step(q, k, v, g, beta, S)
        else:
            parts, start = [], 0
            for off, conv_into, S_into in cuts:  # run up to each checkpoint, copy the states there, go on
                if off > start:  # a checkpoint at the call's first token copies the states as they came in
                    parts.append(delta_rule_span(qk[start:off], v[start:off], g[start:off], beta[start:off], S, Hk))
                S_into.copy_(S)
                conv_into.copy_(buf[off : off + K - 1])
                start = off
            if start < T:
                parts.append(delta_rule_span(qk[start:], v[start:], g[start:], beta[start:], S, Hk))
            o = torch.cat(parts)
        conv.copy_(buf[T:])
        o = rms_norm(o, self.norm, cfg.rms_eps) * F.silu(z.reshape(T, Hv, dv))
        return self.out(o.reshape(T, Hv * dv))


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
    are taken at the end of every multi-token call (the engine's prompt spans) and TAIL tokens before it.
    Everything is allocated up front, like the KV cache, so the memory budget stays honest.
    """

    def __init__(self, cfg: DeltaNetConfig, ctx: int, dtype: torch.dtype, n_checkpoints: int = N_CHECKPOINTS):
        super().__init__([0 if r else cfg.n_kv_heads for r in cfg.recurrent], cfg.head_dim, ctx, dtype)
        self.cfg = cfg
        self.conv, self.ssm = self._states()
        self.checkpoints = [Checkpoint(*self._states()) for _ in range(n_checkpoints)]
        self.step_cuts: list[Cut] = []  # the checkpoints the running forward step takes

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

    def begin_step(self, pos: int, n: int) -> None:
        """A step must start where the recurrent state stands; it takes the checkpoints plan_cuts chose."""
        if pos != self.length:
            raise ValueError(
                f"the recurrent state holds {self.length} positions but the step is at {pos}; truncate the cache first"
            )
        self.step_cuts = self.plan_cuts(pos, n)

    def end_step(self, pos: int, n: int) -> None:
        self.advance(pos + n)
        self.commit(pos, self.step_cuts)
        self.step_cuts = []

    def abort_step(self, pos: int) -> None:
        """The layers run so far moved their states past pos: back to the latest checkpoint at or before it."""
        self.step_cuts = []
        self.rewind(pos)

    def layer_cuts(self, layer: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """(offset, conv_into, S_into) of this step's checkpoints for one DeltaNet layer."""
        return [(c.offset, c.into.conv[layer], c.into.ssm[layer]) for c in self.step_cuts]

    def truncate(self, length: int) -> int:
        if length < self.length:
            self.rewind(length)
        return self.length

    def resumable(self, length: int) -> int:
        if length >= self.length:
            return self.length
        return max((c.pos for c in self.checkpoints if 0 <= c.pos <= length), default=0)

    def snapshot(self, length: int) -> KVSnapshot:
        """KV positions < length and the recurrent states it can resume at: the live state (when it is at or
        before length) and the checkpoints, the latest that fit the checkpoint slots."""
        length = min(length, self.length)
        states = [(c.pos, c.conv, c.ssm) for c in self.checkpoints if 0 < c.pos <= length]
        if self.length <= length:
            states = [s for s in states if s[0] != self.length] + [(self.length, self.conv, self.ssm)]
        states = sorted(states, key=lambda s: s[0])[-len(self.checkpoints) :] if self.checkpoints else []
        copies = [(pos, _clone(conv), _clone(ssm)) for pos, conv, ssm in states]
        return KVSnapshot(length, [t[:length].clone() for t in self.rows()], copies)

    def restore(self, snap: KVSnapshot, length: int) -> int:
        """The snapshot's states become the checkpoints; the live state resumes at the latest one <= length."""
        assert snap.states is not None
        for c in self.checkpoints:
            c.pos = -1
        for c, (pos, conv, ssm) in zip(self.checkpoints, snap.states, strict=False):
            for i in conv:
                c.conv[i].copy_(conv[i])
                c.ssm[i].copy_(ssm[i])
            c.pos = pos
        for t, saved in zip(self.rows(), snap.rows, strict=True):
            t[: snap.length] = saved
        self.length = snap.length
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


def _clone(states: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    return {i: t.clone() for i, t in states.items()}
