"""The routing model (`moestream routes fit / gen`): a generated route file is a route file, and on real
GPT-OSS-20B routing (../shared/routes, skipped without it) it predicts the LRU hit-rate curve of samples it
was not fitted on within 3 points from 10% to 60% of the experts cached, in the engine's cache (one pool for
all layers) and in one split evenly per layer (`replay --per-layer`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from moestream.analysis import route_model as rm
from moestream.analysis.accesses import accesses_from_trace
from moestream.analysis.replay import replay
from moestream.analysis.route_files import RouteSet, read_routes, route_meta, route_rows
from moestream.cli.main import main
from tests.test_route_files import _npz, _skewed

ROOT = Path(__file__).resolve().parents[1]
# ../shared/routes beside the checkout (or beside the folder of its worktrees)
NEAR = (ROOT.parent / "shared" / "routes", ROOT.parents[1] / "shared" / "routes")
SHARED = next((d for d in NEAR if d.is_dir()), None)


SHARES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)


def _lru_curve(rs: RouteSet, per_layer: bool = False) -> list[float]:
    acc = accesses_from_trace(route_meta(rs), route_rows(rs))
    total = rs.n_layers * rs.n_experts
    return [replay(acc, "lru", round(f * total), per_layer=per_layer).hit_rate for f in SHARES]


def test_fit_and_gen_make_a_route_file(tmp_path):
    src = _npz(tmp_path, {f"s{i}": _skewed(60, i) for i in range(4)})
    model, out = str(tmp_path / "m.json"), str(tmp_path / "g.csv")
    assert main(["routes", "fit", src, "-o", model, "--experts", "16"]) == 0
    assert main(["routes", "gen", model, "--tokens", "50", "--samples", "3", "-o", out]) == 0
    rs = read_routes(out)
    assert [len(s.decode) for s in rs.samples] == [50] * 3 and (rs.n_layers, rs.n_experts, rs.top_k) == (4, 16, 4)
    # reuse between consecutive tokens comes through (uniform routing at top-4 of 16 would give 0.25)
    d = rs.samples[0].decode
    reuse = (d[1:, :, :, None] == d[:-1, :, None, :]).any(-1).mean()
    assert abs(reuse - rm.load_model(model)["reuse"]) < 0.1
    # to another shape: the qwen3-30b-a3b shape's layers and experts, at top-6
    assert main(["routes", "gen", model, "--shape", "qwen3-30b-a3b", "--top-k", "6", "--tokens", "8", "-o", out]) == 0
    rs = read_routes(out)
    assert (rs.n_layers, rs.n_experts, rs.top_k) == (48, 128, 6)
    (tmp_path / "bad.json").write_text("{}")
    assert main(["routes", "gen", str(tmp_path / "bad.json"), "-o", out]) == 2


def _in_step(n: int, seed: int, layers: int = 4, experts: int = 16) -> np.ndarray:
    """[n, layers, 4] routes whose tokens either repeat their predecessor's experts in every layer or take new
    ones in every layer: reuse moves all the layers of a token together, as in real routing."""
    rng = np.random.default_rng(seed)
    out = np.zeros((n, layers, 4), np.int8)
    for t in range(n):
        repeat = t and rng.random() < 0.5
        for layer in range(layers):
            out[t, layer] = rng.permutation(out[t - 1, layer]) if repeat else rng.permutation(experts)[:4]
    return out


def _reuse(d: np.ndarray) -> np.ndarray:
    """[tokens - 1, layers]: the share of each token's experts in a layer that its predecessor used there."""
    return (d[1:, :, :, None] == d[:-1, :, None, :]).any(-1).mean(-1)


def test_a_tokens_reuse_moves_its_layers_together(tmp_path):
    src = _npz(tmp_path, {f"s{i}": _in_step(300, i) for i in range(4)})
    model = rm.fit(read_routes(src, 16))
    assert sum(model["classes"]) == pytest.approx(1, abs=1e-4) and model["class_reuse"][-1] == 1.0
    d = rm.generate(model, [2000], seed=3).samples[0].decode
    r = _reuse(d)
    # the layers of a generated token reuse together (drawn layer by layer alone they would not correlate)
    assert np.corrcoef(r[:, 0], r[:, 1])[0, 1] > 0.7
    assert abs(r.mean() - model["reuse"]) < 0.03
    assert (np.diff(np.sort(d, -1), axis=-1) != 0).all()  # a token's experts in a layer are distinct
    # a token's ranks are distinct, yet the reuse drawn is the reuse measured: drawn from the measured
    # distribution itself, without repeats, it falls short on these routes and this fails
    model = rm.fit(read_routes(_npz(tmp_path, {f"s{i}": _skewed(300, i) for i in range(4)}), 16))
    assert abs(_reuse(rm.generate(model, [3000], seed=3).samples[0].decode).mean() - model["reuse"]) < 0.02
    path = tmp_path / "old.json"
    path.write_text('{"routing_model": 1}')
    assert main(["routes", "gen", str(path), "-o", str(tmp_path / "g.csv")]) == 2


@pytest.mark.slow
@pytest.mark.skipif(SHARED is None, reason="no ../shared/routes (the real routing data)")
def test_model_predicts_held_out_gpt_oss_20b_hit_rates():
    rs = read_routes(str(SHARED / "gpt-oss-20b.npz"))

    def part(samples):
        return RouteSet(samples, rs.n_layers, rs.n_experts, rs.top_k, meta=rs.meta)

    fitted, held = part(rs.samples[0::4]), part(rs.samples[1::8])  # disjoint: fit on a quarter, predict an eighth
    model = rm.fit(fitted)
    drawn = rm.generate(model, [len(s.decode) for s in held.samples], seed=1)
    for per_layer in (False, True):
        real, predicted = _lru_curve(held, per_layer), _lru_curve(drawn, per_layer)
        print(
            f"held-out LRU hit rate at {', '.join(f'{f:.0%}' for f in SHARES)} of the experts",
            "(per-layer)," if per_layer else "(global),",
            f"real {np.round(real, 4).tolist()} model {np.round(predicted, 4).tolist()}",
        )
        # global: at 10% (77 slots, 96 accesses a token) an expert's next use always comes after more than 77
        # other experts, so neither holds anything; the per-layer split is what tests the small end there
        assert np.abs(np.array(real) - np.array(predicted)).max() < 0.03, list(zip(real, predicted, strict=True))
