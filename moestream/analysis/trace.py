"""Expert access traces: one CSV row per expert the model asked for, written while it decodes.

Format (version 1), a text file any spreadsheet or `pandas.read_csv(comment='#')` reads:

    # moestream-trace: 1
    # model: "Qwen3-30B-A3B-Q4_K_M.gguf"        <- metadata: one `# key: JSON value` line each
    # n_slots: 1936
    token,phase,step,layer,expert,rank,source,bytes,latency_us
    0,prompt,1,0,3,0,disk,2654208,1834
    ...

token       index in the session of the token (of a prompt span: of its first token)
phase       prompt | decode
step        forward-step counter in micro-batch units: a prompt span advances it by the micro-batches it
            holds (ceil(tokens / ubatch); the replay reads the step's growth allowance from that), a decoded
            token by one
layer       MoE layer
expert      expert id within the layer
rank        position of the expert in the layer's request list; disk rows are written when their read
            completes, so rank is what recovers the request order the cache saw
source      vram | ram | disk (where the expert was served from)
bytes       bytes read from disk (0 for hits)
latency_us  read latency in microseconds (0 for hits)

One (step, layer) pair is one `ExpertCache.fetch` call, a *group* in the replay's terms.

Recording must not slow decoding: `record` only appends a tuple to a list; a writer thread formats and
writes the rows in batches of a few thousand.
"""

from __future__ import annotations

import gzip
import json
import os
import queue
import threading
import warnings
from typing import Any, BinaryIO

import numpy as np

from moestream.errors import MoestreamError

VERSION = 1
COLUMNS = ("token", "phase", "step", "layer", "expert", "rank", "source", "bytes", "latency_us")
HEADER = ",".join(COLUMNS)
PHASES = ("prompt", "decode")  # codes 0, 1 in the array read_trace returns
SOURCES = ("vram", "ram", "disk")  # codes 0, 1, 2
PROMPT, DECODE = 0, 1
VRAM, RAM, DISK = 0, 1, 2

TRACE_DTYPE = np.dtype(
    [
        ("token", np.int64),
        ("phase", np.int8),
        ("step", np.int64),
        ("layer", np.int32),
        ("expert", np.int32),
        ("rank", np.int32),
        ("source", np.int8),
        ("bytes", np.int64),
        ("latency_us", np.int64),
    ]
)

_FLUSH_ROWS = 4096
GZIP_MAGIC = b"\x1f\x8b"  # a trace kept gzipped (bench/results) is read as it is


