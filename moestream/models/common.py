"""Pieces every architecture file shares: RMSNorm, routing, rotary embeddings, the KV cache, the token
embedding, projections fused by compute form, the expert provider and the route hook."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from moestream.compute import kernels, linear, native
from moestream.compute.linear import QLinear
from moestream.errors import ComputeError, ModelFileError
from moestream.formats import quants

SMALL_OP = 1 << 16  # elements up to which a float32 op goes to the native helpers
QUERY_CHUNK = 128  # queries attended at once unless the engine sets its micro-batch (KVCache.query_chunk)
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

# (layer, first position, number of tokens) -> expert ids [tokens, top_k] that replace the router's choice,
# or None to let the router choose. The engine installs one to replay recorded routes (--route-trace).
RouteHook = Callable[[int, int, int], "torch.Tensor | None"]


class ExpertProvider(Protocol):
    """What a model sees of the streaming machinery: ask for experts of a layer, receive weights."""

    def fetch_groups(
        self, layer: int, ids: list[int], admit: bool = True, ordered: bool = False
    ) -> Iterator[list[tuple[int, Expert]]]:
        """Every id's (expert id, weights), in groups as they become available, or in the order of `ids` where
        the slots allow (ordered; see ExpertCache)."""
        ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim. float32 inputs go to the native loop, spread over the lane pool: a decode
    step's many small norms skip torch's per-call dispatch, which outweighs their arithmetic, a prompt span's
    skip its passes over temporaries; each row has the same bits however many rows come in the call."""
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1] or x.shape[-1] == 0:
        raise ModelFileError(
            f"a norm weight of shape {tuple(weight.shape)} for rows of {x.shape[-1]} values; "
            "the model file is broken (its tensor shapes do not match its hyperparameters)"
        )
    if kernels.available() and x.dtype == torch.float32 and weight.dtype == torch.float32:
        return kernels.rms_norm_rows(x, weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps)


def add_weighted_rows(out: torch.Tensor, rows: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> None:
    """out[rows[i]] += y[i] * w[i] for each i in order (rows: int64 [n], y [n, h], w [n, 1]); the same bits as
    out.index_add_(0, rows, y * w). The native loop runs on the caller's thread: torch's index_add_ wakes its
    thread pool for each call, and a prompt span makes one call per expert of every layer."""
    if (
        kernels.available()
        and out.dtype == y.dtype == w.dtype == torch.float32
        and out.is_contiguous()
        and out.dim() == y.dim() == 2
        and y.shape[1] == out.shape[1]
        and rows.shape == (y.shape[0],)
        and w.numel() == y.shape[0]
    ):
        kernels.add_weighted_rows(out, rows, y, w)
        return
    out.index_add_(0, rows, y * w)


def route_topk(logits: torch.Tensor, k: int, norm: bool, layer: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router over logits [T, E]: the k most probable experts per token and their weights (renormalised
    over the k when norm), largest first. One native call for a decode step instead of four torch ops.

    A NaN/inf logit raises ModelFileError naming `layer`: finite weights and inputs never produce one."""
    where = "" if layer is None else f"layer {layer}: "
    if not 1 <= k <= logits.shape[-1]:
        raise ModelFileError(f"{where}{k} experts per token of {logits.shape[-1]}; the model file is broken")
    if kernels.available() and logits.dtype == torch.float32 and logits.numel() <= SMALL_OP:
        try:
            return kernels.route_topk(logits, k, norm)
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
    weight prefetched (faster than torch on its single thread, the decode setting); more rows go to torch's
    GEMM."""
    if kernels.available() and x.shape[0] <= 4 and x.dtype == torch.float32 and w.is_contiguous():
        return kernels.gemv_f32(x, w)
    return x @ w.T


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


def query_chunks(T: int, chunk: int) -> list[tuple[int, int]]:
    """[a, b) ranges of at most `chunk` of T query positions: a long span's attention runs one at a time, so
    that its buffers (scores, mask, output blocks) are chunk x keys, never T x keys."""
    chunk = max(1, chunk)
    return [(a, min(T, a + chunk)) for a in range(0, T, chunk)]


def by_query_chunks(
    x: torch.Tensor, kv: Any, pos: int, run: Callable[[torch.Tensor, int], torch.Tensor]
) -> torch.Tensor:
    """run(x, pos) for an attention block, a prompt span longer than the cache's query chunk a chunk at a
    time (run(x[a:b], pos + a), projections included; each chunk's keys are written before it attends): the
    span then holds its output and one chunk's q, k, v and attention, not those of every token, which the
    budget's compute_nbytes counts."""
    T = x.shape[0]
    chunk = getattr(kv, "query_chunk", T) or T
    if T <= chunk:
        return run(x, pos)
    out: torch.Tensor | None = None
    for a, b in query_chunks(T, chunk):
        y = run(x[a:b], pos + a)
        if out is None:
            out = torch.empty(T, *y.shape[1:], dtype=y.dtype)
        out[a:b] = y
    assert out is not None
    return out


def causal_mask(T: int, S: int, pos: int) -> torch.Tensor | None:
    """[T, S] True where query pos + t may see key s (none for one query: it sees every key)."""
    if T == 1:
        return None
    return torch.arange(S)[None, :] <= torch.arange(pos, pos + T)[:, None]


def native_prefill_ok(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int) -> bool:
    """Whether ms_attn_prefill takes these (the shapes and types it is written for)."""
    D = q.shape[2]
    return (
        q.dtype == torch.float32
        and keys.dtype in (torch.bfloat16, torch.float32)
        and keys.dtype == values.dtype
        and keys.is_contiguous()
        and values.is_contiguous()
        and keys.shape == values.shape
        and D == keys.shape[2]
        and D % 8 == 0
        and D <= 512
        and q.shape[1] % keys.shape[1] == 0
        and pos + q.shape[0] <= keys.shape[0]
    )


def attend_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int, chunk: int) -> torch.Tensor:
    """KVCache.attend with torch's SDPA, where the native library or its shapes are missing (and the baseline
    of bench/attention_ab.py): keys and values in float once, then the queries `chunk` at a time, each over the
    keys up to its own last position, as the micro-batch of those tokens would."""
    T, S = q.shape[0], keys.shape[0]
    kh = keys.float().transpose(0, 1).unsqueeze(0)
    vh = values.float().transpose(0, 1).unsqueeze(0)
    gqa = q.shape[1] != keys.shape[1]
    out = torch.empty(T, q.shape[1], values.shape[2])
    for a, b in query_chunks(T, chunk):
        qh = q[a:b].transpose(0, 1).unsqueeze(0)
        end = S - T + b  # keys through this chunk's last query
        with wide_torch():
            o = F.scaled_dot_product_attention(
                qh, kh[:, :, :end], vh[:, :, :end], attn_mask=causal_mask(b - a, end, pos + a), enable_gqa=gqa
            )
        out[a:b] = o.squeeze(0).transpose(0, 1)
    return out


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
        kc[pos : pos + T] = k.to(self.dtype)
        vc[pos : pos + T] = v.to(self.dtype)
        return kc[: pos + T], vc[: pos + T]

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int) -> torch.Tensor:
        """Causal attention of q [T, H, D] (positions pos..) over keys/values [S, Hkv, D]; returns [T, H, D]."""
        T = q.shape[0]
        native_ok = kernels.available()
        if (
            T == 1
            and native_ok
            and q.dtype == torch.float32
            and keys.dtype in (torch.bfloat16, torch.float32)
            and keys.dtype == values.dtype
            and keys.is_contiguous()
            and values.is_contiguous()
        ):
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


