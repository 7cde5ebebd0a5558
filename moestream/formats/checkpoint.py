"""A Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json) seen as a GGUF model.

CheckpointModel has GGUFModel's interface: llama.cpp's tensor names and `<arch>.*` metadata keys (built
from config.json by formats/checkpoint_arch.py), each tensor a TensorInfo whose (part, offset, nbytes) is a
byte range of one safetensors file, `part` indexing `paths`. So the loader, the expert store and the
reader run on it unchanged, and a routed expert of a per-expert checkpoint (Qwen3-MoE's and Mixtral's
`experts.{e}.gate_proj.weight`) is a byte range of its own, read straight into a cache slot.

Where llama.cpp's converter changes a tensor rather than copying it (Mixtral's q/k rows permuted into
llama's rotary layout, FP8 weights times their block scales, GPT-OSS's interleaved gate/up rows and MXFP4
blocks), the tensor has a `convert`: raw bytes of its range -> the GGUF bytes of its TensorInfo's type and
shape. `read` applies it (resident weights, once at load); the expert store hands it to the cache with the
expert's segment, which applies it on every fill, before packing (Segment.convert).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from moestream.errors import ModelFileError
from moestream.formats.gguf_file import ModelLookups, TensorInfo
from moestream.formats.safetensors_file import SafeTensor, SafetensorsFile

CONFIG, INDEX = "config.json", "model.safetensors.index.json"
Convert = Callable[[np.ndarray], np.ndarray]


def is_checkpoint(path: str) -> bool:
    """A directory that holds a checkpoint (config.json or safetensors) rather than GGUF files."""
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    return CONFIG in names or any(n.endswith(".safetensors") for n in names)


def open_model_file(path: str | os.PathLike[str]) -> Any:
    """A GGUF model (a file, a split set, a directory of one) or a checkpoint directory as one."""
    from moestream.formats.gguf_model import GGUFModel

    path = os.fspath(path)
    return CheckpointModel(path) if is_checkpoint(path) else GGUFModel(path)


def read_json(path: str, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise ModelFileError(f"{path} is missing: a checkpoint directory needs its {what}") from None
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{path}: cannot read it as JSON ({str(e)[:120]}); download it again") from None


class CheckpointModel(ModelLookups):
    MISSING_KEY = "{key} could not be made from config.json"
    MISSING_TENSOR = "tensor {name!r} is missing; the checkpoint is incomplete"

    def __init__(self, directory: str):
        from moestream.formats import checkpoint_arch, checkpoint_tokenizer

        self.path = directory
        self.config = read_json(os.path.join(directory, CONFIG), "config.json")
        if not isinstance(self.config, dict):
            raise ModelFileError(f"{os.path.join(directory, CONFIG)} is not a JSON object")
        builder = checkpoint_arch.builder_for(self.config, directory)  # before opening any file
        self.files: list[SafetensorsFile] = []
        try:
            self.hf: dict[str, tuple[int, SafeTensor]] = self._open_files()
            self.tensors: dict[str, TensorInfo] = {}
            self.converts: dict[str, Convert] = {}
            self.arch, md = builder(self)
            self.metadata: dict[str, Any] = md | checkpoint_tokenizer.metadata(directory, self.config.get("vocab_size"))
        except BaseException:
            self.close()
            raise

    # -- the files ----------------------------------------------------------------------------------------

    def _shard_names(self) -> list[str]:
        index = os.path.join(self.path, INDEX)
        if os.path.exists(index):
            weight_map = read_json(index, "index").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ModelFileError(f"{index} has no weight_map; download it again")
            return sorted(set(weight_map.values()))
        names = sorted(n for n in os.listdir(self.path) if n.endswith(".safetensors"))
        if not names:
            raise ModelFileError(f"{self.path} holds no .safetensors file; download the checkpoint's weights")
        return names

    def _open_files(self) -> dict[str, tuple[int, SafeTensor]]:
        out: dict[str, tuple[int, SafeTensor]] = {}
        for name in self._shard_names():
            path = os.path.join(self.path, name)
            if os.path.basename(name) != name or not os.path.exists(path):
                raise ModelFileError(f"shard {path} is missing ({INDEX} names it); download it next to the others")
            self.files.append(SafetensorsFile(path))
            for t in self.files[-1].tensors.values():
                if t.name in out:
                    raise ModelFileError(f"{path}: tensor {t.name!r} is also in {self.paths[out[t.name][0]]}")
                out[t.name] = (len(self.files) - 1, t)
        return out

    @property
    def paths(self) -> list[str]:
        return [f.path for f in self.files]

    @property
    def part_sizes(self) -> list[int]:
        return [f.file_size for f in self.files]

    @property
    def file_size(self) -> int:
        return sum(self.part_sizes)

    # -- what the builders use ----------------------------------------------------------------------------

    def source(self, name: str) -> tuple[int, SafeTensor]:
        found = self.hf.get(name)
        if found is None:
            raise ModelFileError(
                f"{self.path}: the checkpoint has no tensor {name!r}; it is incomplete or another model"
            )
        return found

    def has_source(self, name: str) -> bool:
        return name in self.hf

    def add(self, name: str, ggml_type: int, shape: tuple[int, ...], src: str, convert: Convert | None = None,
            *, offset: int = 0, nbytes: int | None = None) -> None:  # fmt: skip
        """GGUF tensor `name` is the range of checkpoint tensor `src` from `offset` (all of it by default)."""
        part, t = self.source(src)
        info = TensorInfo(
            name, ggml_type, tuple(shape), t.offset + offset, t.nbytes if nbytes is None else nbytes, part
        )
        self.tensors[name] = info
        if convert is not None:
            self.converts[name] = convert

    def read_source(self, name: str) -> np.ndarray:
        part, t = self.source(name)
        return self.read_range(t.offset, t.nbytes, part)

    # -- GGUFModel's interface ----------------------------------------------------------------------------

    def convert_of(self, name: str) -> Convert | None:
        return self.converts.get(name)

    def read(self, name: str) -> np.ndarray:
        """The tensor as GGUF bytes of its type: the range's bytes, converted where the converter would."""
        info = self.tensor(name)
        raw = self.read_range(info.offset, info.nbytes, info.part)
        convert = self.converts.get(name)
        return raw if convert is None else convert(raw)

    def read_range(self, offset: int, nbytes: int, part: int = 0) -> np.ndarray:
        return self.files[part].read_range(offset, nbytes)

    def close(self) -> None:
        for f in self.files:
            f.close()
