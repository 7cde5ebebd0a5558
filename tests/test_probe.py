import argparse
import json
import os
from collections import namedtuple

import pytest

from moestream.analysis import probe
from moestream.errors import MoestreamError

FAST = dict(inflight=(1, 2), reads_per_row=4, seconds_per_row=0.5, progress=False)


@pytest.fixture
def small_file(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(os.urandom(8 << 20))
    return str(path)


def test_probe_small_file_is_not_representative(small_file):
    r = probe.probe_file(small_file, **FAST)
    assert r.segment_bytes == probe.DEFAULT_SEGMENT and r.file_bytes == 8 << 20
    assert not r.representative
    assert any("not representative" in w for w in r.warnings)
    modes = {row.mode for row in r.rows}
    assert "buffered" in modes  # O_DIRECT too where the filesystem allows it, else a warning says so
    assert ("direct" in modes) or any("O_DIRECT" in w for w in r.warnings)
    assert len(r.rows) == 2 * 2 * len(modes)  # 2 sizes x 2 depths x modes
    for row in r.rows:
        assert row.reads >= 4 and row.mb_s > 0 and row.p50_ms <= row.p90_ms <= row.p99_ms
    rec = r.recommended
    assert rec["io_threads"] in (1, 2) and "--io-threads" in rec["flags"]
    text = probe.format_probe(r)
    assert "recommended reader" in text and "not representative" in text
    back = probe.ProbeResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back.rows == r.rows


def test_probe_reads_the_models_own_segment_size(tmp_path):
    from moestream.synth.shapes import write_synth

    model = write_synth("tiny", "Q4_0", tmp_path / "tiny.gguf", progress=False)
    seg, expert, (lo, hi), _part = probe.expert_geometry(model)
    assert expert == 3 * seg and 0 < lo < hi <= os.path.getsize(model)
    r = probe.probe_file(model, modes=("buffered",), **FAST)
    assert r.segment_bytes == seg and r.expert_bytes == expert
    assert {row.size for row in r.rows} == {seg, 4096}


def test_probe_dir_writes_and_deletes_its_test_file(tmp_path):
    r = probe.probe_dir(str(tmp_path), 64 << 20, modes=("buffered",), **FAST)
    assert r.file_bytes == 64 << 20 and r.rows
    assert list(tmp_path.iterdir()) == []  # deleted
    assert any("freshly written" in w for w in r.warnings)


def test_probe_dir_refuses_without_space(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(probe.shutil, "disk_usage", lambda _: usage(10 << 30, 9 << 30, 1 << 30))
    with pytest.raises(MoestreamError, match="GiB free"):
        probe.probe_dir(str(tmp_path), 4 << 30, **FAST)
    with pytest.raises(MoestreamError, match="no such directory"):
        probe.probe_dir(str(tmp_path / "nope"), 64 << 20, **FAST)


def test_recommend_prefers_fewest_reads_near_the_best():
    def row(mode, q, mb):
        return probe.ProbeRow(2 << 20, mode, q, 64, 1.0, 1.0, 1.0, 2.0, 3.0, mb)

    rows = [
        row("buffered", 1, 900),
        row("buffered", 4, 2000),
        row("buffered", 8, 2100),
        row("direct", 1, 1300),
        row("direct", 2, 1900),
        row("direct", 4, 1950),
    ]
    rec = probe.recommend(rows, 2 << 20)
    assert rec["direct"] and rec["io_threads"] == 2
    rows = [row("buffered", 4, 3000), row("direct", 4, 1000)]
    assert probe.recommend(rows, 2 << 20)["direct"] is False


def test_parse_size():
    assert probe.parse_size("4G") == 4 << 30
    assert probe.parse_size("512MiB") == 512 << 20
    assert probe.parse_size("1.5g") == int(1.5 * (1 << 30))
    assert probe.parse_size("4096") == 4096
    for bad in ("", "lots", "-1G"):
        with pytest.raises(MoestreamError):
            probe.parse_size(bad)


def test_probe_cli(small_file, tmp_path, capsys):
    from moestream.cli.analysis import add_analysis_commands

    parser = argparse.ArgumentParser()
    add_analysis_commands(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "probe.json"
    args = parser.parse_args(
        [
            "probe",
            "--file",
            small_file,
            "--inflight",
            "1",
            "--reads-per-row",
            "4",
            "--seconds-per-row",
            "0.5",
            "--buffered-only",
            "--json",
            "-o",
            str(out),
        ]
    )
    assert args.func(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["representative"] is False and json.loads(out.read_text()) == doc
    args = parser.parse_args(["probe"])
    with pytest.raises(MoestreamError, match="--file"):
        args.func(args)


def test_probe_cli_sizes(small_file, capsys):
    from moestream.cli.analysis import add_analysis_commands

    parser = argparse.ArgumentParser()
    add_analysis_commands(parser.add_subparsers(dest="command", required=True))
    common = ["probe", "--file", small_file, "--inflight", "1", "--reads-per-row", "4", "--seconds-per-row", "0.5"]
    args = parser.parse_args([*common, "--buffered-only", "--json", "--sizes", "64K,1M"])
    assert args.func(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sorted({row["size"] for row in doc["rows"]}) == [64 << 10, 1 << 20]
    args = parser.parse_args([*common, "--sizes", "64K,lots"])
    with pytest.raises(MoestreamError, match="cannot read the size 'lots'"):
        args.func(args)
