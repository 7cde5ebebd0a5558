"""Sampler: greedy, seeding, the top-k / top-p / min-p filters, the penalties and the log-probabilities."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moestream.engine.sampling import Sampler, TokenHistory


def random_logits(v: int = 1000, seed: int = 0) -> torch.Tensor:
    return torch.randn(v, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    s = Sampler()
    for seed in range(20):
        logits = random_logits(seed=seed)
        assert s(logits) == int(torch.argmax(logits))
    assert s(torch.tensor([0.0, 5.0, 1.0], dtype=torch.bfloat16)) == 1


def test_top_k_1_is_greedy_at_any_temperature() -> None:
    s = Sampler(temperature=1.5, top_k=1, seed=0)
    for seed in range(20):
        logits = random_logits(seed=seed)
        assert s(logits) == int(torch.argmax(logits))


def test_same_seed_same_sequence() -> None:
    logits = [random_logits(seed=i) * 0.2 for i in range(30)]  # flat-ish: many candidates
    a = Sampler(temperature=1.0, top_p=0.95, seed=123)
    b = Sampler(temperature=1.0, top_p=0.95, seed=123)
    seq_a = [a(x) for x in logits]
    torch.manual_seed(999)  # the global RNG must not matter
    torch.rand(10)
    seq_b = [b(x) for x in logits]
    assert seq_a == seq_b
    c = Sampler(temperature=1.0, top_p=0.95, seed=124)
    assert [c(x) for x in logits] != seq_a


def test_top_k_restricts_candidates() -> None:
    logits = random_logits(seed=3)
    top5 = set(torch.topk(logits, 5).indices.tolist())
    s = Sampler(temperature=2.0, top_k=5, seed=0)
    drawn = {s(logits) for _ in range(300)}
    assert drawn <= top5 and len(drawn) > 1
    probs = s.probs(logits)
    assert set(torch.nonzero(probs).flatten().tolist()) == top5
    assert probs.sum().item() == pytest.approx(1.0)


def test_empirical_frequencies_match_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    s = Sampler(temperature=0.7, seed=7)
    n = 20000
    counts = torch.bincount(torch.tensor([s(logits) for _ in range(n)]), minlength=4).float() / n
    expected = torch.softmax(logits / 0.7, dim=0)
    assert torch.allclose(counts, expected, atol=0.015)


def test_top_p_example() -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert torch.nonzero(Sampler(1.0, top_p=0.5).probs(logits)).flatten().tolist() == [0]
    assert torch.nonzero(Sampler(1.0, top_p=0.6).probs(logits)).flatten().tolist() == [0, 1]
    assert torch.nonzero(Sampler(1.0, top_p=0.8).probs(logits)).flatten().tolist() == [0, 1]
    assert torch.nonzero(Sampler(1.0, top_p=0.81).probs(logits)).flatten().tolist() == [0, 1, 2]
    assert Sampler(1.0, top_p=0.6).probs(logits)[:2].tolist() == pytest.approx([0.625, 0.375])


@settings(max_examples=300, deadline=None)
@given(
    logits=st.lists(st.floats(-8, 8, allow_nan=False), min_size=1, max_size=12),
    top_p=st.floats(0.01, 1.0),
    top_k=st.integers(0, 14),
    temperature=st.floats(0.3, 3.0),
)
def test_filtered_distribution_properties(logits: list[float], top_p: float, top_k: int, temperature: float) -> None:
    x = torch.tensor(logits)
    s = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, seed=0)
    probs = s.probs(x)
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-5)
    if s.greedy:
        assert probs[torch.argmax(x)] == 1.0
        return
    base = torch.softmax(x / temperature, dim=0)
    kept = probs > 0
    # top-k first: the top-p mass is measured on the renormalized top-k distribution
    if 0 < top_k < len(logits):
        assert int(kept.sum()) <= top_k
        k_vals = torch.topk(base, top_k).values
        base_k = base / k_vals.sum()
        in_k = base >= k_vals[-1]
    else:
        base_k, in_k = base, torch.ones_like(kept)
    assert bool((kept <= in_k).all())
    # kept tokens are the most likely ones
    if (~kept & in_k).any():
        assert base[kept].min() >= base[~kept & in_k].max() - 1e-7
    # the kept set reaches top_p, and is the smallest such set: without its least likely token it falls short
    mass = base_k[kept].sum().item()
    assert mass >= top_p - 1e-5 or bool((kept == in_k).all())
    assert mass - base_k[kept].min().item() < top_p + 1e-5
    # survivors keep their relative odds
    assert torch.allclose(probs[kept], base[kept] / base[kept].sum(), atol=1e-5)
    # and a draw only ever lands on a survivor
    assert all(kept[s(x)] for _ in range(5))


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        Sampler(temperature=-1)
    with pytest.raises(ValueError):
        Sampler(top_k=-1)
    with pytest.raises(ValueError):
        Sampler(top_p=0.0)
    with pytest.raises(ValueError, match="shape"):
        Sampler()(torch.zeros(2, 5))


# ------------------------------------------------------------------------- penalties, min_p, logprobs


def test_penalties_on_known_logits() -> None:
    """OpenAI's: logit -= count * frequency + (count > 0) * presence, over generated tokens; llama.cpp's / HF's
    repetition penalty over prompt and generated tokens first: positive logits divided, negative multiplied."""
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 3.0])
    h = TokenHistory(prompt=[3])
    for t in (0, 0, 1):
        h.add(t)
    s = Sampler(frequency_penalty=0.5, presence_penalty=0.3)
    assert s.penalize(logits, h).tolist() == pytest.approx([2 - 1.0 - 0.3, 1 - 0.5 - 0.3, 0.5, -1.0, 3.0])
    r = Sampler(repetition_penalty=2.0)
    assert r.penalize(logits, h).tolist() == pytest.approx([1.0, 0.5, 0.5, -2.0, 3.0])
    both = Sampler(repetition_penalty=2.0, frequency_penalty=1.0)
    assert both.penalize(logits, h).tolist() == pytest.approx([1.0 - 2.0, 0.5 - 1.0, 0.5, -2.0, 3.0])
    assert logits.tolist() == [2.0, 1.0, 0.5, -1.0, 3.0]  # left alone
    # greedy picks the argmax of the penalized logits: a repeated token loses its place
    h.add(4)
    assert Sampler()(logits, h) == 4 and Sampler(frequency_penalty=2.0, presence_penalty=2.0)(logits, h) == 2
    assert Sampler(presence_penalty=-2.0)(torch.tensor([0.0, 0, 0, 0, 0, 1]), h) == 0  # negative: repeat more


def test_min_p_keeps_tokens_near_the_top() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert torch.nonzero(Sampler(1.0, min_p=0.25).probs(logits)).flatten().tolist() == [0, 1, 2]
    assert torch.nonzero(Sampler(1.0, min_p=0.7).probs(logits)).flatten().tolist() == [0]
    assert Sampler(1.0, min_p=0.5).probs(logits)[:2].tolist() == pytest.approx([0.625, 0.375])


def test_logprobs_follow_the_sampling_distribution() -> None:
    logits, h = torch.tensor([2.0, 1.0, 0.0, -1.0, 1.5]), TokenHistory([4])
    token, lp = Sampler().pick(logits, None, top=3)
    assert lp is not None and token == 0 and lp.top[0] == (0, lp.logprob)
    assert [i for i, _ in lp.top] == [0, 4, 1] and sum(math.exp(v) for _, v in lp.top) <= 1
    s = Sampler(temperature=0.8, repetition_penalty=1.5, seed=5)
    n, counts, logp = 20000, Counter[int](), None
    for _ in range(n):
        token, lp = s.pick(logits, h, top=5)
        counts[token] += 1
        logp = dict(lp.top) if lp else None
    assert logp is not None and set(logp) == set(range(5))
    for t, v in logp.items():  # frequencies: the distribution the logprobs describe (penalized, tempered)
        assert counts[t] / n == pytest.approx(math.exp(v), abs=0.015)
    assert Sampler().pick(logits)[1] is None


def test_with_seed_and_penalty_ranges() -> None:
    s = Sampler(0.9, 5, 0.8, seed=1, min_p=0.1, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2)
    t = s.with_seed(2)
    assert (t.temperature, t.top_k, t.top_p, t.min_p, t.seed) == (0.9, 5, 0.8, 0.1, 2)
    assert (t.presence_penalty, t.frequency_penalty, t.repetition_penalty) == (0.5, -0.5, 1.2)
    for bad in ({"min_p": 1.1}, {"presence_penalty": 2.1}, {"frequency_penalty": -2.5}, {"repetition_penalty": 0.0},
                {"repetition_penalty": math.inf}, {"min_p": math.nan}):  # fmt: skip
        with pytest.raises(ValueError, match=next(iter(bad))):
            Sampler(**bad)
