"""Dense weights handed to a model. The model names each tensor and the shape it expects; the loader reads
it from the file, checks the shape, and returns it in its compute form, counting the bytes it keeps.

Shapes are in numpy order (a weight [out, in]); leading dimensions of 1 are ignored, as llama.cpp ignores
trailing ones in ggml order (a shared-expert gate may be stored [hidden] or [1, hidden]).
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from gguf import GGMLQuantizationType

from moestream.compute import linear
from moestream.compute.linear import QLinear
from moestream.errors import ModelFileError
from moestream.formats import quants
from moestream.formats.gguf_file import TensorInfo
from moestream.formats.gguf_model import GGUFModel
from moestream.formats.quants import as_bytes
from moestream.models.common import Embedding, Fused

Shape = tuple[int, ...]


class Weights(Protocol):
    """What a model sees of its weights file."""

    exact: bool  # every weight in float32 (logits checked against a float reference)
    nbytes: int  # bytes of everything handed out so far
    linears: list[QLinear]  # every matrix handed out by linear()/fused(), in load order

    def has(self, name: str) -> bool: ...

    def vector(self, name: str, length: int) -> torch.Tensor:
        """Norms, biases, per-head constants: float32 [length]."""
        ...

    def matrix(self, name: str, rows: int, cols: int) -> torch.Tensor:
        """Small matrices kept exact (routers, conv kernels): float32 [rows, cols]."""
        ...

    def array(self, name: str, shape: Shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Any other tensor (per-head 3-D weights) of `shape`, widened to float32 then held in `dtype`."""
        ...

    def linear(self, name: str, out_features: int, in_features: int) -> QLinear: ...

    def per_head(self, name: str, heads: int, out_features: int, in_features: int) -> QLinear | None:
        """A 3-D tensor of one [out, in] matrix a head as a [heads * out, in] weight at the file's own bits, or
        None where the lane kernels do not take its type (the caller then holds it dense)."""
        ...

    def linear_rows(self, name: str, out_features: int, in_features: int, order: Sequence[int]) -> QLinear:
        """As linear, its output rows reordered: row i is the file's row order[i] (llama's q/k rotary layout)."""
        ...

    def linear_groups(self, name: str, groups: int, out_features: int, in_features: int) -> list[QLinear]:
        """The weight's rows as `groups` consecutive projections."""
        ...

    def indices(self, name: str, shape: Shape) -> torch.Tensor:
        """An integer table as int64."""
        ...

    def fused(self, parts: Sequence[tuple[str, int, int]]) -> Fused:
        """Several projections of one input, each (name, out_features, in_features), as few matmuls."""
        ...

    def expect(self, name: str, shape: Shape) -> None:
        """Check the shape of a tensor the model does not load itself (the streamed routed experts)."""
        ...

    def embedding(self, name: str, vocab: int, hidden: int) -> Embedding: ...

    def output_head(self, name: str, embedding: Embedding) -> QLinear:
        """The output projection, or the embedding's own bytes when the file ties the two (no `name`)."""
        ...


def _core(shape: Sequence[int]) -> Shape:
    s = tuple(int(d) for d in shape)
    while s and s[0] == 1:
        s = s[1:]
    return s


