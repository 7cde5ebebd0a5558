"""The routing model (moestream/analysis/route_model.py) against real routing it was not fitted on.

    python bench/route_model_heldout.py          # reads ../shared/routes (or --routes DIR); a few minutes

GPT-OSS-20B's 532 generated samples: the model is fitted on every fourth sample and draws as many samples of
the same lengths as every eighth one starting at the second (disjoint from the fitted ones), as
tests/test_route_model.py::test_model_predicts_held_out_gpt_oss_20b_hit_rates does (same split, same seed: the
same figures). Both are replayed with LRU (moestream.analysis.replay: the engine's SlotPolicy, one request a
sample, the cache carried across them) at 10-60% of the 768 experts, with the engine's global capacity and
split evenly per layer (`replay --per-layer`). Beside them, what explains the model's classes:
* the real held-out routes with each layer's token sequence rotated by its own random offset within each
  sample (every layer's own statistics kept, the alignment of a token's layers broken);
* the model with one class (layers drawn independently, as before the classes);
* two more disjoint splits (fit on samples 1::4, predict 2::8; fit 2::4, predict 3::8), global capacity.
Results: bench/results/<date>-route-model-heldout.json.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import git_commit, shared_routes_dir, write_json  # noqa: E402
from moestream.analysis import route_model as rm  # noqa: E402
from moestream.analysis.accesses import accesses_from_trace  # noqa: E402
from moestream.analysis.replay import replay  # noqa: E402
from moestream.analysis.route_files import RouteSample, RouteSet, read_routes, route_meta, route_rows  # noqa: E402

SHARES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)


def lru_curve(rs: RouteSet, per_layer: bool = False) -> list[float]:
    acc = accesses_from_trace(route_meta(rs), route_rows(rs))
    total = rs.n_layers * rs.n_experts
    return [round(replay(acc, "lru", round(f * total), per_layer=per_layer).hit_rate, 4) for f in SHARES]


def rotated(rs: RouteSet, seed: int = 0) -> RouteSet:
    """Each layer's tokens rotated by a random offset within each sample."""
    rng = np.random.default_rng(seed)
    out = []
    for s in rs.samples:
        d = s.decode.copy()
        for layer in range(rs.n_layers):
            d[:, layer] = np.roll(s.decode[:, layer], int(rng.integers(len(d))), axis=0)
        out.append(RouteSample(d, s.prompt))
    return RouteSet(out, rs.n_layers, rs.n_experts, rs.top_k, meta=rs.meta)


def predicted(fitted: RouteSet, held: RouteSet, classes: int = rm.CLASSES) -> tuple[dict, RouteSet]:
    kept, rm.CLASSES = rm.CLASSES, classes
    try:
        model = rm.fit(fitted)
    finally:
        rm.CLASSES = kept
    return model, rm.generate(model, [len(s.decode) for s in held.samples], seed=1)


def main() -> None:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--routes", default=shared_routes_dir())
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args()
    rs = read_routes(os.path.join(args.routes, "gpt-oss-20b.npz"))

    def part(samples: list[RouteSample]) -> RouteSet:
        return RouteSet(samples, rs.n_layers, rs.n_experts, rs.top_k, meta=rs.meta)

    fitted, held = part(rs.samples[0::4]), part(rs.samples[1::8])
    model, drawn = predicted(fitted, held)
    doc: dict = {
        "what": "LRU hit rate of held-out GPT-OSS-20B samples, real vs drawn from the routing model",
        "commit": git_commit(),
        "source": "../shared/routes/gpt-oss-20b.npz",
        "cache_shares": list(SHARES),
        "slots": [round(f * rs.n_layers * rs.n_experts) for f in SHARES],
        "fitted": {"samples": "0::4", "n": len(fitted.samples), "tokens": fitted.decode_tokens},
        "held_out": {"samples": "1::8", "n": len(held.samples), "tokens": held.decode_tokens},
        "model": {k: model[k] for k in ("reuse", "classes", "class_reuse")},
        "seed": 1,
    }
    for cap in ("global", "per_layer"):
        real, pred = lru_curve(held, cap == "per_layer"), lru_curve(drawn, cap == "per_layer")
        err = [round(p - r, 4) for r, p in zip(real, pred, strict=True)]
        doc[cap] = {"real": real, "model": pred, "model_minus_real": err, "max_abs_error": max(map(abs, err))}
        print(cap, doc[cap], flush=True)
    doc["global"]["real_layers_rotated"] = lru_curve(rotated(held))
    doc["global"]["model_one_class"] = lru_curve(predicted(fitted, held, classes=1)[1])
    print("rotated", doc["global"]["real_layers_rotated"], "one class", doc["global"]["model_one_class"], flush=True)
    doc["other_splits"] = []
    for f, h in ((1, 2), (2, 3)):
        fit_s, held_s = part(rs.samples[f::4]), part(rs.samples[h::8])
        real, pred = lru_curve(held_s), lru_curve(predicted(fit_s, held_s)[1])
        err = [round(p - r, 4) for r, p in zip(real, pred, strict=True)]
        doc["other_splits"].append(
            {"fitted": f"{f}::4", "held_out": f"{h}::8", "real": real, "model": pred, "model_minus_real": err}
        )
        print(doc["other_splits"][-1], flush=True)
    out = args.output or os.path.join(here, "bench", "results", f"{datetime.date.today()}-route-model-heldout.json")
    write_json(out, doc)
    print(out)


if __name__ == "__main__":
    main()
