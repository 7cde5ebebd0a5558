"""What every architecture's model class shares: the token embedding, the final norm and output head, the
attachments the engine makes (expert provider, route hook), and the weights it keeps resident."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from moestream.compute import linear
from moestream.models import batch
from moestream.models.common import ExpertProvider, RouteHook, resident_tensors, rms_norm, wide_torch
from moestream.models.loader import Weights


class MoEModel:
    """The resident part of a model plus its forward pass; routed experts come from `experts`.

    A subclass loads its layers between `__init__` (the embedding) and `_load_head` (norm and output head),
    so the weights are read in file order. Its `layers` are (mixer norm, mixer, FFN norm, FFN) per block, a
    block being x += mixer(norm(x)); x += FFN(norm(x)): `forward_batch` runs any such model; an architecture
    whose mixer is not `mixer(h, layer, kv, pos, rope)` overrides `mix_rows`; a mixer split as
    batch.SplitMixer shares its projections across the rows of a batched step.
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
        """One new token for each of B sequences: tokens[b] at positions[b] over its own cache kvs[b] (advanced
        as forward advances it). Returns the last-position logits [B, V] float32; row b is bit-identical to
        forward([tokens[b]], kvs[b], positions[b]), whichever other rows share the step (models/batch.py)."""
        assert self.experts is not None, "no expert provider attached"
        B = len(tokens)
        if not 1 <= B == len(kvs) == len(positions) or len({id(kv) for kv in kvs}) != B:
            raise ValueError(f"forward_batch takes one token, cache and position per sequence ({B} tokens, "
                             f"{len(kvs)} caches, {len(positions)} positions, caches distinct)")  # fmt: skip
        eps = self.cfg.rms_eps
        self.begin_rows(kvs, positions)
        x = self.embed(tokens)
        try:
            for i, (_, _, ffn_norm, ffn) in enumerate(self.layers):
                x = x + self.mix_rows(i, x, kvs, positions)
                moe_layer = getattr(ffn, "expert_layer", None)  # None: a dense block, never routed
                forced = [None if moe_layer is None else self.forced_routes(moe_layer, p, 1) for p in positions]
                x = x + batch.ffn_rows(ffn, batch.norm_rows(x, ffn_norm, eps), self.experts, forced)
        except BaseException:
            self.abort_rows(kvs, positions)
            raise
        self.end_rows(kvs, positions)
        with wide_torch():
            return batch.linear_rows(self.output, batch.norm_rows(x, self.norm, eps))

    def mix_rows(self, i: int, x: torch.Tensor, kvs: list, positions: list[int]) -> torch.Tensor:
        """Block i's mixer output (before the residual) for rows of x [B, hidden], each over its own cache at
        its own position: a SplitMixer's projections on all rows at once, any other mixer row by row."""
        norm, mixer = self.layers[i][0], self.layers[i][1]
        eps = self.cfg.rms_eps
        if hasattr(mixer, "project"):
            return batch.split_rows(mixer, batch.norm_rows(x, norm, eps), i, kvs, positions, self.rope)
        return torch.cat([mixer(rms_norm(x[b : b + 1], norm, eps), i, kvs[b], p, self.rope)
                          for b, p in enumerate(positions)])  # fmt: skip

    def begin_rows(self, kvs: list, positions: list[int]) -> None:
        """Checks a cache kind makes before a batched step (recurrent states must be at their position)."""

    def end_rows(self, kvs: list, positions: list[int]) -> None:
        for kv, p in zip(kvs, positions, strict=True):
            kv.advance(p + 1)

    def abort_rows(self, kvs: list, positions: list[int]) -> None:
        """A batched step failed part-way (a read error, Ctrl-C): undo what cannot be overwritten later."""
