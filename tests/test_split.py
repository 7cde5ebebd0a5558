"""Split GGUFs (llama.cpp's gguf-split: NAME-00001-of-0000N.gguf): a model written split runs exactly as the
same model in one file, whoever wrote the parts (moestream synth or the gguf package's own writer), and every
malformed set ends in one line naming the part."""

from __future__ import annotations

import os
import shutil

import gguf
import numpy as np
import pytest

from moestream.analysis.trace import read_trace
from moestream.cli import values
from moestream.cli.main import main
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import Sampler
from moestream.errors import DiskError, ModelFileError
from moestream.formats.gguf_model import GGUFModel
from moestream.streaming.expert_store import is_routed_expert_tensor
from moestream.synth.shapes import write_synth, write_synth_parts

PROMPT = list(range(5, 45))
N = 10
# a tiny Q4_0 expert tensor is ~0.6 MB: every one gets a part of its own, so each expert's gate, up and down
# lie in three files
SPLIT_BYTES = 200_000


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> str:
    return write_synth("tiny", "Q4_0", tmp_path_factory.mktemp("whole") / "tiny.gguf", progress=False)


@pytest.fixture(scope="module")
def split_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("split")
    write_synth_parts("tiny", "Q4_0", d / "tiny.gguf", progress=False, split_max_size=SPLIT_BYTES)
    return str(d)


def _parts(directory: str) -> list[str]:
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".gguf"))


def write_with_gguf_package(src: str, dst: str, max_tensors: int) -> None:
    """The model in `src` as a split set written entirely by the gguf package's GGUFWriter (header, table
    and data): parts of at most max_tensors tensors each."""
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch, split_max_tensors=max_tensors)
    for field in r.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.alignment"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), vtype, sub)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def package_dir(whole, tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("package")
    write_with_gguf_package(whole, str(d / "tiny.gguf"), max_tensors=10)
    return str(d)


