"""How fast is this disk for streaming experts? Random reads the way the engine's reader issues them.

Each row is one (read size, buffered or O_DIRECT, reads in flight) point: that many threads each issue
os.preadv of `size` bytes at random 4 KiB-aligned offsets until the row has done its reads or spent its
time, so rows stay short. The page cache is dropped (POSIX_FADV_DONTNEED) on the whole file before each
row and, as the engine does, after every buffered read; O_DIRECT rows bypass it anyway.

Sizes: the model's own expert segment (one of an expert's three matrices, which is what the engine reads
at a time: three segment reads in parallel beat one chain of three) and 4 KiB (pure latency).

A small file flatters the disk: a drive's DRAM/SLC cache or, in a VM, the host's page cache can hold it
whole, whatever we drop here. The result says `representative: false` below twice this machine's RAM.
"""

from __future__ import annotations

import itertools
import json
import mmap
import os
import shutil
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from moestream.errors import MoestreamError
from moestream.formats.checkpoint import open_model_file
from moestream.streaming.budget import total_ram
from moestream.streaming.reader import open_direct

ALIGN = 4096
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
INFLIGHT = (1, 2, 4, 8, 16, 32)
DEFAULT_SEGMENT = 2 * MIB


@dataclass
class ProbeRow:
    size: int
    mode: str  # buffered | direct
    inflight: int
    reads: int
    seconds: float
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mb_s: float  # aggregate, 1 MB = 1e6 bytes


@dataclass
class ProbeResult:
    path: str
    file_bytes: int
    segment_bytes: int  # the engine's read size for this model (or the default)
    expert_bytes: int  # one expert's three segments (0 if unknown)
    ram_bytes: int
    representative: bool
    warnings: list[str] = field(default_factory=list)
    rows: list[ProbeRow] = field(default_factory=list)
    recommended: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProbeResult:
        d = dict(d)
        d["rows"] = [ProbeRow(**r) for r in d.get("rows", [])]
        return cls(**d)

    def row(self, size: int, mode: str, inflight: int) -> ProbeRow | None:
        for r in self.rows:
            if r.size == size and r.mode == mode and r.inflight == inflight:
                return r
        return None


def load_probe(path: str | os.PathLike[str]) -> ProbeResult:
    try:
        with open(path, encoding="utf-8") as f:
            return ProbeResult.from_dict(json.load(f))
    except OSError as exc:
        raise MoestreamError(f"cannot read the probe result {path}: {exc.strerror}") from None
    except (json.JSONDecodeError, TypeError, KeyError):
        raise MoestreamError(f"{path} is not a probe result; write one with `moestream probe ... -o FILE`") from None


def expert_geometry(path: str) -> tuple[int, int, tuple[int, int], str]:
    """(segment bytes, expert bytes, (start, end) byte span of the expert tensors, the file that span is in)
    of a GGUF model (a file, any part of a split model, or a directory holding one). A split model's reads
    are probed in the part that holds the most expert bytes: the engine's reads never span two parts."""
    f = open_model_file(path)
    try:
        segs: list[int] = []
        per_layer: dict[str, int] = {}
        spans: dict[int, list[int]] = {}  # part -> [lo, hi, expert bytes]
        for t in f.tensors.values():
            if "_exps." not in t.name or len(t.shape) != 3:
                continue
            seg = t.nbytes // t.shape[0]
            segs.append(seg)
            layer = t.name.split(".")[1]
            per_layer[layer] = per_layer.get(layer, 0) + seg
            span = spans.setdefault(t.part, [t.offset, 0, 0])
            span[0], span[1] = min(span[0], t.offset), max(span[1], t.offset + t.nbytes)
            span[2] += t.nbytes
        experts = list(per_layer.values())
        paths = f.paths
    finally:
        f.close()
    if not segs:
        raise MoestreamError(f"{path} has no routed expert tensors (*_exps); probe a MoE model or use --dir")
    part = max(spans, key=lambda p: spans[p][2])
    lo, hi, _ = spans[part]
    # The most common segment size is the read the engine issues most often.
    values, counts = np.unique(segs, return_counts=True)
    return int(values[np.argmax(counts)]), int(round(float(np.mean(experts)))), (lo, hi), paths[part]


