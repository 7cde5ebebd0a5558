"""Which GGUF files of a Hub repository a quant name means, as llama.cpp's `-hf REPO:QUANT` picks them.

llama.cpp (common/download.cpp, find_best_model): the quant is matched case-insensitively against the file
paths, followed by `.` or `-` (so `Q4_K` does not pick `Q4_K_M`); without a quant, Q4_K_M, then Q8_0, then
the first model file. Side files (mmproj, imatrix, draft heads) are not models. A split model is named by its
first part, and all its parts are taken, wherever they lie (unsloth keeps them in a folder named after the
quant). Paths are compared sorted, so the pick does not depend on the order the Hub lists them in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")
NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
_SPLIT = re.compile(r"(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})", re.IGNORECASE)
_TAG = re.compile(r"[-.](?P<tag>[A-Z0-9_]+)$", re.IGNORECASE)


@dataclass(frozen=True)
class SplitInfo:
    prefix: str  # the path without .gguf and without the part suffix
    index: int  # 1-based, as in the names
    count: int
    tag: str  # the quant the name ends with, upper case ("" if none)


def split_info(path: str) -> SplitInfo:
    stem = path[: -len(".gguf")] if path.lower().endswith(".gguf") else path
    index = count = 1
    m = _SPLIT.fullmatch(stem)
    if m:
        stem, index, count = m["prefix"], int(m["no"]), int(m["count"])
    t = _TAG.search(stem.rsplit("/", 1)[-1])
    return SplitInfo(stem, index, count, t["tag"].upper() if t else "")


def is_model(path: str) -> bool:
    name = path.rsplit("/", 1)[-1].lower()
    return name.endswith(".gguf") and not any(word in name for word in NOT_MODELS)


def _first_parts(paths: list[str]) -> list[str]:
    """The model files that name a model: whole files and the first part of each split set."""
    return [p for p in sorted(paths) if is_model(p) and split_info(p).index == 1]


def matches(path: str, quant: str) -> bool:
    # not preceded by a letter or digit either: Q4_XS must not pick IQ4_XS
    return re.search(rf"(?<![a-z0-9]){re.escape(quant)}[.-]", path, re.IGNORECASE) is not None


def find_model(paths: list[str], quant: str | None) -> str | None:
    """The path of the model the quant names (None: the default), or None if there is none."""
    firsts = _first_parts(paths)
    for q in [quant] if quant else DEFAULT_QUANTS:
        for p in firsts:
            if matches(p, q):
                return p
    if not quant and firsts:
        return firsts[0]
    return None


def model_files(paths: list[str], first: str) -> list[str]:
    """Every part of the model whose first part (or only file) is `first`, in order."""
    info = split_info(first)
    if info.count == 1:
        return [first]
    same = [p for p in paths if (s := split_info(p)).prefix == info.prefix and s.count == info.count]
    return sorted(same, key=lambda p: split_info(p).index)


def quants(paths: list[str]) -> list[str]:
    """The quants the repository's model files are named with (a file without one: its name), sorted."""
    return sorted({split_info(p).tag or p.rsplit("/", 1)[-1] for p in _first_parts(paths)})
