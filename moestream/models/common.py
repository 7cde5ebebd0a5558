"""Pieces every architecture file shares: RMSNorm, rotary embeddings, the KV cache, the expert provider."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
import torch.nn.functional as F

from moestream.compute import native
from moestream.compute.linear import QLinear
from moestream.errors import ComputeError, ModelFileError

SMALL_OP = 1 << 16  # elements up to which a float32 op goes to the native helpers
# torch's threads for the few big torch ops (a prompt's attention) when the engine otherwise keeps torch at
# one thread so that the lane pool has the cores (engine._torch_threads_for); 0: leave torch alone
WIDE_THREADS = 0


def set_wide_threads(n: int) -> None:
    """The engine's thread count, for wide_torch (0: leave torch's count alone)."""
    global WIDE_THREADS
    WIDE_THREADS = n


@contextmanager
def wide_torch() -> Iterator[None]:
    cur = torch.get_num_threads()
    if WIDE_THREADS <= cur:
        yield
        return
    torch.set_num_threads(WIDE_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(cur)


Expert = tuple[QLinear, QLinear, QLinear]  # gate, up, down


class ExpertProvider(Protocol):
    """What a model sees of the streaming machinery: ask for experts of a layer, receive weights."""

    def fetch_groups(self, layer: int, ids: list[int], admit: bool = True) -> Iterator[list[tuple[int, Expert]]]:
        """Every id's (expert id, weights), in groups as they become available (see ExpertCache)."""
        ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim. Small float32 inputs (a decode step) go to the native helper: torch takes
    ~10-30 us of dispatch per call here, the C loop ~1 us, and a 48-layer model makes ~200 calls a token."""
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1] or x.shape[-1] == 0:
        raise ModelFileError(
            f"a norm weight of shape {tuple(weight.shape)} for rows of {x.shape[-1]} values; "
            "the model file is broken (its tensor shapes do not match its hyperparameters)"
        )
    lib = native.lib()
    if lib is not None and x.dtype == torch.float32 and x.numel() <= SMALL_OP and weight.dtype == torch.float32:
        x = x.contiguous()
        out = torch.empty_like(x)
        dim = x.shape[-1]
        lib.ms_rms_norm(x.data_ptr(), weight.contiguous().data_ptr(), x.numel() // dim, dim, eps, out.data_ptr())
        return out
    return F.rms_norm(x, weight.shape, weight, eps)


def route_topk(
    logits: torch.Tensor, k: int, norm: bool, layer: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router over logits [T, E]: the k most probable experts per token and their weights (renormalised
    over the k when norm), largest first. One native call for a decode step instead of four torch ops.

    A NaN/inf logit raises ModelFileError naming `layer`: finite weights and inputs never produce one."""
    where = "" if layer is None else f"layer {layer}: "
    if not 1 <= k <= logits.shape[-1]:
        raise ModelFileError(f"{where}{k} experts per token of {logits.shape[-1]}; the model file is broken")
    lib = native.lib()
    if lib is not None and logits.dtype == torch.float32 and logits.numel() <= SMALL_OP:
        logits = logits.contiguous()
        ids = torch.empty(logits.shape[0], k, dtype=torch.int64)
        weights = torch.empty(logits.shape[0], k)
        try:
            lib.ms_route_topk(logits.data_ptr(), logits.shape[0], logits.shape[1], k, int(norm), ids.data_ptr(),
                              weights.data_ptr())  # fmt: skip
            return weights, ids
        except ComputeError as exc:
            if exc.code != native.NOT_FINITE:
                raise
    elif torch.isfinite(logits).all():
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
        if norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    raise ModelFileError(
        f"{where}the router's output is not finite (NaN/inf); "
        "the model file is broken (corrupted weights or hyperparameters)"
    )


