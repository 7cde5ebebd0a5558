"""The slot policy on its own (no reads, no memory): pins, eviction order, scratch slots, growth while
generating, profile slots and parking; and the replay running this very class."""

from __future__ import annotations

import pytest

from moestream.analysis import replay as rp
from moestream.analysis.policies import make_pools
from moestream.errors import BudgetError
from moestream.streaming.slot_policy import LRU, SlotPolicy


def _admit(sp: SlotPolicy, keys: list[str]) -> list[int]:
    slots = []
    for key in keys:
        slot = sp.take(True)
        assert slot is not None
        sp.place(key, slot)
        slots.append(slot)
    return slots


def test_a_pinned_key_is_never_the_victim():
    sp = SlotPolicy(2)
    a, b = _admit(sp, ["a", "b"])
    sp.unpin(b)  # "a" is still pinned by its request
    assert sp.take(True) == b and "b" not in sp.slot_of and sp.stats.evictions == 1
    sp.unpin(a)
    req = sp.request(["a", "c"], refresh=True)
    assert req.hits == [(0, a)] and req.missed == [1]
    assert sp.take(True) is None  # "a" pinned again by the hit, and no slot is free: the caller waits


def test_hits_refresh_recency_only_when_asked():
    for refresh, victim in ((True, "b"), (False, "a")):
        sp = SlotPolicy(2)
        for slot in _admit(sp, ["a", "b"]):
            sp.unpin(slot)
        sp.unpin(sp.request(["a"], refresh).hits[0][1])
        slot = sp.take(True)
        assert sp.key_of[slot] is None and victim not in sp.slot_of


def test_a_miss_that_is_not_admitted_borrows_scratch_and_changes_nothing():
    sp = SlotPolicy(3, scratch=1)
    sp.admission.prompt = False
    _admit(sp, ["a", "b"])
    assert not sp.admission.admits("c", prompt=True) and sp.admission.admits("c", prompt=False)
    slot = sp.take(False)
    sp.place("c", slot, admitted=False)
    assert slot in sp.scratch_set and sp.take(False) is None  # the one scratch slot is in use
    sp.unpin(slot, release=True)
    assert list(sp.order) == ["a", "b"] and sp.take(False) == slot
    with pytest.raises(BudgetError, match="scratch"):
        SlotPolicy(2).take(False)


def test_min_hits_admits_a_key_seen_often_enough():
    sp = SlotPolicy(4)
    sp.admission.min_hits = 2
    for n in range(3):
        assert sp.admission.admits("a", prompt=False) == (n == 2)
        sp.admission.count(["a"])


def test_growth_while_generating_and_a_free_slot_rather_than_a_wait():
    sp = SlotPolicy(8)
    sp.growth.prompt_slots, sp.growth.decode_slots, sp.growth.generating = 3, 1, True
    sp.begin_step(1, prompt=True)
    _admit(sp, ["a", "b", "c"])  # pinned, and the step's allowance is spent
    assert sp.take(True) is None
    assert sp.take(True, spare_free=True) is not None  # the live cache's choice over waiting
    sp.begin_step(2, prompt=False)
    assert sp.growth.limit == 3 + 2


def test_profile_slots_parking_and_growing_back():
    sp = SlotPolicy(6)
    sp.min_slots = 2
    sp.unpin(sp.place_profile("p"))
    for slot in _admit(sp, ["a", "b"]):
        sp.unpin(slot)
    released = sp.shrink(10)
    assert len(released) == 3 and sp.capacity == 3  # one profile slot and min_slots LRU slots left
    assert "p" in sp.profile and sp.request(["p"], True).hits
    assert sp.grow(2) == 2 and sp.capacity == 5 and sp.stats.shrinks == sp.stats.grows == 1


def test_the_replay_runs_the_cache_policy():
    acc = rp.accesses_from_groups([[1, 2], [3], [2]])  # 3 evicts 1, the least recently used
    pools = make_pools(acc, "lru", [2], False, half_life=64.0, pin_fraction=0.5, profile=None)
    assert type(pools[0]) is SlotPolicy and type(pools[0].order) is LRU
    assert rp.replay(acc, "lru", 2).decode_hits == 1