SINK_SCORES_BYTES = 32 << 20  # float32 scores attend_with_sinks holds at a time (query rows chunked to fit)


def attend_with_sinks(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int, sinks: torch.Tensor, window: int = 0
) -> torch.Tensor:
    """Causal attention of q [T, H, D] (positions pos..) over keys/values [S, Hkv, D] (positions 0..) with a
    learned logit per head (sinks [H]) that joins every row's softmax and carries no value, so a head can
    attend to nothing (GPT-OSS). window > 0: a query sees only itself and the window - 1 positions before
    it. Scores are built explicitly in float32, a chunk of query rows at a time."""
    T, H, D = q.shape
    S, Hkv = keys.shape[0], keys.shape[1]
    rep = H // Hkv
    first = max(0, pos - window + 1) if window else 0  # no query of this call sees a key before it
    kh = keys[first:].float().permute(1, 0, 2).unsqueeze(1)  # [Hkv, 1, S', D]
    vh = values[first:].float().permute(1, 0, 2).unsqueeze(1)
    qh = q.float().reshape(T, Hkv, rep, D).permute(1, 2, 0, 3)  # query head h reads kv head h // rep
    kpos = torch.arange(first, S)
    sink = sinks.float().reshape(Hkv, rep, 1, 1)
    out = torch.empty(Hkv, rep, T, D)
    step = max(1, SINK_SCORES_BYTES // (4 * H * (S - first + 1)))
    with wide_torch():
        for t0 in range(0, T, step):
            t1 = min(T, t0 + step)
            scores = torch.matmul(qh[:, :, t0:t1], kh.transpose(-1, -2)) / math.sqrt(D)
            dist = torch.arange(pos + t0, pos + t1)[:, None] - kpos[None, :]
            hidden = dist < 0
            if window:
                hidden |= dist >= window
            scores = scores.masked_fill(hidden, float("-inf"))
            logits = torch.cat([scores, sink.expand(Hkv, rep, t1 - t0, 1)], dim=-1)
            probs = torch.softmax(logits, dim=-1)[..., :-1]
            out[:, :, t0:t1] = torch.matmul(probs, vh)
    return out.permute(2, 0, 1, 3).reshape(T, H, D)


class Embedding:
    """Token embedding rows kept in the file's encoding and decoded on lookup (never expanded to float)."""

    def __init__(self, raw: np.ndarray, ggml_type: int, vocab: int, hidden: int):
        self.raw, self.ggml_type, self.vocab, self.hidden = raw, ggml_type, vocab, hidden

    def __call__(self, tokens: list[int]) -> torch.Tensor:
        rows = quants.dequantize_rows(self.raw, self.ggml_type, self.hidden, np.asarray(tokens))
        return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))


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


def resident_tensors(model: object) -> list[torch.Tensor | np.ndarray]:
    """Every tensor and array the model's own objects hold: its weights and tables, what mlock keeps in RAM.

    Only objects of the model (moestream.models.*, QLinear) and containers are descended into, so the
    expert provider and the route hook the engine attached are never reached, and neither is a KV cache.
    """
    out: list[torch.Tensor | np.ndarray] = []
    seen: set[int] = set()
    stack: list[object] = [model]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (torch.Tensor, np.ndarray)):
            out.append(obj)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif _is_model_part(obj) and not isinstance(obj, KVCache):
            stack.extend(_attributes(obj))
    return out


def _is_model_part(obj: object) -> bool:
    mod = type(obj).__module__
    return mod.startswith("moestream.models") or mod == "moestream.compute.linear"


def _attributes(obj: object) -> list[object]:
    out = list(getattr(obj, "__dict__", {}).values())
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(obj, name):
                out.append(getattr(obj, name))
    return out