def f32_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w.T for a float32 w [N, K] (routers: kept exact). A few rows run on the lane pool with the
    weight prefetched (2x torch's single thread, the decode setting); more rows go to torch's GEMM."""
    lib = native.lib()
    if lib is not None and x.shape[0] <= 4 and x.dtype == torch.float32 and w.is_contiguous():
        x = x.contiguous()
        y = torch.empty(x.shape[0], w.shape[0])
        lib.ms_gemv_f32(w.data_ptr(), w.shape[0], w.shape[1], x.data_ptr(), x.shape[0], y.data_ptr())
        return y
    return x @ w.T


class RoPE:
    """NeoX-style rotary embedding (rotate the two halves), optionally on the first `rot_dim` dims only."""

    def __init__(self, head_dim: int, theta: float, rot_dim: int | None = None, max_pos: int = 0):
        self.rot_dim = rot_dim or head_dim
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.rot_dim, 2, dtype=torch.float64) / self.rot_dim))
        self._cos = self._sin = torch.empty(0, 1, self.rot_dim // 2)
        if max_pos:
            self._table(max_pos)

    def _table(self, n: int) -> None:
        # Computed once in float64 for every position: each layer's call is then two slices.
        ang = torch.outer(torch.arange(n, dtype=torch.float64), self.inv_freq)
        self._cos = ang.cos().float()[:, None, :]
        self._sin = ang.sin().float()[:, None, :]

    def ensure(self, n: int) -> None:
        """Tables cover positions 0..n-1."""
        if n > self._cos.shape[0]:
            self._table(max(n, 2 * self._cos.shape[0]))

    def cos_ptr(self, pos: int) -> int:
        """Address of position pos's cos row (float32 [rot/2]) for the native kernels."""
        return self._cos.data_ptr() + pos * (self.rot_dim // 2) * 4

    def sin_ptr(self, pos: int) -> int:
        return self._sin.data_ptr() + pos * (self.rot_dim // 2) * 4

    def __call__(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """x [T, heads, head_dim] at positions pos..pos+T-1."""
        T = x.shape[0]
        self.ensure(pos + T)
        lib = native.lib()
        if lib is not None and x.dtype == torch.float32 and x.numel() <= SMALL_OP:
            y = x.contiguous().clone()
            lib.ms_rope_neox(
                y.data_ptr(), T, y.shape[1], y.shape[2], self.rot_dim,
                self.cos_ptr(pos), self.sin_ptr(pos),
            )  # fmt: skip
            return y
        cos = self._cos[pos : pos + T]
        sin = self._sin[pos : pos + T]
        r = self.rot_dim
        half = r // 2
        x1, x2 = x[..., :half], x[..., half:r]
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        if r == x.shape[-1]:
            return rotated
        return torch.cat([rotated, x[..., r:]], dim=-1)


class KVCache:
    """Keys and values for every attention layer at the full context, allocated once up front.

    Allocating at the full context is what keeps the memory budget honest: the cache cannot grow after the
    expert cache has been sized around it.
    """

    def __init__(self, kv_heads: list[int], head_dim: int, ctx: int, dtype: torch.dtype):
        self.ctx = ctx
        self.dtype = dtype
        self.length = 0  # positions filled
        self.k: list[torch.Tensor | None] = []
        self.v: list[torch.Tensor | None] = []
        for h in kv_heads:
            if h:
                self.k.append(torch.zeros(ctx, h, head_dim, dtype=dtype))
                self.v.append(torch.zeros(ctx, h, head_dim, dtype=dtype))
            else:
                self.k.append(None)
                self.v.append(None)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)

    def update(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kc, vc = self.k[layer], self.v[layer]
        assert kc is not None and vc is not None
        T = k.shape[0]
        kc[pos : pos + T] = k.to(self.dtype)
        vc[pos : pos + T] = v.to(self.dtype)
        return kc[: pos + T], vc[: pos + T]

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int) -> torch.Tensor:
        """Causal attention of q [T, H, D] (positions pos..) over keys/values [S, Hkv, D]; returns [T, H, D]."""
        T, S = q.shape[0], keys.shape[0]
        lib = native.lib()
        if (
            T == 1
            and lib is not None
            and q.dtype == torch.float32
            and keys.dtype in (torch.bfloat16, torch.float32)
            and keys.dtype == values.dtype
            and keys.is_contiguous()
            and values.is_contiguous()
        ):
            # one decode token: the native loop (pool over kv heads) instead of ~10 torch ops of dispatch
            q1 = q.contiguous()
            out = torch.empty_like(q1)
            H, D = q.shape[1], q.shape[2]
            rc = lib.ms_attn_decode(
                q1.data_ptr(), keys.data_ptr(), values.data_ptr(), S, H, keys.shape[1], D,
                int(keys.dtype == torch.bfloat16), 1.0 / math.sqrt(D), out.data_ptr(),
            )  # fmt: skip
            if rc == 0:
                return out
        qh = q.transpose(0, 1).unsqueeze(0)
        kh = keys.float().transpose(0, 1).unsqueeze(0)
        vh = values.float().transpose(0, 1).unsqueeze(0)
        mask = None
        if T > 1:
            qpos = torch.arange(pos, pos + T)[:, None]
            mask = torch.arange(S)[None, :] <= qpos
        gqa = q.shape[1] != keys.shape[1]
        with wide_torch():
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=gqa)
        return out.squeeze(0).transpose(0, 1)

    def advance(self, length: int) -> None:
        self.length = length

    def truncate(self, length: int) -> int:
        """Forget positions >= length (a follow-up prompt that diverges there recomputes from it).

        Returns the length actually kept; states that cannot go back exactly (recurrent ones) keep less.
        """
        self.length = min(self.length, length)
        return self.length
