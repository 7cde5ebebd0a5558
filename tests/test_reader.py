"""Run reads: adjacent segments read as one, handed over part by part, the buffer shared until all are done."""

from __future__ import annotations

import os

import pytest

from moestream.errors import MoestreamError
from moestream.streaming.reader import ExpertReader

PART = 5000  # not a multiple of the page size: parts start anywhere in the buffer


@pytest.fixture()
def data_file(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(64 * 1024))
    return str(path)


@pytest.mark.parametrize("direct", [None, False], ids=["direct-if-possible", "buffered"])
def test_each_part_holds_its_own_bytes_and_the_buffer_returns_after_the_last(data_file, direct):
    reader = ExpertReader(data_file, PART, threads=2, direct=direct, run_buffers=1, run_len=4)
    try:
        raw = open(data_file, "rb").read()
        offset = 777
        leases = [f.result() for f in reader.read_run(offset, PART, 3)]
        for i, lease in enumerate(leases):
            want = raw[offset + i * PART : offset + (i + 1) * PART]
            assert bytes(lease.view) == want
        assert reader._run_buffers.qsize() == 0
        for lease in leases[:2]:
            lease.release()
        assert reader._run_buffers.qsize() == 0  # one part still holds the buffer
        leases[2].release()
        assert reader._run_buffers.qsize() == 1
        # the single buffer is reused: a second run reads into it
        again = [f.result() for f in reader.read_run(0, PART, 2)]
        assert bytes(again[1].view) == raw[PART : 2 * PART]
        for lease in again:
            lease.release()
    finally:
        reader.close()


def test_a_failed_run_read_fails_every_part_and_gives_the_buffer_back(data_file, monkeypatch):
    reader = ExpertReader(data_file, PART, threads=2, run_buffers=1, run_len=4)
    try:

        def failing(buf, offset, nbytes, part=0):
            raise MoestreamError("injected read error")

        monkeypatch.setattr(reader, "_read_to", failing)
        parts = reader.read_run(0, PART, 4)
        for f in parts:
            with pytest.raises(MoestreamError, match="injected"):
                f.result()
        assert reader._run_buffers.qsize() == 1
    finally:
        reader.close()


def test_without_run_buffers_a_run_is_read_part_by_part(data_file):
    reader = ExpertReader(data_file, PART, threads=2)
    try:
        assert reader.run_len == 1
        raw = open(data_file, "rb").read()
        leases = [f.result() for f in reader.read_run(100, PART, 3)]
        assert [bytes(x.view) for x in leases] == [raw[100 + i * PART : 100 + (i + 1) * PART] for i in range(3)]
        for lease in leases:
            lease.release()
    finally:
        reader.close()
    short = ExpertReader(data_file, PART, run_buffers=1, run_len=2)
    try:
        with pytest.raises(ValueError):
            short.read_run(0, PART, 3)  # longer than its buffers take
    finally:
        short.close()


@pytest.mark.parametrize("runs", [0, 1], ids=["single", "run"])
def test_a_read_that_waits_too_long_for_a_buffer_fails_instead_of_hanging(data_file, runs):
    """Every buffer held by a lease nobody releases: the next read fails at the reader's deadline."""
    reader = ExpertReader(data_file, PART, threads=2, run_buffers=runs, run_len=2)
    reader.wait_s = 0.2
    try:
        pool = reader._run_buffers if runs else reader._pool_buffers
        held = [pool.get_nowait() for _ in range(pool.qsize())]
        futures = reader.read_run(0, PART, 2)
        for f in futures:
            with pytest.raises(MoestreamError, match="no read buffer came free within 0.2 s"):
                f.result(timeout=30)
        for buf in held:
            pool.put(buf)
        leases = [f.result(timeout=30) for f in reader.read_run(0, PART, 2)]
        assert bytes(leases[1].view) == open(data_file, "rb").read()[PART : 2 * PART]
        for lease in leases:
            lease.release()
            lease.release()  # a second release does nothing: the buffer goes back once
        assert pool.qsize() == len(held)
    finally:
        reader.close()
