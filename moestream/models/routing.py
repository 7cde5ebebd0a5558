"""Routers: (weights, expert ids) from a router's logits, the plain softmax top-k (native for small
calls) and the general form DeepSeek-V2/V3 and their kin configure (Routing)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moestream.compute import kernels, native
from moestream.errors import ComputeError, ModelFileError
from moestream.models.ops import SMALL_OP


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


# llama.cpp clamps the sum of the chosen weights to the smallest normal F16 before dividing by it
MIN_WEIGHT_SUM = 6.103515625e-5


@dataclass(frozen=True)
class Routing:
    """How a router turns its logits into (weights, experts); the default is the plain softmax top-k."""

    # "softmax" over all experts, an independent "sigmoid" or "sqrtsoftplus" (DeepSeek-V4: sqrt(softplus)) per
    # expert, or "softmax_topk": the top-k logits chosen first and the softmax taken over those k only (GPT-OSS)
    gating: str = "softmax"
    norm: bool = True  # renormalise the k chosen weights to sum to 1
    scale: float = 1.0  # then multiply them by this (routed_scaling_factor)
    n_group: int = 1  # experts split into this many groups of consecutive ids
    topk_group: int = 1  # the top-k is taken only within this many best groups
    # a group's score: "top2", the sum of its two best (biased) scores (DeepSeek-V3's noaux_tc, and what
    # llama.cpp computes), or "max", its best one (DeepSeek-V2's group_limited_greedy)
    group_score: str = "top2"

    @property
    def plain(self) -> bool:
        return self.gating == "softmax" and self.scale == 1.0 and self.n_group == 1


def route_general(
    logits: torch.Tensor,
    k: int,
    r: Routing,
    bias: torch.Tensor | None = None,
    forced: torch.Tensor | None = None,
    layer: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) [T, k] under any Routing. `bias` [E] is added to the scores for choosing only; the
    weights are the unbiased scores of the chosen experts. Groups left out are masked with -inf (as
    llama.cpp and DeepSeek's reference code do), so a negative biased score never loses to a masked one."""
    if not torch.isfinite(logits).all():
        where = "" if layer is None else f"layer {layer}: "
        raise ModelFileError(
            f"{where}the router's output is not finite (NaN/inf); "
            "the model file is broken (corrupted weights or hyperparameters)"
        )
    T, E = logits.shape
    if r.gating == "softmax_topk":
        ids = logits.topk(k, dim=-1).indices if forced is None else forced
        weights = torch.softmax(logits.gather(-1, ids), dim=-1)
        return (weights * r.scale if r.scale != 1.0 else weights), ids
    probs = _scores(logits, r.gating)
    if forced is None:
        select = probs if bias is None else probs + bias
        if r.n_group > 1:
            groups = select.view(T, r.n_group, E // r.n_group)
            if r.group_score == "max":
                score = groups.max(dim=-1).values
            else:
                score = groups.topk(min(2, E // r.n_group), dim=-1).values.sum(dim=-1)
            keep = torch.zeros(T, r.n_group, dtype=torch.bool)
            keep.scatter_(1, score.topk(r.topk_group, dim=-1).indices, True)
            select = select.masked_fill(~keep.repeat_interleave(E // r.n_group, dim=1), float("-inf"))
        ids = select.topk(k, dim=-1).indices
    else:
        ids = forced
    weights = probs.gather(-1, ids)
    if r.norm:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(MIN_WEIGHT_SUM)
    if r.scale != 1.0:
        weights = weights * r.scale
    return weights, ids


def _scores(logits: torch.Tensor, gating: str) -> torch.Tensor:
    if gating == "sigmoid":
        return torch.sigmoid(logits)
    if gating == "sqrtsoftplus":  # DeepSeek-V4
        return F.softplus(logits).sqrt()
    return torch.softmax(logits, dim=-1)


def route(
    logits: torch.Tensor, k: int, norm: bool, forced: torch.Tensor | None = None, layer: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) [T, k] of the top-k experts; `forced` [T, k] replaces the choice (a route trace) while
    the weights stay the router's own probabilities for those experts, renormalised over the k when norm."""
    if forced is None:
        return route_topk(logits, k, norm, layer=layer)
    weights = torch.softmax(logits, dim=-1).gather(-1, forced)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, forced
