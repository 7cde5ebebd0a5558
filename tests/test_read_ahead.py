"""The prompt read-ahead's failure paths: an abandoned forward pass and a failed read leave nothing pinned, and
a read error surfaces at the layer that needed the read, never in a later forward pass. Each runs with reads
one segment at a time and with run reads (a prompt's adjacent experts read together)."""

from __future__ import annotations

import pytest

from moestream.errors import MoestreamError
from moestream.formats.gguf_file import GGUFFile
from moestream.streaming.expert_cache import ExpertCache
from moestream.streaming.expert_store import ExpertStore
from moestream.streaming.read_ahead import ahead_experts, ahead_reads
from moestream.streaming.reader import ExpertReader, run_length
from moestream.synth.shapes import write_synth

LAYERS, EXPERTS = 4, 16


THREADS = 3


def make_reader(path, store: ExpertStore, runs: bool) -> ExpertReader:
    """A reader with the buffers the engine plans: for runs, exactly what the read-ahead may hold plus four per
    thread, so a read-ahead that overstepped its share would deadlock the test."""
    if not runs:
        return ExpertReader(path, store.max_segment_nbytes, threads=THREADS, buffers=3 * (4 + ahead_experts(EXPERTS)))
    run_len = run_length(store.max_segment_nbytes, EXPERTS) // 4  # 4 experts a run: several runs per layer
    return ExpertReader(
        path,
        store.max_segment_nbytes,
        threads=THREADS,
        buffers=2 * THREADS,
        run_buffers=ahead_reads(EXPERTS, run_len) + 4 * THREADS,
        run_len=run_len,
    )


@pytest.fixture(params=[False, True], ids=["segments", "runs"])
def cache(tmp_path, request):
    path = write_synth("tiny", "Q4_0", tmp_path / "tiny.gguf", progress=False)
    f = GGUFFile(path)
    store = ExpertStore(f, LAYERS, EXPERTS, False)
    reader = make_reader(path, store, request.param)
    c = ExpertCache(store, reader, 4 * EXPERTS)
    c.phase = "prompt"
    yield c
    c.close()
    reader.close()
    f.close()


def _no_pins(c: ExpertCache) -> bool:
    return not c.ahead.pending and not c.policy.held and not any(c.policy.pins)


def test_a_forward_pass_abandoned_after_reading_ahead_leaves_nothing_pinned(cache):
    groups = cache.fetch_groups(0, list(range(EXPERTS)))
    next(groups)  # layer 0's first group; layer 1 is being read ahead
    assert cache.ahead.layer == 1 and cache.stats.ahead_reads == ahead_experts(EXPERTS)
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
    layer1 = [(s.offset, s.offset + s.nbytes * EXPERTS) for s in cache.store.segments(1, 0)]

    def failing(buf, offset, nbytes, part=0):
        if any(lo <= offset < hi for lo, hi in layer1):  # layer 0's own reads succeed, the read-ahead's fail
            raise MoestreamError("injected read error")
        return real(buf, offset, nbytes, part)

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


def test_a_scattered_read_ahead_reads_fewer_experts_not_more_buffers(cache):
    """Uncached experts scattered over the next layer make runs of one: the read-ahead then stops at the reads
    its buffers allow, and the prompt still goes through (a read-ahead holding every buffer would hang it)."""
    for _ in cache.fetch(1, list(range(0, EXPERTS, 2))):  # every other expert of layer 1 cached
        pass
    for _ in cache.fetch(0, list(range(EXPERTS))):
        pass
    run_len = cache.reader.run_len
    assert 0 < cache.stats.ahead_reads <= min(ahead_experts(EXPERTS), ahead_reads(EXPERTS, run_len) // 3)
    for layer in range(1, LAYERS):  # the last layer reads nothing ahead
        got = dict(cache.fetch(layer, list(range(EXPERTS))))
        assert sorted(got) == list(range(EXPERTS))
    assert _no_pins(cache)


def test_run_reads_give_the_experts_that_single_reads_give(tmp_path):
    path = write_synth("tiny", "Q4_0", tmp_path / "tiny.gguf", progress=False)
    f = GGUFFile(path)
    store = ExpertStore(f, LAYERS, EXPERTS, False)
    caches = []
    for runs in (False, True):
        c = ExpertCache(store, make_reader(path, store, runs), LAYERS * EXPERTS)
        c.phase = "prompt"
        caches.append(c)
    try:
        ids = [0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 14, 15]  # runs of several lengths, broken by gaps
        for layer in range(LAYERS):
            single, run = (dict(c.fetch(layer, ids)) for c in caches)
            assert caches[1].reader.run_len > 1 and sorted(single) == sorted(run) == ids
            for e in ids:
                assert type(single[e]) is type(run[e])
                for a, b in zip(single[e].matrices(), run[e].matrices(), strict=True):
                    assert a.weight.dtype == b.weight.dtype and a.weight.equal(b.weight)
    finally:
        for c in caches:
            c.close()
            c.reader.close()
        f.close()
