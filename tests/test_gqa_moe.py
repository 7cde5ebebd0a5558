"""What only the plain GQA families have (the generic checks run on each in tests/test_models.py): llama's
q/k rotary layout put back at load, Mixtral's older one-tensor-per-expert files, a llama file without expert
keys read as dense."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moestream.cli.main import main
from moestream.engine.engine import Engine
from moestream.engine.model_file import dense_estimate, open_model
from moestream.engine.options import EngineOptions
from moestream.errors import ModelFileError
from moestream.formats.gguf_file import GGUFFile
from moestream.models.gqa import unpermute_rows
from moestream.models.mixtral import Mixtral
from moestream.streaming.mlock import routed_nbytes
from tests.hf_gguf import one_torch_thread, random_tokens, rel_error, rewrite_gguf
from tests.hf_gguf_gqa import MIXTRAL, MIXTRAL_PER_EXPERT, OLMOE, QWEN2MOE, llama_permute

pytest.importorskip("transformers")
one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """(model, merged file, per-expert file) of one tiny Mixtral."""
    model = MIXTRAL.hf_model(seed=3)
    d = tmp_path_factory.mktemp("mixtral")
    merged, split = str(d / "merged.gguf"), str(d / "split.gguf")
    MIXTRAL.write(model, merged)
    MIXTRAL_PER_EXPERT.write(model, split)
    return model, merged, split


def test_unpermute_rows_inverts_the_converters_permute():
    w = torch.randn(4 * 64, 32)
    torch.testing.assert_close(llama_permute(w, 4)[unpermute_rows(4, 64)], w, rtol=0, atol=0)


def test_rope_layout_matters(mixtral, monkeypatch):
    """Without putting the q/k rows back, the logits are far from transformers': the check is live."""
    model, path, _ = mixtral
    toks = random_tokens(24, model.config.vocab_size)
    with torch.no_grad():
        ref = model(torch.tensor([toks])).logits[0].float()
    errors = []
    for pairs in (True, False):
        monkeypatch.setattr(Mixtral, "rope_pairs", pairs)
        eng = Engine(path, EngineOptions(n_slots=16))
        try:
            with torch.inference_mode():
                errors.append(rel_error(eng.forward(toks, 0, all_logits=True), ref))
        finally:
            eng.close()
    assert errors[0] < 1e-3 < 1e-2 < errors[1]


def _expert_bytes(path: str) -> tuple[list[bytes], int]:
    m = open_model(path)
    try:
        store, f = m.store, m.gguf
        out = [b"".join(f.read_range(s.offset, s.nbytes).tobytes() for s in store.segments(layer, e))
               for layer in range(store.n_layers) for e in range(store.n_experts)]  # fmt: skip
        g0, g1 = store.segments(0, 0)[0], store.segments(0, 1)[0]
        adjacent = g1.offset == g0.offset + g0.nbytes
        assert adjacent == (store.run_len > 1)
        return out, store.run_len
    finally:
        m.close()


def test_per_expert_tensors_map_to_the_same_experts(mixtral):
    _, merged, split = mixtral
    merged_bytes, merged_run = _expert_bytes(merged)
    split_bytes, split_run = _expert_bytes(split)
    assert merged_bytes == split_bytes
    assert merged_run > 1 and split_run == 1  # per-expert tensors are not adjacent: no run reads across them


def test_per_expert_tensors_are_streamed_not_resident(mixtral):
    _, merged, split = mixtral
    a, b = GGUFFile(merged), GGUFFile(split)
    try:
        assert dense_estimate(a, True) == dense_estimate(b, True)
        assert routed_nbytes(a) == routed_nbytes(b) > 0
    finally:
        a.close()
        b.close()


def test_per_expert_file_streams_to_the_same_tokens(mixtral):
    model, merged, split = mixtral
    prompt = random_tokens(40, model.config.vocab_size, seed=4)
    outs = []
    for path, slots in ((merged, 64), (split, 64), (split, 3)):
        eng = Engine(path, EngineOptions(n_slots=slots, ubatch=8))
        try:
            outs.append(eng.generate(prompt, 8).tokens)
        finally:
            eng.close()
    assert outs[0] == outs[1] == outs[2]


def test_an_expert_of_another_shape_is_refused(mixtral, tmp_path):
    _, _, split = mixtral
    bad = tmp_path / "bad.gguf"
    rewrite_gguf(split, bad, tensors={"blk.1.ffn_up.5.weight": np.zeros((128, 256), np.float32)})
    with pytest.raises(ModelFileError, match="ffn_up.5.weight"):
        open_model(str(bad)).close()


def test_a_mixtral_without_its_expert_keys_reads_as_a_broken_dense_llama(mixtral, tmp_path, capsys):
    """A llama file without expert keys is a dense Llama (models/dense.py): Mixtral's tensors then lack the
    dense FFN, a one-line error naming it."""
    _, merged, _ = mixtral
    dense = tmp_path / "dense.gguf"
    rewrite_gguf(merged, dense, metadata={"llama.expert_count": None, "llama.expert_used_count": None})
    rc = main(["run", "-m", str(dense), "-p", "hello", "-n", "2"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "Traceback" not in err
    assert "'blk.0.ffn_gate.weight' is missing" in err.splitlines()[-1]


@pytest.mark.parametrize("arch", [MIXTRAL, MIXTRAL_PER_EXPERT, OLMOE, QWEN2MOE], ids=lambda a: a.id)
def test_greedy_tokens_equal_transformers_through_micro_batches(tmp_path, arch):
    """A prompt of several micro-batches, then greedy decoding, under a budget that streams and one that
    holds every expert: the tokens are transformers' own, and the prompt's last logits within 1e-3."""
    model = arch.hf_model(seed=5)
    path = str(tmp_path / "m.gguf")
    arch.write(model, path)
    prompt, n_new = random_tokens(50, model.config.vocab_size, seed=5), 8
    seq = list(prompt)
    with torch.no_grad():
        last = model(torch.tensor([seq])).logits[0, -1].float()
        for _ in range(n_new):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    for slots in (model.config.num_experts_per_tok + 1, 64):
        eng = Engine(path, EngineOptions(n_slots=slots, ubatch=16))
        try:
            assert eng.generate(prompt, n_new).tokens == seq[len(prompt) :]
            eng.reset()
            with torch.inference_mode():
                for s in range(0, len(prompt), 16):
                    ours = eng.forward(prompt[s : s + 16], s)
            assert rel_error(ours, last) < 1e-3
        finally:
            eng.close()
