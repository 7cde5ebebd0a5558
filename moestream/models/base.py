"""What every architecture's model class shares: the token embedding, the final norm and output head, the
attachments the engine makes (expert provider, route hook), and the weights it keeps resident."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import moestream.models.batch as batch
from moestream.compute import linear
from moestream.models.common import ExpertProvider, RouteHook, resident_tensors, rms_norm, wide_torch
from moestream.models.loader import Weights


class MoEModel:
    """The resident part of a model plus its forward pass; routed experts come from `experts`.

    A subclass loads its layers between `__init__` (the embedding) and `_load_head` (norm and output head),
    so the weights are read in file order. Its `layers` are (mixer norm, mixer, FFN norm, FFN) per block, a
    block being x += mixer(norm(x)); x += FFN(norm(x)): `forward_rows` runs any such model; an architecture
    whose mixer is not `mixer(h, layer, kv, pos, rope)` overrides `mix_rows` and `mix_block`; a mixer split
    as batch.SplitMixer shares its projections across the one-token rows of a batched step.
    """

    arch: str
    Config: Any  # the architecture's config dataclass, with from_metadata(md, shapes, source)

    def __init__(self, cfg: Any, w: Weights):
        self.cfg = cfg
        self.exact = w.exact
        self.experts: ExpertProvider | None = None  # the engine attaches its expert cache
        self.route_hook: RouteHook | None = None  # router choices replayed from a trace (--route-trace)
        self.embed = w.embedding("token_embd.weight", cfg.vocab_size, cfg.hidden)

    def _load_head(self, w: Weights) -> None:
        self.norm = w.vector("output_norm.weight", self.cfg.hidden)
        self.output = w.output_head("output.weight", self.embed)
        self.dense_nbytes = w.nbytes
        # the output head runs once a token, widened to every thread when it is not in the lane form (a
        # Q4_K_M's Q6_K head); the per-layer weights must all run on the lane pool for torch to stay at one
        # thread
        self.lane_decode = linear.decode_on_pool([lin for lin in w.linears if lin is not self.output])

    def resident_tensors(self) -> list[torch.Tensor | np.ndarray]:
        return resident_tensors(self)

    def forced_routes(self, layer: int, pos: int, n_tokens: int) -> torch.Tensor | None:
        return self.route_hook(layer, pos, n_tokens) if self.route_hook is not None else None

    def logits(self, x: torch.Tensor, all_logits: bool) -> torch.Tensor:
        """Logits of the last position ([V]) or of all ([T, V]) from the last layer's output x [T, hidden]."""
        if not all_logits:
            x = x[-1:]
        with wide_torch():
            logits = self.output(rms_norm(x, self.norm, self.cfg.rms_eps))
        return logits if all_logits else logits[0]

    def forward_batch(self, tokens: list[int], kvs: list, positions: list[int]) -> torch.Tensor:
        """One new token for each of B sequences: forward_rows of one-token blocks."""
        return self.forward_rows([[t] for t in tokens], kvs, positions)

    def forward_rows(self, blocks: list[list[int]], kvs: list, positions: list[int]) -> torch.Tensor:
        """Blocks of tokens of B sequences in one step: block b (T_b >= 1 tokens) at positions[b].. over its
        own cache kvs[b] (advanced as forward advances it). Returns each block's last-position logits [B, V]
        float32; row b is bit-identical to forward(blocks[b], kvs[b], positions[b]), whatever other blocks
        share the step (models/batch.py). One-token blocks (decoding rows) share every row-invariant kernel;
        a longer block (a prompt chunk) runs its mixer, norms and router as forward runs them; every block's
        routed experts are fetched once per layer for the union, each run once on all the rows routed to it."""
        assert self.experts is not None, "no expert provider attached"
        B = len(blocks)
        if not 1 <= B == len(kvs) == len(positions) or len({id(kv) for kv in kvs}) != B or not all(blocks):
            raise ValueError(
                f"forward_rows takes a non-empty block of tokens, a cache and a position per sequence ({B} blocks, "
                f"{len(kvs)} caches, {len(positions)} positions, caches distinct)"
            )
        eps, lengths = self.cfg.rms_eps, [len(t) for t in blocks]
        spans = batch.spans_of(lengths)
        aux = self.begin_rows(kvs, positions, lengths)
        x = self.embed([t for block in blocks for t in block])
        try:
            for i, (_, _, ffn_norm, ffn) in enumerate(self.layers):
                x = x + self.mix_blocks(i, x, spans, kvs, positions, aux)
                moe_layer = getattr(ffn, "expert_layer", None)  # None: a dense block, never routed
                forced = [None if moe_layer is None else self.forced_routes(moe_layer, p, n)
                          for p, n in zip(positions, lengths, strict=True)]  # fmt: skip
                h = batch.norm_blocks(x, spans, ffn_norm, eps)
                x = x + batch.ffn_blocks(ffn, h, spans, self.experts, forced)
        except BaseException:
            self.abort_rows(kvs, positions)
            raise
        self.end_rows(kvs, positions, lengths, aux)
        with wide_torch():
            last = x if B == x.shape[0] else x[[e - 1 for _, e in spans]]
            return batch.linear_rows(self.output, batch.norm_rows(last, self.norm, eps))

    def mix_blocks(self, i: int, x: torch.Tensor, spans: batch.Spans, kvs: list, positions: list[int], aux: list):
        """Block i's mixer output (before the residual) for a step's blocks of x: the one-token blocks
        together (mix_rows), each longer one as forward runs it (mix_block)."""
        return batch.blockwise(
            x,
            spans,
            lambda bs, xr: self.mix_rows(i, xr, [kvs[b] for b in bs], [positions[b] for b in bs]),
            lambda b, xb: self.mix_block(i, xb, kvs[b], positions[b], aux[b]),
        )

    def mix_block(self, i: int, x: torch.Tensor, kv: Any, pos: int, aux: Any) -> torch.Tensor:
        """Block i's mixer on T tokens of one sequence, the call forward makes (aux: what begin_rows gave)."""
        norm, mixer = self.layers[i][0], self.layers[i][1]
        return mixer(rms_norm(x, norm, self.cfg.rms_eps), i, kv, pos, self.rope)

    def mix_rows(self, i: int, x: torch.Tensor, kvs: list, positions: list[int]) -> torch.Tensor:
        """Block i's mixer output (before the residual) for rows of x [B, hidden], each over its own cache at
        its own position: a SplitMixer's projections on all rows at once, any other mixer row by row."""
        norm, mixer = self.layers[i][0], self.layers[i][1]
        eps = self.cfg.rms_eps
        if hasattr(mixer, "project"):
            return batch.split_rows(mixer, batch.norm_rows(x, norm, eps), i, kvs, positions, self.rope)
        return torch.cat([mixer(rms_norm(x[b : b + 1], norm, eps), i, kvs[b], p, self.rope)
                          for b, p in enumerate(positions)])  # fmt: skip

    def begin_rows(self, kvs: list, positions: list[int], lengths: list[int]) -> list:
        """Checks a cache kind makes before a step of blocks (recurrent states must be at their position);
        what each block's mix_block and end_rows need of it (checkpoints to take)."""
        return [None] * len(kvs)

    def end_rows(self, kvs: list, positions: list[int], lengths: list[int], aux: list) -> None:
        for kv, p, n in zip(kvs, positions, lengths, strict=True):
            kv.advance(p + n)

    def abort_rows(self, kvs: list, positions: list[int]) -> None:
        """A step failed part-way (a read error, Ctrl-C): undo what cannot be overwritten later."""
