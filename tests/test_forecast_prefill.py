import itertools
import json
import math

import pytest

from moestream.analysis import prefill_forecast as pf
from moestream.analysis.forecast import EXPERT_SHARE, Geometry
from moestream.analysis.probe import ProbeResult, ProbeRow
from moestream.analysis.trace import TraceWriter
from moestream.cli.main import main
from moestream.errors import MoestreamError
from moestream.streaming.read_ahead import consecutive_runs

SEG = 1_000_000
# one prompt span of 10 tokens over 2 layers of 8 experts, then one decoded token at position 10
LAYER_EXPERTS = ([0, 1, 2, 5], [3, 4])
META = {
    "layers": 2,
    "experts": 8,
    "top_k": 2,
    "expert_bytes": 3 * SEG,
    "n_slots": 16,
    "admit_prompt": True,
    "read_ahead": False,
    "read_run_len": 2,
}


def _probe(sizes=((SEG, 1000.0), (2 * SEG, 2000.0))) -> ProbeResult:
    """Known bandwidths: the same at every depth, by read size."""
    rows = [ProbeRow(size, "direct", q, 64, 1.0, 1.0, 1.0, 1.0, 1.0, mb) for size, mb in sizes for q in (1, 2, 4, 8)]
    return ProbeResult("disk", 1 << 40, SEG, 3 * SEG, 1 << 34, True, rows=rows)


def _trace(path) -> str:
    with TraceWriter(path, META) as w:
        for layer, experts in enumerate(LAYER_EXPERTS):
            for rank, e in enumerate(experts):
                w.record(0, "prompt", 1, layer, e, rank, "disk", 3 * SEG, 0.001)
        for layer in range(2):
            for rank, e in enumerate((0, 3)):
                w.record(10, "decode", 2, layer, e, rank, "ram", 0, 0.0)
    return str(path)


def _hand_ms(ms_per_token: float) -> float:
    """The traced prompt by hand: layer 0 reads 4 experts in 3 runs ([0, 1], [2], [5]: 9 reads of 4/3 MB,
    bandwidth interpolated in log size between 1000 and 2000 MB/s); layer 1 reads [3, 4] in one run (3 reads of
    2 MB at 2000 MB/s). Each layer: its dense part, then the later of its experts' work and its reads plus the
    last expert's work."""
    layer = ms_per_token * 10 / 2
    work = EXPERT_SHARE * layer
    dense = layer - work
    bw0 = 1000 + 1000 * math.log(4 / 3) / math.log(2)
    read0 = 1e3 * 12 * SEG / (bw0 * 1e6)
    read1 = 1e3 * 6 * SEG / 2000e6
    t = max(dense + work, dense + read0 + work / 4)
    return max(t + dense + work, t + dense + read1 + work / 2)


def test_prefill_from_trace_is_hand_computed(tmp_path):
    from moestream.analysis import replay as rp
    from moestream.analysis.trace import read_trace

    meta, rows = read_trace(_trace(tmp_path / "t.csv"))
    acc = rp.accesses_from_trace(meta, rows)
    groups: list[rp.GroupMisses] = []
    rp.replay(acc, "lru", 16, group_misses=groups)
    assert pf.trace_spans(rows) == [(1, 10)]
    spans = pf.replay_spans(acc, groups, pf.trace_spans(rows), run_len=2)
    assert [(r.experts, r.misses, r.runs) for r in spans[0].layers] == [(4, 4, 3), (2, 2, 1)]
    geom = Geometry(2, 2, 3 * SEG, 8)
    for ms in (0.1, 2.0, 20.0):  # reads dominate, then compute does
        f = pf.prefill_forecast(_probe(), geom, spans, ms, io_threads=4)
        assert 1e3 * f.seconds == pytest.approx(_hand_ms(ms))
        assert f.tok_s == pytest.approx(10 / f.seconds) and f.experts_read == 6 and f.mb_read == 18
    # more reader threads than reads: the depth is the reads (bandwidth here does not depend on it)
    assert pf.read_ms(_probe(), geom, 2, 1, 4, True) == pytest.approx(3.0)


def test_read_ahead_overlaps_the_next_layer():
    # layer 1 wholly read ahead during layer 0: its reads are queued behind layer 0's and need no fetch
    geom = Geometry(2, 2, 3 * SEG, 8)
    span = pf.Span(10, [pf.LayerReads(2, 2, 2), pf.LayerReads(2, 0, 0, ahead=2, ahead_runs=2)])
    ms_per_token, pack = 1.0, 0.1
    layer = ms_per_token * 10 / 2
    work, dense = EXPERT_SHARE * layer, (1 - EXPERT_SHARE) * layer
    read = 1e3 * 6 * SEG / 1000e6  # 2 experts, one each: 6 reads of 1 MB
    t0 = max(dense + work + 2 * pack, dense + read + work / 2 + pack)
    ahead_done = dense + 2 * read
    t1 = max(t0 + dense + work + 2 * pack, ahead_done + work / 2 + pack)
    f = pf.prefill_forecast(_probe(), geom, [span], ms_per_token, io_threads=8, pack_ms=pack)
    assert 1e3 * f.seconds == pytest.approx(t1)
    # read in its own fetch instead, layer 1 would wait for all its reads after its dense part
    serial = pf.Span(10, [pf.LayerReads(2, 2, 2), pf.LayerReads(2, 2, 2)])
    assert pf.prefill_forecast(_probe(), geom, [serial], ms_per_token, io_threads=8, pack_ms=pack).seconds > f.seconds


