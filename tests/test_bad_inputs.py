"""Every bad input ends in one line on stderr that says what is wrong and what to do, exit code 2."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter

from moestream.cli.main import main
from moestream.synth.shapes import write_synth


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("bad") / "tiny.gguf")
    write_synth("tiny", "Q4_0", path, progress=False)
    return path


def _rewrite(src: str, dst: str, arch: str | None = None, retype: dict[str, T] | None = None) -> None:
    """Copy a GGUF, optionally changing its architecture string or declaring tensors of another type."""
    r = GGUFReader(src)
    old_arch = str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8")
    w = GGUFWriter(dst, arch or old_arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        key = name.replace(old_arch + ".", (arch or old_arch) + ".", 1)
        w.add_key_value(key, value, field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None)
    from gguf.constants import GGML_QUANT_SIZES

    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        ttype = retype.get(t.name, t.tensor_type) if retype else t.tensor_type
        block, size = GGML_QUANT_SIZES[ttype]
        rows = int(np.prod(shape[:-1]))
        if ttype == t.tensor_type:
            raw = np.asarray(t.data).view(np.uint8).reshape(rows, -1)
        else:
            raw = np.zeros((rows, shape[-1] // block * size), np.uint8)
        if ttype in (T.F32, T.F16):
            w.add_tensor(t.name, raw.view(np.float32 if ttype == T.F32 else np.float16).reshape(shape))
        else:
            w.add_tensor(t.name, raw.reshape(*shape[:-1], -1), raw_dtype=ttype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _one_line_error(capsys, rc: int, *needles: str) -> str:
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert "Traceback" not in err
    last = err.splitlines()[-1]
    assert last.startswith("error: ")
    for n in needles:
        assert n in last, last
    return last


def run(model: str, *extra: str) -> int:
    return main(["run", "-m", model, "-p", "hello", "-n", "2", *extra])


def test_not_a_gguf(tmp_path, capsys):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"this is not a model" * 100)
    _one_line_error(capsys, run(str(p)), "not a GGUF")


def test_missing_file(tmp_path, capsys):
    _one_line_error(capsys, run(str(tmp_path / "nope.gguf")), "not found")


def test_truncated_gguf(tiny, tmp_path, capsys):
    p = tmp_path / "cut.gguf"
    data = open(tiny, "rb").read()
    p.write_bytes(data[: len(data) * 2 // 3])
    _one_line_error(capsys, run(str(p)), "truncated")


def test_truncated_header(tiny, tmp_path, capsys):
    p = tmp_path / "cut.gguf"
    p.write_bytes(open(tiny, "rb").read()[:200])
    _one_line_error(capsys, run(str(p)))


def test_unsupported_architecture(tiny, tmp_path, capsys):
    p = str(tmp_path / "falcon.gguf")
    _rewrite(tiny, p, arch="falcon")
    _one_line_error(capsys, run(p), "'falcon'", "not supported")


def test_unsupported_weight_type(tiny, tmp_path, capsys):
    p = str(tmp_path / "q8k.gguf")  # Q8_K: llama.cpp's activation type, never a weight's
    _rewrite(tiny, p, retype={"blk.0.attn_q.weight": T.Q8_K})
    _one_line_error(capsys, run(p), "Q8_K")


def test_budget_too_small(tiny, capsys):
    _one_line_error(capsys, run(tiny, "--ram-budget-mb", "100"), "--ram-budget-mb 100 is too small", "at least")


def test_negative_budget(tiny, capsys):
    _one_line_error(capsys, run(tiny, "--ram-budget-mb", "-5"), "positive")


def test_prompt_longer_than_context(tiny, capsys):
    rc = main(["run", "-m", tiny, "-p", "word " * 200, "-n", "2", "--ctx", "32"])
    _one_line_error(capsys, rc, "context", "--ctx")
