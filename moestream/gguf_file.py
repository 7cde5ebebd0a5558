"""A GGUF file: metadata, the tensor table, and tensor bytes read by offset.

The `gguf` package parses the header; tensor bytes are read with os.pread so loading a dense tensor
does not leave a copy of it in the page cache (we drop the pages we read right after).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.constants import GGML_QUANT_SIZES, GGUFValueType

from moestream.errors import ModelFileError


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    # numpy order: the last dimension is the contiguous one (a weight [out, in] has shape (out, in))
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name


def _field_value(field: Any) -> Any:
    vtype = field.types[0] if field.types else None
    if vtype == GGUFValueType.ARRAY:
        sub = field.types[1] if len(field.types) > 1 else None
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if vtype == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    value = field.parts[field.data[0]]
    return value.tolist()[0]


class GGUFFile:
    """Header of a GGUF file plus positional reads of its tensors."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise ModelFileError(f"model file not found: {self.path}")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ModelFileError(f"{self.path} is not a GGUF file (bad magic {magic!r}); pass a .gguf model")
        try:
            reader = GGUFReader(self.path, "r")
        except Exception as exc:  # the gguf parser raises many kinds on a damaged header
            raise ModelFileError(f"{self.path}: cannot parse the GGUF header ({exc}); re-download the file") from None
        self.file_size = os.path.getsize(self.path)
        self.metadata: dict[str, Any] = {}
        for name, field in reader.fields.items():
            if name.startswith("GGUF."):
                continue
            try:
                self.metadata[name] = _field_value(field)
            except Exception:  # an unreadable key we never use must not stop loading
                continue
        self.tensors: dict[str, TensorInfo] = {}
        for t in reader.tensors:
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            info = TensorInfo(t.name, int(t.tensor_type), shape, int(t.data_offset), int(t.n_bytes))
            if info.offset + info.nbytes > self.file_size:
                raise ModelFileError(
                    f"{self.path} is truncated: tensor {t.name} ends at byte {info.offset + info.nbytes} "
                    f"but the file has {self.file_size}; re-download or re-convert it"
                )
            self.tensors[t.name] = info
        del reader  # drops its memmap of the whole file
        self.arch: str = str(self.metadata.get("general.architecture", ""))
        self._fd = os.open(self.path, os.O_RDONLY)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_key(self, suffix: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{suffix}", default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise ModelFileError(f"{self.path}: metadata key {key!r} is missing; the file was not made for this arch")
        return self.metadata[key]

    def tensor(self, name: str) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise ModelFileError(f"{self.path}: tensor {name!r} is missing; the file is incomplete or another arch")
        return info

    def read(self, name: str) -> np.ndarray:
        """The raw bytes of a tensor as a uint8 array, without leaving them in the page cache."""
        info = self.tensor(name)
        return self.read_range(info.offset, info.nbytes)

    def read_range(self, offset: int, nbytes: int) -> np.ndarray:
        buf = np.empty(nbytes, dtype=np.uint8)
        view = memoryview(buf)
        done = 0
        while done < nbytes:
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n <= 0:
                raise ModelFileError(f"{self.path}: short read at byte {offset + done}; the file is truncated")
            done += n
        drop_page_cache(self._fd, offset, nbytes)
        return buf

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def drop_page_cache(fd: int, offset: int, nbytes: int) -> None:
    """Tell the kernel we will not read these pages again, so they do not become an unbudgeted cache."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def tensor_nbytes(ggml_type: int, n_elems: int) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return n_elems // block * size
