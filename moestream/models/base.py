"""What every architecture's model class shares: the token embedding, the stack of decoder blocks, the final
norm and output head, the one forward step, and the weights it keeps resident."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from moestream.compute import linear
from moestream.models.common import ExpertProvider, RouteHook, resident_tensors
from moestream.models.layer import DecoderLayer, Mixer, Step
from moestream.models.loader import Weights
from moestream.models.moe import link_lookahead
from moestream.models.ops import rms_norm, wide_torch
from moestream.models.rope import RoPE
from moestream.models.rows import linear_rows, norm_rows, spans_of


class PlainResidual:
    """One residual stream [N, hidden] from the embeddings to the final norm (hyper-connections widen it)."""

    def widen(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def narrow(self, x: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        return x


class MoEModel:
    """The resident part of a model plus its forward step; routed experts come from the provider a step is
    given.

    An architecture's class says what its blocks are made of: `mixer(w, i)` and `ffn(w, i)` for block i (the
    norms around them are read here, in file order: the mixer's norm, the mixer, the FFN's norm, the FFN),
    its rotary table (`rotary`), its cache (`kv_cache`) and what that cache and a prompt's compute take
    (`memory`); `step` runs any such stack.
    """

    arch: str
    Config: Any  # the architecture's config dataclass, with from_metadata(md, shapes, source)
    ffn_norm = "ffn_norm"  # the tensor of each block's FFN input norm ("post_attention_norm" in some files)
    residual: Any = PlainResidual()  # how the embeddings become the residual stream and back (DeepSeek-V4 widens it)

    def __init__(self, cfg: Any, w: Weights):
        self.cfg = cfg
        self.exact = w.exact
        self.embed = w.embedding("token_embd.weight", cfg.vocab_size, cfg.hidden)
        self.layers: list[DecoderLayer] = [self._block(w, i) for i in range(self.n_blocks(cfg))]
        link_lookahead(self.layers)
        self.norm = w.vector("output_norm.weight", cfg.hidden)
        self.output = w.output_head("output.weight", self.embed)
        self.dense_nbytes = w.nbytes
        # the output head runs once a token, widened to every thread when it is not in the lane form (a
        # Q4_K_M's Q6_K head); the per-layer weights must all run on the lane pool for torch to stay at one
        # thread
        self.lane_decode = linear.decode_on_pool([lin for lin in w.linears if lin is not self.output])
        self.rope = self.rotary(cfg)

    def _block(self, w: Weights, i: int) -> DecoderLayer:
        H = self.cfg.hidden
        mixer_norm = w.vector(f"blk.{i}.attn_norm.weight", H)
        mixer = self.mixer(w, i)
        ffn_norm = w.vector(f"blk.{i}.{self.ffn_norm}.weight", H)
        return DecoderLayer(mixer_norm, mixer, ffn_norm, self.ffn(w, i))

    # -- what an architecture says ----------------------------------------------------------------------

    @staticmethod
    def n_blocks(cfg: Any) -> int:
        return cfg.n_layers

    def mixer(self, w: Weights, i: int) -> Mixer:
        raise NotImplementedError

    def ffn(self, w: Weights, i: int) -> Any:
        """Block i's feed-forward: moe.MoE or moe.DenseFFN."""
        raise NotImplementedError

    def rotary(self, cfg: Any) -> RoPE:
        raise NotImplementedError

    def kv_cache(self, ctx: int, dtype: torch.dtype) -> Any:
        """One sequence's cache at ctx positions (with begin_step, end_step and abort_step)."""
        raise NotImplementedError

    @staticmethod
    def memory(cfg: Any) -> Any:
        """What one sequence's cache and a prompt's compute take (models/memory.py's ModelMemory)."""
        raise NotImplementedError

    def before_layers(self, step: Step) -> None:
        """What may start once a step's tokens are known, before any layer runs (hash-routed experts' reads)."""

    @staticmethod
    def load_notes(cfg: Any, exact: bool = False) -> list[str]:
        """What the file holds that this model does not run (said when the engine opens it)."""
        return []

    def new_kv(self, ctx: int, dtype: torch.dtype | None = None) -> Any:
        return self.kv_cache(ctx, dtype or (torch.float32 if self.exact else torch.float16))

    def resident_tensors(self) -> list[torch.Tensor | np.ndarray]:
        return resident_tensors(self)

    def forward(
        self,
        tokens: list[int],
        kv: Any,
        pos: int,
        experts: ExpertProvider,
        *,
        route_hook: RouteHook | None = None,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """A sequence alone, the batch of one: tokens at positions pos.. over kv; the last position's logits
        [V], or every position's [T, V]."""
        logits = self.step([tokens], [kv], [pos], experts, route_hook=route_hook, all_logits=all_logits)
        return logits if all_logits else logits[0]

    def step(
        self,
        blocks: list[list[int]],
        kvs: list,
        positions: list[int],
        experts: ExpertProvider,
        *,
        route_hook: RouteHook | None = None,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """The forward pass: blocks of tokens of B sequences in one step, block b (T_b >= 1 tokens) at
        positions[b].. over its own cache kvs[b] (advanced as the step advances it). Returns each block's
        last-position logits [B, V] float32 (all_logits, one block: every position's [T, V]). Row b is
        bit-identical to block b run alone, whatever other blocks share the step (models/rows.py): the
        one-token blocks share every row-invariant kernel, a longer block (a prompt span) runs its mixer,
        norms and router alone, and every block's routed experts are fetched once per layer for the union,
        each run once on all the rows routed to it (models/routed.py)."""
        B, lengths = len(blocks), [len(t) for t in blocks]
        if not 1 <= B == len(kvs) == len(positions) or len({id(kv) for kv in kvs}) != B or not all(blocks):
            raise ValueError(
                f"a forward step takes a non-empty block of tokens, a cache and a position per sequence ({B} "
                f"blocks, {len(kvs)} caches, {len(positions)} positions, caches distinct)"
            )
        if all_logits and B != 1:
            raise ValueError("all_logits is for a step of one sequence")
        eps, spans = self.cfg.rms_eps, spans_of(lengths)
        tokens = [t for block in blocks for t in block]
        step = Step(spans, kvs, positions, self.rope, experts, route_hook, tokens)
        for kv, p, n in zip(kvs, positions, lengths, strict=True):
            kv.begin_step(p, n)
        self.before_layers(step)
        x = self.residual.widen(self.embed(tokens))
        try:
            for i, layer in enumerate(self.layers):
                x = layer(x, i, step, eps)
        except BaseException:
            for kv, p in zip(kvs, positions, strict=True):
                kv.abort_step(p)
            raise
        for kv, p, n in zip(kvs, positions, lengths, strict=True):
            kv.end_step(p, n)
        x = self.residual.narrow(x, spans)
        with wide_torch():
            if all_logits:
                return self.output(rms_norm(x, self.norm, eps))
            last = x if B == x.shape[0] else x[[e - 1 for _, e in spans]]
            return linear_rows(self.output, norm_rows(last, self.norm, eps))
