"""Models from the Hugging Face Hub: `moestream pull REPO[:QUANT]` and `-m hf:REPO[:QUANT]`.

The files are fetched by the huggingface_hub client into its shared cache ($HF_HOME, $HF_HUB_CACHE), with
its progress bars, retries, token ($HF_TOKEN) and offline mode ($HF_HUB_OFFLINE=1); `quant.py` says which
files a quant name means, `pull.py` fetches and checks them, `cached.py` lists what the cache holds. Only
this package imports huggingface_hub, and only when a Hub model is asked for.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PREFIX = "hf:"
_REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


class HubModel(str):
    """A model option given as hf:OWNER/NAME[:QUANT] (the text without the prefix): the command line's parser
    returns it, and main() fetches it once the whole command line is parsed."""


@dataclass(frozen=True)
class Spec:
    repo: str
    quant: str | None  # None: llama.cpp's default (Q4_K_M, Q8_0, else the first model file)

    def __str__(self) -> str:
        return self.repo + (f":{self.quant}" if self.quant else "")


def parse_spec(text: str) -> Spec:
    """OWNER/NAME[:QUANT], with or without the hf: prefix; ValueError says what is wrong."""
    body = text[len(PREFIX) :] if text.startswith(PREFIX) else text
    repo, _, quant = body.partition(":")
    if not _REPO.fullmatch(repo) or ".." in repo or (_ and not re.fullmatch(r"[\w.-]+", quant)):
        raise ValueError(f"{text!r} is not a Hub model; write OWNER/NAME or OWNER/NAME:QUANT, e.g. {EXAMPLE}")
    return Spec(repo, quant or None)


EXAMPLE = "unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M"
