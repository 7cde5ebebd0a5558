"""--route-trace: the routed experts are the trace's, and bad traces are refused in one line."""

from __future__ import annotations

import numpy as np
import pytest

from moestream.analysis.routes import RouteTrace
from moestream.analysis.trace import DECODE, read_trace
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler
from moestream.errors import MoestreamError
from moestream.synth.shapes import write_synth


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("routes") / "tiny.gguf")
    write_synth("tiny", "Q4_0", path, progress=False)
    return path


def test_route_trace_drives_the_router(tiny, tmp_path):
    recorded = str(tmp_path / "rec.csv")
    eng = Engine(tiny, EngineOptions(n_slots=16, trace_path=recorded))
    eng.generate([1, 2, 3, 4], 10, Sampler())
    eng.close()
    replayed = str(tmp_path / "replayed.csv")
    eng = Engine(tiny, EngineOptions(n_slots=16, trace_path=replayed, route_trace=recorded))
    k = eng.cfg.top_k
    routes = RouteTrace(recorded, eng.cfg.n_experts, k).routes
    eng.generate([7, 8, 9], 12, Sampler(temperature=1.0, seed=3))
    eng.close()
    _, rows = read_trace(replayed)
    rows = rows[rows["phase"] == DECODE]
    assert len(rows) > 0
    for step in np.unique(rows["step"]):
        r = rows[rows["step"] == step]
        pos = int(r["token"][0])
        for layer in np.unique(r["layer"]):
            got = r[r["layer"] == layer]
            got = got["expert"][np.argsort(got["rank"])].tolist()
            assert got == routes[pos % len(routes), layer].tolist()


def test_route_trace_with_wrong_top_k_is_refused(tiny, tmp_path):
    recorded = str(tmp_path / "rec.csv")
    eng = Engine(tiny, EngineOptions(n_slots=16, trace_path=recorded))
    eng.generate([1, 2, 3], 3, Sampler())
    eng.close()
    with pytest.raises(MoestreamError, match="top-k"):
        RouteTrace(recorded, eng.cfg.n_experts, eng.cfg.top_k + 1)
    with pytest.raises(MoestreamError, match="16 experts"):
        RouteTrace(recorded, 1, eng.cfg.top_k)
