"""A GGUF file: metadata, the tensor table, and tensor bytes read by offset.

The header is parsed straight off a read-only mapping (fast for 250k-token vocabularies); tensor bytes are
read with os.pread so loading a dense tensor does not leave a copy of it in the page cache (we drop the
pages we read right after).
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES as _QUANT_SIZES

from moestream.errors import ModelFileError
from moestream.formats.quants import type_name as quant_type_name

# keyed by plain int type ids, so an unknown id is a missed lookup rather than an enum ValueError
GGML_QUANT_SIZES: dict[int, tuple[int, int]] = {int(t): v for t, v in _QUANT_SIZES.items()}


# metadata value types (gguf GGUFValueType): struct formats of the scalars, numpy dtypes of scalar arrays
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_VALUE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", 7: "bool",
                8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}  # fmt: skip
_INT_TYPES = frozenset({0, 1, 2, 3, 4, 5, 10, 11})

# What llama.cpp's gguf.cpp accepts: versions 2 and 3 (v1 had 32-bit counts), at most GGML_MAX_DIMS dims,
# tensor names shorter than GGML_MAX_NAME bytes.
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4
MAX_NAME = 64
# Sane limits far above any real model (~50 keys, a 262k-token vocabulary as three arrays, a few thousand
# tensors); they bound the memory a hostile header can make us allocate before the file's size does.
MAX_KV = 1 << 16
MAX_TENSORS = 1 << 18
MAX_ARRAY_ELEMENTS = 1 << 23  # over all metadata arrays together
MAX_ARRAY_DEPTH = 4
MAX_ALIGNMENT = 1 << 30
_INT64_MAX = (1 << 63) - 1
# smallest encodings: key length + type + one byte; name length + n_dims + one dim + type + offset
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8
_MIN_ITEM_BYTES = {_STRING: 8, _ARRAY: 12}


class _BadHeader(Exception):
    """A header defect; GGUFFile turns it into one ModelFileError naming the file."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    # numpy order: the last dimension is the contiguous one (a weight [out, in] has shape (out, in))
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file (in its part's file, for a split model)
    nbytes: int
    part: int = 0  # which file of a split model holds it (gguf_model.GGUFModel); 0 for a whole model

    @property
    def type_name(self) -> str:
        return quant_type_name(self.ggml_type)


class _HeaderReader:
    """Sequential little-endian reads over the mapped file, each checked against the bytes left.

    gguf's GGUFReader builds a numpy view per array element, which makes a large vocabulary slow to parse;
    reading the strings straight off the mapping builds nothing per element but the string itself.
    """

    def __init__(self, buf: mmap.mmap, size: int):
        self.buf = buf
        self.size = size
        self.pos = 0
        self.array_elements = 0

    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise _BadHeader(f"the file is truncated: {what} at byte {self.pos} needs {n} bytes, {self.left()} left")

    def scalar(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def string(self, what: str) -> str:
        n = self.scalar("<Q", f"the length of {what}")
        self.need(n, f"{what} ({n} bytes)")
        v = self.buf[self.pos : self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return v

    def value(self, vtype: int, key: str, depth: int = 0) -> Any:
        if vtype == _STRING:
            return self.string(f"the value of {key!r}")
        if vtype == _ARRAY:
            return self.array(key, depth)
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], f"the value of {key!r}")
        raise _BadHeader(f"metadata key {key!r} has unknown value type {vtype}")

    def array(self, key: str, depth: int) -> list[Any]:
        if depth >= MAX_ARRAY_DEPTH:
            raise _BadHeader(f"metadata key {key!r} nests arrays more than {MAX_ARRAY_DEPTH} deep")
        etype = self.scalar("<I", f"the element type of {key!r}")
        count = self.scalar("<Q", f"the length of {key!r}")
        if etype not in _VALUE_NAMES:
            raise _BadHeader(f"metadata key {key!r} is an array of unknown value type {etype}")
        item = struct.calcsize(_SCALARS[etype]) if etype in _SCALARS else _MIN_ITEM_BYTES[etype]
        if count > self.left() // item:
            raise _BadHeader(
                f"metadata key {key!r} claims {count} elements of {_VALUE_NAMES[etype]} but only {self.left()} "
                "bytes are left; the file is damaged or truncated"
            )
        self.array_elements += count
        if self.array_elements > MAX_ARRAY_ELEMENTS:
            raise _BadHeader(f"metadata arrays hold more than {MAX_ARRAY_ELEMENTS} elements (at {key!r})")
        if etype in _SCALARS:
            dt = np.dtype(_SCALARS[etype])
            arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
            self.pos += dt.itemsize * count
            return arr.tolist()
        return [self.value(etype, key, depth + 1) for _ in range(count)]


def _read_metadata(r: _HeaderReader) -> tuple[int, dict[str, Any]]:
    r.need(4, "the magic")
    if bytes(r.buf[0:4]) != b"GGUF":
        raise _BadHeader(f"not a GGUF file (bad magic {bytes(r.buf[0:4])!r}); pass a .gguf model")
    r.pos = 4
    version = r.scalar("<I", "the version")
    if version & 0xFFFF == 0 and version:
        raise _BadHeader("the file is a big-endian GGUF; moestream reads little-endian files only")
    if version not in SUPPORTED_VERSIONS:
        raise _BadHeader(
            f"GGUF version {version} is not supported (supported: {', '.join(map(str, SUPPORTED_VERSIONS))}); "
            "re-convert the model with a current llama.cpp"
        )
    n_tensors = r.scalar("<Q", "the tensor count")
    n_kv = r.scalar("<Q", "the metadata count")
    if n_kv > MAX_KV or n_kv * _MIN_KV_BYTES > r.left():
        raise _BadHeader(f"the header claims {n_kv} metadata keys, more than the file (or any model) can hold")
    if n_tensors > MAX_TENSORS or n_tensors * _MIN_TENSOR_BYTES > r.left():
        raise _BadHeader(f"the header claims {n_tensors} tensors, more than the file (or any model) can hold")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string("a metadata key")
        if key in metadata:
            raise _BadHeader(f"metadata key {key!r} appears twice")
        metadata[key] = r.value(r.scalar("<I", f"the value type of {key!r}"), key)
    return n_tensors, metadata


def _alignment(metadata: dict[str, Any]) -> int:
    align = metadata.get("general.alignment", 32)
    if isinstance(align, bool) or not isinstance(align, int):
        raise _BadHeader(f"general.alignment must be an integer, got {type(align).__name__} {align!r}"[:200])
    if align <= 0 or align & (align - 1) or align > MAX_ALIGNMENT:
        raise _BadHeader(f"general.alignment must be a power of two between 1 and {MAX_ALIGNMENT}, got {align}")
    return align


def _read_tensor_table(r: _HeaderReader, n_tensors: int) -> list[tuple[str, list[int], int, int]]:
    raw = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = r.string(f"the name of tensor {i}")
        if len(name.encode("utf-8", errors="replace")) >= MAX_NAME:
            raise _BadHeader(f"tensor {i} has a name of {len(name)} characters (at most {MAX_NAME - 1}): {name[:80]!r}")
        if name in names:
            raise _BadHeader(f"tensor {name!r} appears twice in the tensor table")
        names.add(name)
        n_dims = r.scalar("<I", f"the dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise _BadHeader(f"tensor {name!r} has {n_dims} dimensions (must be 1 to {MAX_DIMS})")
        dims = [r.scalar("<Q", f"a dimension of tensor {name!r}") for _ in range(n_dims)]
        n = 1
        for d in dims:
            if d == 0:
                raise _BadHeader(f"tensor {name!r} has a dimension of 0 ({dims})")
            n *= d
            if n > _INT64_MAX:
                raise _BadHeader(f"tensor {name!r} has dimensions {dims} whose product overflows int64")
        ttype = r.scalar("<I", f"the type of tensor {name!r}")
        raw.append((name, dims, ttype, r.scalar("<Q", f"the data offset of tensor {name!r}")))
    return raw


def _tensor_infos(
    raw: list[tuple[str, list[int], int, int]], data_start: int, align: int, file_size: int
) -> list[TensorInfo]:
    tensors = []
    for name, dims, ttype, rel in raw:
        sizes = GGML_QUANT_SIZES.get(ttype)
        if sizes is None:
            raise _BadHeader(f"tensor {name!r} has unknown type id {ttype}; the file is damaged or from a newer ggml")
        block, size = sizes
        if dims[0] % block:
            raise _BadHeader(
                f"tensor {name!r} of type {quant_type_name(ttype)} has rows of {dims[0]} weights, "
                f"not a multiple of its block size {block}"
            )
        if rel % align:
            raise _BadHeader(f"tensor {name!r} has data offset {rel}, not a multiple of the alignment {align}")
        n = 1
        for d in dims:
            n *= d
        nbytes = n // block * size
        start = data_start + rel
        if start + nbytes > file_size:
            raise _BadHeader(
                f"the file is truncated: tensor {name!r} ends at byte {start + nbytes} but the file has {file_size}; "
                "re-download or re-convert it"
            )
        tensors.append(TensorInfo(name, ttype, tuple(reversed(dims)), start, nbytes))
    # llama.cpp's rule: the data of each tensor starts where the previous one's (padded) data ends
    expected = 0
    for t in tensors:
        if t.offset - data_start != expected:
            raise _BadHeader(
                f"tensor {t.name!r} has data offset {t.offset - data_start}, expected {expected} "
                "(tensors overlap or leave gaps); the file is damaged"
            )
        expected += (t.nbytes + align - 1) // align * align
    return tensors


def _parse_header(fd: int, file_size: int) -> tuple[dict[str, Any], list[TensorInfo], int]:
    with mmap.mmap(fd, file_size, access=mmap.ACCESS_READ) as buf:
        r = _HeaderReader(buf, file_size)
        n_tensors, metadata = _read_metadata(r)
        raw = _read_tensor_table(r, n_tensors)
        header_end = r.pos
    align = _alignment(metadata)
    data_start = (header_end + align - 1) // align * align
    return metadata, _tensor_infos(raw, data_start, align, file_size), header_end


def _open_regular(path: str) -> tuple[int, int]:
    """An fd of a readable regular file and its size; anything else is one clear error (never a blocking open)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ModelFileError(f"model file not found: {path}") from None
    except PermissionError:
        raise ModelFileError(f"cannot read the model file {path}: permission denied") from None
    except OSError as exc:
        raise ModelFileError(f"cannot open the model file {path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise ModelFileError(f"{path} is {kind}; pass a .gguf model file")
        if st.st_size < 24:
            magic = os.pread(fd, 4, 0)
            if magic != b"GGUF"[: len(magic)] or not magic:
                raise ModelFileError(f"{path} is not a GGUF file (bad magic {magic!r}); pass a .gguf model")
            raise ModelFileError(f"{path} is truncated ({st.st_size} bytes, less than a GGUF header)")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


class ModelLookups:
    """Metadata and tensor lookups over `path`, `metadata`, `arch` and `tensors`, shared by every kind of model
    file (a GGUF, a split set, a checkpoint directory); each says in its own words what a missing one means."""

    path: str
    metadata: dict[str, Any]
    arch: str
    tensors: dict[str, TensorInfo]
    MISSING_KEY = "metadata key {key!r} is missing; the file was not made for this arch"
    MISSING_TENSOR = "tensor {name!r} is missing; the file is incomplete or another arch"

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_key(self, suffix: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{suffix}", default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise ModelFileError(f"{self.path}: " + self.MISSING_KEY.format(key=key))
        return self.metadata[key]

    def tensor(self, name: str) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise ModelFileError(f"{self.path}: " + self.MISSING_TENSOR.format(name=name))
        return info


class GGUFFile(ModelLookups):
    """Header of a GGUF file plus positional reads of its tensors.

    Nothing in the header is trusted: every count, length, dimension, type id and offset is checked against
    the file's size and the limits above before it is used, and any defect is one ModelFileError.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        self._fd = -1
        fd, self.file_size = _open_regular(self.path)
        try:
            self.metadata, tensors, header_end = _parse_header(fd, self.file_size)
        except _BadHeader as exc:
            os.close(fd)
            msg = str(exc)
            if msg.startswith("not a GGUF file"):
                raise ModelFileError(f"{self.path} is {msg}") from None
            raise ModelFileError(f"{self.path}: {msg}") from None
        except (OSError, ValueError, MemoryError) as exc:  # a read error (EIO) or a mapping the kernel refused
            os.close(fd)
            raise ModelFileError(
                f"{self.path}: cannot read the GGUF header ({exc}); check the file and the disk"
            ) from None
        self._fd = fd
        drop_page_cache(fd, 0, header_end)
        self.tensors: dict[str, TensorInfo] = {t.name: t for t in tensors}
        arch = self.metadata.get("general.architecture", "")
        if not isinstance(arch, str):
            self.close()
            raise ModelFileError(f"{self.path}: general.architecture must be a string, got {type(arch).__name__}")
        self.arch: str = arch

    @property
    def paths(self) -> list[str]:
        """The files of the model: this one (a split model, gguf_model.GGUFModel, has several)."""
        return [self.path]

    def read(self, name: str) -> np.ndarray:
        """The raw bytes of a tensor as a uint8 array, without leaving them in the page cache."""
        info = self.tensor(name)
        return self.read_range(info.offset, info.nbytes)

    def read_range(self, offset: int, nbytes: int) -> np.ndarray:
        buf = np.empty(nbytes, dtype=np.uint8)
        view = memoryview(buf)
        done = 0
        while done < nbytes:
            try:
                n = os.preadv(self._fd, [view[done:]], offset + done)
            except OSError as exc:
                raise ModelFileError(
                    f"{self.path}: read error at byte {offset + done} ({exc.strerror or exc}); check the disk"
                ) from None
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
    """Bytes of `n_elems` weights of a known type (rounded down to whole blocks)."""
    sizes = GGML_QUANT_SIZES.get(ggml_type)
    if sizes is None:
        raise ValueError(f"unknown GGUF type id {ggml_type}")
    block, size = sizes
    return n_elems // block * size
