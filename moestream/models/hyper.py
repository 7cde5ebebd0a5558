"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the residual stream is `hc` streams [T, hc, D]
instead of one. Before each block the streams are collapsed into the block's input with weights `pre`; the
block's output is expanded back with weights `post` and added to the streams mixed by `comb`, a matrix made
doubly stochastic by Sinkhorn-Knopp iterations:

    streams' = post * block(sum_j pre_j streams_j) + comb^T streams

pre, post and comb come from a one-layer perceptron over the RMS-normalised (unweighted) flattened streams:
pre = sigmoid(.) + eps, post = 2 sigmoid(.), comb = softmax(.) + eps then normalised by columns, then by rows
and columns `iters - 1` times. The head collapses the streams once more (HyperHead, only pre) before the final
norm. Everything here runs in float32, as the reference keeps these modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from moestream.models.layer import DecoderLayer, Step
from moestream.models.loader import Weights
from moestream.models.rows import blockwise, norm_blocks, per_row


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


@dataclass(frozen=True)
class HyperSpec:
    hc: int  # streams
    iters: int  # Sinkhorn-Knopp iterations
    eps: float  # hc_eps: the floor added to pre and comb and to every normaliser
    norm_eps: float  # the unweighted RMSNorm's epsilon (the model's rms_eps)


class HyperConnection:
    """One site's mixing weights: fn [(2 + hc) hc, hc D], base [(2 + hc) hc], scale [3]."""

    def __init__(self, w: Weights, prefix: str, hidden: int, spec: HyperSpec):
        n = spec.hc
        mix = (2 + n) * n
        self.spec = spec
        self.fn = w.matrix(prefix + "_fn.weight", mix, n * hidden)
        self.base = w.vector(prefix + "_base.weight", mix)
        self.scale = w.vector(prefix + "_scale.weight", 3)

    def weights(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pre [T, hc], post [T, hc], comb [T, hc, hc]) for streams x [T, hc, D]."""
        s = self.spec
        n = s.hc
        mixes = F.linear(unweighted_rms(x.flatten(1), s.norm_eps), self.fn)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + s.eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * self.scale[2] + comb_b.view(n, n), dim=-1) + s.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + s.eps)
        for _ in range(s.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + s.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + s.eps)
        return pre, post, comb

    def collapse(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the block's input [T, D], post, comb) for streams x [T, hc, D]."""
        pre, post, comb = self.weights(x)
        return (pre.unsqueeze(-1) * x).sum(dim=1), post, comb


def expand(x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The new streams: post_k y + sum_j comb[j, k] x_j."""
    return post.unsqueeze(-1) * y.unsqueeze(1) + torch.matmul(comb.transpose(-1, -2), x)


class HyperHead:
    """The final collapse of the streams (only `pre`): fn [hc, hc D], base [hc], scale [1]."""

    def __init__(self, w: Weights, prefix: str, hidden: int, spec: HyperSpec):
        self.spec = spec
        self.fn = w.matrix(prefix + "_fn.weight", spec.hc, spec.hc * hidden)
        self.base = w.vector(prefix + "_base.weight", spec.hc)
        self.scale = w.vector(prefix + "_scale.weight", 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(unweighted_rms(x.flatten(1), self.spec.norm_eps), self.fn)
        pre = torch.sigmoid(mixes * self.scale + self.base) + self.spec.eps
        return (pre.unsqueeze(-1) * x).sum(dim=1)


def by_rows(spans: list[tuple[int, int]], x: torch.Tensor, fn) -> Any:
    """fn over a step's blocks of streams x, each one-token block alone (torch's matmuls pick kernels by
    shape, so a row's bits would otherwise depend on what shares the step)."""
    return blockwise(x, spans, lambda _bs, xr: per_row(fn, xr), lambda _b, xb: fn(xb))


def stream_mean(x: torch.Tensor) -> torch.Tensor:
    """GLM-5.3-Flash's head: the streams' plain mean (it has no weights of its own)."""
    return x.mean(dim=1)


class HyperResidual:
    """The model's residual as hc_mult streams: copies of the embeddings in, the head's mix of them out."""

    def __init__(self, hc_mult: int, head: Callable[[torch.Tensor], torch.Tensor]):
        self.hc_mult, self.head = hc_mult, head

    def widen(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()

    def narrow(self, x: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        return by_rows(spans, x, self.head)


@dataclass(eq=False)
class HyperDecoderLayer(DecoderLayer):
    """A decoder block over hyper-connected streams: each of the mixer and the FFN reads the streams collapsed
    by its own HyperConnection and writes back through expand()."""

    attn_hc: HyperConnection | None = None
    ffn_hc: HyperConnection | None = None

    def __call__(self, x: torch.Tensor, layer: int, step: Step, eps: float) -> torch.Tensor:
        assert self.attn_hc is not None and self.ffn_hc is not None
        x = self._site(x, step, self.attn_hc, lambda h: self.mix(h, layer, step, eps))
        return self._site(x, step, self.ffn_hc,
                          lambda h: self.ffn(norm_blocks(h, step.spans, self.ffn_norm, eps), step))  # fmt: skip

    def _site(self, x: torch.Tensor, step: Step, hc: HyperConnection, block) -> torch.Tensor:
        T, n, D = x.shape
        packed = by_rows(step.spans, x, lambda xs: _pack(*hc.collapse(xs)))
        h, post, comb = _unpack(packed, n, D)
        y = block(h)
        return by_rows(step.spans, torch.cat([x.flatten(1), y, post, comb.flatten(1)], dim=1),
                        lambda r: expand(*_split_expand(r, n, D)).flatten(1)).view(T, n, D)  # fmt: skip


def hyper_block(w: Weights, i: int, hidden: int, spec: HyperSpec, mixer: Callable, ffn: Callable) -> HyperDecoderLayer:
    """Block i over hyper-connected streams, its tensors read in file order: the mixer's norm, the mixer
    (mixer(w, i)), the FFN's norm, the FFN (ffn(w, i)), then the two sites' mixing weights."""
    p = f"blk.{i}."
    mixer_norm = w.vector(p + "attn_norm.weight", hidden)
    mix = mixer(w, i)
    ffn_norm = w.vector(p + "ffn_norm.weight", hidden)
    ff = ffn(w, i)
    attn_hc = HyperConnection(w, p + "hc_attn", hidden, spec)
    ffn_hc = HyperConnection(w, p + "hc_ffn", hidden, spec)
    return HyperDecoderLayer(mixer_norm, mix, ffn_norm, ff, attn_hc, ffn_hc)


def _pack(h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    return torch.cat([h, post, comb.flatten(1)], dim=1)


def _unpack(p: torch.Tensor, n: int, D: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h, post, comb = p.split([D, n, n * n], dim=1)
    return h.contiguous(), post, comb.reshape(-1, n, n)


def _split_expand(r: torch.Tensor, n: int, D: int):
    x, y, post, comb = r.split([n * D, D, n, n * n], dim=1)
    return x.reshape(-1, n, D), y, post, comb.reshape(-1, n, n)
