"""Seeded, structure-aware mutations of tiny GGUF files (the corpus of the GGUF fuzzer).

A seed file is decoded into a `Gguf` (typed metadata, tensor table, data bytes) and encoded back by our
own writer, which records where every field sits; a case is then one of:
  truncation     the file cut at a field boundary or a random byte
  header-flip    random bits or bytes of the header changed
  field          one header field (version, a count, a length, a value, n_dims, a dim, a type id, an
                 offset) overwritten in place with a hostile value
  metadata       the metadata rebuilt: a value of another kind or a hostile value, a key dropped or doubled,
                 general.alignment changed, deeply nested arrays
  tensor-table   the tensor table rebuilt: entries dropped, doubled, renamed, reshaped, retyped, reordered
  data           tensor bytes corrupted: random flips, NaN/inf floats, NaN block scales
  special        files that are not files: empty, a directory, a FIFO, /dev/zero, unreadable, sparse
Each case is reproducible from (seed, index) alone.
"""

from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from moestream.formats.gguf_write import write_gguf
from moestream.formats.tokenizer import build_tiny_bpe_metadata
from moestream.synth import shapes as synth

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
SCALAR_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
              U64: "<Q", I64: "<q", F64: "<d"}  # fmt: skip
INT_TYPES = (U8, I8, U16, I16, U32, I32, U64, I64)
FAMILIES = ("truncation", "header-flip", "field", "metadata", "tensor-table", "data", "special")
SPECIALS = ("empty", "magic-only", "directory", "fifo", "dev-zero", "unreadable", "symlink-loop", "sparse-huge",
            "zeros-after-magic", "not-gguf")  # fmt: skip


@dataclass
class Tensor:
    name: str
    dims: list[int]  # ggml order: dims[0] is the contiguous one
    ttype: int
    offset: int  # relative to the data section


@dataclass
class Gguf:
    version: int
    kvs: list[tuple[str, int, Any]]  # key, value type, value (an array is (element type, list))
    tensors: list[Tensor]
    data: bytes
    alignment: int = 32


@dataclass
class Case:
    family: str
    kind: str  # what was done, enough to name the defect class
    data: bytes | None = None  # the file's bytes; None for special files
    special: str = ""
    seed_name: str = ""
    index: int = 0
    detail: str = ""  # the exact mutation, for a reproducer


@dataclass
class Encoded:
    data: bytes
    fields: list[tuple[str, int, str, int]] = field(default_factory=list)  # (what, offset, struct fmt, value)
    data_start: int = 0


# ---- decoding and encoding ----------------------------------------------------------------------------


def decode(raw: bytes) -> Gguf:
    """A well-formed seed file -> Gguf (no checks: seeds come from our own writer)."""
    pos = 4

    def take(fmt: str) -> Any:
        nonlocal pos
        v = struct.unpack_from(fmt, raw, pos)[0]
        pos += struct.calcsize(fmt)
        return v

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        s = raw[pos : pos + n].decode()
        pos += n
        return s

    def value(vt: int) -> Any:
        if vt == STR:
            return string()
        if vt == ARR:
            et, n = take("<I"), take("<Q")
            return (et, [value(et) for _ in range(n)])
        return take(SCALAR_FMT[vt])

    version, n_t, n_kv = take("<I"), take("<Q"), take("<Q")
    kvs = []
    for _ in range(n_kv):
        k = string()
        vt = take("<I")
        kvs.append((k, vt, value(vt)))
    tensors = []
    for _ in range(n_t):
        name = string()
        nd = take("<I")
        dims = [take("<Q") for _ in range(nd)]
        tensors.append(Tensor(name, dims, take("<I"), take("<Q")))
    align = next((v for k, _, v in kvs if k == "general.alignment"), 32)
    start = (pos + align - 1) // align * align
    return Gguf(version, kvs, tensors, raw[start:], align)


