"""Router choices replayed from a recorded trace (`--route-trace`).

Random weights route almost uniformly, so a synthetic model's cache behaviour says little about a real
chat. With a route trace, the router's top-k choice for token t at layer l is the one recorded in the
trace for decode token t (by request rank); the model still reads and computes those experts, weighted
by its own router's probabilities for them. The trace is cycled when the session is longer than it, and
a model deeper than the trace reuses the trace's layers in turn (layer l takes trace layer l mod L).

The format is the expert-access trace written by `--trace` (moestream/analysis/trace.py); only decode rows are
used, each decode step giving one token's routing.
"""

from __future__ import annotations

import numpy as np
import torch

from moestream.analysis.trace import DECODE, read_trace
from moestream.errors import MoestreamError


class RouteTrace:
    """A route hook (models.common.RouteHook): called with (layer, pos, n_tokens), it returns the expert ids
    [n_tokens, top_k] the model uses instead of its router's choice."""

    def __init__(self, path: str, n_experts: int, top_k: int):
        _meta, rows = read_trace(path)
        rows = rows[rows["phase"] == DECODE]
        if len(rows) == 0:
            raise MoestreamError(f"{path} has no decode accesses to take routes from; record one with --trace")
        steps = np.unique(rows["step"])
        n_layers = int(rows["layer"].max()) + 1
        if int(rows["expert"].max()) >= n_experts:
            raise MoestreamError(
                f"{path} routes to expert {int(rows['expert'].max())} but the model has {n_experts} experts per "
                "layer; record the trace on a model with the same expert count"
            )
        order = np.lexsort((rows["rank"], rows["layer"], rows["step"]))
        rows = rows[order]
        per_group = len(rows) // (len(steps) * n_layers) if len(steps) * n_layers else 0
        if per_group != top_k or len(rows) != len(steps) * n_layers * top_k:
            raise MoestreamError(
                f"{path} does not hold {top_k} experts for every layer of every decode token (the model's "
                "top-k); record the trace on a model with the same top-k"
            )
        self.routes = torch.from_numpy(rows["expert"].astype(np.int64).reshape(len(steps), n_layers, top_k))
        self.n_tokens = len(steps)
        self.n_layers = n_layers

    def __call__(self, layer: int, pos: int, n_tokens: int) -> torch.Tensor:
        """Expert ids [n_tokens, top_k] for tokens at positions pos..pos+n_tokens-1 of `layer`."""
        t = torch.arange(pos, pos + n_tokens) % self.n_tokens
        return self.routes[t, layer % self.n_layers]
