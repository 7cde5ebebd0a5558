"""Opening a model: its GGUF file (or a split set's files) -> architecture -> config -> expert store, in one place."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from moestream.compute import linear
from moestream.engine.options import EngineOptions
from moestream.errors import ModelFileError, MoestreamError
from moestream.formats import quants
from moestream.formats.checkpoint import open_model_file
from moestream.formats.gguf_model import GGUFModel
from moestream.formats.tokenizer import Tokenizer
from moestream.models import ARCHITECTURES, model_class
from moestream.models.loader import GGUFWeights, config_from_gguf
from moestream.models.mla import UP_PROJECTIONS
from moestream.streaming.expert_store import ExpertStore, is_routed_expert_tensor
from moestream.streaming.heap import release_free_heap
from moestream.streaming.mlock import LockReport, lock_dense, routed_nbytes

FLOAT_TYPES = {0, 1}  # F32, F16: computed in float32 (exact mode)


@dataclass
class OpenModel:
    """A model file read as far as its header: what every user of the file needs before loading weights."""

    gguf: GGUFModel  # one file, or every part of a split model
    arch: type  # the architecture's model class (ARCHITECTURES)
    cfg: Any  # the architecture's config, from the file's metadata
    exact: bool  # float32 compute (float files) instead of the quantized kernels
    store: ExpertStore  # where each expert's bytes lie in the file

    @property
    def path(self) -> str:
        return self.gguf.path

    def close(self) -> None:
        self.gguf.close()


def open_model(path: str, exact: bool | None = None, *, check_types: bool = True) -> OpenModel:
    """Open `path` (a model file, any part of a split model, or a directory holding one model) and read what
    it holds; the caller closes it. exact None: float32 for float files."""
    f = open_model_file(path)
    try:
        arch = model_class(f.arch, f.metadata)
        if arch is None:
            raise ModelFileError(
                f"{path}: architecture {f.arch or '(none)'!r} is not supported "
                f"(supported: {', '.join(sorted(ARCHITECTURES))})"
            )
        exact = is_float_model(f) if exact is None else exact
        if check_types:
            _check_types(f)
            if note := slow_path_note(f, exact):
                print(note, file=sys.stderr)
        cfg = config_from_gguf(arch, f)
        if check_types:
            for line in getattr(arch, "load_notes", lambda _cfg, _exact: [])(cfg, exact):
                print(f"note: {line}", file=sys.stderr)  # what the architecture says of this file
        # cfg.n_layers counts the layers with routed experts; an architecture with leading dense blocks
        # says where they start
        store = ExpertStore(f, cfg.n_layers, cfg.n_experts, exact, getattr(cfg, "first_moe_block", 0))
    except BaseException:
        f.close()
        raise
    return OpenModel(f, arch, cfg, exact, store)


def is_float_model(f: GGUFModel) -> bool:
    return all(t.ggml_type in FLOAT_TYPES for t in f.tensors.values() if len(t.shape) >= 2)


INDEX_TYPES = frozenset({26})  # I32: integer tables (DeepSeek-V4's tid2eid), read as indices, never as weights


def _check_types(f: GGUFModel) -> None:
    for t in f.tensors.values():
        if t.ggml_type not in quants.SUPPORTED_TYPES and t.ggml_type not in INDEX_TYPES:
            supported = ", ".join(quants.type_name(x) for x in sorted(quants.SUPPORTED_TYPES))
            raise ModelFileError(
                f"{f.path}: tensor {t.name} has weight type {t.type_name}, which moestream does not support yet "
                f"(supported: {supported}); use a file quantized to one of those"
            )


def slow_path_note(f: GGUFModel, exact: bool) -> str:
    """One line naming the weight types this file holds that no native kernel computes (decoded to bf16 by
    numpy when loaded, an expert at each cache fill), or '' when there are none."""
    slow = set()
    for t in f.tensors.values():
        if len(t.shape) >= 2 and linear.slow_path(t.ggml_type, t.shape[-2], t.shape[-1], exact):
            slow.add(t.ggml_type)
    if not slow:
        return ""
    names = ", ".join(quants.type_name(x) for x in sorted(slow))
    form = "float32" if exact else "bf16"
    return f"note: {names} tensors are decoded to {form} when loaded (slower than the native kernels)"


def tokenizer_if_any(f: GGUFModel) -> Tokenizer | None:
    """The file's tokenizer, or None when it has none (Engine.tokenizer then says why, if asked)."""
    if "tokenizer.ggml.model" not in f.metadata:
        return None
    try:
        return Tokenizer.from_metadata(f.metadata)
    except MoestreamError:
        return None


def trunk_blocks(cfg: Any) -> int:
    """The blocks the model runs: every block but the multi-token-prediction ones a file may append."""
    return getattr(cfg, "n_blocks", cfg.n_layers)


def dense_estimate(f: GGUFModel, exact: bool, n_blocks: int | None = None) -> int:
    """Bytes the resident weights will take, from the tensor table alone (checked before loading).

    n_blocks: tensors of blocks from this one on (multi-token-prediction blocks, never loaded) are left out."""
    total = 0
    for t in f.tensors.values():
        if is_routed_expert_tensor(t.name) or n_blocks is not None and _block_of(t.name) >= n_blocks:
            continue
        if t.name.endswith(UP_PROJECTIONS):  # as models/mla.py's UpProjections holds them
            n, k = _numel(t.shape[:-1]), t.shape[-1]
            split = not t.name.endswith("attn_kv_b.weight")
            if split and linear.compute_kind(t.ggml_type, n, k, exact) == "lane":
                total += linear.packed_nbytes(t.ggml_type, n, k, exact)
            else:
                total += _numel(t.shape) * (4 if exact else 2)
        elif t.ggml_type in INDEX_TYPES:
            total += _numel(t.shape) * 8  # integer tables held as int64 indices
        elif len(t.shape) != 2 or "ffn_gate_inp" in t.name:
            total += _numel(t.shape) * 4  # norms, routers: float32
        elif t.name == "token_embd.weight":
            total += t.nbytes
            if "output.weight" not in f.tensors:
                total += linear.packed_nbytes(t.ggml_type, t.shape[0], t.shape[1], exact)
        else:
            total += linear.packed_nbytes(t.ggml_type, t.shape[0], t.shape[1], exact)
    return total


def _block_of(name: str) -> int:
    """The block number of a `blk.N.*` tensor; -1 for the others (embedding, head, final norm)."""
    parts = name.split(".", 2)
    return int(parts[1]) if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() else -1


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def load_resident(file: OpenModel, options: EngineOptions) -> tuple[Any, LockReport]:
    """The dense weights, resident (and locked where allowed): everything but the routed experts."""
    model = file.arch(file.cfg, GGUFWeights(file.gguf, file.exact))
    release_free_heap()  # the loader's freed read buffers would otherwise be measured as resident
    # Locked before sizing, so the budget measures the locked skeleton (mlock leaves RSS as it is).
    return model, lock_dense(model, routed_nbytes(file.gguf), enabled=options.mlock is not False)
