"""What a model holds besides its weights and the expert slots: one sequence's KV cache (and recurrent state),
and the transient buffers of one forward call over a prompt span.

One account for every architecture, from a few numbers per mixer kind (grouped-query or gated attention,
multi-head latent attention, Gated DeltaNet) and FFN kind (routed experts, with or without an always-on FFN
beside them). An architecture states its kinds (the model class's `memory(cfg)`); the planner sizes the
expert cache with what the budget leaves.

A forward call over `tokens` prompt tokens at up to `ctx` positions holds, at its widest:
- one layer's span state: the keys and values attention reads in float32 (a prompt's flash attention, attn.c's
  or SDPA's, never builds the [T, S] score matrix), MLA's latents, the score chunks of attention with sinks;
- the matmul kernels' scratch (linear.kernel_scratch_bytes);
- per token, the residual stream and its norm temporaries, and on top the wider of the mixer's moment and the
  MoE's, both in float32, with a margin of MARGIN_NUM / MARGIN_DEN;
- two float32 rows of logits and the runtime's own buffers (RUNTIME_BYTES).
"""

from __future__ import annotations

from dataclasses import dataclass

from moestream.compute import linear
from moestream.models.attention import SINK_SCORES_BYTES
from moestream.models.compressed_attention import CSA_RATE, CompressedKVCache
from moestream.models.deltanet import CHUNK, N_CHECKPOINTS
from moestream.models.kv_cache import QUERY_CHUNK
from moestream.models.routed import summed_as_they_come
from moestream.models.sparse_attention import INDEX_SCORES_BYTES, DSACache

FLOAT = 4  # bytes of a float32 value
RESIDUAL_VALUES = 6  # float32 values a token holds per hidden unit: the residual stream and its norm temporaries
LOGIT_ROWS = 2  # float32 rows of vocabulary logits held at once
RUNTIME_BYTES = 4 << 20  # attention's per-thread blocks, masks, rope tables
# The per-token part is counted half again: a design choice that covers the allocator's rounding and the short-lived
# temporaries the account does not name, on which the promise that peak RSS stays within the budget rests.
MARGIN_NUM, MARGIN_DEN = 3, 2


def _rows(tokens: int, chunk: int | None) -> int:
    """Query rows one attention call runs: a span's attention goes `chunk` queries at a time (by_query_chunks)."""
    return min(tokens, chunk or tokens)


