"""GPT-OSS checkpoints (GptOssForCausalLM) -> llama.cpp's gpt-oss tensors."""

from __future__ import annotations

from typing import Any


def gpt_oss(m: Any) -> tuple[str, dict[str, Any]]:
    raise NotImplementedError
