import gzip
import time

import numpy as np
import pytest

from moestream.analysis.trace import (
    COLUMNS,
    DECODE,
    DISK,
    HEADER,
    PROMPT,
    RAM,
    VRAM,
    TraceWriter,
    read_meta,
    read_trace,
)
from moestream.errors import MoestreamError


def test_roundtrip_rows_and_meta(tmp_path):
    path = tmp_path / "t.csv"
    meta = {"model": "m.gguf", "n_slots": 1936, "policy": "lru", "admit_prompt": False, "expert_bytes": 2654208}
    with TraceWriter(path, meta, flush_rows=3) as w:  # several flushes
        w.record(0, "prompt", 1, 0, 5, 0, "disk", 2654208, 0.0018344)
        w.record(0, "prompt", 1, 0, 9, 1, "ram", 0, 0.0)
        w.record(7, "decode", 2, 3, 127, 7, "vram", 0, 0.0)
        w.record(8, "decode", 3, 47, 1, 2, "disk", 100, 1.5)
    got_meta, rows = read_trace(path)
    assert got_meta["moestream-trace"] == 1
    assert {k: got_meta[k] for k in meta} == meta
    assert read_meta(path)["n_slots"] == 1936
    assert rows.dtype.names == COLUMNS
    assert rows["token"].tolist() == [0, 0, 7, 8]
    assert rows["phase"].tolist() == [PROMPT, PROMPT, DECODE, DECODE]
    assert rows["step"].tolist() == [1, 1, 2, 3]
    assert rows["layer"].tolist() == [0, 0, 3, 47]
    assert rows["expert"].tolist() == [5, 9, 127, 1]
    assert rows["rank"].tolist() == [0, 1, 7, 2]
    assert rows["source"].tolist() == [DISK, RAM, VRAM, DISK]
    assert rows["bytes"].tolist() == [2654208, 0, 0, 100]
    assert rows["latency_us"].tolist() == [1834, 0, 0, 1_500_000]


def test_file_is_plain_csv_with_comment_header(tmp_path):
    path = tmp_path / "t.csv"
    with TraceWriter(path, {"n_slots": 4}) as w:
        w.record(3, "decode", 9, 1, 2, 0, "ram", 0, 0.0)
    lines = path.read_text().splitlines()
    assert lines[0] == "# moestream-trace: 1"
    assert lines[1] == "# n_slots: 4"
    assert lines[2] == HEADER
    assert lines[3] == "3,decode,9,1,2,0,ram,0,0"


def test_empty_trace_and_partial_last_line(tmp_path):
    path = tmp_path / "t.csv"
    TraceWriter(path, {}).close()
    meta, rows = read_trace(path)
    assert len(rows) == 0
    with open(path, "a") as f:
        f.write("1,decode,2,0,3,0,disk,10,5\n2,decode,3,0,")  # a writer still running
    _, rows = read_trace(path)
    assert rows["token"].tolist() == [1]


def test_not_a_trace(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(MoestreamError, match="not a moestream trace"):
        read_trace(path)
    with pytest.raises(MoestreamError, match="cannot read"):
        read_trace(tmp_path / "missing.csv")


def test_a_gzipped_trace_reads_as_the_plain_one(tmp_path):
    path = tmp_path / "t.csv"
    with TraceWriter(path, {"n_slots": 7}) as w:
        for i in range(300):
            w.record(i, "decode", i, i % 4, i % 16, 0, "disk", 10, 0.0)
    packed = tmp_path / "t.csv.gz"
    packed.write_bytes(gzip.compress(path.read_bytes()))
    meta, rows = read_trace(path)
    gz_meta, gz_rows = read_trace(packed)
    assert gz_meta == meta and meta["n_slots"] == 7
    assert np.array_equal(gz_rows, rows)
    assert read_meta(packed) == meta
    cut = tmp_path / "cut.csv.gz"
    cut.write_bytes(packed.read_bytes()[:-20])
    with pytest.raises(MoestreamError, match="damaged or cut off"):
        read_trace(cut)


def test_damaged_row_is_reported(tmp_path):
    path = tmp_path / "t.csv"
    with TraceWriter(path, {}) as w:
        w.record(1, "decode", 2, 0, 3, 0, "disk", 10, 0.0)
    with open(path, "a") as f:
        f.write("2,decode,3,0,4,0,floppy,10,5\n")
    with pytest.raises(MoestreamError, match="row 2"):
        read_trace(path)


def test_unwritable_path():
    with pytest.raises(MoestreamError, match="cannot write the trace"):
        TraceWriter("/nonexistent-dir/t.csv", {})


def test_record_is_cheap(tmp_path):
    # Budget: well under the ~1 ms a decoded token spends per layer; the target is < 2 us per record.
    n = 50_000
    w = TraceWriter(tmp_path / "t.csv", {})
    rec = w.record
    t0 = time.perf_counter()
    for i in range(n):
        rec(i >> 8, "decode", i >> 8, (i >> 3) & 31, i & 127, i & 7, "disk", 2654208, 0.0018)
    per_record = (time.perf_counter() - t0) / n
    w.close()
    assert per_record < 10e-6  # loose: shared CI machines are noisy
    _, rows = read_trace(tmp_path / "t.csv")
    assert len(rows) == n
    assert np.array_equal(rows["expert"][:8], np.arange(8))
