import json

import pytest

from moestream.analysis import forecast as fc
from moestream.analysis.probe import ProbeResult, ProbeRow
from moestream.cli.main import build_parser
from moestream.engine.calibrate import measure_compute_ms
from moestream.errors import MoestreamError

SEG = 1_000_000


def _probe(direct=((1, 500), (2, 1000), (4, 2000), (8, 2000)), buffered=()):
    rows = [ProbeRow(SEG, "direct", q, 64, 1.0, 1.0, 1.0, 1.0, 1.0, mb) for q, mb in direct]
    rows += [ProbeRow(SEG, "buffered", q, 64, 1.0, 1.0, 1.0, 1.0, 1.0, mb) for q, mb in buffered]
    return ProbeResult(
        path="disk",
        file_bytes=1 << 40,
        segment_bytes=SEG,
        expert_bytes=3 * SEG,
        ram_bytes=1 << 34,
        representative=True,
        rows=rows,
    )


def test_bandwidth_interpolates_between_depths():
    p = _probe()
    assert fc.bandwidth(p, 1, True) == 500
    assert fc.bandwidth(p, 4, True) == 2000
    assert fc.bandwidth(p, 3, True) == pytest.approx(1000 + 1000 * 0.5849625, rel=1e-6)  # log2(3) - 1
    assert fc.bandwidth(p, 64, True) == 2000
    with pytest.raises(MoestreamError, match="buffered"):
        fc.bandwidth(p, 4, False)


def test_forecast_from_hit_rate():
    geom = fc.Geometry(n_layers=10, top_k=1, expert_bytes=3 * SEG)
    p = _probe()
    # no hits: every layer misses its one expert = 3 reads of 1 MB with 3 in flight
    f = fc.forecast(p, geom, compute_ms=20.0, hit_rate=0.0, io_threads=4, pack_ms=0.0)
    per_layer_ms = 3 * SEG / (fc.bandwidth(p, 3, True) * 1e6) * 1e3
    assert f.read_ms == pytest.approx(10 * per_layer_ms)
    assert f.tok_s == pytest.approx(1e3 / (20 + 10 * per_layer_ms))
    assert f.misses_per_token == 10 and f.mb_per_token == pytest.approx(30)
    # all hits: compute only
    assert fc.forecast(p, geom, 20.0, hit_rate=1.0).tok_s == pytest.approx(50)
    # fewer reader threads: slower
    assert fc.forecast(p, geom, 20.0, hit_rate=0.0, io_threads=1).tok_s < f.tok_s
    with pytest.raises(MoestreamError):
        fc.forecast(p, geom, 20.0, hit_rate=1.5)
    with pytest.raises(MoestreamError):
        fc.forecast(p, geom, 20.0)


def test_forecast_from_miss_histogram():
    geom = fc.Geometry(n_layers=2, top_k=4, expert_bytes=3 * SEG)
    p = _probe()
    # half the (token, layer) groups miss nothing, half miss 4 (12 reads, 4 in flight at 2000 MB/s)
    f = fc.forecast(p, geom, 10.0, miss_hist=[5, 0, 0, 0, 5])
    assert f.hit_rate == pytest.approx(0.5)
    assert f.read_ms == pytest.approx(2 * 0.5 * 12 * SEG / 2000e6 * 1e3)
    # the same hit rate spread binomially reads more (isolated misses cost more per expert)
    assert fc.forecast(p, geom, 10.0, hit_rate=0.5).read_ms > f.read_ms


def test_read_stats(tmp_path):
    assert fc.read_stats("5.5") == {"decode_tps": 5.5}
    path = tmp_path / "s.json"
    # 11 decoded tokens are 10 forward passes: the first token comes from the prompt's logits
    path.write_text(json.dumps({"decode_tokens": 11, "decode_s": 2.0, "decode_read_wait_s": 1.5}))
    got = fc.read_stats(str(path))
    assert got["decode_tps"] == 5 and got["compute_ms"] == pytest.approx(50)
    assert got["read_bytes_per_pass"] == 0
    path.write_text(json.dumps({"stats": {"decode_tps": 3.0}}))
    assert fc.read_stats(str(path)) == {"decode_tps": 3.0}
    path.write_text("[]")
    with pytest.raises(MoestreamError):
        fc.read_stats(str(path))
    with pytest.raises(MoestreamError, match="cannot read"):
        fc.read_stats(str(tmp_path / "none.json"))


