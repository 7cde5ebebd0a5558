"""The router lookahead (--lookahead): in decode, each MoE layer guesses the next layer's experts with that
layer's router and starts their reads while it computes. The output must not move, the expert accesses must
be as many, and most guessed reads must be ones the next layer then takes."""

from __future__ import annotations

import pytest

from moestream.cli.main import main
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.planning import SlotPlanner, reader_nbytes
from moestream.models.moe import MoE
from moestream.streaming.ahead import OFF_MISSES, ON_MISSES, GuessSwitch
from moestream.streaming.budget import MB
from moestream.synth.shapes import write_synth

PROMPT = list(range(5, 25))


@pytest.fixture(scope="module", params=["tiny-deepseek4", "tiny-glm-dsa", "tiny"])
def model(request, tmp_path_factory) -> str:
    quant = "MXFP4" if request.param == "tiny-deepseek4" else "Q4_0"
    return write_synth(request.param, quant, tmp_path_factory.mktemp("la") / "m.gguf", progress=False)


def _run(path: str, lookahead: bool, slots: int, tokens: int = 16) -> tuple[list[int], object]:
    engine = Engine(path, EngineOptions(n_slots=slots, threads=2, lookahead=lookahead))
    try:
        return engine.generate(PROMPT, tokens).tokens, engine.snapshot()
    finally:
        engine.close()


def test_same_tokens_and_counts_guessed_reads_taken(model):
    """Tokens as without it, and as many expert accesses; reads were started ahead, most of them experts the
    next layer then asked for (a guess it did not ask for is finished and kept in the cache, so the hits that
    follow may differ a little)."""
    slots = 16
    plain, base = _run(model, False, slots)
    tokens, snap = _run(model, True, slots)
    assert tokens == plain
    assert snap.hits + snap.misses == base.hits + base.misses
    assert snap.ahead_reads > base.ahead_reads  # without it only hash layers' known experts read ahead
    assert snap.ahead_unused < snap.ahead_reads / 2


def test_every_moe_but_the_last_guesses_the_next(model):
    """link_lookahead gives each MoE block the next one that routes by its router (hash-routed layers route by
    token id: nothing to guess) and the ratio of the two FFN norms."""
    engine = Engine(model, EngineOptions(n_slots=16, threads=2))
    try:
        moes = [layer.ffn for layer in engine.model.layers if isinstance(layer.ffn, MoE)]
        routed = [m for m in moes if getattr(m, "tid2eid", None) is None]
        linked = [m.lookahead[0] for m in moes if m.lookahead is not None]
        assert linked == [m for m in moes[1:] if m in routed]
        assert moes[-1].lookahead is None
    finally:
        engine.close()


def test_prompt_steps_guess_nothing(model):
    """The lookahead is a decode lever: a prompt (one forward pass of the whole prompt, no decode) starts no
    guessed reads."""
    engine = Engine(model, EngineOptions(n_slots=16, threads=2, lookahead=True, read_ahead=False))
    try:
        engine.forward(PROMPT, 0)
        assert engine.snapshot().ahead_reads == 0
        assert engine.cache.ahead.guessed is None
    finally:
        engine.close()


def test_cli_flag_reaches_the_engine(model, capsys):
    """--lookahead on `run` decodes the same text as without it."""
    out = []
    for flag in ("--no-lookahead", "--lookahead"):
        rc = main(["run", "-m", model, "-p", "hello world", "-n", "8", "--ignore-eos", "--ram-budget-mb", "2048", flag])
        assert rc == 0
        out.append(capsys.readouterr().out)
    assert out[0] == out[1]


def test_switch_turns_on_while_decode_misses_and_off_when_it_stops():
    """'auto' guesses once recent fetches miss ON_MISSES experts on average and stops below OFF_MISSES; 'on'
    and 'off' ignore what fetches miss."""
    switch = GuessSwitch("auto")
    assert not switch.active
    switch.observe(0)
    assert not switch.active
    switch.observe(8)
    assert switch.active
    while switch.misses >= ON_MISSES:
        switch.observe(0)
    assert switch.active  # hit-only fetches within the band keep it on
    while switch.misses >= OFF_MISSES:
        assert switch.active
        switch.observe(0)
    assert not switch.active
    switch.observe(1)  # one miss within the band does not turn it on again
    assert not switch.active and switch.misses < ON_MISSES
    for mode, active in (("on", True), ("off", False)):
        fixed = GuessSwitch(mode)
        for misses in (0, 9, 0):
            fixed.observe(misses)
            assert fixed.active is active
    with pytest.raises(ValueError, match="lookahead mode"):
        GuessSwitch("sometimes")


def test_default_guesses_where_the_cache_misses(model, tmp_path):
    """By default the lookahead is automatic where the cache cannot hold every expert: a tight cache decodes
    the same tokens as without it and starts guessed reads; a cache holding every expert, or a traced run,
    has it off (and the reader without its buffers)."""
    plain, _ = _run(model, False, 16)
    engine = Engine(model, EngineOptions(n_slots=16, threads=2))
    try:
        assert engine.cache.guesses.mode == "auto"
        assert engine.generate(PROMPT, 16).tokens == plain
        assert engine.snapshot().ahead_reads > 0
    finally:
        engine.close()
    every = Engine(model, EngineOptions(threads=2)).cfg
    for opts in (
        EngineOptions(n_slots=every.n_layers * every.n_experts, threads=2),
        EngineOptions(n_slots=16, threads=2, trace_path=str(tmp_path / "t.csv")),
    ):
        engine = Engine(model, opts)
        try:
            assert engine.cache.guesses.mode == "off"
            assert not engine.cache.lookahead
        finally:
            engine.close()


def test_a_budget_that_misses_plans_the_guesses_buffers(model):
    """Where a budget's cache cannot hold every expert, the plan turns the automatic lookahead on and counts
    its guesses' buffers in the reader it plans (the budget holds them); where it holds them all, neither."""
    engine = Engine(model, EngineOptions(n_slots=16, threads=2))  # the weights loaded: what plan() measures
    try:
        store, cfg = engine.cache.store, engine.cfg
        every = store.n_layers * store.n_experts
        sizes = dict(ubatch=64, prefill_span=64)
        base = SlotPlanner(engine.file, 512, EngineOptions(ram_budget_mb=1 << 16, lookahead=False, **sizes))
        full, _, _ = base.plan(False)
        held = full.resident + full.compute + full.reader + full.reserve
        for slots, mode in ((every // 2, "auto"), (2 * every, "off")):
            budget_mb = (held + slots * full.slot_nbytes) // MB + 1
            planner = SlotPlanner(engine.file, 512, EngineOptions(ram_budget_mb=budget_mb, **sizes))
            plan, _, _ = planner.plan(False)
            assert planner.lookahead == mode
            guesses = reader_nbytes(cfg, store, 4, False, lookahead=True)
            assert (plan.reader == guesses) is (mode == "auto")
            assert plan.n_slots < every if mode == "auto" else plan.n_slots == every
    finally:
        engine.close()
