"""The key/value cache of the attention layers, allocated at the full context up front, and its snapshots
(the prompt cache)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moestream.compute import kernels
from moestream.models.attention import attend_sdpa, native_decode_ok, native_prefill_ok

QUERY_CHUNK = 128  # queries attended at once unless the engine sets its micro-batch (KVCache.query_chunk)
F16_MAX = 65504.0  # float16's largest finite value


def as_cached(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in a cache's dtype. The default caches are float16, as llama.cpp's are: bf16 in the same bytes keeps
    three fewer mantissa bits, and keys rounded that coarsely move the scores of sharp heads (large attention
    biases) enough to change greedy tokens. A value past float16's range saturates instead of becoming inf,
    as the native block decode stores it (kv_store1)."""
    if dtype == torch.float16:
        x = x.clamp(-F16_MAX, F16_MAX)
    return x.to(dtype)


class KVCache:
    """Keys and values for every attention layer at the full context, allocated once up front.

    Allocating at the full context is what keeps the memory budget honest: the cache cannot grow after the
    expert cache has been sized around it.

    query_chunk: queries of one call attended at a time (the engine sets its micro-batch): a prompt span of
    thousands of tokens runs through every layer at once, its attention in chunks of this many queries.
    """

    def __init__(self, kv_heads: list[int], head_dim: int, ctx: int, dtype: torch.dtype):
        self.ctx = ctx
        self.query_chunk = QUERY_CHUNK
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
        kc[pos : pos + T] = as_cached(k, self.dtype)
        vc[pos : pos + T] = as_cached(v, self.dtype)
        return kc[: pos + T], vc[: pos + T]

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int) -> torch.Tensor:
        """Causal attention of q [T, H, D] (positions pos..) over keys/values [S, Hkv, D]; returns [T, H, D]."""
        T = q.shape[0]
        native_ok = kernels.available()
        if T == 1 and native_decode_ok(q, keys, values):
            # one decode token: the native loop (pool over kv heads) instead of ~10 torch ops of dispatch
            out = kernels.attn_decode(q, keys, values)
            if out is not None:
                return out
        if T > 1 and native_ok and native_prefill_ok(q, keys, values, pos):
            # a prompt chunk: the native flash attention (ms_attn_prefill), whose rows do not depend on how the
            # prompt was cut into chunks, so a span and its micro-batches give the same bits
            return kernels.attn_prefill(q, keys, values, pos)
        return attend_sdpa(q, keys, values, pos, self.query_chunk)

    def advance(self, length: int) -> None:
        self.length = length

    # A forward step over this cache: begun at pos for n tokens, then ended (the positions now held) or, when
    # it failed part-way (a read error, Ctrl-C), aborted, undoing what cannot be overwritten later.
    def begin_step(self, pos: int, n: int) -> None:
        pass

    def end_step(self, pos: int, n: int) -> None:
        self.advance(pos + n)

    def abort_step(self, pos: int) -> None:
        pass

    def truncate(self, length: int) -> int:
        """Forget positions >= length (a follow-up prompt that diverges there recomputes from it).

        Returns the length actually kept; states that cannot go back exactly (recurrent ones) keep less.
        """
        self.length = min(self.length, length)
        return self.length

    def resumable(self, length: int) -> int:
        """The length truncate(length) would keep, without truncating."""
        return min(self.length, length)

    def rows(self) -> list[torch.Tensor]:
        """The per-position tensors (position on dim 0) a snapshot copies."""
        return [t for t in self.k + self.v if t is not None]

    def snapshot(self, length: int) -> KVSnapshot:
        """A copy of positions < length, to be restored into this cache later (a prompt cache)."""
        length = min(length, self.length)
        return KVSnapshot(length, [t[:length].clone() for t in self.rows()])

    def restore(self, snap: KVSnapshot, length: int) -> int:
        """Hold the snapshot's first `length` positions (the rest is forgotten); returns the length held."""
        length = snap.resume_at(length)
        for t, saved in zip(self.rows(), snap.rows, strict=True):
            t[:length] = saved[:length]
        self.length = length
        return length


@dataclass(eq=False)
class KVSnapshot:
    """Saved cache positions 0..length-1; states: recurrent states by position (hybrid caches), which a
    restore can only resume at; None where every position is a place to resume."""

    length: int
    rows: list[torch.Tensor]
    states: list[tuple[int, dict[int, torch.Tensor], dict[int, torch.Tensor]]] | None = None

    @property
    def nbytes(self) -> int:
        n = sum(t.numel() * t.element_size() for t in self.rows)
        for _pos, conv, ssm in self.states or []:
            n += sum(t.numel() * t.element_size() for t in [*conv.values(), *ssm.values()])
        return n

    def resume_at(self, length: int) -> int:
        """The longest prefix of at most `length` positions a restore can hold."""
        if self.states is None:
            return min(length, self.length)
        return max((pos for pos, _c, _s in self.states if pos <= length), default=0)