class _Writer:
    def __init__(self) -> None:
        self.buf = bytearray()
        self.fields: list[tuple[str, int, str, int]] = []

    def put(self, fmt: str, v: Any, what: str | None = None) -> None:
        if what is not None:
            self.fields.append((what, len(self.buf), fmt, v))
        self.buf += struct.pack(fmt, v)

    def string(self, s: str | bytes, what: str) -> None:
        b = s.encode() if isinstance(s, str) else s
        self.put("<Q", len(b), f"{what}:len")
        self.buf += b

    def value(self, vt: int, v: Any, what: str) -> None:
        if vt == STR:
            self.string(v, what)
        elif vt == ARR:
            et, items = v
            self.put("<I", et, f"{what}:etype")
            self.put("<Q", len(items), f"{what}:count")
            for i, x in enumerate(items):
                self.value(et, x, f"{what}[{i}]" if i < 2 else None)
        elif what is None:
            self.put(SCALAR_FMT[vt], v)
        else:
            self.put(SCALAR_FMT[vt], v, f"{what}:{'float' if vt in (F32, F64) else 'int'}")


def encode(g: Gguf, n_tensors: int | None = None, n_kv: int | None = None, raw_kv: bytes = b"") -> Encoded:
    """Bytes of `g` (counts overridable; `raw_kv`: one extra key-value pair already encoded) and its fields."""
    w = _Writer()
    w.buf += b"GGUF"
    w.put("<I", g.version, "version")
    w.put("<Q", len(g.tensors) if n_tensors is None else n_tensors, "n_tensors")
    w.put("<Q", len(g.kvs) + bool(raw_kv) if n_kv is None else n_kv, "n_kv")
    for k, vt, v in g.kvs:
        w.string(k, f"key {k}")
        w.put("<I", vt, f"kv {k}:vtype")
        w.value(vt, v, f"kv {k}")
    w.buf += raw_kv
    for t in g.tensors:
        w.string(t.name, f"tensor {t.name}:name")
        w.put("<I", len(t.dims), f"tensor {t.name}:n_dims")
        for i, d in enumerate(t.dims):
            w.put("<Q", d, f"tensor {t.name}:dim{i}")
        w.put("<I", t.ttype, f"tensor {t.name}:type")
        w.put("<Q", t.offset, f"tensor {t.name}:offset")
    align = g.alignment
    start = (len(w.buf) + align - 1) // align * align
    w.buf += bytes(start - len(w.buf))
    return Encoded(bytes(w.buf) + g.data, w.fields, start)


# ---- seeds --------------------------------------------------------------------------------------------

TINY_QWEN35 = replace(
    synth.SHAPES["qwen3.6-35b-a3b"],
    n_layers=2,
    hidden=256,
    n_heads=4,
    n_kv_heads=2,
    head_dim=64,
    n_experts=8,
    top_k=2,
    expert_ffn=256,
    shared_ffn=256,
    context_length=4096,
    lin_k_heads=2,
    lin_v_heads=4,
    lin_head_dim=64,
    rot_dim=16,
    full_attention_interval=2,  # one DeltaNet layer, one attention layer
)


def write_seeds(directory: str) -> dict[str, str]:
    """The tiny valid files every case starts from: qwen3moe in Q4_0 and Q4_K_M, qwen35moe in Q4_0."""
    os.makedirs(directory, exist_ok=True)
    paths = {
        "qwen3moe-q4_0": os.path.join(directory, "qwen3moe-q4_0.gguf"),
        "qwen3moe-q4_k_m": os.path.join(directory, "qwen3moe-q4_k_m.gguf"),
        "qwen35moe-q4_0": os.path.join(directory, "qwen35moe-q4_0.gguf"),
    }
    if not os.path.exists(paths["qwen3moe-q4_0"]):
        synth.write_synth("tiny", "Q4_0", paths["qwen3moe-q4_0"], layers=1, progress=False)
    if not os.path.exists(paths["qwen3moe-q4_k_m"]):
        synth.write_synth("tiny", "Q4_K_M", paths["qwen3moe-q4_k_m"], layers=1, seed=1, progress=False)
    if not os.path.exists(paths["qwen35moe-q4_0"]):
        s, tok = TINY_QWEN35, build_tiny_bpe_metadata()
        vocab = len(tok["tokenizer.ggml.tokens"])
        md = synth.shape_metadata(s, "fuzz-qwen35moe", 2) | tok
        specs = synth.synth_tensors(s, synth.T.Q4_0, synth.T.Q4_0, vocab, 0, False)
        write_gguf(paths["qwen35moe-q4_0"], s.arch, md, specs, progress=False)
    return paths


