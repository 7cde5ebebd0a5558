"""One .safetensors file's tensor table, from its header, and positional reads of its bytes.

The format (the `safetensors` package's): a little-endian u64 header length, that many bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the data, each
tensor's offsets relative to the data's start. Every length and offset is checked against the file's size
before it is used, so a truncated or damaged file is one ModelFileError naming it.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import numpy as np

from moestream.errors import ModelFileError

# dtype -> bytes per element
DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "U8": 1, "I8": 1,
               "I16": 2, "U16": 2, "I32": 4, "U32": 4, "I64": 8, "U64": 8, "BOOL": 1}  # fmt: skip
MAX_HEADER = 100 << 20  # the package's own limit


@dataclass(frozen=True)
class SafeTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute, in the file
    nbytes: int


class SafetensorsFile:
    def __init__(self, path: str):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise ModelFileError(f"{path}: cannot open ({e.strerror})") from None
        try:
            self.file_size = os.fstat(self.fd).st_size
            self.tensors = self._header()
        except BaseException:
            os.close(self.fd)
            raise

    def _bad(self, what: str) -> ModelFileError:
        return ModelFileError(f"{self.path}: {what}; the file is damaged or incomplete: download it again")

    def _header(self) -> dict[str, SafeTensor]:
        head = os.pread(self.fd, 8, 0)
        if len(head) < 8:
            raise self._bad("too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > self.file_size:
            raise self._bad(f"its header says {n} bytes but the file holds {self.file_size}")
        try:
            table = json.loads(os.pread(self.fd, n, 8))
        except (UnicodeDecodeError, ValueError):
            raise self._bad("its header is not JSON") from None
        if not isinstance(table, dict):
            raise self._bad("its header is not a table of tensors")
        table.pop("__metadata__", None)
        start, out = 8 + n, {}
        for name, t in table.items():
            out[name] = self._tensor(name, t, start)
        return out

    def _tensor(self, name: str, t: object, start: int) -> SafeTensor:
        try:
            dtype, shape, (b, e) = t["dtype"], tuple(int(d) for d in t["shape"]), t["data_offsets"]  # type: ignore[index]
        except (TypeError, KeyError, ValueError):
            raise self._bad(f"tensor {name!r} has a malformed entry") from None
        size = DTYPE_SIZES.get(dtype)
        if size is None:
            raise ModelFileError(f"{self.path}: tensor {name!r} has dtype {dtype!r}, which moestream cannot read")
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if (
            not (isinstance(b, int) and isinstance(e, int))
            or b < 0
            or e - b != numel * size
            or any(d < 0 for d in shape)
        ):
            raise self._bad(f"tensor {name!r} {list(shape)} {dtype} has data offsets {b}..{e}")
        if start + e > self.file_size:
            raise self._bad(f"tensor {name!r} ends at byte {start + e} but the file holds {self.file_size}")
        return SafeTensor(name, dtype, shape, start + b, e - b)

    def read_range(self, offset: int, nbytes: int) -> np.ndarray:
        buf = bytearray(nbytes)
        view, done = memoryview(buf), 0
        while done < nbytes:
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise self._bad(f"a read at byte {offset + done} came back short")
            done += got
        return np.frombuffer(buf, dtype=np.uint8)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
