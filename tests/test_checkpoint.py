"""Hugging Face checkpoint directories as models (formats/checkpoint.py): tiny transformers models saved as
bf16, f32, FP8 with block scales and (GPT-OSS) MXFP4 experts generate what transformers generates on the same
weights and what the same model converted to GGUF generates, streamed under a budget or all cached."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from moestream.cli.main import main
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler
from moestream.formats import quants
from moestream.formats.checkpoint import CheckpointModel
from moestream.formats.gguf_file import GGUFFile
from moestream.formats.tokenizer import Tokenizer
from tests.hf_checkpoint import bf16_round, save_checkpoint, save_fp8_checkpoint
from tests.hf_gguf import QWEN3MOE, TinyArch, n_experts, random_tokens, tiny_tokenizer_metadata
from tests.hf_gguf_gpt_oss import GPT_OSS, quantize_gpt_oss_experts, write_gpt_oss_from_hf
from tests.hf_gguf_gqa import MIXTRAL

ARCHS = [QWEN3MOE, MIXTRAL, GPT_OSS]
N = 10


def _prompt(model) -> list[int]:
    return random_tokens(40, model.config.vocab_size, seed=2)


def _transformers(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=N, do_sample=False)
    return out[0, len(prompt) :].tolist()


def _ours(path: str, prompt: list[int], slots: int, exact: bool | None = None) -> list[int]:
    eng = Engine(path, EngineOptions(n_slots=slots, ubatch=16, exact=exact))
    try:
        gen = eng.generate(prompt, N, Sampler())
        assert eng.cache.used_slots <= slots
        return gen.tokens
    finally:
        eng.close()


def _budgets(model) -> tuple[int, int]:
    """A few expert slots (streamed) and every expert cached."""
    cfg = model.config
    return cfg.num_experts_per_tok + 1, cfg.num_hidden_layers * n_experts(cfg)


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: a.id)
def test_f32_checkpoint_equals_transformers_and_the_f32_gguf(arch: TinyArch, tmp_path):
    model = arch.hf_model(seed=2)
    ckpt = save_checkpoint(model, str(tmp_path / "ckpt"), torch.float32)
    gguf = str(tmp_path / "m.gguf")
    arch.write(model, gguf, dense_type=T.F32, expert_type=T.F32)
    prompt = _prompt(model)
    want = _transformers(model, prompt)
    for slots in _budgets(model):
        assert _ours(ckpt, prompt, slots) == want == _ours(gguf, prompt, slots), slots


@pytest.mark.parametrize("arch", ARCHS, ids=lambda a: a.id)
def test_bf16_checkpoint_equals_the_bf16_gguf_and_transformers(arch: TinyArch, tmp_path):
    model = arch.hf_model(seed=2)
    ckpt = save_checkpoint(model, str(tmp_path / "ckpt"), torch.bfloat16)
    bf16_round(model)
    gguf = str(tmp_path / "m.gguf")
    arch.write(model, gguf, dense_type=T.BF16, expert_type=T.BF16)
    prompt = _prompt(model)
    for slots in _budgets(model):
        assert _ours(ckpt, prompt, slots) == _ours(gguf, prompt, slots), slots
    # float32 compute on the bf16 weights: transformers' float32 model of the same values
    assert _ours(ckpt, prompt, _budgets(model)[0], exact=True) == _transformers(model, prompt)


@pytest.mark.parametrize("arch", [QWEN3MOE, MIXTRAL], ids=lambda a: a.id)
def test_fp8_block_scaled_checkpoint(arch: TinyArch, tmp_path):
    model = arch.hf_model(seed=2)
    ckpt = str(tmp_path / "ckpt")
    model = save_fp8_checkpoint(model, ckpt)  # transformers on the values the checkpoint holds
    f = CheckpointModel(ckpt)
    try:
        assert f.hf["model.layers.0.self_attn.q_proj.weight"][1].dtype == "F8_E4M3"
        # kept at 1 byte a weight (and a scale per 128) in the cache, computed by the FP8 kernel
        assert f.tensor("blk.0.ffn_down.3.weight").ggml_type == quants.FP8_B128
    finally:
        f.close()
    cfg = model.config
    hidden, ffn = cfg.hidden_size, cfg.moe_intermediate_size if arch is QWEN3MOE else cfg.intermediate_size
    prompt = _prompt(model)
    want = _transformers(model, prompt)
    for slots in _budgets(model):
        eng = Engine(ckpt, EngineOptions(n_slots=slots, ubatch=16))
        try:
            lay = eng.store.layouts[0]
            assert lay.gate_kind == "fp8" and lay.packed_nbytes == 3 * hidden * ffn * 132 // 128
            assert eng.store.slot_nbytes < 3 * hidden * ffn * 2  # what a bf16 expert took
            gen = eng.generate(prompt, N, Sampler())
            assert eng.cache.used_slots <= slots
        finally:
            eng.close()
        assert gen.tokens == want, slots
    assert _ours(ckpt, prompt, _budgets(model)[0], exact=True) == want


def test_gpt_oss_mxfp4_checkpoint(tmp_path):
    from safetensors.torch import save_file

    model = GPT_OSS.hf_model(seed=3)
    packed = quantize_gpt_oss_experts(model)
    ckpt = save_checkpoint(model, str(tmp_path / "ckpt"), torch.float32)
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if not k.endswith(("gate_up_proj", "down_proj"))}
    for name, (blocks, scales) in packed.items():
        sd[name + "_blocks"], sd[name + "_scales"] = torch.from_numpy(blocks), torch.from_numpy(scales)
    save_file(sd, os.path.join(ckpt, "model.safetensors"))
    gguf = str(tmp_path / "m.gguf")
    write_gpt_oss_from_hf(model, gguf, mxfp4=packed)
    f, g = CheckpointModel(ckpt), GGUFFile(gguf)
    try:  # each expert's fill gives the bytes llama.cpp's converter writes, scales and all
        for w in ("gate", "up", "down"):
            merged = g.read(f"blk.1.ffn_{w}_exps.weight").reshape(n_experts(model.config), -1)
            for e in (0, 5):
                np.testing.assert_array_equal(f.read(f"blk.1.ffn_{w}.{e}.weight"), merged[e])
    finally:
        f.close()
        g.close()
    prompt = _prompt(model)
    for slots in _budgets(model):
        assert _ours(ckpt, prompt, slots) == _ours(gguf, prompt, slots), slots
        assert _ours(ckpt, prompt, slots, exact=True) == _transformers(model, prompt), slots


def test_sharded_checkpoint_and_its_tokenizer(tmp_path):
    model = QWEN3MOE.hf_model(seed=2)
    ckpt = save_checkpoint(model, str(tmp_path / "ckpt"), torch.float32, max_shard_size="300KB")
    assert os.path.exists(os.path.join(ckpt, "model.safetensors.index.json"))
    f = CheckpointModel(ckpt)
    try:
        assert len(f.paths) > 2 and len({t.part for t in f.tensors.values()}) == len(f.paths)
        ours, ref = Tokenizer.from_metadata(f.metadata), Tokenizer.from_metadata(tiny_tokenizer_metadata())
        text = "The quick brown fox, 1234 times! <|im_start|>user"
        assert ours.encode(text) == ref.encode(text) and ours.eos_id == ref.eos_id
        assert ours.chat_template == ref.chat_template
    finally:
        f.close()
    prompt = _prompt(model)
    assert _ours(ckpt, prompt, 3) == _transformers(model, prompt)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return save_checkpoint(QWEN3MOE.hf_model(seed=2), str(tmp_path_factory.mktemp("good") / "ckpt"), torch.float32,
                           max_shard_size="300KB")  # fmt: skip


def _config(d, **changes):
    path = os.path.join(d, "config.json")
    with open(path) as fh:
        cfg = json.load(fh)
    with open(path, "w") as fh:
        json.dump(cfg | changes, fh)


def _truncate(d):
    name = sorted(n for n in os.listdir(d) if n.endswith(".safetensors"))[-1]
    path = os.path.join(d, name)
    os.truncate(path, os.path.getsize(path) - 100)


@pytest.mark.parametrize(
    "damage,says",
    [
        (lambda d: os.remove(os.path.join(d, "config.json")), "config.json is missing"),
        (lambda d: _config(d, architectures=["FooForCausalLM"]), "'FooForCausalLM'"),
        (
            lambda d: os.remove(os.path.join(d, sorted(n for n in os.listdir(d) if n.endswith(".safetensors"))[1])),
            "is missing",
        ),
        (_truncate, "download it again"),
    ],
    ids=["no-config", "unknown-arch", "missing-shard", "truncated"],
)
def test_bad_directories_are_one_line_errors(good, tmp_path, capsys, damage, says):
    d = str(tmp_path / "bad")
    shutil.copytree(good, d)
    damage(d)
    capsys.readouterr()
    rc = main(["run", "-m", d, "-p", "hello", "-n", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert says in err, err
