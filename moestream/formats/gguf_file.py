"""A GGUF file: metadata, the tensor table, and tensor bytes read by offset.

The header is parsed straight off a read-only mapping (fast for 250k-token vocabularies); tensor bytes are
read with os.pread so loading a dense tensor does not leave a copy of it in the page cache (we drop the
pages we read right after).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

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


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "<u1",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9


class _HeaderReader:
    """Sequential little-endian reads over the mapped file (the header only is ever touched).

    gguf's GGUFReader builds a numpy view per array element: a 150k-token vocabulary takes it 10-20 s
    to parse. Reading strings straight off the mapping takes well under a second.
    """

    def __init__(self, buf: mmap.mmap):
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError("string runs past the end of the file")
        v = self.buf[self.pos : self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return v

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype == _STRING:
                return [self.string() for _ in range(count)]
            if etype in _NUMPY:
                dt = np.dtype(_NUMPY[etype])
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos += dt.itemsize * count
                return arr.tolist()
            return [self.value(etype) for _ in range(count)]
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        raise ValueError(f"unknown metadata value type {vtype}")


def _parse_header(path: str, file_size: int) -> tuple[dict[str, Any], list[TensorInfo]]:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        r = _HeaderReader(buf)
        r.pos = 4
        version = r.scalar("<I")
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old")
        n_tensors, n_kv = r.scalar("<Q"), r.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = r.string()
            metadata[key] = r.value(r.scalar("<I"))
        raw = []
        for _ in range(n_tensors):
            name = r.string()
            n_dims = r.scalar("<I")
            dims = [r.scalar("<Q") for _ in range(n_dims)]
            raw.append((name, dims, r.scalar("<I"), r.scalar("<Q")))
        align = int(metadata.get("general.alignment", 32))
        data_start = (r.pos + align - 1) // align * align
        header_end = r.pos
    drop = os.open(path, os.O_RDONLY)
    drop_page_cache(drop, 0, header_end)
    os.close(drop)
    tensors = []
    for name, dims, ttype, rel in raw:
        shape = tuple(int(x) for x in reversed(dims))
        n = 1
        for d in shape:
            n *= d
        try:
            nbytes = tensor_nbytes(ttype, n)
        except (ValueError, KeyError):
            nbytes = 0  # a type we cannot size; rejected by name later, where the error can say which
        tensors.append(TensorInfo(name, ttype, shape, data_start + rel, nbytes))
    return metadata, tensors


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
        self.file_size = os.path.getsize(self.path)
        try:
            self.metadata, tensors = _parse_header(self.path, self.file_size)
        except (ValueError, struct.error, IndexError, OverflowError, MemoryError) as exc:
            raise ModelFileError(
                f"{self.path}: cannot parse the GGUF header ({exc}); the file is damaged or truncated, re-download it"
            ) from None
        self.tensors: dict[str, TensorInfo] = {}
        for info in tensors:
            if info.offset + info.nbytes > self.file_size:
                raise ModelFileError(
                    f"{self.path} is truncated: tensor {info.name} ends at byte {info.offset + info.nbytes} "
                    f"but the file has {self.file_size}; re-download or re-convert it"
                )
            self.tensors[info.name] = info
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
