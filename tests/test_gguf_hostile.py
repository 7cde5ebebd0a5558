"""Hostile GGUF files: the parser refuses each defect class with one clear error, and a seeded fuzz corpus
(tests/fuzz) ends every case in a run or a clean error, never a traceback, a signal, a hang or a runaway."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
import tracemalloc
from dataclasses import replace

import pytest
from gguf import GGUFReader

from moestream.errors import ModelFileError
from moestream.formats.gguf_file import GGUFFile
from tests.fuzz.gguf_cases import ARR, STR, U32, Gguf, _deep_array, encode, load_seeds, make_case, write_seeds
from tests.fuzz.runner import Worker, run_case, run_cli

CORPUS_SEED = 7
CORPUS_CASES = 240


@pytest.fixture(scope="module")
def seed_paths(tmp_path_factory) -> dict[str, str]:
    return write_seeds(str(tmp_path_factory.mktemp("fuzz_seeds")))


@pytest.fixture(scope="module")
def seeds(seed_paths):
    return load_seeds(seed_paths)


@pytest.fixture(scope="module")
def base(seeds) -> Gguf:
    return seeds["qwen3moe-q4_0"][0]


def _refused(tmp_path, data: bytes, *needles: str) -> str:
    p = tmp_path / "bad.gguf"
    p.write_bytes(data)
    with pytest.raises(ModelFileError) as exc:
        GGUFFile(p)
    msg = str(exc.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg
    return msg


def _patched(g: Gguf, what: str, value: int) -> bytes:
    enc = encode(g)
    off, fmt = next((o, f) for w, o, f, _ in enc.fields if w == what)
    b = bytearray(enc.data)
    struct.pack_into(fmt, b, off, value)
    return bytes(b)


def test_seeds_read_as_ggufs_reader_reads_them(seed_paths):
    for path in seed_paths.values():
        ours, theirs = GGUFFile(path), GGUFReader(path)
        assert len(ours.tensors) == len(theirs.tensors)
        for t in theirs.tensors:
            mine = ours.tensors[t.name]
            assert (mine.ggml_type, mine.offset, mine.nbytes) == (int(t.tensor_type), t.data_offset, t.n_bytes)
            assert mine.shape == tuple(int(x) for x in reversed(t.shape.tolist()))


@pytest.mark.parametrize("version", [0, 1, 4, 5, 255, 2**32 - 1])
def test_unsupported_versions_are_refused(tmp_path, base, version):
    _refused(tmp_path, encode(replace(base, version=version)).data, f"GGUF version {version} is not supported")


def test_versions_2_and_3_are_read(tmp_path, base):
    for v in (2, 3):
        p = tmp_path / f"v{v}.gguf"
        p.write_bytes(encode(replace(base, version=v)).data)
        assert len(GGUFFile(p).tensors) == len(base.tensors)


def test_big_endian_file_is_named(tmp_path, base):
    _refused(tmp_path, encode(replace(base, version=0x03000000)).data, "big-endian")


def test_unknown_type_id_names_the_tensor(tmp_path, base):
    name = base.tensors[3].name
    _refused(tmp_path, _patched(base, f"tensor {name}:type", 99), f"tensor {name!r} has unknown type id 99")
    _refused(tmp_path, _patched(base, f"tensor {name}:type", 4), "unknown type id 4")  # Q4_2, long removed
    _refused(tmp_path, _patched(base, f"tensor {name}:type", 2**32 - 1), "unknown type id 4294967295")


def test_rows_not_a_multiple_of_the_block(tmp_path, base):
    t = next(t for t in base.tensors if t.ttype == 2)  # Q4_0, 32 weights a block
    _refused(tmp_path, _patched(base, f"tensor {t.name}:dim0", t.dims[0] + 1), "not a multiple of its block size 32")


@pytest.mark.parametrize(
    ("what", "value", "needle"),
    [
        ("n_dims", 0, "has 0 dimensions"),
        ("n_dims", 5, "has 5 dimensions"),
        ("n_dims", 2**32 - 1, "dimensions (must be 1 to 4)"),
        ("dim0", 0, "a dimension of 0"),
        ("dim1", 2**63, "overflows int64"),
        ("offset", 1, "not a multiple of the alignment"),
        ("offset", 2**63, "truncated"),
        ("name:len", 2**64 - 1, "truncated"),
    ],
)
def test_tensor_table_fields(tmp_path, base, what, value, needle):
    t = next(t for t in base.tensors if len(t.dims) == 2)
    _refused(tmp_path, _patched(base, f"tensor {t.name}:{what}", value), needle)


def test_offsets_overlapping_out_of_order_or_past_the_end(tmp_path, base):
    a, b = base.tensors[1], base.tensors[2]
    overlap = replace(base, tensors=[replace(t, offset=a.offset) if t is b else t for t in base.tensors])
    _refused(tmp_path, encode(overlap).data, f"tensor {b.name!r} has data offset {a.offset}")
    _refused(tmp_path, encode(base).data[:-100], "truncated", "re-download")


def test_duplicate_names_and_keys(tmp_path, base):
    t = base.tensors[0]
    _refused(tmp_path, encode(replace(base, tensors=[t, *base.tensors])).data, f"tensor {t.name!r} appears twice")
    kv = base.kvs[2]
    _refused(tmp_path, encode(replace(base, kvs=[kv, *base.kvs])).data, f"metadata key {kv[0]!r} appears twice")


def test_long_tensor_name(tmp_path, base):
    t = base.tensors[0]
    long = replace(base, tensors=[replace(t, name="x" * 64), *base.tensors[1:]])
    _refused(tmp_path, encode(long).data, "at most 63")


@pytest.mark.parametrize(("align", "needle"), [(0, "power of two"), (3, "power of two"), (2**31, "power of two")])
def test_bad_alignment(tmp_path, base, align, needle):
    g = replace(base, kvs=[*base.kvs, ("general.alignment", U32, align)])
    _refused(tmp_path, encode(g).data, "general.alignment", needle)


def test_alignment_of_the_wrong_kind(tmp_path, base):
    g = replace(base, kvs=[*base.kvs, ("general.alignment", STR, "32")])
    _refused(tmp_path, encode(g).data, "general.alignment must be an integer")


def test_architecture_of_the_wrong_kind(tmp_path, base):
    kvs = [(k, U32, 5) if k == "general.architecture" else (k, t, v) for k, t, v in base.kvs]
    _refused(tmp_path, encode(replace(base, kvs=kvs)).data, "general.architecture must be a string")


def test_deeply_nested_array_is_refused_without_recursion(tmp_path, base):
    kv = struct.pack("<Q", 4) + b"deep" + struct.pack("<I", ARR) + _deep_array(5000)
    _refused(tmp_path, encode(base, raw_kv=kv).data, "'deep' nests arrays more than 4 deep")


@pytest.mark.parametrize(
    ("what", "value", "needle"),
    [
        ("n_kv", 2**64 - 1, "metadata keys"),
        ("n_tensors", 2**40, "tensors, more than"),
        ("kv tokenizer.ggml.tokens:count", 2**62, "claims 4611686018427387904 elements"),
        ("kv tokenizer.ggml.token_type:count", 2**64 - 1, "claims"),
        ("kv general.name:len", 2**64 - 1, "truncated"),
        ("kv general.name:vtype", 13, "unknown value type 13"),
        ("kv tokenizer.ggml.tokens:etype", 2**32 - 1, "array of unknown value type"),
    ],
)
def test_huge_counts_are_refused_before_allocating(tmp_path, base, what, value, needle):
    data = _patched(base, what, value)
    tracemalloc.start()
    try:
        _refused(tmp_path, data, needle)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak  # a header of 23 kB: never gigabytes


@pytest.mark.parametrize(("count", "needle"), [(2**40, "claims"), (2**36, "more than 8388608 elements")])
def test_header_memory_is_bounded_on_a_sparse_terabyte(tmp_path, count, needle):
    p = tmp_path / "sparse.gguf"
    with open(p, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k")
        f.write(struct.pack("<IIQ", ARR, STR, count))
        f.truncate(1 << 40)
    t0 = time.time()
    with pytest.raises(ModelFileError, match=needle):
        GGUFFile(p)
    assert time.time() - t0 < 5


def test_files_that_are_not_files(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "magic").write_bytes(b"GGUF")
    for name, needle in [("fifo", "not a regular file"), ("dir", "a directory"), ("empty", "not a GGUF"),
                         ("magic", "truncated")]:  # fmt: skip
        with pytest.raises(ModelFileError, match=needle):
            GGUFFile(tmp_path / name)
    with pytest.raises(ModelFileError, match="not a regular file"):
        GGUFFile("/dev/zero")


def test_unreadable_file(tmp_path, seed_paths):
    p = tmp_path / "locked.gguf"
    p.write_bytes(open(seed_paths["qwen3moe-q4_0"], "rb").read())
    p.chmod(0)
    drop = "os.setuid(65534); " if os.geteuid() == 0 else ""  # root reads anything
    code = f"import os, sys; from moestream.formats.gguf_file import GGUFFile; {drop}GGUFFile(sys.argv[1])"
    r = subprocess.run([sys.executable, "-c", code, str(p)], capture_output=True, text=True)
    assert r.returncode != 0 and "permission denied" in r.stderr.splitlines()[-1], r.stderr


# ---- the fuzz corpus ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def worker(seed_paths):
    w = Worker(seed_paths["qwen3moe-q4_0"])
    yield w
    w.stop()


@pytest.mark.slow
@pytest.mark.parametrize("index", range(CORPUS_CASES))
def test_fuzz_corpus(index, seeds, worker, tmp_path):
    case = make_case(seeds, CORPUS_SEED, index)
    out = run_case(case, str(tmp_path), worker, timeout=60.0)
    assert out.outcome in ("ok", "clean"), (
        f"{case.family}/{case.kind} on {case.seed_name} ({case.detail}): {out.outcome} {out.detail} in {out.where}; "
        f"reproduce: python tools/fuzz_gguf.py --seed {CORPUS_SEED} --case {index} --keep /tmp/case.gguf"
    )


@pytest.mark.parametrize("special", ["fifo", "header-field"])
def test_cli_ends_in_one_line(special, seeds, tmp_path, base):
    """Through the real command line: exit 2, one `error:` line, in bounded time (a FIFO must not block)."""
    p = tmp_path / "case.gguf"
    if special == "fifo":
        os.mkfifo(p)
    else:
        t = base.tensors[1]
        p.write_bytes(_patched(base, f"tensor {t.name}:type", 99))
    out = run_cli(str(p), timeout=60.0)
    assert out.outcome == "clean", out
    assert "error: " in out.detail