def _fmt(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _checked(f: GGUFModel, name: str, shape: Shape) -> TensorInfo:
    """The tensor's info, its shape checked against the one the model's metadata gives it."""
    info = f.tensor(name)
    if any(d <= 0 for d in shape) or _core(info.shape) != _core(shape):
        raise ModelFileError(
            f"{f.path}: tensor {name} has shape {_fmt(info.shape)} but the model's metadata makes it "
            f"{_fmt(shape)}; the file is damaged or was converted wrongly"
        )
    return info


class GGUFWeights:
    """Weights read from a GGUF file the caller opened (and closes)."""

    def __init__(self, f: GGUFModel, exact: bool):
        self.f = f
        self.exact = exact
        self.nbytes = 0
        self.linears: list[QLinear] = []

    def has(self, name: str) -> bool:
        return name in self.f.tensors

    def expect(self, name: str, shape: Shape) -> None:
        _checked(self.f, name, shape)

    def _floats(self, name: str, shape: Shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        info = _checked(self.f, name, shape)
        a = quants.dequantize(self.f.read(name), info.ggml_type, info.shape)
        if not np.isfinite(a).all():
            raise ModelFileError(f"{self.f.path}: tensor {name} holds NaN or infinite values; the file is damaged")
        t = torch.from_numpy(a.copy()).reshape(shape).to(dtype)
        self.nbytes += t.numel() * t.element_size()
        return t

    def vector(self, name: str, length: int) -> torch.Tensor:
        return self._floats(name, (length,))

    def matrix(self, name: str, rows: int, cols: int) -> torch.Tensor:
        return self._floats(name, (rows, cols))

    def array(self, name: str, shape: Shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._floats(name, tuple(shape), dtype)

    def linear(self, name: str, out_features: int, in_features: int) -> QLinear:
        info = _checked(self.f, name, (out_features, in_features))
        lin = linear.from_gguf(self.f.read(name), info.ggml_type, out_features, in_features, self.exact)
        self.nbytes += lin.nbytes
        self.linears.append(lin)
        return lin

    def per_head(self, name: str, heads: int, out_features: int, in_features: int) -> QLinear | None:
        info = _checked(self.f, name, (heads, out_features, in_features))
        n = heads * out_features
        if linear.compute_kind(info.ggml_type, n, in_features, self.exact) != "lane":
            return None
        lin = linear.from_gguf(self.f.read(name), info.ggml_type, n, in_features, self.exact)
        self.nbytes += lin.nbytes
        self.linears.append(lin)
        return lin

    def linear_rows(self, name: str, out_features: int, in_features: int, order: Sequence[int]) -> QLinear:
        info = _checked(self.f, name, (out_features, in_features))
        if sorted(order) != list(range(out_features)):
            raise ValueError(f"{name}: the row order is not a permutation of its {out_features} rows")
        # a row is whole quantization blocks (they run along the input dimension), so rows move as bytes
        raw = self.f.read(name).reshape(out_features, -1)[np.asarray(order)].reshape(-1)
        lin = linear.from_gguf(raw, info.ggml_type, out_features, in_features, self.exact)
        self.nbytes += lin.nbytes
        self.linears.append(lin)
        return lin

    def fused(self, parts: Sequence[tuple[str, int, int]]) -> Fused:
        return Fused([self.linear(*p) for p in parts])

    def linear_groups(self, name: str, groups: int, out_features: int, in_features: int) -> list[QLinear]:
        """A [out, in] weight's rows as `groups` consecutive projections of out / groups rows each (a grouped
        projection: group g reads its own slice of the input)."""
        info = _checked(self.f, name, (out_features, in_features))
        if out_features % groups:
            raise ModelFileError(f"{self.f.path}: {name} has {out_features} rows, not a multiple of {groups} groups")
        rows = out_features // groups
        raw = self.f.read(name).reshape(out_features, -1)
        out = []
        for g in range(groups):
            part = np.ascontiguousarray(raw[g * rows : (g + 1) * rows]).reshape(-1)
            lin = linear.from_gguf(part, info.ggml_type, rows, in_features, self.exact)
            self.nbytes += lin.nbytes
            self.linears.append(lin)
            out.append(lin)
        return out

    def indices(self, name: str, shape: Shape) -> torch.Tensor:
        """An I32 table (DeepSeek-V4's tid2eid) as int64."""
        info = _checked(self.f, name, shape)
        if info.ggml_type != GGMLQuantizationType.I32:
            raise ModelFileError(f"{self.f.path}: {name} should be an I32 table; the file was converted wrongly")
        t = torch.from_numpy(np.frombuffer(as_bytes(self.f.read(name)), dtype=np.int32).copy()).long()
        self.nbytes += t.numel() * 4
        return t.reshape(shape)

    def embedding(self, name: str, vocab: int, hidden: int) -> Embedding:
        info = _checked(self.f, name, (vocab, hidden))
        raw = self.f.read(name)  # rows decoded on lookup; never expanded to float
        self.nbytes += raw.nbytes
        return Embedding(raw, info.ggml_type, vocab, hidden)

    def output_head(self, name: str, embedding: Embedding) -> QLinear:
        if self.has(name):
            return self.linear(name, embedding.vocab, embedding.hidden)
        # tied embeddings: the head reads the same bytes as the embedding table
        e = embedding
        head = linear.from_gguf(e.raw, e.ggml_type, e.vocab, e.hidden, self.exact)
        self.nbytes += head.nbytes
        return head


def tensor_shapes(f: GGUFModel) -> dict[str, Shape]:
    return {name: info.shape for name, info in f.tensors.items()}


def config_from_gguf(model_cls: Any, f: GGUFModel) -> Any:
    """The architecture's config from an open file's metadata and tensor table."""
    return model_cls.Config.from_metadata(f.metadata, tensor_shapes(f), f.path)


class ArchMetadata:
    """Typed reads of one architecture's `<arch>.*` metadata keys. Every refusal is one ModelFileError
    naming the key: missing, of the wrong kind (a string or array where a number belongs), not finite, or
    out of the range the model can run."""

    REQUIRED: Any = object()

    def __init__(self, md: Mapping[str, Any], arch: str, shapes: Mapping[str, Shape], source: str = "model file"):
        self.md, self.arch, self.shapes, self.source = md, arch, shapes, source

    def error(self, key: str, what: str) -> ModelFileError:
        return ModelFileError(f"{self.source}: metadata {self.arch}.{key} {what}")

    def _raw(self, key: str, default: Any) -> Any:
        v = self.md.get(f"{self.arch}.{key}", default)
        if v is ArchMetadata.REQUIRED:
            raise self.error(key, "is missing; the file is incomplete")
        return v

    def _number(self, key: str, v: Any) -> float | int:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.error(key, f"is {_show(v)}, not a number; the file is damaged")
        return v

    def int(self, key: str, default: Any = REQUIRED, *, low: int = 1, per_layer: bool = False) -> int:
        """An integer >= low; with per_layer, an array of one value per layer when all the values agree."""
        v = self._raw(key, default)
        if per_layer and isinstance(v, list):  # llama.cpp allows per-layer arrays; we run uniform layers only
            if not v or len(set(map(repr, v))) != 1:
                raise self.error(key, "differs between layers, which moestream does not support")
            v = v[0]
        v = self._number(key, v)
        if isinstance(v, float) and not (math.isfinite(v) and v.is_integer()):
            raise self.error(key, f"is {v!r}, not a whole number; the file is damaged")
        if v < low:
            raise self.error(key, f"is {int(v)}; it must be at least {low}")
        return int(v)

    def float(self, key: str, default: Any = REQUIRED) -> float:
        """A finite number > 0 (epsilons, rope bases: zero or NaN would make every activation NaN)."""
        v = float(self._number(key, self._raw(key, default)))
        if not (math.isfinite(v) and v > 0):
            raise self.error(key, f"is {v!r}; it must be a finite number > 0")
        return v

    def per_block(self, key: str, n: int, kind: type | None = None) -> list:
        """A number given once for every block or as a list of at least n (the first n: a trunk's blocks), each
        made a `kind` (int where None: the name is this class's method here)."""
        kind = kind or builtins.int
        v = self._raw(key, ArchMetadata.REQUIRED)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return [kind(v)] * n
        if not isinstance(v, (list, tuple)) or len(v) < n or not all(isinstance(x, (int, float)) for x in v):
            raise self.error(key, f"is {v!r}; it must give a value for each of the {n} blocks")
        return [kind(x) for x in v[:n]]

    def flag(self, key: str, default: bool) -> bool:
        v = self._raw(key, default)
        if not isinstance(v, (bool, int)) or isinstance(v, int) and v not in (0, 1):
            raise self.error(key, f"is {_show(v)}, not true/false; the file is damaged")
        return bool(v)

    def flags(self, key: str, n: int) -> list[bool] | None:
        """The first n entries of a per-layer boolean array, or None when the file has none."""
        v = self._raw(key, None)
        if v is None:
            return None
        if not isinstance(v, list) or len(v) < n or any(not isinstance(x, (bool, int)) for x in v[:n]):
            raise self.error(key, f"is {_show(v)}, not true/false for each of the {n} layers; the file is damaged")
        return [bool(x) for x in v[:n]]

    def attention(self) -> tuple[int, int, int, int]:
        """(hidden size, query heads, key/value heads, head size), checked against each other."""
        hidden, n_heads = self.int("embedding_length"), self.int("attention.head_count", per_layer=True)
        n_kv_heads = self.int("attention.head_count_kv", n_heads, per_layer=True)
        self.require(n_heads % n_kv_heads == 0, "attention.head_count_kv",
                     f"({n_kv_heads}) does not divide the {n_heads} query heads")  # fmt: skip
        if f"{self.arch}.attention.key_length" not in self.md:
            self.require(hidden % n_heads == 0, "attention.key_length",
                         "is missing and embedding_length is not a multiple of attention.head_count")  # fmt: skip
        return hidden, n_heads, n_kv_heads, self.int("attention.key_length", hidden // n_heads)

    def experts(self) -> tuple[int, int]:
        """(routed experts per layer, experts each token uses)."""
        n_experts, top_k = self.int("expert_count"), self.int("expert_used_count")
        self.require(top_k <= n_experts, "expert_used_count", f"is {top_k} but there are {n_experts} experts")
        return n_experts, top_k

    def require(self, ok: bool, key: str, what: str) -> None:
        if not ok:
            raise self.error(key, what)

    def tensor_shape(self, name: str) -> Shape:
        shape = self.shapes.get(name)
        if shape is None:
            raise ModelFileError(f"{self.source}: tensor {name!r} is missing; the file is incomplete or another arch")
        return tuple(shape)


def _show(v: Any) -> str:
    if isinstance(v, str):
        return f"the string {v[:40]!r}"
    if isinstance(v, list):
        return f"an array of {len(v)}"
    return repr(v)[:40]
