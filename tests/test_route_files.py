"""Route files (`moestream routes import`): each source format round trips to the same accesses, bad sources
end in one line and exit 2, an engine run on imported routes replays exactly, and serve's requests each take
their own sample."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from moestream.analysis import replay as rp
from moestream.analysis.route_files import read_routes
from moestream.analysis.routes import RouteTrace
from moestream.analysis.trace import DECODE, read_trace
from moestream.cli.main import main
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler
from moestream.synth.shapes import write_synth

L, E, K = 4, 16, 4  # the tiny shape's


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return write_synth("tiny", "Q4_0", tmp_path_factory.mktemp("m") / "tiny.gguf", progress=False)


def _skewed(n: int, seed: int) -> np.ndarray:
    """[n, L, K] routes with reuse between tokens, as real routing has."""
    rng = np.random.default_rng(seed)
    out = np.zeros((n, L, K), np.int8)
    for t in range(n):
        for layer in range(L):
            keep = list(out[t - 1, layer, :2]) if t and rng.random() < 0.6 else []
            rest = [e for e in rng.permutation(E)[: K + 2] if e not in keep]
            out[t, layer] = (keep + rest)[:K]
    return out


def _npz(tmp_path, samples: dict[str, np.ndarray], order=None) -> str:
    path = str(tmp_path / "routes.npz")
    np.savez(path, **samples)
    with open(tmp_path / "routes.json", "w") as f:
        json.dump([{"key": k} for k in (order or list(samples))], f)
    return path


def _route_csv(tmp_path, turns: list[tuple[np.ndarray, np.ndarray]]) -> str:
    """'route_trace v1': prompt tokens lack the last layer but the last one's, as llama.cpp writes them."""
    lines = ["# route_trace v1", f"# model=x.gguf arch=qwen3moe n_layer={L} n_expert={E} n_expert_used={K}"]
    lines += [f"# layer={i} expert_bytes=1000 dense_bytes=10" for i in range(L)]
    lines.append("turn,phase,step,layer,slot,expert,weight,residency,expert_bytes")
    step = 0
    for turn, (prompt, decode) in enumerate(turns):
        for phase, routes in ((0, prompt), (1, decode)):
            for t, tok in enumerate(routes):
                last = phase == 1 or t == len(routes) - 1
                for layer in range(L if last else L - 1):
                    lines += [f"{turn},{phase},{step},{layer},{j},{e},0.2,0,1000" for j, e in enumerate(tok[layer])]
                step += 1
    path = tmp_path / "r.route.csv"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _replayed(path: str, slots: int = 12) -> tuple[np.ndarray, rp.ReplayResult]:
    meta, rows = read_trace(path)
    acc = rp.accesses_from_trace(meta, rows)
    return acc.keys, rp.replay(acc, "lru", slots)


