"""The decoder block every architecture is made of, and the one interface its token mixers share.

A block is x += mixer(norm(x)); x += ffn(norm(x)). An architecture says which mixer (grouped-query
attention, latent attention, gated attention, Gated DeltaNet) and which FFN (dense, MoE, MoE with a shared
expert) each of its blocks uses; the model's forward step (models/base.py) runs any such stack, for one
sequence or for a batch of them alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moestream.models.attention import by_query_chunks
from moestream.models.common import ExpertProvider, RouteHook
from moestream.models.ops import rms_norm
from moestream.models.rows import ALONE, ROWS, Ops, Spans, blockwise, norm_blocks, norm_rows


@dataclass(eq=False)
class Step:
    """What every block of one forward step needs besides its input: the blocks' rows of the step's x (block
    b: one sequence's tokens, at positions[b] over its own cache kvs[b]), the rotary table, the expert
    provider, and the recorded routes that replace the router's choice (None: the router chooses)."""

    spans: Spans
    kvs: list[Any]
    positions: list[int]
    rope: Any
    experts: ExpertProvider
    route_hook: RouteHook | None = None
    tokens: list[int] | None = None  # the step's token ids in row order (hash routers read them)

    def forced(self, moe_layer: int) -> list[torch.Tensor | None]:
        """Each block's recorded expert ids [T_b, k] for MoE layer `moe_layer`, or None."""
        if self.route_hook is None:
            return [None] * len(self.spans)
        hook = self.route_hook
        return [
            hook(moe_layer, p, e - a, kv) for p, (a, e), kv in zip(self.positions, self.spans, self.kvs, strict=True)
        ]


class Mixer:
    """A block's token mixer. `__call__` runs T tokens of one sequence (its input normed); `rows` one token of
    each of B sequences (its input not yet normed, so that a mixer may fold the norm into a native call),
    each row with the bits it gets alone: by default row by row."""

    def __call__(self, h: torch.Tensor, layer: int, kv: Any, pos: int, rope: Any) -> torch.Tensor:
        raise NotImplementedError

    def rows(
        self, x: torch.Tensor, norm: torch.Tensor, eps: float, layer: int, kvs: list, positions: list[int], rope: Any
    ) -> torch.Tensor:
        return torch.cat(
            [self(rms_norm(x[b : b + 1], norm, eps), layer, kvs[b], p, rope) for b, p in enumerate(positions)]
        )


class SplitMixer(Mixer):
    """A mixer whose projections (row-wise: shared by a step's one-token rows, each weight read once) are
    split from what each sequence does over its own cache at its own position (`core`)."""

    def project(self, x: torch.Tensor, ops: Ops) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def core(self, parts: tuple[torch.Tensor, ...], layer: int, kv: Any, pos: int, rope: Any) -> torch.Tensor:
        raise NotImplementedError

    def output(self, a: torch.Tensor, ops: Ops) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, h: torch.Tensor, layer: int, kv: Any, pos: int, rope: Any) -> torch.Tensor:
        """T tokens of one sequence; a long span a query chunk at a time (by_query_chunks)."""

        def run(xc: torch.Tensor, p: int) -> torch.Tensor:
            return self.output(self.core(self.project(xc, ALONE), layer, kv, p, rope), ALONE)

        return by_query_chunks(h, kv, pos, run)

    def rows(
        self, x: torch.Tensor, norm: torch.Tensor, eps: float, layer: int, kvs: list, positions: list[int], rope: Any
    ) -> torch.Tensor:
        parts = self.project(norm_rows(x, norm, eps), ROWS)
        cores = [self.core(tuple(t[b : b + 1] for t in parts), layer, kvs[b], p, rope) for b, p in enumerate(positions)]
        return self.output(torch.cat(cores), ROWS)


@dataclass(eq=False)
class DecoderLayer:
    """One block: x += mixer(mixer_norm(x)); x += ffn(ffn_norm(x)). The FFN is called as ffn(h, step).
    An architecture whose residual is not one stream (hyper-connections) subclasses it and overrides
    __call__."""

    mixer_norm: torch.Tensor
    mixer: Mixer
    ffn_norm: torch.Tensor
    ffn: Any  # moe.MoE or moe.DenseFFN

    def __call__(self, x: torch.Tensor, layer: int, step: Step, eps: float) -> torch.Tensor:
        """The block on a step's x: the residual stream after it."""
        x = x + self.mix(x, layer, step, eps)
        return x + self.ffn(norm_blocks(x, step.spans, self.ffn_norm, eps), step)

    def mix(self, x: torch.Tensor, layer: int, step: Step, eps: float) -> torch.Tensor:
        """The mixer's output (before the residual) for a step's blocks of x: the one-token blocks together
        (Mixer.rows), each longer one alone."""
        norm, mixer, kvs, positions = self.mixer_norm, self.mixer, step.kvs, step.positions
        return blockwise(
            x,
            step.spans,
            lambda bs, xr: mixer.rows(
                xr, norm, eps, layer, [kvs[b] for b in bs], [positions[b] for b in bs], step.rope
            ),  # fmt: skip
            lambda b, xb: mixer(rms_norm(xb, norm, eps), layer, kvs[b], positions[b], step.rope),
        )