def test_uniform_routing_fallback():
    assert pf.uniform_distinct(1, 8, 128) == pytest.approx(8)
    assert pf.uniform_distinct(600, 8, 128) == pytest.approx(128 * (1 - (1 - 8 / 128) ** 600))
    geom = Geometry(n_layers=3, top_k=8, expert_bytes=3 * SEG, n_experts=128)
    d = pf.uniform_distinct(512, 8, 128)
    streams = pf.uniform_spans(600, 512, geom, run_len=1)
    assert [s.tokens for s in streams] == [512, 88]
    assert streams[0].layers[0].misses == pytest.approx(d) and streams[0].layers[0].runs > 0
    # a cache of every expert reads each one once over the whole prompt
    fits = pf.uniform_spans(600, 512, geom, run_len=4, slots=3 * 128)
    assert sum(s.experts_read for s in fits) == pytest.approx(3 * pf.uniform_distinct(600, 8, 128))
    # with a cache of 4 layers the later layers' first half is read ahead
    ahead = pf.uniform_spans(512, 512, geom, run_len=4, slots=4 * 128).pop().layers
    assert ahead[0].ahead == 0 and ahead[1].ahead == 64 and ahead[1].ahead_runs == 16
    assert ahead[1].misses == pytest.approx(d / 2)
    with pytest.raises(MoestreamError, match="number of experts"):
        pf.uniform_spans(10, 10, Geometry(3, 8, 3 * SEG), 1)


def test_expected_runs_matches_enumeration():
    n, p = 6, 0.3
    for run_len in (1, 2, 4):
        exact = 0.0
        for picks in itertools.product((0, 1), repeat=n):
            ids = [i for i in range(n) if picks[i]]
            prob = math.prod(p if x else 1 - p for x in picks)
            exact += prob * len(consecutive_runs(ids, run_len))
        assert pf.expected_runs(n, p, run_len) == pytest.approx(exact)
    assert pf.expected_runs(8, 1.0, 4) == pytest.approx(2) and pf.expected_runs(8, 0.0, 4) == 0


def test_respan_keeps_the_trace_spans_and_scales_partial_ones():
    geom = Geometry(1, 2, 3 * SEG, 8)
    full, part = pf.Span(4, [pf.LayerReads(6, 6, 3)]), pf.Span(2, [pf.LayerReads(3, 3, 2)])
    assert pf.respan([full, part], 6, 4, geom) == [full, part]
    got = pf.respan([full, part], 11, 4, geom)
    assert [s.tokens for s in got] == [4, 4, 3] and got[1] == full
    f = pf.uniform_distinct(3, 2, 8) / pf.uniform_distinct(4, 2, 8)
    assert got[2].layers[0].misses == pytest.approx(6 * f)


def _cli(tmp_path, *extra):
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps(_probe().to_dict()))
    return ["forecast", "--probe", str(probe), "--compute-ms", "30", "--pack-ms", "0", *extra]


def test_cli_prefill_from_trace_with_measured(tmp_path, capsys):
    trace = _trace(tmp_path / "t.csv")
    stats = tmp_path / "s.json"
    stats.write_text(json.dumps({"prompt_tokens": 10, "prompt_s": 0.05, "decode_tokens": 2, "decode_s": 0.1}))
    cached = tmp_path / "cached.json"
    cached.write_text(json.dumps({"prompt_tokens": 10, "prompt_s": 0.02, "decode_tokens": 2, "decode_s": 0.1}))
    argv = _cli(tmp_path, "--trace", trace, "--prefill-compute-from", str(cached), "--measured", str(stats))
    assert main([*argv, "--json"]) == 0
    pre = json.loads(capsys.readouterr().out)["prefill"]
    assert 1e3 * pre["seconds"] == pytest.approx(_hand_ms(2.0))
    assert pre["measured_tok_s"] == pytest.approx(200) and pre["error"] == pytest.approx(pre["tok_s"] / 200 - 1)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "prefill: 10 prompt tokens in 1 span(s)" in out and "forecast" in out
    # another length: spans of the trace's 10 tokens
    assert main([*argv, "--prompt-tokens", "25", "--json"]) == 0
    pre = json.loads(capsys.readouterr().out)["prefill"]
    assert (pre["tokens"], pre["spans"], pre["span"]) == (25, 3, 10)


def test_cli_prefill_uniform(tmp_path, capsys):
    geom = ["--layers", "2", "--top-k", "2", "--expert-bytes", str(3 * SEG)]
    argv = _cli(tmp_path, *geom, "--prompt-tokens", "100", "--prefill-compute-ms-per-token", "5")
    # without the number of experts the uniform routing has nothing to spread over
    assert main(argv) == 2
    assert "number of experts" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prompt-tokens", "-5", "--prefill-compute-ms-per-token", "5"], "--prompt-tokens"),
        (["--prompt-tokens", "0", "--prefill-compute-ms-per-token", "5"], "--prompt-tokens"),
        (["--prompt-tokens", "100"], "compute per prompt token"),
        (["--prompt-tokens", "100", "--prefill-compute-ms-per-token", "-1"], "--prefill-compute-ms-per-token"),
        (["--prefill-compute-ms-per-token", "5", "--hit-rate", "50%"], "--prompt-tokens N"),
    ],
)
def test_cli_prefill_bad_values(tmp_path, capsys, extra, message):
    geom = ["--layers", "2", "--top-k", "2", "--expert-bytes", str(3 * SEG)]
    assert main(_cli(tmp_path, *geom, *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_cli_prefill_compute_from_needs_prompt_figures(tmp_path, capsys):
    stats = tmp_path / "s.json"
    stats.write_text(json.dumps({"decode_tokens": 2, "decode_s": 0.1}))
    argv = _cli(tmp_path, "--trace", _trace(tmp_path / "t.csv"), "--prefill-compute-from", str(stats))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "no prompt_tokens" in err and "--preload" in err and err.count("\n") == 1
