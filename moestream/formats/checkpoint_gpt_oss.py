"""GPT-OSS checkpoints (GptOssForCausalLM) -> llama.cpp's gpt-oss tensors, as its converter (GptOssModel)
maps them.

The experts are [E, ...] tensors, each expert's slice a byte range. gate_up_proj interleaves its rows
(gate even, up odd), so ffn_gate.e and ffn_up.e are both expert e's whole gate_up range, each converted to
its half on the fill: read twice, the price of keeping the cache's three-segment experts. In the released
MXFP4 checkpoints the blocks hold pairs of codes per byte and the e8m0 scales lie in a tensor of their own
(kept in memory: a sixteenth of the blocks' bytes); the fill rebuilds GGUF's MXFP4 blocks (the scale byte,
then value j in the low nibble of byte j and value j + 16 in its high one), so the native MXFP4 kernels
compute them at their 4 bits. A bf16/f32 checkpoint's experts are stored [in, out]: transposed on the fill.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T

from moestream.errors import ModelFileError
from moestream.formats.checkpoint_arch import ELEM, TYPES, Config, _attention, _common, _ends, weight


def _mxfp4(raw: np.ndarray, scales: np.ndarray, rows: int, parity: int | None) -> np.ndarray:
    """Checkpoint blocks [rows, G, 16] of one expert (+ its scales [rows, G]) -> GGUF MXFP4 bytes, the even
    (parity 0) or odd (1) rows only, or all of them (None)."""
    blocks = raw.reshape(rows, -1, 16)
    if parity is not None:
        blocks, scales = blocks[parity::2], scales[parity::2]
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([scales[..., None], qs], axis=-1).astype(np.uint8).reshape(-1)


def _float_rows(raw: np.ndarray, elem: int, shape: tuple[int, int], parity: int | None) -> np.ndarray:
    """One expert's [in, out] float matrix -> [out, in] rows (the even or odd outputs only, or all)."""
    w = raw.view({2: np.uint16, 4: np.uint32}[elem]).reshape(shape)
    if parity is not None:
        w = w[:, parity::2]
    return np.ascontiguousarray(w.T).view(np.uint8).reshape(-1)


def _experts_mxfp4(m: Any, i: int, n_experts: int, hidden: int, ffn: int) -> None:
    ex = f"model.layers.{i}.mlp.experts."
    for proj, n, k in (("gate_up_proj", 2 * ffn, hidden), ("down_proj", hidden, ffn)):
        _, st = m.source(ex + proj + "_blocks")
        want = (n_experts, n, k // 32, 16)
        if st.shape != want or st.dtype != "U8":
            raise ModelFileError(f"{m.path}: {st.name} is {list(st.shape)} {st.dtype}, expected {list(want)} U8")
        scales = m.read_source(ex + proj + "_scales")
        if scales.size != n_experts * n * (k // 32):
            raise ModelFileError(f"{m.path}: {ex}{proj}_scales does not hold one byte per 32 weights")
        scales = scales.reshape(n_experts, n, k // 32)
        nbytes = n * k // 2
        halves = (("gate", 0, ffn), ("up", 1, ffn)) if proj == "gate_up_proj" else (("down", None, hidden),)
        for e in range(n_experts):
            for name, parity, rows in halves:

                def convert(raw, s=scales[e], n=n, parity=parity):  # noqa: E306
                    return _mxfp4(raw, s, n, parity)

                m.add(f"blk.{i}.ffn_{name}.{e}.weight", int(T.MXFP4), (rows, k), ex + proj + "_blocks", convert,
                      offset=e * nbytes, nbytes=nbytes)  # fmt: skip


def _experts_float(m: Any, i: int, n_experts: int, hidden: int, ffn: int) -> None:
    ex = f"model.layers.{i}.mlp.experts."
    for proj, k, n in (("gate_up_proj", hidden, 2 * ffn), ("down_proj", ffn, hidden)):
        _, st = m.source(ex + proj)
        if st.dtype not in TYPES or st.shape != (n_experts, k, n):
            raise ModelFileError(f"{m.path}: {st.name} is {list(st.shape)} {st.dtype}, expected "
                                 f"[{n_experts}, {k}, {n}] BF16, F16 or F32")  # fmt: skip
        t = TYPES[st.dtype]
        nbytes = k * n * ELEM[t]
        halves = (("gate", 0, ffn), ("up", 1, ffn)) if proj == "gate_up_proj" else (("down", None, hidden),)
        for e in range(n_experts):
            for name, parity, rows in halves:

                def convert(raw, elem=ELEM[t], shape=(k, n), parity=parity):  # noqa: E306
                    return _float_rows(raw, elem, shape, parity)

                m.add(f"blk.{i}.ffn_{name}.{e}.weight", t, (rows, k), ex + proj, convert, offset=e * nbytes,
                      nbytes=nbytes)  # fmt: skip


def _bias_halves(m: Any, i: int, n_experts: int, ffn: int) -> None:
    hf = f"model.layers.{i}.mlp.experts.gate_up_proj_bias"
    _, st = m.source(hf)
    if st.dtype not in TYPES or st.shape != (n_experts, 2 * ffn):
        raise ModelFileError(f"{m.path}: {hf} is {list(st.shape)} {st.dtype}, expected [{n_experts}, {2 * ffn}]")
    elem = ELEM[TYPES[st.dtype]]
    for name, parity in (("gate", 0), ("up", 1)):

        def convert(raw, parity=parity, elem=elem):  # noqa: E306
            return np.ascontiguousarray(raw.reshape(n_experts, 2 * ffn, elem)[:, parity::2]).reshape(-1)

        m.add(f"blk.{i}.ffn_{name}_exps.bias", TYPES[st.dtype], (n_experts, ffn), hf, convert)


def gpt_oss(m: Any) -> tuple[str, dict[str, Any]]:
    c = Config(m.config, m.path)
    rope, a = c.rope(), "gpt-oss."
    E, hidden, ffn = c.experts(), c.int("hidden_size"), c.int("intermediate_size")
    md = _common("gpt-oss", c) | {a + "expert_count": E, a + "expert_feed_forward_length": ffn,
                                  a + "attention.sliding_window": c.int("sliding_window")}  # fmt: skip
    if rope.get("rope_type", rope.get("type")) == "yarn":
        orig = int(rope.get("original_max_position_embeddings", 4096))
        md |= {a + "rope.scaling.type": "yarn", a + "rope.scaling.factor": float(rope.get("factor", 1.0)),
               a + "rope.scaling.original_context_length": orig}  # fmt: skip
    _ends(m, c)
    for i in range(c.int("num_hidden_layers")):
        hf, p = f"model.layers.{i}.", f"blk.{i}."
        weight(m, p + "attn_norm.weight", hf + "input_layernorm.weight")
        _attention(m, i)
        weight(m, p + "attn_sinks.weight", hf + "self_attn.sinks")
        weight(m, p + "post_attention_norm.weight", hf + "post_attention_layernorm.weight")
        weight(m, p + "ffn_gate_inp.weight", hf + "mlp.router.weight")
        weight(m, p + "ffn_gate_inp.bias", hf + "mlp.router.bias")
        if m.has_source(hf + "mlp.experts.gate_up_proj_blocks"):
            _experts_mxfp4(m, i, E, hidden, ffn)
        else:
            _experts_float(m, i, E, hidden, ffn)
        _bias_halves(m, i, E, ffn)
        weight(m, p + "ffn_down_exps.bias", hf + "mlp.experts.down_proj_bias")
    return "gpt-oss", md
