"""Kimi Delta Attention (KDA: Kimi Linear's, GLM-5.3-Flash's linear layers): the gated delta rule of
deltanet.py with a decay per key channel instead of one per head, its gates from low-rank projections.

Per head h of `heads` heads of head_dim d (queries, keys and values alike):
    q, k, v = silu(causal_depthwise_conv([attn_q | attn_k | attn_v](x)))     one filter per channel (q, k, v)
    q, k L2-normalised, q /= sqrt(d);  beta = sigmoid(ssm_beta(x))
    g = ssm_f_b(ssm_f_a(x)) + dt_bias, per channel; with a lower bound lb (kda.gate_lower_bound):
        g = lb * sigmoid(exp(A_log) g), else g = -exp(A_log) softplus(g)    (the file's ssm_a is -exp(A_log))
    S = diag(exp(g)) S;  S += k (beta (v - S^T k))^T;  o = S^T q                S: [d, d] per head
    out = attn_output(RMSNorm(o) * sigmoid(ssm_g_b(ssm_g_a(x))))
A prompt runs token by token too: a chunked form (a triangular solve per chunk, as deltanet.py's) was slower
on these shapes on the CPU, its per-channel decays making every chunk's products elementwise. The recurrent
state and its checkpoints live in deltanet.HybridCache, whose config fields KdaShape gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from moestream.models.deltanet import HybridCache, causal_conv, delta_rule_step, l2_normalize
from moestream.models.layer import Mixer
from moestream.models.loader import Weights
from moestream.models.ops import rms_norm


@dataclass(frozen=True)
class KdaShape:
    """A model's KDA layers, in the fields deltanet.HybridCache reads (its DeltaNetConfig)."""

    hidden: int
    recurrent: tuple[bool, ...]  # per block: True = KDA, False = an attention block (its cache is not here)
    heads: int
    head_dim: int
    conv_kernel: int
    lower_bound: float | None
    rms_eps: float
    n_kv_heads: int = 0  # HybridCache's own KV for the attention blocks: none (their architecture keeps theirs)

    @property
    def n_k_heads(self) -> int:
        return self.heads

    @property
    def n_v_heads(self) -> int:
        return self.heads

    @property
    def k_head_dim(self) -> int:
        return self.head_dim

    @property
    def v_head_dim(self) -> int:
        return self.head_dim

    @property
    def conv_dim(self) -> int:
        return 3 * self.heads * self.head_dim

    @property
    def state_nbytes(self) -> int:
        """float32 conv and recurrent state of every KDA layer: one sequence's."""
        per_layer = (self.conv_kernel - 1) * self.conv_dim + self.heads * self.head_dim**2
        return 4 * sum(self.recurrent) * per_layer


class KimiDeltaAttention(Mixer):
    def __init__(self, w: Weights, i: int, s: KdaShape):
        p = f"blk.{i}."
        H, n, d, K = s.hidden, s.heads, s.head_dim, s.conv_kernel
        D = n * d
        # every projection of x as one matmul: [q | k | v | f_a | g_a | beta]
        self.proj = w.fused([(p + "attn_q.weight", D, H), (p + "attn_k.weight", D, H), (p + "attn_v.weight", D, H),
                             (p + "ssm_f_a.weight", d, H), (p + "ssm_g_a.weight", d, H),
                             (p + "ssm_beta.weight", n, H)])  # fmt: skip
        self.f_b = w.linear(p + "ssm_f_b.weight", D, d)
        self.g_b = w.linear(p + "ssm_g_b.weight", D, d)
        conv = [w.array(f"{p}ssm_conv1d_{c}.weight", (D, 1, K)).reshape(D, K) for c in "qkv"]
        self.conv_t = torch.cat(conv).T.contiguous()  # [K, 3D]
        self.dt_bias = w.vector(p + "ssm_dt.bias", D)
        self.a = w.vector(p + "ssm_a", n)  # -exp(A_log)
        self.norm = w.vector(p + "ssm_norm.weight", d)
        self.out = w.linear(p + "attn_output.weight", H, D)
        self.shape = s

    def __call__(self, h: torch.Tensor, layer: int, kv: HybridCache, pos: int, rope: Any = None) -> torch.Tensor:
        """T tokens of one sequence over its own recurrent state (the step's checkpoints taken on the way)."""
        return self.mix(h, kv.conv[layer], kv.ssm[layer], kv.layer_cuts(layer))

    def gates(self, f_a: torch.Tensor, T: int) -> torch.Tensor:
        """The log decay g [T, heads, d] of each key channel (<= 0)."""
        s = self.shape
        g = (self.f_b(f_a) + self.dt_bias).view(T, s.heads, s.head_dim)
        if s.lower_bound is not None:
            return s.lower_bound * torch.sigmoid(-self.a[:, None] * g)
        return self.a[:, None] * F.softplus(g)

    def mix(self, x: torch.Tensor, conv: torch.Tensor, S: torch.Tensor,
            cuts: list[tuple[int, torch.Tensor, torch.Tensor]]) -> torch.Tensor:  # fmt: skip
        """x [T, hidden]; conv [K-1, 3D] and S [heads, d, d]: the layer's live state, updated in place.
        cuts: (offset, conv_into, S_into): copy the states as they are after `offset` of the T tokens."""
        s = self.shape
        T, K, n, d = x.shape[0], s.conv_kernel, s.heads, s.head_dim
        q, k, v, f_a, g_a, b = self.proj(x)
        buf = torch.cat([conv, torch.cat([q, k, v], dim=1)])  # the kept inputs, then this call's
        mixed = F.silu(causal_conv(buf, self.conv_t))
        q, k, v = (t.reshape(T, n, d) for t in mixed.split(n * d, dim=1))
        q, k = l2_normalize(q) * d**-0.5, l2_normalize(k)
        g, beta = self.gates(f_a, T), torch.sigmoid(b)
        at = {off: (c, si) for off, c, si in cuts}
        o = torch.empty(T, n, d)
        for t in range(T + 1):
            if t in at:  # the states after t tokens (t = 0: as they came in)
                at[t][1].copy_(S)
                at[t][0].copy_(buf[t : t + K - 1])
            if t < T:
                o[t] = delta_rule_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], S)[0]
        conv.copy_(buf[T:])
        o = rms_norm(o, self.norm, s.rms_eps) * torch.sigmoid(self.g_b(g_a).view(T, n, d))
        return self.out(o.reshape(T, n * d))