def _keys(samples: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """The accesses in the order a replay sees them: each sample's prompt, then its decode tokens."""
    out = []
    for prompt, decode in samples:
        for routes in (prompt, decode):
            for tok in routes.astype(np.int64):
                out += [layer * E + e for layer in range(L) for e in tok[layer] if e >= 0]
    return np.array(out)


def test_npz_round_trip(tmp_path, capsys):
    a, b = _skewed(30, 1), _skewed(20, 2)
    src = _npz(tmp_path, {"s0": a, "s1": b}, order=["s1", "s0"])  # the .json's order, not the archive's
    out = str(tmp_path / "r.csv")
    assert main(["routes", "import", src, "-o", out, "--experts", str(E)]) == 0
    meta, _ = read_trace(out)
    assert meta["samples"] == [20, 30] and (meta["layers"], meta["experts"], meta["top_k"]) == (L, E, K)
    keys, r = _replayed(out)
    empty = np.zeros((0, L, K), np.int8)
    assert np.array_equal(keys, _keys([(empty, b), (empty, a)]))
    # importing the route file again keeps it as it was: the same samples, the same replay
    again = str(tmp_path / "again.csv")
    assert main(["routes", "import", out, "-o", again]) == 0
    keys2, r2 = _replayed(again)
    assert np.array_equal(keys, keys2) and r2.decode_hits == r.decode_hits
    rs = read_routes(again)
    assert [len(s.decode) for s in rs.samples] == [20, 30] and np.array_equal(rs.samples[1].decode, a)


def test_route_csv_round_trip(tmp_path):
    turns = [(_skewed(5, 3), _skewed(12, 4)), (_skewed(3, 5), _skewed(9, 6))]
    src = _route_csv(tmp_path, turns)
    out = str(tmp_path / "r.csv")
    assert main(["routes", "import", src, "-o", out]) == 0
    meta, _ = read_trace(out)
    assert meta["samples"] == [12, 9] and meta["prompt_tokens"] == [5, 3] and meta["expert_bytes"] == 1000
    expected = []
    for prompt, decode in turns:
        p = prompt.astype(np.int16).copy()
        p[:-1, L - 1] = -1  # the rows the source does not have
        expected.append((p, decode))
    keys, r = _replayed(out)
    assert np.array_equal(keys, _keys(expected))
    assert r.decode_tokens == 21


def test_moestream_trace_imports_its_decode_routes(tiny, tmp_path):
    rec = str(tmp_path / "rec.csv")
    eng = Engine(tiny, EngineOptions(n_slots=16, trace_path=rec))
    eng.generate([1, 2, 3, 4], 10, Sampler())
    eng.close()
    out = str(tmp_path / "r.csv")
    assert main(["routes", "import", rec, "-o", out, "--model", tiny]) == 0
    assert np.array_equal(read_routes(out).samples[0].decode, RouteTrace(rec, E, K, L).routes.numpy())


def _bad(tmp_path) -> dict[str, str]:
    good = _skewed(8, 1)
    cases = {}
    (tmp_path / "empty.csv").write_text("")
    cases["empty"] = str(tmp_path / "empty.csv")
    d = tmp_path / "cut"
    d.mkdir()
    src = _npz(d, {"s0": good, "s1": good})
    with open(src, "rb") as f:
        head = f.read()
    (d / "cut.npz").write_bytes(head[: len(head) // 2])
    cases["truncated npz"] = str(d / "cut.npz")
    d = tmp_path / "range"
    d.mkdir()
    cases["ids out of range"] = _npz(d, {"s0": good + 20})
    d = tmp_path / "shape"
    d.mkdir()
    cases["2-D sample"] = _npz(d, {"s0": good[:, 0]})
    d = tmp_path / "mixed"
    d.mkdir()
    cases["samples of two shapes"] = _npz(d, {"s0": good, "s1": good[:, :2]})
    d = tmp_path / "csv"
    d.mkdir()
    text = open(_route_csv(d, [(good, good)])).read().splitlines()
    (d / "cut.csv").write_text("\n".join(text[:-3]) + "\n" + text[-3][:4])
    cases["truncated route csv"] = str(d / "cut.csv")
    (d / "dup.csv").write_text("\n".join(text + [text[-1]]) + "\n")
    cases["route csv with a row twice"] = str(d / "dup.csv")
    (tmp_path / "text.csv").write_text("hello,world\n1,2\n")
    cases["not a route source"] = str(tmp_path / "text.csv")
    return cases


def test_bad_sources_end_in_one_line(tmp_path, capsys):
    for what, path in _bad(tmp_path).items():
        code = main(["routes", "import", path, "-o", str(tmp_path / "out.csv"), "--experts", str(E)])
        err = capsys.readouterr().err
        assert code == 2, what
        assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, (what, err)


def test_shape_mismatch_names_both_shapes(tiny, tmp_path, capsys):
    src = _npz(tmp_path, {"s0": _skewed(8, 1)[:, :, :3]})  # top-3 against the model's top-4
    assert main(["routes", "import", src, "-o", str(tmp_path / "o.csv"), "--model", tiny]) == 2
    err = capsys.readouterr().err
    assert "4 layers x 16 experts, top-3" in err and "4 layers x 16 experts, top-4" in err and err.count("\n") == 1
    # a model at that top-k takes them (synth --top-k)
    top3 = str(tmp_path / "top3.gguf")
    assert main(["synth", "--shape", "tiny", "--top-k", "3", "-o", top3]) == 0
    assert main(["routes", "import", src, "-o", str(tmp_path / "o.csv"), "--model", top3]) == 0
    assert main(["synth", "--shape", "tiny", "--top-k", "17", "-o", top3]) == 2


def test_run_on_imported_routes_replays_exactly(tiny, tmp_path):
    src = _npz(tmp_path, {"s0": _skewed(40, 7), "s1": _skewed(40, 8)})
    routes = str(tmp_path / "r.csv")
    assert main(["routes", "import", src, "-o", routes, "--model", tiny]) == 0
    rec = str(tmp_path / "rec.csv")
    eng = Engine(tiny, EngineOptions(n_slots=24, trace_path=rec, route_trace=routes))
    eng.generate([5, 6, 7], 30, Sampler())
    live = eng.cache.stats.hits
    eng.close()
    meta, rows = read_trace(rec)
    acc = rp.accesses_from_trace(meta, rows)
    assert rp.replay(acc, "lru", meta["n_slots"]).hits == live == rp.live_result(acc).hits
    assert 0 < live < len(rows)
    # the decode tokens routed as the first sample says, token by token
    dec = rows[rows["phase"] == DECODE]
    want = read_routes(routes).samples[0].decode
    for step in np.unique(dec["step"])[:10]:
        r = dec[dec["step"] == step]
        for layer in range(L):
            got = r[r["layer"] == layer]
            assert got["expert"][np.argsort(got["rank"])].tolist() == want[r["token"][0], layer].tolist()


def test_serve_clients_follow_different_samples(tiny, tmp_path):
    from tests.test_batch_serving import _complete
    from tests.test_server import serve_process

    a = np.tile(np.arange(K, dtype=np.int8), (64, L, 1))  # sample 0 routes to experts 0-3 only
    src = _npz(tmp_path, {"s0": a, "s1": a + 8})  # sample 1 to experts 8-11 only
    routes, rec = str(tmp_path / "r.csv"), str(tmp_path / "rec.csv")
    assert main(["routes", "import", src, "-o", routes, "--experts", str(E)]) == 0
    args = ("--max-batch", "2", "--route-trace", routes, "--trace", rec)
    with serve_process(tiny, tmp_path, *args) as url:
        out: list[str] = []
        clients = [threading.Thread(target=lambda p=p: out.append(_complete(url, p, False))) for p in ("Hi", "Yo")]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
    assert len(out) == 2
    _, rows = read_trace(rec)
    dec = rows[rows["phase"] == DECODE]
    groups = {}
    for r in dec:
        groups.setdefault((int(r["step"]), int(r["layer"])), set()).add(int(r["expert"]))
    first, second = set(range(K)), set(range(8, 8 + K))
    assert all(g <= first | second for g in groups.values())
    # both samples were followed (before, every request followed the first), and together in one step
    assert any(g & first for g in groups.values()) and any(g & second for g in groups.values())
    assert any(g == first | second for g in groups.values())