def _is_gguf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _drop(fd: int, offset: int = 0, nbytes: int = 0) -> None:
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def _run_row(
    fd: int, direct: bool, size: int, inflight: int, offsets: np.ndarray, seconds: float
) -> tuple[list[float], float, int]:
    """Read offsets[i] with `inflight` threads until all are read or `seconds` pass.
    Returns (latencies in s, wall seconds, bytes)."""
    nbytes = (size + ALIGN - 1) // ALIGN * ALIGN if direct else size
    counter = itertools.count()  # next() on it is atomic under the GIL
    n = len(offsets)
    lat: list[list[float]] = [[] for _ in range(inflight)]
    deadline = time.perf_counter() + seconds
    errors: list[BaseException] = []

    def worker(j: int) -> None:
        buf = mmap.mmap(-1, nbytes)  # page-aligned, as O_DIRECT needs
        view = memoryview(buf)
        mine = lat[j]
        try:
            while (i := next(counter)) < n and time.perf_counter() < deadline:
                off = int(offsets[i])
                t0 = time.perf_counter()
                got = os.preadv(fd, [view], off)
                mine.append(time.perf_counter() - t0)
                if not direct:
                    _drop(fd, off, got)  # as the engine's buffered reader does
        except BaseException as exc:
            errors.append(exc)
        finally:
            view.release()
            buf.close()

    threads = [threading.Thread(target=worker, args=(j,), daemon=True) for j in range(inflight)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise MoestreamError(f"a read failed during the probe: {errors[0]}")
    flat = [x for m in lat for x in m]
    return flat, wall, len(flat) * size


def _summarize(size: int, mode: str, inflight: int, lat: list[float], wall: float, nbytes: int) -> ProbeRow:
    a = np.array(lat) * 1e3 if lat else np.zeros(1)
    return ProbeRow(
        size=size,
        mode=mode,
        inflight=inflight,
        reads=len(lat),
        seconds=round(wall, 4),
        mean_ms=float(a.mean()),
        p50_ms=float(np.percentile(a, 50)),
        p90_ms=float(np.percentile(a, 90)),
        p99_ms=float(np.percentile(a, 99)),
        mb_s=nbytes / 1e6 / wall if wall > 0 else 0.0,
    )


def recommend(rows: list[ProbeRow], segment: int) -> dict[str, Any]:
    """Reader settings: the fewest reads in flight within 10% of the best bandwidth (more only add
    latency), but at least 2 where measured (a reader thread also packs what it read: a second one keeps
    the disk busy meanwhile); O_DIRECT unless buffered reads are more than 10% faster (its tail is tighter
    and it keeps no second copy in the page cache)."""
    seg_rows = [r for r in rows if r.size == segment and r.reads > 0]
    if any(r.inflight >= 2 for r in seg_rows):
        seg_rows = [r for r in seg_rows if r.inflight >= 2]
    if not seg_rows:
        return {}
    best: dict[str, ProbeRow] = {}
    for mode in ("direct", "buffered"):
        mine = [r for r in seg_rows if r.mode == mode]
        if not mine:
            continue
        top = max(r.mb_s for r in mine)
        best[mode] = min((r for r in mine if r.mb_s >= 0.9 * top), key=lambda r: r.inflight)
    if "direct" in best and ("buffered" not in best or best["direct"].mb_s >= 0.9 * best["buffered"].mb_s):
        pick = best["direct"]
    else:
        pick = best["buffered"]
    flags = f"--io-threads {pick.inflight}" + (" --buffered" if pick.mode == "buffered" else "")
    return {
        "io_threads": pick.inflight,
        "direct": pick.mode == "direct",
        "mb_s": pick.mb_s,
        "p50_ms": pick.p50_ms,
        "p99_ms": pick.p99_ms,
        "flags": flags,
    }


def probe_file(
    path: str,
    *,
    segment: int | None = None,
    inflight: tuple[int, ...] = INFLIGHT,
    modes: tuple[str, ...] = ("buffered", "direct"),
    reads_per_row: int = 128,
    seconds_per_row: float = 2.0,
    sizes: tuple[int, ...] | None = None,
    seed: int = 0,
    progress: bool = True,
) -> ProbeResult:
    """Probe random reads of an existing file (a GGUF model: its own expert segment size and region; a split
    model, or a directory holding one: the part with the most expert bytes)."""
    path = os.fspath(path)
    if not os.path.isfile(path) and not (segment is None and os.path.isdir(path)):
        raise MoestreamError(f"no such file: {path}; pass a model file with --file or a directory with --dir")
    expert_bytes = 0
    span = None
    if segment is None:
        if os.path.isdir(path) or _is_gguf(path):
            segment, expert_bytes, span, path = expert_geometry(path)
        else:
            segment = DEFAULT_SEGMENT
    file_bytes = os.path.getsize(path)
    lo, hi = span or (0, file_bytes)
    sizes = sizes or (segment, 4 * KIB)
    if hi - lo < max(sizes) + ALIGN:
        lo, hi = 0, file_bytes
    if file_bytes < max(sizes) + ALIGN:
        raise MoestreamError(f"{path} is only {file_bytes} bytes; the probe needs a file larger than a read")
    ram, ram_kind = total_ram()
    warnings = []
    representative = file_bytes >= 2 * ram
    if not representative:
        warnings.append(
            f"not representative: the {file_bytes / GIB:.1f} GiB file is under twice this machine's RAM "
            f"({ram / GIB:.1f} GiB, {ram_kind}), so a drive or host cache may hold it and flatter the figures; "
            "probe a larger model file, or --dir with a larger --size"
        )
    rng = np.random.default_rng(seed)
    fds = {"buffered": os.open(path, os.O_RDONLY)}
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fds["buffered"], 0, 0, os.POSIX_FADV_RANDOM)
    if "direct" in modes:
        fd = open_direct(path)
        if fd is None:
            warnings.append("O_DIRECT is not supported on this filesystem; only buffered reads were probed")
        else:
            fds["direct"] = fd
    result = ProbeResult(
        path=path,
        file_bytes=file_bytes,
        segment_bytes=segment,
        expert_bytes=expert_bytes,
        ram_bytes=ram,
        representative=representative,
        warnings=warnings,
    )
    plan = [(s, m, q) for s in sizes for m in modes if m in fds for q in inflight]
    if not plan:
        for fd in fds.values():
            os.close(fd)
        raise MoestreamError(f"O_DIRECT reads are not supported where {path} lives; probe buffered reads")
    try:
        for size, mode, q in tqdm(plan, desc="probe", unit="row", disable=not progress, leave=False):
            n = max(reads_per_row if size > 64 * KIB else 4 * reads_per_row, 4 * q)
            top = max(lo, (hi - size) // ALIGN * ALIGN)
            offsets = rng.integers(lo // ALIGN, top // ALIGN + 1, size=n) * ALIGN
            _drop(fds["buffered"])
            lat, wall, nbytes = _run_row(fds[mode], mode == "direct", size, q, offsets, seconds_per_row)
            result.rows.append(_summarize(size, mode, q, lat, wall, nbytes))
    finally:
        for fd in fds.values():
            os.close(fd)
    result.recommended = recommend(result.rows, segment)
    return result


def probe_dir(directory: str, size_bytes: int = 4 * GIB, *, progress: bool = True, **kw: Any) -> ProbeResult:
    """Write a temporary test file of random bytes in `directory`, probe it, delete it."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise MoestreamError(f"no such directory: {directory}")
    if size_bytes < 64 * MIB:
        raise MoestreamError(f"--size {size_bytes / MIB:.0f} MiB is too small for a probe; use at least 64M")
    free = shutil.disk_usage(directory).free
    if free < size_bytes + GIB:
        raise MoestreamError(
            f"{directory} has {free / GIB:.1f} GiB free, the test file needs {size_bytes / GIB:.1f} GiB "
            "plus 1 GiB to spare; pass a smaller --size or another --dir"
        )
    fd, path = tempfile.mkstemp(prefix="moestream-probe-", suffix=".bin", dir=directory)
    try:
        chunk = 16 * MIB
        rng = np.random.default_rng(1)
        bar = tqdm(
            total=size_bytes, unit="B", unit_scale=True, desc="writing test file", disable=not progress, leave=False
        )
        with os.fdopen(fd, "wb") as f, bar:
            done = 0
            while done < size_bytes:
                n = min(chunk, size_bytes - done)
                f.write(rng.bytes(n))  # random, so no layer below can compress or dedupe it
                done += n
                bar.update(n)
            f.flush()
            os.fsync(f.fileno())
        result = probe_file(path, segment=kw.pop("segment", None) or DEFAULT_SEGMENT, progress=progress, **kw)
        result.warnings.append(
            "freshly written test file: an SSD may still serve it from its SLC cache; "
            "probing the model file itself (--file) is closer to real use"
        )
        return result
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


def format_probe(r: ProbeResult) -> str:
    head = f"probe: {r.path} ({r.file_bytes / GIB:.2f} GiB), read size {r.segment_bytes / MIB:.2f} MiB" + (
        f" (one expert = {r.expert_bytes / MIB:.2f} MiB in 3 segments)" if r.expert_bytes else ""
    )
    lines = [
        head,
        f"  {'size':>9} {'mode':>8} {'in flight':>9} {'reads':>6} {'p50 ms':>8} {'p90 ms':>8} "
        f"{'p99 ms':>8} {'MB/s':>8}",
    ]
    for row in r.rows:
        size = f"{row.size / MIB:.2f} MiB" if row.size >= MIB else f"{row.size // KIB} KiB"
        lines.append(
            f"  {size:>9} {row.mode:>8} {row.inflight:>9} {row.reads:>6} {row.p50_ms:>8.2f} "
            f"{row.p90_ms:>8.2f} {row.p99_ms:>8.2f} {row.mb_s:>8.0f}"
        )
    rec = r.recommended
    if rec:
        lines.append(
            f"recommended reader: reads in flight {rec['io_threads']}, "
            f"{'O_DIRECT' if rec['direct'] else 'buffered'} ({rec['mb_s']:.0f} MB/s, p99 "
            f"{rec['p99_ms']:.1f} ms): moestream run {rec['flags']} ..."
        )
    for w in r.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def parse_size(text: str) -> int:
    """'4G', '512M', '1.5GiB', '1048576' -> bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": KIB, "M": MIB, "G": GIB, "T": 1 << 40}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in "KMGT" and t[-1:] else t
    try:
        value = float(num)
    except ValueError:
        raise MoestreamError(f"cannot read the size {text!r}; write e.g. 4G or 512M") from None
    if value <= 0:
        raise MoestreamError(f"the size must be positive, got {text!r}")
    return int(value * mult)
