"""Damaged model files end in one ModelFileError naming the key or tensor: metadata of the wrong kind,
missing, non-finite or inconsistent; tensors whose shape disagrees with the metadata or that hold NaN."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler
from moestream.errors import ModelFileError
from moestream.formats.gguf_file import GGUFFile
from moestream.models.qwen3moe import Qwen3MoeConfig
from moestream.models.qwen35moe import Qwen35MoeConfig
from moestream.synth.shapes import write_synth
from tests.hf_gguf import rewrite_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("files") / "tiny.gguf")
    write_synth("tiny", "Q4_0", path, layers=2, progress=False)
    return path


@pytest.fixture(scope="module")
def header(tiny) -> tuple[dict, dict]:
    f = GGUFFile(tiny)
    md, shapes = dict(f.metadata), {n: t.shape for n, t in f.tensors.items()}
    f.close()
    return md, shapes


def _q35_metadata() -> tuple[dict, dict]:
    """A consistent qwen35moe header (as the converter writes for a tiny model) without a file."""
    a = "qwen35moe"
    md = {
        f"{a}.block_count": 4, f"{a}.embedding_length": 256, f"{a}.attention.head_count": 4,
        f"{a}.attention.head_count_kv": 2, f"{a}.attention.key_length": 64, f"{a}.rope.dimension_count": 16,
        f"{a}.expert_count": 8, f"{a}.expert_used_count": 2, f"{a}.expert_feed_forward_length": 256,
        f"{a}.expert_shared_feed_forward_length": 256, f"{a}.ssm.conv_kernel": 4, f"{a}.ssm.state_size": 64,
        f"{a}.ssm.group_count": 2, f"{a}.ssm.time_step_rank": 4, f"{a}.ssm.inner_size": 256,
        f"{a}.attention.recurrent_layers": [True, False, True, False],
    }  # fmt: skip
    return md, {"token_embd.weight": (1000, 256)}


def test_the_good_headers_parse(header):
    cfg = Qwen3MoeConfig.from_metadata(*header)
    assert cfg.n_layers == 2 and cfg.vocab_size == header[1]["token_embd.weight"][0]
    q35 = Qwen35MoeConfig.from_metadata(*_q35_metadata())
    assert (q35.v_head_dim, q35.rot_dim, q35.recurrent) == (64, 16, [True, False, True, False])


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("attention.layer_norm_rms_epsilon", math.nan, "finite number > 0"),
        ("attention.layer_norm_rms_epsilon", -1e-6, "finite number > 0"),
        ("rope.freq_base", 0.0, "finite number > 0"),
        ("rope.freq_base", math.inf, "finite number > 0"),
        ("block_count", "2", "the string '2', not a number"),
        ("block_count", 2.5, "not a whole number"),
        ("block_count", True, "not a number"),
        ("embedding_length", [256, 256], "an array of 2, not a number"),
        ("attention.head_count", [4, 8], "differs between layers"),
        ("attention.head_count", 0, "at least 1"),
        ("attention.head_count_kv", 3, "does not divide"),
        ("expert_count", None, "is missing"),
        ("expert_used_count", 99, "there are"),
        ("expert_weights_norm", "yes", "not true/false"),
    ],
)
def test_bad_qwen3moe_metadata_is_named(header, key, value, message):
    md, shapes = header
    md = dict(md)
    if value is None:
        del md[f"qwen3moe.{key}"]
    else:
        md[f"qwen3moe.{key}"] = value
    with pytest.raises(ModelFileError, match=message) as e:
        Qwen3MoeConfig.from_metadata(md, shapes, "m.gguf")
    assert str(e.value).startswith(f"m.gguf: metadata qwen3moe.{key} ") and "\n" not in str(e.value)


def test_head_size_must_come_from_somewhere(header):
    md, shapes = header
    md = {k: v for k, v in md.items() if k != "qwen3moe.attention.key_length"}
    md["qwen3moe.attention.head_count"] = 3
    md["qwen3moe.attention.head_count_kv"] = 1
    with pytest.raises(ModelFileError, match="key_length is missing and embedding_length"):
        Qwen3MoeConfig.from_metadata(md, shapes)


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("nextn_predict_layers", 4, "trunk would be empty"),
        ("attention.recurrent_layers", [True, False], "each of the 4 layers"),
        ("attention.recurrent_layers", "yes", "each of the 4 layers"),
        ("ssm.group_count", 3, "does not divide"),
        ("ssm.inner_size", 250, "not a multiple"),
        ("rope.dimension_count", 128, "at most the head size"),
        ("ssm.conv_kernel", -4, "at least 1"),
        ("expert_shared_feed_forward_length", math.nan, "not a whole number"),
    ],
)
def test_bad_qwen35moe_metadata_is_named(key, value, message):
    md, shapes = _q35_metadata()
    md[f"qwen35moe.{key}"] = value
    with pytest.raises(ModelFileError, match=message):
        Qwen35MoeConfig.from_metadata(md, shapes)


def _refused(path: str) -> str:
    with pytest.raises(ModelFileError) as e:
        Engine(path, EngineOptions(n_slots=8))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_norm_of_the_wrong_length_is_refused_before_use(tiny, header, tmp_path):
    H = header[1]["blk.0.attn_norm.weight"][0]
    bad = str(tmp_path / "norm.gguf")
    rewrite_gguf(tiny, bad, tensors={"blk.1.ffn_norm.weight": np.ones(H - 1, np.float32)})
    msg = _refused(bad)
    assert f"tensor blk.1.ffn_norm.weight has shape [{H - 1}]" in msg and f"makes it [{H}]" in msg
    rewrite_gguf(tiny, bad, tensors={"blk.0.attn_q_norm.weight": np.ones(0, np.float32)})
    msg = _refused(bad)  # the file's parser refuses a zero dimension before any shape is compared
    assert "blk.0.attn_q_norm.weight" in msg and "dimension of 0" in msg


def test_a_router_of_the_wrong_shape_is_refused(tiny, header, tmp_path):
    E, H = header[1]["blk.0.ffn_gate_inp.weight"]
    bad = str(tmp_path / "router.gguf")
    rewrite_gguf(tiny, bad, tensors={"blk.0.ffn_gate_inp.weight": np.zeros((E, H // 2), np.float32)})
    assert f"blk.0.ffn_gate_inp.weight has shape [{E}, {H // 2}]" in _refused(bad)


def test_non_finite_weights_are_refused(tiny, header, tmp_path):
    H = header[1]["output_norm.weight"][0]
    w = np.ones(H, np.float32)
    w[3] = np.nan
    bad = str(tmp_path / "nan.gguf")
    rewrite_gguf(tiny, bad, tensors={"output_norm.weight": w})
    assert "output_norm.weight holds NaN or infinite values" in _refused(bad)


def test_metadata_of_the_wrong_kind_in_a_file(tiny, tmp_path):
    bad = str(tmp_path / "kind.gguf")
    rewrite_gguf(tiny, bad, metadata={"qwen3moe.block_count": "two"})
    assert "metadata qwen3moe.block_count is the string 'two', not a number" in _refused(bad)
    rewrite_gguf(tiny, bad, metadata={"qwen3moe.attention.layer_norm_rms_epsilon": float("nan")})
    assert "layer_norm_rms_epsilon is nan; it must be a finite number > 0" in _refused(bad)


def test_leading_ones_in_a_shape_are_the_same_shape(tiny, header, tmp_path):
    """A vector stored as [1, n] (ggml [n, 1]) is the vector [n], as llama.cpp reads it."""
    H = header[1]["output_norm.weight"][0]
    f = GGUFFile(tiny)
    norm = f.read("output_norm.weight").view(np.float32).copy()
    f.close()
    ok = str(tmp_path / "ones.gguf")
    rewrite_gguf(tiny, ok, tensors={"output_norm.weight": norm.reshape(1, H)})
    tokens = []
    for path in (tiny, ok):
        eng = Engine(path, EngineOptions(n_slots=16))
        try:
            tokens.append(eng.generate([1, 2, 3], 4, Sampler()).tokens)
        finally:
            eng.close()
    assert tokens[0] == tokens[1]


def test_the_cli_says_it_in_one_line(tiny, tmp_path):
    bad = str(tmp_path / "cli.gguf")
    rewrite_gguf(tiny, bad, metadata={"qwen3moe.rope.freq_base": 0.0})
    r = subprocess.run([sys.executable, "-m", "moestream", "run", "-m", bad, "-p", "hi", "-n", "1"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "metadata qwen3moe.rope.freq_base is 0.0; it must be a finite number > 0" in r.stderr