@dataclass(frozen=True)
class AttentionMemory:
    """Grouped-query attention over a KV cache of `layers` layers (q/k norms and windows alike). `gated`: the
    query projection carries an output gate as wide as itself (Qwen3.5's gated attention). `sinks`: GPT-OSS's
    attend_with_sinks, which holds score chunks and their softmax, and the projection's biased copy."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    gated: bool = False
    sinks: bool = False

    def kv_nbytes(self, ctx: int, exact: bool) -> int:
        return 2 * self.layers * ctx * self.kv_heads * self.head_dim * (4 if exact else 2)

    def span_nbytes(self, tokens: int, ctx: int, chunk: int | None = None) -> int:
        keys = 2 * ctx * self.kv_heads * self.head_dim * FLOAT
        if not self.sinks:
            return keys
        row = FLOAT * self.heads * (ctx + 1)  # one query's scores over every key and the sink
        return keys + 2 * min(SINK_SCORES_BYTES + row, tokens * row)

    def peak_values(self, tokens: int, chunk: int | None, hidden: int) -> int:
        """q, k and v with their normed and rotated copies (and the biased projection, with sinks)."""
        q_heads = 2 * self.heads if self.gated else self.heads
        copies = 4 if self.sinks else 3
        return _rows(tokens, chunk) * copies * (q_heads + 2 * self.kv_heads) * self.head_dim

    @property
    def input_width(self) -> int:
        return self.heads * self.head_dim  # the output projection's


@dataclass(frozen=True)
class LatentAttentionMemory:
    """Multi-head latent attention (DeepSeek): a cache of kv_lora_rank latents and qk_rope rotary keys a token
    and layer; `q_lora_rank` 0 where the query is one projection. With a sparse attention's indexer
    (sparse_attention.py): `index_layers` blocks that cache an indexer key of `index_dim` values a token, its
    `index_heads` queries scored against every key, the `index_top_k` positions chosen for each query."""

    layers: int
    heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head_dim: int
    index_layers: int = 0
    index_heads: int = 0
    index_dim: int = 0
    index_top_k: int = 0

    def kv_nbytes(self, ctx: int, exact: bool) -> int:
        index_keys = self.index_layers * self.index_dim
        return DSACache.bytes_for(self.layers, self.kv_lora_rank, self.qk_rope, ctx, exact, index_keys)

    def span_nbytes(self, tokens: int, ctx: int, chunk: int | None = None) -> int:
        latents = 2 * ctx * (self.kv_lora_rank + self.qk_rope) * FLOAT
        if not self.index_layers:
            return latents
        # the indexer keys in float, a piece of the scores' products, a query chunk's scores (float32) and its
        # masks (bool), and the step's choices (int64) which the blocks pass on to the shared ones
        products = min(INDEX_SCORES_BYTES + FLOAT * self.index_heads * ctx, FLOAT * tokens * self.index_heads * ctx)
        scores = _rows(tokens, chunk) * ctx * (FLOAT + 3)
        return latents + FLOAT * ctx * self.index_dim + products + scores + 8 * tokens * min(ctx, self.index_top_k)

    def peak_values(self, tokens: int, chunk: int | None, hidden: int) -> int:
        """Per query and head either the absorbed query, its [latent | rope] key-sized copy and the latent-sized
        output, or (the naive form, chosen only while it is no larger) the decompressed keys and values; the
        query's LoRA, the latent and the rotary key besides. An indexer adds its projections, each query's
        choice."""
        L, R, nh = self.kv_lora_rank, self.qk_rope, self.heads
        per_query = 2 * nh * (self.qk_nope + R) + 2 * nh * (2 * L + R) + nh * self.v_head_dim
        rows = _rows(tokens, chunk)
        values = rows * (per_query + self.q_lora_rank + L + R)
        if self.index_layers:  # the indexer's projections and rotated copies, a chunk's top_k (int64)
            values += rows * (2 * self.index_heads * self.index_dim + 2 * self.index_dim + self.index_heads)
            values += rows * 4 * self.index_top_k
        return values

    @property
    def input_width(self) -> int:
        # the up-projections at their file's bits quantize every head's latent output at once (kernels.qmm_groups)
        return max(self.heads * self.v_head_dim, self.q_lora_rank, self.heads * self.kv_lora_rank)


@dataclass(frozen=True)
class DeltaNetMemory:
    """Gated DeltaNet layers: a fixed-size recurrent state (`state_nbytes`, every such layer's conv and
    recurrent state for one sequence) instead of a KV cache, kept with N_CHECKPOINTS saved copies."""

    conv_kernel: int
    conv_dim: int
    v_heads: int
    k_head_dim: int
    v_head_dim: int
    state_nbytes: int

    def kv_nbytes(self, ctx: int, exact: bool) -> int:
        return (1 + N_CHECKPOINTS) * self.state_nbytes

    def span_nbytes(self, tokens: int, ctx: int, chunk: int | None = None) -> int:
        return 0

    def peak_values(self, tokens: int, chunk: int | None, hidden: int) -> int:
        """The span's output, and for the chunk of tokens the layer runs at a time (as many as attention's
        query chunk): the conv's [K, conv_dim] windows and its outputs, the q/k/v head copies of the chunked
        delta rule and its chunk-by-chunk decay matrices."""
        head = max(self.k_head_dim, self.v_head_dim)
        per_token = (self.conv_kernel + 3) * self.conv_dim + self.v_heads * (12 * head + 3 * min(CHUNK, tokens))
        return tokens * hidden + _rows(tokens, chunk) * per_token

    @property
    def input_width(self) -> int:
        return self.v_heads * self.v_head_dim


@dataclass(frozen=True)
class CompressedAttentionMemory:
    """DeepSeek-V4's attention (compressed_attention.py): per layer a ring of raw entries, and by its compress
    rate the compressors' projection rings and ctx / rate compressed entries; one shared key/value head.
    `hc`: the hyper-connection streams every token carries through the step."""

    ratios: tuple[int, ...]
    head_dim: int
    window: int
    index_dim: int
    heads: int
    q_lora_rank: int
    hc: int

    def kv_nbytes(self, ctx: int, exact: bool) -> int:
        return CompressedKVCache.bytes_for(self.ratios, self.head_dim, self.window, self.index_dim, ctx, exact)

    def span_nbytes(self, tokens: int, ctx: int, chunk: int | None = None) -> int:
        """The keys a chunk of queries reads in float32 (window, chunk and every compressed entry), the scores
        over them for every head, and the indexer's scores (V4's attention runs QUERY_CHUNK queries at a time
        whatever the caller's chunk)."""
        rows = min(tokens, QUERY_CHUNK)
        keys = self.window + rows + ctx // CSA_RATE
        return FLOAT * (2 * keys * self.head_dim + 2 * self.heads * rows * keys)

    def peak_values(self, tokens: int, chunk: int | None, hidden: int) -> int:
        """q with its normed and rotated copies, the output and its rotation, the q LoRA; the streams and
        their mixed copies for every token."""
        per_query = 5 * self.heads * self.head_dim + 2 * self.q_lora_rank + 8 * self.index_dim
        return _rows(tokens, chunk) * per_query + tokens * 4 * self.hc * hidden

    @property
    def input_width(self) -> int:
        return self.heads * self.head_dim


