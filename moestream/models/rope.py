"""Rotary position embeddings: NeoX-style rotation of the first rot_dim dims, tables grown on demand, and
YaRN's frequencies for long-context files."""

from __future__ import annotations

import math

import torch

from moestream.compute import kernels
from moestream.models.ops import SMALL_OP


def yarn_inv_freq(
    rot_dim: int,
    theta: float,
    factor: float,
    orig_ctx: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> torch.Tensor:
    """YaRN's per-pair frequencies (float64 [rot_dim/2]), as ggml's rope_yarn computes them: pairs that turn
    more than beta_fast times over the original context keep their frequency, pairs that turn fewer than
    beta_slow times are interpolated (divided by factor), with a linear ramp between. truncate=False keeps
    the ramp's ends where they fall instead of rounding them outwards to whole dims (GPT-OSS's reference)."""
    base = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))

    def corr_dim(n_rot: float) -> float:
        return rot_dim * math.log(orig_ctx / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(0.0, low), min(rot_dim - 1.0, high)
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float64) - low) / max(0.001, high - low)).clamp(0, 1)
    extrapolate = 1.0 - ramp
    return base / factor * (1 - extrapolate) + base * extrapolate


class RoPE:
    """NeoX-style rotary embedding (rotate the two halves), optionally on the first `rot_dim` dims only.

    inv_freq replaces the plain theta^(-2i/d) frequencies (YaRN); mscale multiplies cos and sin."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        rot_dim: int | None = None,
        max_pos: int = 0,
        *,
        inv_freq: torch.Tensor | None = None,
        mscale: float = 1.0,
    ):
        self.rot_dim = rot_dim or head_dim
        if inv_freq is None:
            inv_freq = 1.0 / (theta ** (torch.arange(0, self.rot_dim, 2, dtype=torch.float64) / self.rot_dim))
        self.inv_freq = inv_freq.to(torch.float64)
        self.mscale = mscale
        self._cos = self._sin = torch.empty(0, 1, self.rot_dim // 2)
        if max_pos:
            self._table(max_pos)

    def _table(self, n: int) -> None:
        # Computed once in float64 for every position: each layer's call is then two slices.
        ang = torch.outer(torch.arange(n, dtype=torch.float64), self.inv_freq)
        self._cos = (ang.cos() * self.mscale).float()[:, None, :]
        self._sin = (ang.sin() * self.mscale).float()[:, None, :]

    def ensure(self, n: int) -> None:
        """Tables cover positions 0..n-1."""
        if n > self._cos.shape[0]:
            self._table(max(n, 2 * self._cos.shape[0]))

    def table_rows(self, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Position pos's (cos, sin) rows (float32 [1, rot/2]) onwards, for the native kernels."""
        return self._cos[pos], self._sin[pos]

    def __call__(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """x [T, heads, head_dim] at positions pos..pos+T-1."""
        T = x.shape[0]
        self.ensure(pos + T)
        if kernels.available() and x.dtype == torch.float32 and x.numel() <= SMALL_OP:
            return kernels.rope_neox(x, *self.table_rows(pos), self.rot_dim)
        cos = self._cos[pos : pos + T]
        sin = self._sin[pos : pos + T]
        r = self.rot_dim
        half = r // 2
        x1, x2 = x[..., :half], x[..., half:r]
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        if r == x.shape[-1]:
            return rotated
        return torch.cat([rotated, x[..., r:]], dim=-1)
