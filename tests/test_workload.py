import argparse
import json

import numpy as np
import pytest

from moestream.analysis.profile import Profile, build_profile, load_profile, write_profile
from moestream.analysis.trace import TraceWriter, read_trace
from moestream.analysis.workload import format_report, workload_stats
from moestream.errors import MoestreamError


def _write(path, decode_tokens, prompt=(), meta=None, hits=frozenset()):
    """decode_tokens: per token, per layer, the expert ids; hits: (token, layer, expert) served from RAM."""
    meta = {
        "layers": len(decode_tokens[0]),
        "experts": 8,
        "top_k": len(decode_tokens[0][0]),
        "expert_bytes": 1000,
        "n_slots": 4,
        "model": "toy",
    } | (meta or {})
    step = 0
    with TraceWriter(path, meta) as w:
        for layers in prompt:
            step += 1
            for layer, ids in enumerate(layers):
                for rank, e in enumerate(ids):
                    w.record(0, "prompt", step, layer, e, rank, "disk", 1000, 0.001)
        for t, layers in enumerate(decode_tokens):
            step += 1
            for layer, ids in enumerate(layers):
                for rank, e in enumerate(ids):
                    hit = (t, layer, e) in hits
                    w.record(
                        100 + t,
                        "decode",
                        step,
                        layer,
                        e,
                        rank,
                        "ram" if hit else "disk",
                        0 if hit else 1000,
                        0.0 if hit else 0.001,
                    )
    return read_trace(path)


def test_u_of_k_and_saving(tmp_path):
    # one layer, top-2: tokens alternate pairs {0,1},{0,1},{2,3},{2,3}: a 2-token batch reads 2, not 4
    toks = [[[0, 1]], [[0, 1]], [[2, 3]], [[2, 3]]] * 2
    meta, rows = _write(tmp_path / "t.csv", toks)
    s = workload_stats(meta, rows, ks=(1, 2, 4))
    u = {r["k"]: r for r in s["u_of_k"]}
    assert u[1]["U"] == 2 and u[1]["saving"] == 0
    assert u[2]["U"] == 2 and u[2]["saving"] == pytest.approx(0.5)
    assert u[4]["U"] == 4 and u[4]["saving"] == pytest.approx(0.5)
    assert u[2]["mb_per_token"] == pytest.approx(1 * 1000 / 1e6)


def test_reuse_singletons_coverage(tmp_path):
    toks = [[[0]], [[0]], [[1]], [[0]], [[2]]]
    meta, rows = _write(tmp_path / "t.csv", toks, meta={"top_k": 1})
    s = workload_stats(meta, rows, window=5, top_n=[1, 2])
    hist = {h["tokens"]: h["accesses"] for h in s["reuse"]["histogram"]}
    assert hist["1"] == 1 and hist["2"] == 1 and hist["first use"] == 3  # gaps: 0->1: 1, 1->3: 2
    assert s["reuse"]["median"] == 1.5
    assert s["singletons"]["share"] == pytest.approx(2 / 5)  # experts 1 and 2 once in the window
    top = {t["n"]: t["share"] for t in s["coverage"]["top"]}
    assert top[1] == pytest.approx(3 / 5) and top[2] == pytest.approx(4 / 5)
    assert s["coverage"]["slots_for"]["50%"] == 1 and s["coverage"]["distinct"] == 3


def test_per_layer_hit_rates_from_sources(tmp_path):
    toks = [[[0, 1], [2, 3]], [[0, 1], [2, 3]]]
    hits = {(1, 0, 0), (1, 0, 1), (1, 1, 2)}
    meta, rows = _write(tmp_path / "t.csv", toks, prompt=[[[0, 1, 2], [3]]], hits=hits)
    s = workload_stats(meta, rows)
    layers = s["per_layer"]
    assert layers[0]["decode_hit_rate"] == 0.5 and layers[1]["decode_hit_rate"] == 0.25
    assert layers[0]["prompt_accesses"] == 3 and layers[1]["prompt_hit_rate"] == 0.0
    assert s["decode_hit_rate"] == pytest.approx(3 / 8)
    assert s["decode_tokens"] == 2
    text = format_report(s)
    assert "U(k)" in text and "singletons" in text and "layer" in text
    json.dumps(s)  # JSON-ready


def test_profile_rank_roundtrip(tmp_path):
    toks = [[[3, 1]], [[3, 2]], [[3, 1]]]
    meta, rows = _write(tmp_path / "t.csv", toks, prompt=[[[5, 6, 7]]])
    prof = build_profile(meta, rows, source="t.csv")
    assert prof.entries == [(0, 3, 3), (0, 1, 2), (0, 2, 1)]  # the prompt's accesses are left out
    assert prof.top(2) == [(0, 3), (0, 1)]
    assert prof.coverage(1) == pytest.approx(0.5)
    assert len(build_profile(meta, rows, phases="all").entries) == 6
    for name in ("p.txt", "p.json"):
        write_profile(prof, tmp_path / name)
        back = load_profile(tmp_path / name)
        assert back.entries == prof.entries
        assert back.meta["source"] == "t.csv" and back.meta["accesses"] == 6
    lines = (tmp_path / "p.txt").read_text().splitlines()
    assert lines[0] == "# moestream-profile: 1" and "layer expert count" in lines and lines[-1] == "0 2 1"


def test_profile_per_layer_and_errors(tmp_path):
    prof = Profile([(1, 4, 9), (0, 2, 8), (1, 5, 7), (0, 3, 1)])
    assert prof.top_per_layer(1) == {1: [4], 0: [2]}
    bad = tmp_path / "bad.txt"
    bad.write_text("hello\n")
    with pytest.raises(MoestreamError, match="not a moestream profile"):
        load_profile(bad)
    bad.write_text("layer expert count\n1 2\n")
    with pytest.raises(MoestreamError, match=":2:"):
        load_profile(bad)
    with pytest.raises(MoestreamError, match="cannot read"):
        load_profile(tmp_path / "missing.txt")


def test_stats_and_profile_cli(tmp_path, capsys):
    from moestream.cli.analysis import add_analysis_commands

    parser = argparse.ArgumentParser()
    add_analysis_commands(parser.add_subparsers(dest="command", required=True))
    rng = np.random.default_rng(0)
    toks = [[list(rng.choice(8, 2, replace=False)) for _ in range(2)] for _ in range(20)]
    _write(tmp_path / "t.csv", toks)
    args = parser.parse_args(["stats", str(tmp_path / "t.csv"), "--json", "--k", "1,4"])
    assert args.func(args) == 0
    assert [r["k"] for r in json.loads(capsys.readouterr().out)["u_of_k"]] == [1, 4]
    args = parser.parse_args(["profile", str(tmp_path / "t.csv"), "-o", str(tmp_path / "p.txt")])
    assert args.func(args) == 0
    assert "pairs" in capsys.readouterr().out
    assert load_profile(tmp_path / "p.txt").total == 80
