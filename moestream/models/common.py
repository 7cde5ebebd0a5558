"""What every architecture's loader shares: the expert provider protocol and the route hook, the token
embedding, projections fused by compute form, and the walk over a model's resident tensors."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
import torch

from moestream.compute import linear
from moestream.compute.experts import ExpertWeights
from moestream.compute.linear import QLinear
from moestream.formats import quants
from moestream.models.kv_cache import KVCache

# (layer, first position, number of tokens, the sequence's KV cache) -> expert ids [tokens, top_k] that replace
# the router's choice, or None to let the router choose. The engine installs one to replay recorded routes
# (--route-trace); the KV cache tells one sequence of a batch from another.
RouteHook = Callable[[int, int, int, Any], "torch.Tensor | None"]


class ExpertProvider(Protocol):
    """What a model sees of the streaming machinery: ask for experts of a layer, receive weights."""

    def fetch_groups(
        self, layer: int, ids: list[int], admit: bool = True, ordered: bool = False
    ) -> Iterator[list[tuple[int, ExpertWeights]]]:
        """Every id's (expert id, weights), in groups as they become available, or in the order of `ids` where
        the slots allow (ordered; see ExpertCache)."""
        ...


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