def test_synth_writes_a_split_set_whose_experts_span_parts(split_dir, whole):
    parts = _parts(split_dir)
    n = len(parts)
    assert n > 3
    assert [os.path.basename(p) for p in parts] == [f"tiny-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    model, one = GGUFModel(parts[0]), GGUFModel(whole)
    try:
        assert model.paths == parts
        assert set(model.tensors) == set(one.tensors)
        assert model.metadata["tokenizer.ggml.tokens"] == one.metadata["tokenizer.ggml.tokens"]
        expert_parts = {t.part for t in model.tensors.values() if is_routed_expert_tensor(t.name)}
        assert len(expert_parts) > 3
        for name in ("blk.2.ffn_up_exps.weight", "token_embd.weight"):
            assert np.array_equal(model.read(name), one.read(name))
    finally:
        model.close()
        one.close()


def _generate(path: str, n_slots: int, trace: str) -> tuple[list[int], np.ndarray]:
    eng = Engine(path, EngineOptions(n_slots=n_slots, ubatch=8, trace_path=trace))
    try:
        assert eng.reader.run_len > 1  # the prompt's run reads are on
        tokens = eng.generate(PROMPT, N, Sampler()).tokens
    finally:
        eng.close()
    _meta, rows = read_trace(trace)
    # the rows of one step come in the order its reads complete, which the disk decides: compared as a set
    return tokens, np.sort(rows[[n for n in rows.dtype.names if n != "latency_us"]])


@pytest.mark.parametrize("n_slots", [64, 12], ids=["all-cached", "streaming"])
def test_split_sets_give_the_whole_files_output_and_trace(whole, split_dir, package_dir, tmp_path, n_slots):
    want, want_rows = _generate(whole, n_slots, str(tmp_path / "whole.csv"))
    reads = int((want_rows["bytes"] > 0).sum())
    assert reads == 64 if n_slots == 64 else reads > 64  # streaming: experts evicted and read again
    firsts = {
        "synth-first": _parts(split_dir)[0],
        "synth-middle": _parts(split_dir)[4],
        "synth-dir": split_dir,
        "package-first": _parts(package_dir)[0],
    }
    for label, path in firsts.items():
        got, rows = _generate(path, n_slots, str(tmp_path / f"{label}.csv"))
        assert got == want, label
        assert np.array_equal(rows, want_rows), label


def test_a_changed_part_is_noticed(split_dir):
    eng = Engine(split_dir, EngineOptions(n_slots=12))
    try:
        eng.check_model_file()
        third = _parts(split_dir)[2]
        st = os.stat(third)
        os.utime(third, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        try:
            with pytest.raises(DiskError, match=os.path.basename(third)):
                eng.check_model_file()
        finally:
            os.utime(third, ns=(st.st_atime_ns, st.st_mtime_ns))
    finally:
        eng.close()


# ---- malformed sets ----------------------------------------------------------------------------------


def _foreign_part(path: str, no: int, count: int, tensors_count: int, arch: str = "qwen3moe", n: int = 1) -> None:
    """A part that says it is part `no` of `count` but holds n tensors of no model in the set."""
    w = gguf.GGUFWriter(path, arch)
    w.add_uint16("split.no", no)
    w.add_uint16("split.count", count)
    w.add_int32("split.tensors.count", tensors_count)
    for i in range(n):
        w.add_tensor(f"blk.{i}.foreign.weight", np.ones(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _missing(parts: list[str]) -> str:
    os.remove(parts[1])
    return parts[1]


def _extra(parts: list[str]) -> str:
    extra = parts[0].replace(f"-of-{len(parts):05d}", f"-of-{len(parts) + 1:05d}")
    shutil.copy(parts[0], extra)
    return extra


def _out_of_order(parts: list[str]) -> str:
    tmp = parts[1] + ".tmp"
    os.rename(parts[1], tmp)
    os.rename(parts[2], parts[1])
    os.rename(tmp, parts[2])
    return parts[1]


def _other_split(parts: list[str]) -> str:
    d = os.path.dirname(parts[0]) + "-other"
    os.makedirs(d)
    other = _parts(os.path.dirname(write_synth("tiny", "Q4_0", os.path.join(d, "t.gguf"), progress=False,
                                               split_max_size=SPLIT_BYTES * 4)))  # fmt: skip
    assert len(other) != len(parts)
    shutil.copy(other[1], parts[1])
    return parts[1]


def _other_count(parts: list[str]) -> str:
    model = GGUFModel(parts[0])
    want = model.metadata["split.tensors.count"]
    model.close()
    _foreign_part(parts[3], 3, len(parts), want + 1)
    return parts[3]


def _other_tensors(parts: list[str]) -> str:
    model = GGUFModel(parts[0])
    want = model.metadata["split.tensors.count"]
    model.close()
    _foreign_part(parts[3], 3, len(parts), want, n=2)  # in place of a part of one tensor
    return parts[3]


def _other_arch(parts: list[str]) -> str:
    model = GGUFModel(parts[0])
    want = model.metadata["split.tensors.count"]
    model.close()
    _foreign_part(parts[3], 3, len(parts), want, arch="llama")
    return parts[3]


def _truncated(parts: list[str]) -> str:
    os.truncate(parts[2], os.path.getsize(parts[2]) - 4096)
    return parts[2]


MALFORMED = {  # how to break a copy of the set -> what names the culprit; and what the line says
    "missing part": (_missing, "is missing"),
    "extra part": (_extra, "is an extra part"),
    "out of order": (_out_of_order, "out of order"),
    "other split.count": (_other_split, "belongs to a set of"),
    "other tensor count": (_other_count, "belongs to another model: its split.tensors.count differs"),
    "other tensors": (_other_tensors, "split.tensors.count says"),
    "other arch": (_other_arch, "belongs to another model: its general.architecture differs"),
    "truncated part": (_truncated, "truncated"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_set_is_one_line_naming_the_part(split_dir, tmp_path, capsys, case):
    d = str(tmp_path / "set")
    shutil.copytree(split_dir, d)
    parts = _parts(d)
    breaks, says = MALFORMED[case]
    culprit = os.path.basename(breaks(parts))
    for given in (parts[0], parts[-1], d):
        if not os.path.exists(given):
            continue
        with pytest.raises(ModelFileError) as exc:
            GGUFModel(given).close()
        msg = str(exc.value)
        assert "\n" not in msg and culprit in msg and says in msg, msg
    capsys.readouterr()
    rc = main(["run", "-m", parts[0] if os.path.exists(parts[0]) else d, "-p", "hello", "-n", "2"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and culprit in err, err


def test_a_directory_of_two_models_is_one_line(whole, split_dir, tmp_path, capsys):
    d = tmp_path / "two"
    shutil.copytree(split_dir, d)
    shutil.copy(whole, d / "other.gguf")
    rc = main(["run", "-m", str(d), "-p", "hello", "-n", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "holds 2 models" in err and "other.gguf" in err


# ---- synth --split-max-size ---------------------------------------------------------------------------


@pytest.mark.parametrize("text,want", [("2G", 2_000_000_000), ("500M", 500_000_000), ("100k", 100_000), ("7", 7)])
def test_split_max_size_takes_gguf_splits_units(text, want):
    assert values.byte_size(text) == want


@pytest.mark.parametrize("bad", ["0", "-1", "1.5G", "2X", "G", "", "2 G", "99999999999G"])
def test_a_bad_split_max_size_is_one_line(tmp_path, capsys, bad):
    rc = main(["synth", "--shape", "tiny", "-o", str(tmp_path / "t.gguf"), "--split-max-size", bad])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "--split-max-size" in err
    assert not os.listdir(tmp_path)


def test_synth_cli_writes_the_parts(tmp_path, capsys):
    rc = main(["synth", "--shape", "tiny", "--layers", "1", "-o", str(tmp_path / "t.gguf"), "--split-max-size", "1M"])
    assert rc == 0, capsys.readouterr().err
    names = sorted(os.listdir(tmp_path))
    assert len(names) > 1 and names[0] == f"t-00001-of-{len(names):05d}.gguf"
    GGUFModel(str(tmp_path)).close()
