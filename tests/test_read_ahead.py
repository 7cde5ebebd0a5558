"""The prompt read-ahead's failure paths: an abandoned forward pass and a failed read leave nothing pinned, and
a read error surfaces at the layer that needed the read, never in a later forward pass."""

from __future__ import annotations

import pytest

from moestream.errors import MoestreamError
from moestream.expert_cache import ExpertCache
from moestream.expert_store import ExpertStore
from moestream.gguf_file import GGUFFile
from moestream.read_ahead import ahead_experts
from moestream.reader import ExpertReader
from moestream.synth import write_synth

LAYERS, EXPERTS = 4, 16


@pytest.fixture()
def cache(tmp_path):
    path = write_synth("tiny", "Q4_0", tmp_path / "tiny.gguf", progress=False)
    f = GGUFFile(path)
    store = ExpertStore(f, LAYERS, EXPERTS, False)
    reader = ExpertReader(path, store.max_segment_nbytes, threads=3, buffers=3 * (4 + ahead_experts(EXPERTS)))
    c = ExpertCache(store, reader, 4 * EXPERTS)
    c.phase = "prompt"
    yield c
    c.close()
    reader.close()
    f.close()


def _no_pins(c: ExpertCache) -> bool:
    return not c._ahead and not c._reserved and not any(c._pins)


def test_a_forward_pass_abandoned_after_reading_ahead_leaves_nothing_pinned(cache):
    groups = cache.fetch_groups(0, list(range(EXPERTS)))
    next(groups)  # layer 0's first group; layer 1 is being read ahead
    assert cache._ahead_layer == 1 and cache.stats.ahead_reads == ahead_experts(EXPERTS)
    groups.close()  # the forward pass stops here (an error, Ctrl-C)
    for _ in cache.fetch(0, list(range(EXPERTS))):  # it starts again at layer 0: the read-ahead is settled
        pass
    for layer in range(1, LAYERS):
        for _ in cache.fetch(layer, [0, 1]):
            pass
    assert _no_pins(cache)
    assert len(cache.cached_keys()) <= cache.n_slots


def test_a_failed_read_ahead_raises_at_the_layer_that_needs_it_and_frees_its_slots(cache, monkeypatch):
    real = cache.reader._read_to
    calls = {"n": 0}

    def failing(buf, offset, nbytes):
        calls["n"] += 1
        if calls["n"] > 3 * EXPERTS:  # layer 0's own reads succeed, the read-ahead's fail
            raise MoestreamError("injected read error")
        return real(buf, offset, nbytes)

    monkeypatch.setattr(cache.reader, "_read_to", failing)
    for _ in cache.fetch(0, list(range(EXPERTS))):
        pass
    with pytest.raises(MoestreamError, match="injected"):
        for _ in cache.fetch(1, list(range(EXPERTS))):
            pass
    monkeypatch.setattr(cache.reader, "_read_to", real)
    for _ in cache.fetch(0, [0]):  # the next forward pass starts over: what layer 1 read ahead is dropped
        pass
    assert _no_pins(cache)
    assert not any(k[0] == 1 for k in cache.cached_keys())  # nothing half-read stays cached
    got = dict(cache.fetch(1, list(range(EXPERTS))))  # the layer reads again, this time from a good disk
    assert sorted(got) == list(range(EXPERTS))