Mixer = AttentionMemory | LatentAttentionMemory | DeltaNetMemory | CompressedAttentionMemory


@dataclass(frozen=True)
class MoEMemory:
    """Routed experts of `expert_ffn` rows, `top_k` a token. `always_on_ffn`: the rows of an FFN every token
    runs beside them (a shared expert, or the dense FFN of leading dense blocks: a block has one or the other,
    so the wider counts). `gate_logits`: router logits a token beyond the experts' (a shared expert's gate).
    `clamped`: GPT-OSS's clamped SwiGLU with biases, computed in float32."""

    n_experts: int
    top_k: int
    expert_ffn: int
    always_on_ffn: int = 0
    gate_logits: int = 0
    clamped: bool = False

    def peak_values(self, tokens: int, hidden: int, ordered: bool) -> int:
        """Every chosen expert's output row kept until the fixed-order sum with the gathered inputs, the router,
        one expert's intermediates and the always-on FFN's. `ordered` (the engine's assurance that a long
        span's fetch keeps its order): the experts are summed as they come (moe.InOrderSum), so the span
        holds its output, its tokens quantized once (1.625 bytes a value: half a float counted) and one row
        batch."""
        H, F = hidden, self.expert_ffn
        # the clamped form: gate and up in float32, their clamped copies and the output row; the lane kernels
        # otherwise: the inputs quantized once and the intermediates
        expert = 4 * F + H if self.clamped else (H + 3 * F) // 2
        rows = 2 * self.top_k * H  # the (token, expert) rows gathered and their results
        per_token = rows + self.n_experts + self.gate_logits + expert + 3 * self.always_on_ffn
        if ordered and summed_as_they_come(tokens * self.top_k):
            return tokens * (per_token - rows + H + H // 2) + 2 * linear.SWIGLU_MAX_ROWS * H
        return tokens * per_token

    @property
    def input_width(self) -> int:
        return self.always_on_ffn  # its down projection's


@dataclass(frozen=True)
class ModelMemory:
    """An architecture's account: its hidden size and vocabulary, the mixer kinds of its blocks, its FFN."""

    hidden: int
    vocab: int
    mixers: tuple[Mixer, ...]
    ffn: MoEMemory

    def kv_nbytes(self, ctx: int, exact: bool) -> int:
        """One sequence's cache at `ctx` positions (bf16 values, float32 when `exact`)."""
        return sum(m.kv_nbytes(ctx, exact) for m in self.mixers)

    def compute_nbytes(self, tokens: int, ctx: int, chunk: int | None = None, ordered: bool = False) -> int:
        """Peak transient memory of one forward call over `tokens` prompt tokens at up to `ctx` positions, its
        attention run `chunk` queries at a time and, `ordered`, its experts summed as they come."""
        H, ffn = self.hidden, self.ffn
        span = max(m.span_nbytes(tokens, ctx, chunk) for m in self.mixers)
        max_in = max(H, ffn.input_width, *(m.input_width for m in self.mixers))
        scratch = linear.kernel_scratch_bytes(tokens, ffn.top_k, H, ffn.expert_ffn, max_in)
        widest = max(ffn.peak_values(tokens, H, ordered), *(m.peak_values(tokens, chunk, H) for m in self.mixers))
        per_token = FLOAT * (tokens * RESIDUAL_VALUES * H + widest) * MARGIN_NUM // MARGIN_DEN
        return span + scratch + per_token + LOGIT_ROWS * FLOAT * self.vocab + RUNTIME_BYTES
