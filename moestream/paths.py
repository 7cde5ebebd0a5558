"""Where moestream keeps what it makes once and reuses (compiled kernels, demo models)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$MOESTREAM_HOME, else $XDG_CACHE_HOME/moestream, else ~/.cache/moestream."""
    home = os.environ.get("MOESTREAM_HOME")
    if home:
        return Path(home)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moestream"