class TraceWriter:
    """Buffers access records and appends them to a CSV trace in batches.

    `record` only appends a tuple to a list; every `flush_rows` records the batch goes to a writer thread
    that formats and writes it, mostly while the model thread is inside torch or waiting on reads (both
    release the GIL). Rows are written in the order `record` was called; call it from one thread at a time.
    `close()` writes what is still buffered: rows recorded after the last flush are lost without it.
    """

    def __init__(self, path: str | os.PathLike[str], meta: dict[str, Any] | None = None, flush_rows: int = _FLUSH_ROWS):
        self.path = os.fspath(path)
        try:
            self._f = open(self.path, "w", encoding="utf-8", newline="\n")
        except OSError as exc:
            raise MoestreamError(f"cannot write the trace {self.path}: {exc.strerror}; pick a writable path") from None
        head = [f"# moestream-trace: {VERSION}"]
        for key, value in (meta or {}).items():
            if "\n" in key or ":" in key:
                raise ValueError(f"trace metadata key {key!r} may not contain ':' or a newline")
            head.append(f"# {key}: {json.dumps(value)}")
        head.append(HEADER)
        self._f.write("\n".join(head) + "\n")
        self._f.flush()
        self._rows: list[tuple] = []
        self._flush_rows = flush_rows
        self.n_records = 0
        self._error: BaseException | None = None
        self._queue: queue.Queue[list[tuple] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._write_loop, name="moestream-trace", daemon=True)
        self._thread.start()

    def record(
        self,
        token: int,
        phase: str,
        step: int,
        layer: int,
        expert: int,
        rank: int,
        source: str,
        nbytes: int,
        latency_s: float,
    ) -> None:
        rows = self._rows
        rows.append((token, phase, step, layer, expert, rank, source, nbytes, latency_s))
        if len(rows) >= self._flush_rows:
            self.flush()

    def flush(self) -> None:
        """Hand the buffered rows to the writer thread (it writes them soon; close() waits for it)."""
        rows, self._rows = self._rows, []
        if rows:
            self.n_records += len(rows)
            self._queue.put(rows)

    def _write_loop(self) -> None:
        while (rows := self._queue.get()) is not None:
            if self._error is not None:
                continue
            try:
                # Latency becomes integer microseconds here, off the model's thread.
                self._f.write(
                    "".join(
                        [
                            f"{t},{ph},{st},{la},{ex},{rk},{src},{nb},{round(lat * 1e6)}\n"
                            for t, ph, st, la, ex, rk, src, nb, lat in rows
                        ]
                    )
                )
                self._f.flush()
            except BaseException as exc:  # a full disk must not kill decoding; close() reports it
                self._error = exc

    def close(self) -> None:
        if self._f.closed:
            return
        self.flush()
        self._queue.put(None)
        self._thread.join()
        self._f.close()
        if self._error is not None:
            raise MoestreamError(f"writing the trace {self.path} failed: {self._error}; check the disk")

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The `# key: value` metadata at the top of a trace."""
    path = os.fspath(path)
    with _open_trace(path) as f:
        return _read_head(path, f)


def _open_trace(path: str) -> BinaryIO:
    """The trace file for reading; a gzipped one (as bench/results keeps them) is read through gzip."""
    try:
        f = open(path, "rb")
        if f.read(2) != GZIP_MAGIC:
            f.seek(0)
            return f
        f.close()
        return gzip.open(path, "rb")  # type: ignore[return-value]
    except OSError as exc:
        raise MoestreamError(f"cannot read the trace {path}: {exc.strerror}; check the path") from None


def parse_meta_line(line: str, meta: dict[str, Any]) -> bool:
    """Take a `# key: JSON value` line into meta (a value that is not JSON is kept as text); False for
    any line that is not a comment. Traces and profiles share this header format."""
    if not line.startswith("#"):
        return False
    key, sep, value = line[1:].partition(":")
    if sep:
        try:
            meta[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            meta[key.strip()] = value.strip()
    return True


def _read_head(path: str, f: BinaryIO) -> dict[str, Any]:
    """The metadata, leaving f at the first data row."""
    meta: dict[str, Any] = {}
    while raw := f.readline():
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if parse_meta_line(line, meta):
            continue
        if line.strip() != HEADER:
            raise MoestreamError(
                f"{path} is not a moestream trace (expected the header '{HEADER}'); record one with --trace FILE"
            )
        return meta
    raise MoestreamError(f"{path} is not a moestream trace (no header line); record one with --trace FILE")


# Text codes substituted before numeric parsing; the surrounding commas make each replacement exact.
_CODES = [(b",prompt,", b",0,"), (b",decode,", b",1,"), (b",vram,", b",0,"), (b",ram,", b",1,"), (b",disk,", b",2,")]


def read_trace(path: str | os.PathLike[str]) -> tuple[dict[str, Any], np.ndarray]:
    """(metadata, rows) with rows a structured array of TRACE_DTYPE; phase and source as small codes.

    A trace still being written may end in a partial line: it is ignored.
    """
    path = os.fspath(path)
    try:
        with _open_trace(path) as f:
            meta = _read_head(path, f)
            data = f.read()
    except (OSError, EOFError) as exc:  # gzip's BadGzipFile is an OSError; a cut-off .gz ends in EOFError
        raise MoestreamError(f"cannot read the trace {path}: {exc}; the file is damaged or cut off") from None
    end = data.rfind(b"\n")
    data = data[: end + 1] if end >= 0 else b""
    if not data:
        return meta, np.zeros(0, TRACE_DTYPE)
    n_rows = data.count(b"\n")
    for text, code in _CODES:
        data = data.replace(text, code)
    # Every field is now an integer: one flat parse is much faster than np.loadtxt. fromstring stops quietly
    # (or raises) at the first field it cannot parse, so the count is checked.
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            text = data.replace(b"\n", b",").decode("ascii", "replace")
            flat = np.fromstring(text, dtype=np.int64, sep=",")
    except ValueError:  # newer numpy raises where older ones stopped early
        flat = np.zeros(0, np.int64)
    if flat.size != n_rows * len(COLUMNS):
        bad = _first_bad_line(data)
        raise MoestreamError(f"{path}: row {bad} does not parse as {HEADER}; is the trace damaged?")
    flat = flat.reshape(n_rows, len(COLUMNS))
    rows = np.empty(len(flat), TRACE_DTYPE)
    for i, name in enumerate(COLUMNS):
        rows[name] = flat[:, i]
    if len(rows) and (rows["phase"].max() > DECODE or rows["source"].max() > DISK):
        raise MoestreamError(f"{path}: unknown phase or source values; is the trace damaged?")
    return meta, rows


def _first_bad_line(data: bytes) -> int:
    for i, line in enumerate(data.split(b"\n")):
        fields = line.split(b",")
        if len(fields) != len(COLUMNS) or not all(f.strip().lstrip(b"-").isdigit() for f in fields):
            return i + 1
    return 0
