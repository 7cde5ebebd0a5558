"""Tiny Hugging Face checkpoint directories for tests/test_checkpoint.py: a transformers model saved with
save_pretrained (bf16, f32), or its weights written as FP8 with 128x128 block scales the way DeepSeek-V3's
checkpoints hold them, or GPT-OSS's experts as MXFP4 blocks/scales; with a tokenizer.json of the tiny BPE
vocabulary the GGUF writers use."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from moestream.formats import tokenizer as tk
from tests.hf_gguf import tiny_tokenizer_metadata

FP8_BLOCK = 128


def write_tokenizer(directory: str) -> None:
    """tokenizer.json (+ tokenizer_config.json with the chat template) of the tiny BPE vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    md = tiny_tokenizer_metadata()
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    vocab = {t: i for i, (t, ty) in enumerate(zip(tokens, types, strict=True)) if ty == tk.NORMAL}
    merges = [tuple(m.split(" ")) for m in md["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab, merges))
    split = pre_tokenizers.Split(Regex(tk.QWEN2_SPLIT), behavior="isolated")
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([t for t, ty in zip(tokens, types, strict=True) if ty != tk.NORMAL])
    tok.save(os.path.join(directory, "tokenizer.json"))
    conf = {"chat_template": md["tokenizer.chat_template"], "eos_token": tokens[md["tokenizer.ggml.eos_token_id"]],
            "bos_token": tokens[md["tokenizer.ggml.bos_token_id"]], "add_bos_token": False}  # fmt: skip
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as fh:
        json.dump(conf, fh)


def save_checkpoint(model: Any, directory: str, dtype: torch.dtype = torch.bfloat16, **kw: Any) -> str:
    """save_pretrained in `dtype`, with the tiny tokenizer."""
    model.to(dtype).save_pretrained(directory, **kw)
    model.to(torch.float32)
    write_tokenizer(directory)
    return directory


def fp8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [n, k] -> (float8_e4m3fn [n, k], float32 scale_inv [ceil(n/128), ceil(k/128)]): each block's
    largest magnitude at 448, as DeepSeek's checkpoints store it (weight = fp8 * scale_inv)."""
    n, k = w.shape
    bn, bk = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    pad = torch.zeros(bn * FP8_BLOCK, bk * FP8_BLOCK)
    pad[:n, :k] = w.float()
    blocks = pad.view(bn, FP8_BLOCK, bk, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / 448.0
    q = (blocks / scale_inv[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(bn * FP8_BLOCK, bk * FP8_BLOCK)[:n, :k].contiguous(), scale_inv.float()


def fp8_dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """What the checkpoint holds: each weight fp8 * scale in float32, as moestream's FP8 kernel takes it."""
    n, k = q.shape
    s = scale_inv.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return q.float() * s


def save_fp8_checkpoint(
    model: Any, directory: str, skip: tuple[str, ...] = ("embed_tokens", "lm_head", "gate.")
) -> Any:
    """Every 2-D weight of the saved checkpoint but the embedding, head and routers as FP8 with block scales
    (the rest bf16); returns the reference: transformers' float32 model of the values the checkpoint holds
    (in float32, as moestream's FP8 kernel computes them), loaded from a twin directory of dequantized weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model.to(torch.bfloat16).save_pretrained(directory)
    model.to(torch.float32)
    path = os.path.join(directory, "model.safetensors")
    fp8, plain = {}, {}
    for name, t in load_file(path).items():
        if t.ndim == 2 and not any(s in name for s in skip):
            q, s = fp8_quantize(t)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            plain[name] = fp8_dequantize(q, s)
        else:
            fp8[name], plain[name] = t, t.float()
    twin = directory + "-dequantized"
    shutil.copytree(directory, twin)
    save_file(plain, os.path.join(twin, "model.safetensors"), metadata={"format": "pt"})
    save_file(fp8, path, metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json")) as fh:
        cfg = json.load(fh)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}  # fmt: skip
    with open(os.path.join(directory, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    write_tokenizer(directory)
    ref = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    ref.config._attn_implementation = model.config._attn_implementation
    return ref


def bf16_round(model: Any) -> Any:
    """The model's weights rounded to bf16 (what a bf16 checkpoint of it holds), in float32."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.data.to(torch.bfloat16).float())
    return model


def np_f32(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().numpy()
