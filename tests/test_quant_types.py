"""The low-bit types (formats/lowbit.py): decoders bit for bit against gguf's, the slow path that widens them
to bf16 once per cache fill, and a model whose experts come in them running the same streamed as resident."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from moestream.compute import linear, native
from moestream.engine.engine import Engine
from moestream.engine.model_file import open_model
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler
from moestream.formats import lowbit, quants
from moestream.formats.gguf_file import GGUFFile
from moestream.formats.gguf_write import array_tensor, write_gguf
from tests.hf_gguf import QWEN3MOE, one_torch_thread, random_tokens

LOWBIT_TYPES = [T(t) for t in lowbit.DECODERS]

one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)


def reference(raw: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> np.ndarray:
    return np.asarray(gq.dequantize(raw.reshape(shape[0], -1), T(ggml_type)), dtype=np.float32).reshape(shape)


def _same_bits(a: np.ndarray, b: np.ndarray) -> None:
    """Equal as bit patterns: -0.0 and 0.0 differ, as two NaNs with different payloads would."""
    assert a.shape == b.shape and a.dtype == b.dtype == np.float32
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("ggml_type", LOWBIT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_blocks", [1, 3, 300])
def test_decoder_is_gguf_bit_for_bit(ggml_type, n_blocks):
    block = quants.BLOCK_SIZES[ggml_type][0]
    rng = np.random.default_rng(int(ggml_type) * 1000 + n_blocks)
    raw = quants.random_gguf(ggml_type, n_blocks * block, rng)
    shape = (n_blocks, block)
    _same_bits(quants.dequantize(raw, ggml_type, shape), reference(raw, ggml_type, shape))


@pytest.mark.parametrize("ggml_type", LOWBIT_TYPES, ids=lambda t: t.name)
def test_every_bit_pattern_of_a_block_decodes_as_gguf(ggml_type):
    """Blocks whose code bytes run through all 256 values at every position (scales kept finite)."""
    block, size = quants.BLOCK_SIZES[ggml_type]
    b = np.tile(np.arange(256, dtype=np.uint8)[:, None], (1, size))
    b = (b + np.arange(size, dtype=np.uint8) * 37).astype(np.uint8)  # every column sees every byte value
    lowbit.fix_random_blocks(ggml_type, b, np.linspace(-2.0, 2.0, 256))
    raw = b.reshape(-1)
    _same_bits(quants.dequantize(raw, ggml_type, (256, block)), reference(raw, ggml_type, (256, block)))


def test_codebooks_come_from_gguf():
    assert lowbit.IQ2XXS_GRID.shape == (256, 8) and lowbit.IQ1S_GRID.shape == (2048, 8)
    assert set(np.unique(lowbit.IQ1S_GRID)) == {-1.0, 0.0, 1.0}
    # a sign index's eighth sign makes the count of negatives even (ggml's ksigns)
    assert ((lowbit.KSIGNS < 0).sum(axis=1) % 2 == 0).all()
    assert lowbit.IQ4NL_VALUES.tolist() == list(gq.IQ4_NL.kvalues)


def test_bf16_rounding_is_torchs():
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.standard_normal(10000).astype(np.float32) * 1e3,
            np.array([0.0, -0.0, np.inf, -np.inf, 3.3895314e38, 1e-40, -1e-45], np.float32),
            # halfway cases, which round to even
            (np.arange(1000, dtype=np.uint32) << 16 | 0x8000).view(np.float32),
        ]
    )
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(linear.f32_to_bf16_bits(x), want)
    nan_bits = linear.f32_to_bf16_bits(np.array([np.nan], np.float32)).astype(np.uint32) << 16
    assert np.isnan(nan_bits.view(np.float32)).all()


@pytest.mark.parametrize("ggml_type", [T(t) for t in sorted(linear.DECODED_TYPES)], ids=lambda t: t.name)
def test_slow_path_packs_the_decoded_weight(ggml_type, monkeypatch):
    """An expert of a type without a kernel is widened once: bf16 of the reference decode (float32 exact).
    Every type takes this path where the lane kernels cannot run (no VNNI; here: switched off)."""
    monkeypatch.setattr(native, "lane_ok", lambda: False)
    n, k = 96, 512
    rng = np.random.default_rng(int(ggml_type))
    raw = quants.random_gguf(ggml_type, n * k, rng)
    w = reference(raw, ggml_type, (n, k))
    assert linear.slow_path(ggml_type, n, k, False)
    assert linear.packed_nbytes(ggml_type, n, k, False) == n * k * 2  # what a slot of this expert holds
    # into a slot-like buffer, a few rows per decode step (DECODE_ROWS_BYTES small)
    out = linear.aligned_empty(n * k * 2 + 64)
    out.fill_(0xAB)
    lin = linear.pack_into(raw, ggml_type, n, k, out, False)
    assert lin.kind == "bf16" and lin.weight.data_ptr() == out.data_ptr()
    assert (out[n * k * 2 :] == 0xAB).all()
    torch.testing.assert_close(lin.dense(), torch.from_numpy(w).to(torch.bfloat16).float(), rtol=0, atol=0)
    exact = linear.from_gguf(raw, ggml_type, n, k, True)
    assert exact.kind == "f32"
    _same_bits(exact.dense().numpy(), w)
    x = torch.from_numpy(rng.standard_normal((3, k)).astype(np.float32))
    torch.testing.assert_close(exact(x), x @ torch.from_numpy(w).T, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()))


def test_slow_path_decodes_in_slices(monkeypatch):
    """Bounded temporaries: a matrix bigger than one slice comes out the same, slice edges included."""
    n, k = 37, 256
    raw = quants.random_gguf(T.IQ3_S, n * k, np.random.default_rng(3))
    whole = linear.from_gguf(raw, T.IQ3_S, n, k, True).dense()
    monkeypatch.setattr(linear, "DECODE_ROWS_BYTES", 5 * k * 4)  # 5 rows at a time
    torch.testing.assert_close(linear.from_gguf(raw, T.IQ3_S, n, k, True).dense(), whole, rtol=0, atol=0)


# ---- a model whose experts are of a slow type -----------------------------------------------------------


def _scaled_blocks(ggml_type: int, n_elems: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks whose decoded weights have about `std` (every type is linear in its scale)."""
    if ggml_type not in lowbit.DECODERS:  # Q5_0 / Q5_1: gguf's own encoder on normal weights
        w = (rng.standard_normal(n_elems) * std).astype(np.float32).reshape(-1, 256)
        return np.asarray(gq.quantize(w, T(ggml_type)), np.uint8).reshape(-1)
    block, size = quants.BLOCK_SIZES[ggml_type]
    b = rng.integers(0, 256, (n_elems // block, size), dtype=np.uint8)
    lowbit.fix_random_blocks(ggml_type, b, np.ones(b.shape[0]))
    got = quants.dequantize(b.reshape(-1), ggml_type, (n_elems,)).std()
    lowbit.fix_random_blocks(ggml_type, b, np.full(b.shape[0], std / got))
    return b.reshape(-1)


def _with_experts(src: str, dst: str, experts: dict[str, tuple[int, np.ndarray]]) -> None:
    """Copy a GGUF with the named tensors replaced by (type, bytes) of the same shape."""
    f = GGUFFile(src)
    try:
        md = {k: v for k, v in f.metadata.items() if not k.startswith("GGUF.") and k != "general.alignment"}
        specs = []
        for name, info in f.tensors.items():
            t, raw = experts.get(name, (info.ggml_type, f.read(name)))
            specs.append(array_tensor(name, t, info.shape, raw))
        write_gguf(dst, f.arch, md, specs, progress=False)
    finally:
        f.close()


@pytest.fixture(scope="module")
def float_model(tmp_path_factory):
    model = QWEN3MOE.hf_model(seed=5)
    path = str(tmp_path_factory.mktemp("lowbit") / "f32.gguf")
    QWEN3MOE.write(model, path)
    return path, model.config


def _low_and_wide(src: str, tmp_path, ggml_type: int) -> tuple[str, str]:
    """Copies of `src` with its experts as random `ggml_type` blocks, and as those blocks widened to BF16."""
    rng = np.random.default_rng(int(ggml_type))
    low, wide = {}, {}
    f = GGUFFile(src)
    try:
        for name, info in f.tensors.items():
            if "_exps." in name:
                raw = _scaled_blocks(ggml_type, int(np.prod(info.shape)), 0.02, rng)
                low[name] = (int(ggml_type), raw)
                w = quants.dequantize(raw, ggml_type, info.shape)
                wide[name] = (int(T.BF16), linear.f32_to_bf16_bits(w))
    finally:
        f.close()
    p_low, p_wide = str(tmp_path / "low.gguf"), str(tmp_path / "wide.gguf")
    _with_experts(src, p_low, low)
    _with_experts(src, p_wide, wide)
    return p_low, p_wide


def _run(paths_slots: list[tuple[str, int]], prompt: list[int]) -> list[tuple[torch.Tensor, list[int], float]]:
    """(prompt logits, 10 greedy tokens, hit rate) of each (file, expert slots)."""
    out = []
    for path, slots in paths_slots:
        eng = Engine(path, EngineOptions(n_slots=slots, ubatch=16))
        try:
            with torch.inference_mode():
                logits = eng.forward(prompt, 0, all_logits=True)
            assert torch.isfinite(logits).all()
            eng.kv.truncate(0)
            gen = eng.generate(prompt, 10, Sampler())
            out.append((logits, gen.tokens, gen.stats.hit_rate))
        finally:
            eng.close()
    return out


@pytest.mark.parametrize("ggml_type", [T.IQ2_XXS, T.IQ3_S, T.IQ1_M], ids=lambda t: t.name)
def test_model_with_slow_type_experts(float_model, tmp_path, capfd, ggml_type):
    """Experts in `ggml_type`: the same logits as a file holding those experts already widened to BF16, a
    note on stderr naming the type, and the same greedy tokens streamed through 2 slots as all resident."""
    src, cfg = float_model
    p_low, p_wide = _low_and_wide(src, tmp_path, ggml_type)
    capfd.readouterr()
    m = open_model(p_low)
    m.close()
    note = capfd.readouterr().err.strip().splitlines()
    assert note == [f"note: {ggml_type.name} tensors are decoded to bf16 when loaded (slower than the native kernels)"]
    slot_low = m.store.slot_nbytes
    m = open_model(p_wide)
    m.close()
    assert capfd.readouterr().err == ""
    assert slot_low == m.store.slot_nbytes  # a slot holds the widened expert

    prompt = random_tokens(30, cfg.vocab_size, seed=4)
    runs = _run([(p_wide, 64), (p_low, 64), (p_low, cfg.num_experts_per_tok)], prompt)
    (l_wide, t_wide, _), (l_low, t_low, hit_all), (l_stream, t_stream, hit_two) = runs
    torch.testing.assert_close(l_low, l_wide, rtol=0, atol=0)
    torch.testing.assert_close(l_stream, l_wide, rtol=0, atol=0)
    assert t_low == t_wide == t_stream
    assert hit_two < hit_all


@pytest.mark.skipif(not native.lane_ok(), reason="needs AVX-512 VNNI and the native library")
@pytest.mark.parametrize("ggml_type", [T.Q2_K, T.Q3_K, T.IQ4_XS, T.Q5_0, T.Q5_1, T.MXFP4], ids=lambda t: t.name)
def test_model_with_native_low_bit_experts(float_model, tmp_path, capfd, ggml_type):
    """Q2_K, Q3_K, IQ4_XS, Q5_0, Q5_1 and MXFP4 experts computed at their own bits: no note, slots of about
    their GGUF size (exactly it for the last three), the logits of the widened file up to the int8 rounding of
    the activations, and streaming changes nothing."""
    src, cfg = float_model
    p_low, p_wide = _low_and_wide(src, tmp_path, ggml_type)
    capfd.readouterr()
    m = open_model(p_low)
    m.close()
    assert capfd.readouterr().err == ""
    f = GGUFFile(p_low)
    try:
        gguf_bytes = max(t.nbytes for n, t in f.tensors.items() if "_exps." in n) // cfg.num_experts
    finally:
        f.close()
    assert m.store.slot_nbytes <= 4 * gguf_bytes  # three projections at about their own bits, not bf16's
    if ggml_type in (T.Q5_0, T.Q5_1, T.MXFP4):
        assert m.store.slot_nbytes == -(-(3 * gguf_bytes + 3 * 64) // 4096) * 4096

    prompt = random_tokens(30, cfg.vocab_size, seed=4)
    runs = _run([(p_wide, 64), (p_low, 64), (p_low, cfg.num_experts_per_tok)], prompt)
    (l_wide, _, _), (l_low, t_low, hit_all), (l_stream, t_stream, hit_two) = runs
    # int8 rounding of the activations: ~0.5% a position; at most one position may be off by more, where a
    # router near-tie picks another expert (MXFP4's random experts have one at position 19)
    per_position = (l_low - l_wide).norm(dim=-1) / l_wide.norm(dim=-1)
    assert float(per_position.median()) < 1e-2 and int((per_position > 2e-2).sum()) <= 1
    torch.testing.assert_close(l_stream, l_low, rtol=0, atol=0)
    assert t_low == t_stream
    assert hit_two < hit_all
