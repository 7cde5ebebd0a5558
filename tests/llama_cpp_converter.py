"""llama.cpp's own converter (convert_hf_to_gguf.py of the llama-cpp-python 0.3.36 sdist) run on a saved tiny
checkpoint, to check a test writer (tests/hf_gguf_*.py) against what it mirrors.

The source: $LLAMA_CPP_SRC (a llama.cpp tree), else the sdist unpacked under MOESTREAM_HOME, fetched once with
pip (`pip download --no-binary`). The converter recognises a BPE tokenizer by hashing how it splits a test
text, and the tiny test vocabulary is in none of its lists; it splits as Qwen2's does, so its pre-tokenizer is
named "qwen2" (`get_vocab_base_pre`, patched in the converter's process), and GLM's vocabulary step (which
looks up GLM's special tokens, absent from it) is the plain GPT-2 one.

Run as a script: python tests/llama_cpp_converter.py SRC CHECKPOINT_DIR [converter options...]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

VERSION = "0.3.36"


def converter_source() -> Path | None:
    """The llama.cpp tree holding convert_hf_to_gguf.py, or None where it cannot be had (no network)."""
    env = os.environ.get("LLAMA_CPP_SRC")
    if env:
        return Path(env) if (Path(env) / "convert_hf_to_gguf.py").is_file() else None
    from moestream.paths import cache_dir

    root = cache_dir() / "llama-cpp-src"
    src = root / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if (src / "convert_hf_to_gguf.py").is_file():
        return src
    root.mkdir(parents=True, exist_ok=True)
    got = subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={VERSION}", "--no-deps",
                          "--no-binary", ":all:", "-d", str(root)], capture_output=True)  # fmt: skip
    sdist = root / f"llama_cpp_python-{VERSION}.tar.gz"
    if got.returncode != 0 or not sdist.is_file():
        return None
    with tarfile.open(sdist) as tar:
        tar.extractall(root, filter="data")
    return src if (src / "convert_hf_to_gguf.py").is_file() else None


def convert(src: Path, checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], outtype: str = "f32") -> None:
    """convert_hf_to_gguf.py CHECKPOINT --outfile OUT --outtype OUTTYPE in a fresh process (its gguf-py)."""
    cmd = [sys.executable, __file__, str(src), str(checkpoint), "--outfile", str(out), "--outtype", outtype]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the converter failed:\n{done.stderr[-3000:]}")


def _main() -> None:
    import runpy

    src = Path(sys.argv[1])
    sys.path[:0] = [str(src), str(src / "gguf-py")]
    import conversion.base as base  # type: ignore[import-not-found]

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
    base.TextModel._set_vocab_glm = base.TextModel._set_vocab_gpt2
    sys.argv = [str(src / "convert_hf_to_gguf.py"), *sys.argv[2:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    _main()
