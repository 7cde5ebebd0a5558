"""What every architecture's model class shares: the token embedding, the final norm and output head, the
attachments the engine makes (expert provider, route hook), and the weights it keeps resident."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from moestream.compute import linear
from moestream.models.common import ExpertProvider, RouteHook, resident_tensors, rms_norm, wide_torch
from moestream.models.loader import Weights


class MoEModel:
    """The resident part of a model plus its forward pass; routed experts come from `experts`.

    A subclass loads its layers between `__init__` (the embedding) and `_load_head` (norm and output head),
    so the weights are read in file order.
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