def load_seeds(paths: dict[str, str]) -> dict[str, tuple[Gguf, Encoded]]:
    out = {}
    for name, p in paths.items():
        g = decode(open(p, "rb").read())
        out[name] = (g, encode(g))
    return out


# ---- hostile values -----------------------------------------------------------------------------------

_MAX = {"<B": 0xFF, "<b": 0x7F, "<H": 0xFFFF, "<h": 0x7FFF, "<I": 2**32 - 1, "<i": 2**31 - 1, "<Q": 2**64 - 1,
        "<q": 2**63 - 1, "<?": 1}  # fmt: skip
_FLOATS = [0.0, -0.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e38, 1e-45, 3.0e38]


def _int_value(rng: np.random.Generator, fmt: str, v: int, size: int) -> int:
    top = _MAX[fmt]
    low = -top - 1 if fmt in ("<b", "<h", "<i", "<q") else 0
    picks = [0, 1, top, top // 2 + 1, v + 1, v - 1, v * 2, v // 2, size, size + 1, 2**32, 2**40, low, -1]
    x = picks[rng.integers(len(picks))]
    return min(max(x, low), top)


def _field_value(rng: np.random.Generator, what: str, fmt: str, v: Any, size: int, g: Gguf) -> Any:
    if fmt in ("<f", "<d"):
        return _FLOATS[rng.integers(len(_FLOATS))]
    kind = what.rsplit(":", 1)[-1]
    if what == "version":
        return int(rng.choice([0, 1, 2, 4, 5, 255, 2**32 - 1, 0x03000000, 0x02000000]))
    if kind in ("vtype", "etype"):
        return int(rng.choice([0, 4, 6, 7, 8, 9, 10, 12, 13, 255, 2**32 - 1]))
    if kind == "type":
        return int(rng.choice([0, 1, 2, 8, 10, 12, 13, 14, 30, 31, 39, 40, 42, 255, 2**32 - 1]))
    if kind == "n_dims":
        return int(rng.choice([0, 1, 2, 3, 5, 64, 2**32 - 1]))
    if kind == "offset":
        other = g.tensors[rng.integers(len(g.tensors))].offset
        return int(rng.choice([v + 1, v + 16, v + g.alignment, max(v - g.alignment, 0), 0, other, size, 2**63]))
    return _int_value(rng, fmt, int(v), size)


# ---- families -----------------------------------------------------------------------------------------


def _truncation(rng, g: Gguf, enc: Encoded) -> Case:
    n = len(enc.data)
    r = rng.random()
    if r < 0.4:
        what, off, fmt, _ = enc.fields[rng.integers(len(enc.fields))]
        cut, kind = off + int(rng.integers(0, struct.calcsize(fmt) + 1)), "at-field"
    elif r < 0.7:
        cut, kind = int(rng.integers(0, enc.data_start)), "in-header"
    elif r < 0.8:
        cut, kind = enc.data_start, "at-data-start"
    else:
        cut, kind = int(rng.integers(enc.data_start, n)), "in-data"
    return Case("truncation", kind, enc.data[:cut], detail=f"cut at byte {cut} of {n}")


def _header_flip(rng, g: Gguf, enc: Encoded) -> Case:
    b = bytearray(enc.data)
    k = int(rng.choice([1, 1, 2, 4, 8, 32]))
    spots = rng.integers(4, enc.data_start, size=k)
    how = "bits" if rng.random() < 0.5 else "bytes"
    for s in spots:
        b[s] = b[s] ^ (1 << int(rng.integers(8))) if how == "bits" else int(rng.integers(256))
    return Case("header-flip", f"{how}", bytes(b), detail=f"{how} at {sorted(int(s) for s in spots)}")


def _field(rng, g: Gguf, enc: Encoded) -> Case:
    what, off, fmt, v = enc.fields[rng.integers(len(enc.fields))]
    new = _field_value(rng, what, fmt, v, len(enc.data), g)
    b = bytearray(enc.data)
    struct.pack_into(fmt, b, off, new)
    kind = what.rsplit(":", 1)[-1] if ":" in what else what
    if kind.startswith("dim"):
        kind = "dim"
    return Case("field", kind, bytes(b), detail=f"{what} = {new!r} (was {v!r})")


def _retyped(rng, vt: int, v: Any) -> tuple[str, int, Any]:
    """A value of another kind, or a hostile value of the same kind."""
    choices = []
    if vt in INT_TYPES or vt == BOOL:
        hostile = _int_value(rng, SCALAR_FMT[vt], int(v), 1 << 20)
        choices += [("int-hostile", vt, hostile), ("int-to-string", STR, str(v)),
                    ("int-to-float", F32, float("nan")), ("int-to-array", ARR, (vt, [v, v]))]  # fmt: skip
    elif vt in (F32, F64):
        choices += [("float-hostile", vt, _FLOATS[rng.integers(len(_FLOATS))]), ("float-to-string", STR, "1e-6"),
                    ("float-to-int", I32, 0), ("float-to-array", ARR, (vt, [v]))]  # fmt: skip
    elif vt == STR:
        choices += [("string-to-int", U32, 7), ("string-to-array", ARR, (STR, [v, v])), ("string-empty", STR, ""),
                    ("string-invalid-utf8", STR, b"\xff\xfe\x80"), ("string-long", STR, "x" * 5000)]  # fmt: skip
    else:
        et, items = v
        choices += [("array-empty", ARR, (et, [])), ("array-to-int", U32, len(items)),
                    ("array-truncated", ARR, (et, items[: len(items) // 2])), ("array-one", ARR, (et, items[:1])),
                    ("array-elems-to-string", ARR, (STR, [str(x) for x in items[:8]])),
                    ("array-elems-to-float", ARR, (F32, [float("nan")] * len(items)))]  # fmt: skip
    return choices[rng.integers(len(choices))]


def _deep_array(depth: int) -> bytes:
    return struct.pack("<IQ", ARR, 1) * depth + struct.pack("<IQI", U32, 1, 7)


def _metadata(rng, g: Gguf, enc: Encoded) -> Case:
    g = replace(g, kvs=list(g.kvs))
    r = rng.random()
    i = int(rng.integers(len(g.kvs)))
    key, vt, v = g.kvs[i]
    if r < 0.55:
        kind, nvt, nv = _retyped(rng, vt, v)
        g.kvs[i] = (key, nvt, nv)
        detail = f"{key}: {kind} -> {nv!r}"[:200]
    elif r < 0.65:
        del g.kvs[i]
        kind, detail = "drop-key", f"dropped {key}"
    elif r < 0.72:
        g.kvs.insert(i, (key, vt, v))
        kind, detail = "duplicate-key", f"doubled {key}"
    elif r < 0.85:
        align = int(rng.choice([0, 1, 3, 8, 64, 100, 4096, 2**31]))
        kind, detail = "alignment", f"general.alignment = {align}"
        g.kvs = [kv for kv in g.kvs if kv[0] != "general.alignment"] + [("general.alignment", U32, align)]
        if align > 0 and align & (align - 1) == 0 and align <= 4096:
            g = _relayout(g, align)
            detail += " (data re-laid out)"
    elif r < 0.92:
        depth = int(rng.choice([2, 5, 100, 5000]))
        kv = struct.pack("<Q", 4) + b"deep" + struct.pack("<I", ARR) + _deep_array(depth)
        return Case("metadata", "nested-array", encode(g, raw_kv=kv).data, detail=f"array nested {depth} deep")
    else:
        kind = "architecture"
        nv = [("general.architecture", STR, "llama"), ("general.architecture", STR, ""),
              ("general.architecture", U32, 5), ("general.architecture", ARR, (STR, ["qwen3moe"]))]  # fmt: skip
        j = next(j for j, kv in enumerate(g.kvs) if kv[0] == "general.architecture")
        g.kvs[j] = nv[rng.integers(len(nv))]
        detail = f"{g.kvs[j]!r}"
    return Case("metadata", kind, encode(g).data, detail=detail)


def _relayout(g: Gguf, align: int) -> Gguf:
    """The same tensors, each at an offset that is a multiple of `align` (the file stays valid)."""
    out, tensors, pos = bytearray(), [], 0
    ends = sorted(t.offset for t in g.tensors)
    for t in g.tensors:
        nxt = next((e for e in ends if e > t.offset), len(g.data))
        chunk = g.data[t.offset : nxt]
        pos = (len(out) + align - 1) // align * align
        out += bytes(pos - len(out)) + chunk
        tensors.append(replace(t, offset=pos))
    return replace(g, tensors=tensors, data=bytes(out), alignment=align)


def _tensor_table(rng, g: Gguf, enc: Encoded) -> Case:
    tensors = [replace(t, dims=list(t.dims)) for t in g.tensors]
    g = replace(g, tensors=tensors)
    i = int(rng.integers(len(tensors)))
    t = tensors[i]
    ops = ["drop", "duplicate", "rename-existing", "rename-long", "rename-empty", "swap-dims", "add-dim",
           "drop-dim", "double-dim", "halve-dim", "retype", "reorder", "same-offset", "count-lie"]  # fmt: skip
    op = ops[rng.integers(len(ops))]
    detail = f"{op} {t.name}"
    if op == "drop":
        del tensors[i]
    elif op == "duplicate":
        tensors.insert(i, replace(t))
    elif op == "rename-existing":
        t.name = tensors[(i + 1) % len(tensors)].name
    elif op == "rename-long":
        t.name = t.name + "x" * 100
    elif op == "rename-empty":
        t.name = ""
    elif op == "swap-dims":
        t.dims.reverse()
    elif op == "add-dim":
        t.dims.insert(int(rng.integers(len(t.dims) + 1)), int(rng.choice([1, 2])))
    elif op == "drop-dim" and len(t.dims) > 1:
        t.dims.pop(int(rng.integers(len(t.dims))))
    elif op == "double-dim":
        t.dims[int(rng.integers(len(t.dims)))] *= 2
    elif op == "halve-dim":
        j = int(rng.integers(len(t.dims)))
        t.dims[j] = max(t.dims[j] // 2, 1)
    elif op == "retype":
        t.ttype = int(rng.choice([0, 1, 2, 8, 10, 12, 14, 30]))
        detail += f" -> type {t.ttype}"
    elif op == "reorder":
        rng.shuffle(tensors)
        g = _relayout(g, g.alignment)
        detail = "tensor table and data shuffled alike (valid)"
    elif op == "same-offset":
        t.offset = tensors[(i + 1) % len(tensors)].offset
    elif op == "count-lie":
        n = int(rng.choice([len(tensors) - 1, len(tensors) + 1, 0]))
        return Case("tensor-table", op, encode(g, n_tensors=n).data, detail=f"n_tensors = {n}")
    return Case("tensor-table", op, encode(g).data, detail=detail)


def _pick_tensor(rng, g: Gguf, pattern: str, types: tuple[int, ...]) -> Tensor | None:
    found = [t for t in g.tensors if pattern in t.name and t.ttype in types]
    return found[rng.integers(len(found))] if found else None


def _data(rng, g: Gguf, enc: Encoded) -> Case:
    b = bytearray(enc.data)
    base = enc.data_start
    r = rng.random()
    if r < 0.4:
        k = int(rng.choice([1, 4, 16, 256]))
        spots = rng.integers(base, len(b), size=k)
        for s in spots:
            b[s] = int(rng.integers(256))
        return Case("data", "random-bytes", bytes(b), detail=f"{k} random bytes in the data at seed-chosen spots")
    pattern = str(rng.choice(["norm", "ffn_gate_inp", "ssm_a", "ssm_dt", "output_norm"]))
    t = _pick_tensor(rng, g, pattern, (0,))
    if r < 0.75 and t is not None:
        n = int(np.prod(t.dims))
        val = float(rng.choice([np.nan, np.inf, -np.inf, 0.0, 1e30]))
        count = int(rng.choice([1, n]))
        arr = np.full(count, val, np.float32)
        at = base + t.offset + 4 * int(rng.integers(n - count + 1))
        b[at : at + 4 * count] = arr.tobytes()
        return Case("data", f"f32-{val}", bytes(b), detail=f"{count} of {t.name} set to {val}")
    t = _pick_tensor(rng, g, "", (2, 8))  # Q4_0 / Q8_0: a block starts with its fp16 scale
    if t is None:
        t = g.tensors[rng.integers(len(g.tensors))]
        b[base + t.offset : base + t.offset + 64] = b"\xff" * 64
        return Case("data", "ff-fill", bytes(b), detail=f"first 64 bytes of {t.name} = 0xff")
    bsize = 18 if t.ttype == 2 else 34
    nblocks = int(np.prod(t.dims)) // 32
    scale = int(rng.choice([0x7E00, 0x7C00, 0xFC00, 0x7BFF]))  # NaN, inf, -inf, the largest fp16
    for blk in rng.integers(nblocks, size=int(rng.choice([1, 8]))):
        struct.pack_into("<H", b, base + t.offset + int(blk) * bsize, scale)
    return Case("data", f"scale-{scale:#06x}", bytes(b), detail=f"block scales of {t.name} = {scale:#06x}")


def _special(rng, g: Gguf, enc: Encoded) -> Case:
    s = SPECIALS[rng.integers(len(SPECIALS))]
    return Case("special", s, special=s, detail=s)


_MAKERS = {"truncation": _truncation, "header-flip": _header_flip, "field": _field, "metadata": _metadata,
           "tensor-table": _tensor_table, "data": _data, "special": _special}  # fmt: skip
# the families weighted by how much of the parser each reaches
WEIGHTS = {"truncation": 2, "header-flip": 2, "field": 4, "metadata": 3, "tensor-table": 3, "data": 2, "special": 1}


def make_case(seeds: dict[str, tuple[Gguf, Encoded]], seed: int, index: int, family: str | None = None) -> Case:
    rng = np.random.default_rng([seed, index])
    fams = list(WEIGHTS)
    p = np.array([WEIGHTS[f] for f in fams], float)
    drawn = fams[rng.choice(len(fams), p=p / p.sum())]  # drawn even when given, so indices reproduce
    fam = family or drawn
    names = sorted(seeds)
    seed_name = names[rng.integers(len(names))]
    g, enc = seeds[seed_name]
    case = _MAKERS[fam](rng, g, enc)
    case.seed_name, case.index = seed_name, index
    return case


def materialize(case: Case, path: str) -> str:
    """Put the case on disk at (or next to) `path`; returns the path to hand the program."""
    _clear(path)
    s = case.special
    if not s:
        with open(path, "wb") as f:
            f.write(case.data)
    elif s == "empty":
        open(path, "wb").close()
    elif s == "magic-only":
        open(path, "wb").write(b"GGUF")
    elif s == "zeros-after-magic":
        open(path, "wb").write(b"GGUF" + bytes(4096))
    elif s == "not-gguf":
        open(path, "wb").write(b"PK\x03\x04" + bytes(100))
    elif s == "directory":
        os.mkdir(path)
    elif s == "fifo":
        os.mkfifo(path)
    elif s == "dev-zero":
        os.symlink("/dev/zero", path)
    elif s == "symlink-loop":
        os.symlink(path, path)
    elif s == "unreadable":
        open(path, "wb").write(b"GGUF" + bytes(100))
        os.chmod(path, 0)
    elif s == "sparse-huge":
        # a valid-looking header claiming a 2^40-element string array, over a sparse 1 TiB file
        with open(path, "wb") as f:
            f.write(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k")
            f.write(struct.pack("<IIQ", ARR, STR, 2**40))
            f.truncate(1 << 40)
    return path


def _clear(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        os.rmdir(path)
    else:
        os.unlink(path)
