"""Expert profiles: (layer, expert) pairs ranked by how often a workload used them.

`moestream profile TRACE -o PROFILE` writes one; the engine pins from it (`load_profile(path).top(n)`),
and `moestream replay --policy pin --profile PROFILE` measures what pinning it would give.

Text format (default), hottest first, ties by (layer, expert):

    # moestream-profile: 1
    # source: "session.trace.csv"       <- metadata, one `# key: JSON value` line each
    # phases: "decode"
    # accesses: 30720
    layer expert count
    12 87 64
    3 5 61
    ...

JSON format (when the path ends in .json): {"moestream-profile": 1, "meta": {...},
"entries": [[layer, expert, count], ...]}.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moestream.analysis.trace import DECODE, VRAM, parse_meta_line
from moestream.errors import MoestreamError

VERSION = 1
HEADER = "layer expert count"


@dataclass
class Profile:
    entries: list[tuple[int, int, int]]  # (layer, expert, count), hottest first
    meta: dict[str, Any] = field(default_factory=dict)

    def ranked(self) -> list[tuple[int, int]]:
        return [(layer, e) for layer, e, _ in self.entries]

    def top(self, n: int) -> list[tuple[int, int]]:
        """The n hottest (layer, expert) pairs over all layers."""
        return self.ranked()[:n]

    def top_per_layer(self, n: int) -> dict[int, list[int]]:
        """The n hottest experts of every layer (for per-layer pins)."""
        out: dict[int, list[int]] = {}
        for layer, e, _ in self.entries:
            mine = out.setdefault(layer, [])
            if len(mine) < n:
                mine.append(e)
        return out

    @property
    def total(self) -> int:
        return sum(c for _, _, c in self.entries)

    def coverage(self, n: int) -> float:
        """Share of the profiled accesses the top n pairs served."""
        t = self.total
        return sum(c for _, _, c in self.entries[:n]) / t if t else 0.0


def build_profile(meta: dict[str, Any], rows: np.ndarray, phases: str = "decode", source: str = "") -> Profile:
    """Count accesses per (layer, expert); phases 'decode' (what decoding speed depends on) or 'all'."""
    if phases not in ("decode", "all"):
        raise MoestreamError(f"phases must be 'decode' or 'all', got {phases!r}")
    rows = rows[rows["source"] != VRAM] if phases == "all" else rows[(rows["phase"] == DECODE)]
    if not len(rows):
        raise MoestreamError(
            "the trace has no decode accesses to profile; record a session that generates tokens, or use --phases all"
        )
    n_experts = int(meta.get("experts") or int(rows["expert"].max()) + 1)
    keys = rows["layer"].astype(np.int64) * n_experts + rows["expert"]
    uniq, counts = np.unique(keys, return_counts=True)
    order = np.lexsort((uniq, -counts))
    entries = [
        (k // n_experts, k % n_experts, c) for k, c in zip(uniq[order].tolist(), counts[order].tolist(), strict=True)
    ]
    pmeta = {"source": source, "phases": phases, "accesses": int(counts.sum())}
    for key in ("model", "layers", "experts", "top_k"):
        if key in meta:
            pmeta[key] = meta[key]
    return Profile(entries, pmeta)


def write_profile(profile: Profile, path: str | os.PathLike[str]) -> None:
    path = os.fspath(path)
    try:
        with open(path, "w", encoding="utf-8") as f:
            if path.endswith(".json"):
                json.dump(
                    {"moestream-profile": VERSION, "meta": profile.meta, "entries": [list(e) for e in profile.entries]},
                    f,
                )
                f.write("\n")
                return
            f.write(f"# moestream-profile: {VERSION}\n")
            for key, value in profile.meta.items():
                f.write(f"# {key}: {json.dumps(value)}\n")
            f.write(HEADER + "\n")
            f.write("".join(f"{layer} {e} {c}\n" for layer, e, c in profile.entries))
    except OSError as exc:
        raise MoestreamError(f"cannot write the profile {path}: {exc.strerror}; pick a writable path") from None


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Read a profile written by `moestream profile` (text or JSON)."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise MoestreamError(f"cannot read the profile {path}: {exc.strerror}; check the path") from None
    bad = f"{path} is not a moestream profile; make one with `moestream profile TRACE -o {path}`"
    if text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
            entries = [(int(a), int(b), int(c)) for a, b, c in doc["entries"]]
            return Profile(entries, dict(doc.get("meta", {})))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise MoestreamError(bad) from None
    meta: dict[str, Any] = {}
    entries = []
    seen_header = False
    for n, line in enumerate(text.splitlines(), 1):
        if parse_meta_line(line, meta):
            continue
        if not line.strip():
            continue
        if not seen_header:
            if line.split() != HEADER.split():
                raise MoestreamError(bad)
            seen_header = True
            continue
        try:
            layer, e, c = (int(x) for x in line.split())
        except ValueError:
            raise MoestreamError(f"{path}:{n}: expected '{HEADER}' numbers, got {line!r}") from None
        entries.append((layer, e, c))
    if not seen_header:
        raise MoestreamError(bad)
    meta.pop("moestream-profile", None)
    return Profile(entries, meta)
