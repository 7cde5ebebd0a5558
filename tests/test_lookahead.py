"""The router lookahead (--lookahead): in decode, each MoE layer guesses the next layer's experts with that
layer's router and starts their reads while it computes. The output must not move, the expert accesses must
be as many, and most guessed reads must be ones the next layer then takes."""

from __future__ import annotations

import pytest

from moestream.cli.main import main
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.models.moe import MoE
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
    assert base.ahead_reads == 0
    assert snap.ahead_reads > 0
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