def test_compute_from_a_run_that_read_experts_counts_packing_once(tmp_path):
    """A streamed run's decode time minus its read waits holds the packing of what it read; forecasting that
    same run's misses must give back its own speed when its reads were hidden, not that packing twice."""
    geom = fc.Geometry(n_layers=4, top_k=4, expert_bytes=3 * SEG)
    pack_ms, compute_cached = 5.0, 40.0
    misses = 8  # per pass, 2 a layer, all reads hidden under compute (no waits)
    decode_s = (compute_cached + misses * pack_ms) / 1e3 * 10
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"decode_tokens": 11, "decode_s": decode_s, "decode_read_wait_s": 0.0,
                                "decode_bytes_read": 10 * misses * geom.expert_bytes}))  # fmt: skip
    got = fc.read_stats(str(path))
    assert fc.cached_compute_ms(got, geom, pack_ms) == pytest.approx(compute_cached)
    f = fc.forecast(_probe(), geom, fc.cached_compute_ms(got, geom, pack_ms), miss_hist=[0, 0, 10], pack_ms=pack_ms)
    assert f.tok_s == pytest.approx(got["decode_tps"], rel=0.02)
    assert fc.cached_compute_ms({"compute_ms": 1.0, "read_bytes_per_pass": 9e9}, geom, pack_ms) == 0.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from moestream.synth.shapes import write_synth

    return write_synth("tiny", "Q4_0", tmp_path_factory.mktemp("m") / "tiny.gguf", progress=False)


def test_geometry_from_gguf(tiny):
    g = fc.geometry_from_gguf(tiny)
    assert (g.n_layers, g.top_k, g.n_experts) == (4, 4, 16)
    assert g.expert_bytes > 0 and g.model == "tiny.gguf"
    assert fc.geometry_from_meta({"layers": 4, "top_k": 4, "expert_bytes": 9}).expert_bytes == 9
    with pytest.raises(MoestreamError):
        fc.geometry_from_meta({})


def test_measure_compute(tiny):
    ms = measure_compute_ms(tiny, tokens=4)
    assert 0 < ms < 5000


def test_forecast_cli_with_trace_and_measured(tiny, tmp_path, capsys):
    from moestream.analysis.trace import TraceWriter

    trace = tmp_path / "t.csv"
    with TraceWriter(
        trace, {"layers": 4, "top_k": 4, "experts": 16, "expert_bytes": 3 * SEG, "n_slots": 16, "admit_prompt": True}
    ) as w:
        for step in range(1, 30):
            for layer in range(4):
                for rank, e in enumerate((0, 1, 2, 3 + step % 5)):
                    w.record(step, "decode", step, layer, e, rank, "disk", 3 * SEG, 0.001)
    probe_json = tmp_path / "probe.json"
    probe_json.write_text(json.dumps(_probe().to_dict()))
    parser = build_parser("forecast")
    args = parser.parse_args(
        [
            "forecast",
            "--probe",
            str(probe_json),
            "--trace",
            str(trace),
            "--slots",
            "16",
            "--compute-ms",
            "30",
            "--measured",
            "12.5",
            "--json",
        ]
    )
    assert args.func(args) == 0
    cases = {c["case"]: c for c in json.loads(capsys.readouterr().out)["cases"]}
    replayed = cases["replay lru @16"]
    assert 0.5 < replayed["hit_rate"] < 1 and replayed["measured_tok_s"] == 12.5
    assert cases["no cache hits"]["tok_s"] < replayed["tok_s"] < cases["all cached"]["tok_s"]
    args = parser.parse_args(
        ["forecast", "--probe", str(probe_json), "--model", tiny, "--hit-rate", "60%", "--compute-ms", "30"]
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "hit rate 60.0%" in out and "tiny.gguf" in out
    args = parser.parse_args(["forecast", "--probe", str(probe_json), "--model", tiny, "--hit-rate", "60%"])
    with pytest.raises(MoestreamError, match="compute time"):
        args.func(args)


def test_forecast_overlaps_reads_with_cached_experts():
    # 8 experts, 4 of them missing: the 4 cached ones are computed while the misses are read, so the layer
    # costs the dense part + max(read + one miss's work, all the CPU work), never read + compute.
    geom = fc.Geometry(n_layers=1, top_k=8, expert_bytes=3 * SEG)
    p = _probe()
    read_ms = 1e3 * fc.layer_read_s(p, geom, 4, 4, True)
    f = fc.forecast(p, geom, compute_ms=10.0, miss_hist=[0, 0, 0, 0, 1], pack_ms=0.5)
    per_expert = fc.EXPERT_SHARE * 10.0 / 8
    dense = 10.0 - 8 * per_expert
    expected = dense + max(read_ms + per_expert + 0.5, 8 * per_expert + 4 * 0.5)
    assert 1e3 / f.tok_s == pytest.approx(expected)
    assert 1e3 / f.tok_s < 10.0 + read_ms + 4 * 0.5  # cheaper than reading, then computing
