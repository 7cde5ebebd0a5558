"""Write GGUF files whose tensors are produced chunk by chunk.

`gguf.GGUFWriter` wants every tensor as one numpy array in memory; a 17 GB synthetic model does not
fit that. We let GGUFWriter write the header, the metadata and the tensor table (so the layout is
exactly the reference one), then stream each tensor's bytes ourselves from a generator. A writer
thread does the disk writes so producing the next chunk overlaps the previous write.
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.gguf_writer import GGUFValue

Chunk = np.ndarray | bytes | bytearray | memoryview
Producer = Callable[[], Iterable[Chunk]]

_ALIGN = 4096  # O_DIRECT granularity (offsets, lengths, buffer addresses)
_STAGE_BYTES = 32 << 20


def tensor_nbytes(ggml_type: int, shape: Sequence[int]) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    if shape[-1] % block:
        raise ValueError(f"{GGMLQuantizationType(ggml_type).name} rows must be a multiple of {block}, got {shape}")
    return int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // block) * size


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write: `produce()` yields its raw GGUF bytes in order, in chunks of any size."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: last dim contiguous, e.g. (out, in) for a weight
    produce: Producer

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.ggml_type, self.shape)


def array_tensor(name: str, ggml_type: int, shape: Sequence[int], raw: np.ndarray) -> TensorSpec:
    """A tensor whose bytes are already in memory (small or test tensors)."""
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    spec = TensorSpec(name, GGMLQuantizationType(ggml_type), tuple(int(s) for s in shape), lambda: (data,))
    if data.nbytes != spec.nbytes:
        raise ValueError(f"{name}: got {data.nbytes} bytes, {spec.ggml_type.name} {spec.shape} needs {spec.nbytes}")
    return spec


def _typed(key: str, value: Any) -> GGUFValue:
    """Python value -> GGUF-typed value, with the types llama.cpp checks for (u32 counts, f32 floats)."""
    if isinstance(value, GGUFValue):
        return value
    if isinstance(value, np.ndarray):
        value = value.tolist()
    elif isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bool):
        return GGUFValue(value, GGUFValueType.BOOL)
    if isinstance(value, int):
        # llama.cpp reads counts, lengths and token ids as u32 and refuses other int types
        vtype = GGUFValueType.UINT32 if 0 <= value < 1 << 32 else GGUFValueType.INT64
        return GGUFValue(value, vtype)
    if isinstance(value, float):
        return GGUFValue(value, GGUFValueType.FLOAT32)
    if isinstance(value, (str, bytes)):
        return GGUFValue(value, GGUFValueType.STRING)
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"metadata {key!r}: GGUF cannot store an empty array")
        first = value[0]
        if isinstance(first, (str, bytes)):
            sub = GGUFValueType.STRING
        elif isinstance(first, bool):
            sub = GGUFValueType.BOOL
        elif isinstance(first, (int, np.integer)):
            sub = GGUFValueType.INT32  # tokenizer.ggml.token_type is an i32 array in llama.cpp
        elif isinstance(first, (float, np.floating)):
            sub = GGUFValueType.FLOAT32
        else:
            raise ValueError(f"metadata {key!r}: cannot store arrays of {type(first).__name__}")
        return GGUFValue(list(value), GGUFValueType.ARRAY, sub)
    raise ValueError(f"metadata {key!r}: cannot store a {type(value).__name__}")


def _as_bytes(chunk: Chunk) -> memoryview:
    if isinstance(chunk, np.ndarray):
        chunk = np.ascontiguousarray(chunk)
        return memoryview(chunk.reshape(-1).view(np.uint8))
    return memoryview(chunk).cast("B")


class _DiskWriter:
    """Appends bytes to the file from a background thread, so producing the next chunk overlaps the write.

    Writes go through O_DIRECT when the filesystem allows: that is faster than buffered writes and leaves
    no model-sized dirty page cache behind to evict everything else (benchmarks that follow want a cold
    cache anyway). O_DIRECT needs page-aligned memory, offsets
    and lengths, so chunks are copied into an aligned staging buffer that starts at the page holding
    the end of the header.
    """

    def __init__(self, path: str, start: int, bar: Any):
        self.bar = bar
        self.direct = hasattr(os, "O_DIRECT")
        try:
            self.fd = os.open(path, os.O_WRONLY | (os.O_DIRECT if self.direct else 0))
        except OSError:  # tmpfs and some others refuse O_DIRECT
            self.direct = False
            self.fd = os.open(path, os.O_WRONLY)
        self.stage = np.frombuffer(mmap.mmap(-1, _STAGE_BYTES), np.uint8)  # mmap memory is page-aligned
        self.pos = start // _ALIGN * _ALIGN  # file offset of stage[0]
        self.fill = start - self.pos
        with open(path, "rb") as f:  # the header's last partial page is rewritten with the first data
            f.seek(self.pos)
            self.stage[: self.fill] = np.frombuffer(f.read(self.fill), np.uint8)
        self.q: queue.Queue[memoryview | int | None] = queue.Queue(maxsize=2)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gguf-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self.q.get()) is not None:
            if self.error is not None:
                continue  # keep draining so the producer never blocks forever
            try:
                if isinstance(item, int):  # that many zero bytes of padding
                    item = memoryview(bytes(item))
                src = np.frombuffer(item, np.uint8)
                done = 0
                while done < len(src):
                    n = min(len(src) - done, _STAGE_BYTES - self.fill)
                    self.stage[self.fill : self.fill + n] = src[done : done + n]
                    self.fill += n
                    done += n
                    if self.fill == _STAGE_BYTES:
                        self._flush(_STAGE_BYTES)
                if self.bar is not None:
                    self.bar.update(len(src))
            except BaseException as exc:  # re-raised on the producer's thread
                self.error = exc

    def _flush(self, n: int) -> None:
        view = memoryview(self.stage)[:n]
        done = 0
        while done < n:
            done += os.pwrite(self.fd, view[done:], self.pos + done)
        self.pos += self.fill
        self.fill = 0

    def put(self, buf: memoryview | int) -> None:
        if self.error is not None:
            raise self.error
        self.q.put(buf)

    def finish(self) -> None:
        self.q.put(None)
        self._thread.join()
        try:
            if self.error is not None:
                raise self.error
            end = self.pos + self.fill
            # O_DIRECT writes whole pages: write the zero-padded last page, then cut the file to size
            self._flush(-(-self.fill // _ALIGN) * _ALIGN)
            os.ftruncate(self.fd, end)
        finally:
            os.close(self.fd)


def write_gguf(
    path: str | os.PathLike[str],
    arch: str,
    metadata: Mapping[str, Any],
    tensors: Sequence[TensorSpec],
    *,
    progress: bool = True,
    desc: str | None = None,
    split_max_size: int = 0,
) -> int:
    """Write a GGUF file (or a split set: write_gguf_parts); returns the bytes written, every part together."""
    paths = write_gguf_parts(path, arch, metadata, tensors, progress=progress, desc=desc, split_max_size=split_max_size)
    return sum(os.path.getsize(p) for p in paths)


def write_gguf_parts(
    path: str | os.PathLike[str],
    arch: str,
    metadata: Mapping[str, Any],
    tensors: Sequence[TensorSpec],
    *,
    progress: bool = True,
    desc: str | None = None,
    split_max_size: int = 0,
) -> list[str]:
    """Write a GGUF file; returns the paths written: `path`, or the parts of a split set.

    `metadata` maps full key names (e.g. "qwen3moe.block_count") to Python values or `GGUFValue`s;
    "general.architecture" comes from `arch`. split_max_size > 0: parts of at most that many tensor bytes
    each, as llama.cpp's gguf-split makes them (GGUFWriter's split: a tensor larger than that gets a part of
    its own; the metadata in the first part, split.no/split.count/split.tensors.count in every part),
    named NAME-00001-of-0000N.gguf after `path` (NAME.gguf). The files appear only once all are complete.
    """
    path = os.fspath(path)
    tmp = path + ".part"
    w = _header_writer(tmp, arch, metadata, tensors, split_max_size)
    # GGUFWriter names the parts after the path it writes: the temporary one, then the final one
    tmp_paths = [str(p) for p in w.format_shard_names(Path(tmp))]
    paths = [str(p) for p in w.format_shard_names(Path(path))]
    total = sum(GGUFWriter.ggml_pad(t.nbytes, w.data_alignment) for t in tensors)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc=desc or os.path.basename(path), total=total, unit="iB", unit_scale=True, unit_divisor=1024)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        assert w.fout is not None and len(w.fout) == len(tmp_paths)
        starts = []
        for f in w.fout:
            w.write_padding(f, f.tell())
            starts.append(f.tell())
        w.close()
        by_name = {t.name: t for t in tensors}
        for tmp_path, start, part in zip(tmp_paths, starts, w.tensors, strict=True):
            _write_data(tmp_path, start, [by_name[name] for name in part], w.data_alignment, bar)
        for tmp_path, final in zip(tmp_paths, paths, strict=True):
            os.replace(tmp_path, final)
    except BaseException:
        w.close()
        for tmp_path in tmp_paths:
            if os.path.exists(tmp_path):
                os.remove(tmp_path)
        raise
    finally:
        if bar is not None:
            bar.close()
    return paths


def _header_writer(
    path: str, arch: str, metadata: Mapping[str, Any], tensors: Sequence[TensorSpec], split_max_size: int
) -> GGUFWriter:
    """A GGUFWriter holding the metadata and the tensor table (split into parts where asked), no data yet."""
    w = GGUFWriter(path, arch, split_max_size=split_max_size)
    for key, value in metadata.items():
        if key == "general.architecture":
            if value != arch:
                raise ValueError(f"general.architecture {value!r} disagrees with arch {arch!r}")
            continue
        v = _typed(key, value)
        w.add_key_value(key, v.value, v.type, v.sub_type)
    for t in tensors:
        # the uint8 "byte shape" path makes GGUFWriter derive the element shape for any block type
        block, size = GGML_QUANT_SIZES[t.ggml_type]
        byte_shape = (*t.shape[:-1], t.shape[-1] // block * size)
        w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), t.nbytes, raw_dtype=t.ggml_type)
    return w


def _write_data(path: str, start: int, tensors: Sequence[TensorSpec], alignment: int, bar: Any) -> None:
    """Stream the tensors' bytes into `path` from byte `start` on, each padded to the alignment."""
    disk = _DiskWriter(path, start, bar)
    try:
        for t in tensors:
            done = 0
            for chunk in t.produce():
                buf = _as_bytes(chunk)
                done += len(buf)
                if done > t.nbytes:
                    raise ValueError(f"{t.name}: producer gave more than the {t.nbytes} bytes it needs")
                disk.put(buf)
            if done != t.nbytes:
                raise ValueError(f"{t.name}: producer gave {done} bytes, expected {t.nbytes}")
            pad = GGUFWriter.ggml_pad(t.nbytes, alignment) - t.nbytes
            if pad:
                disk.put(pad)
    finally:
        disk.finish()
