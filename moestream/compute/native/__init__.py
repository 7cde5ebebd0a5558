"""Loader for the small C library in this folder (pack.c: GGUF bytes -> torch compute forms; the lane kernels).

The library is compiled on first use with the system C compiler into a per-user cache directory,
keyed by a hash of the source, the flags, the compiler and the CPU, so a cache shared between machines
never hands an AVX-512 build to a CPU without it. It is loaded with ctypes.CDLL, which releases the
GIL for the duration of each call: that is what lets reader threads convert experts in parallel.

If there is no compiler, or the build fails, `lib()` returns None, callers use their torch/numpy
path, and we warn once. Set MOESTREAM_NO_NATIVE=1 to force that path.

Every entry point checks its sizes, counts and pointers and returns a negative code when one is out of
range; the ctypes declarations raise ComputeError for it (errcheck), so no caller can overlook a refusal.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moestream.errors import ComputeError
from moestream.paths import cache_dir

log = logging.getLogger(__name__)

_SOURCE_NAMES = (
    "pack.c", "lane_pack.c", "pool.c", "qmm.c", "qmm_vnni.c", "qmm_avx2.c", "ops.c", "mla.c", "deltanet.c", "attn.c",
    "fp8.c",
)  # fmt: skip
SOURCES = tuple(Path(__file__).with_name(n) for n in _SOURCE_NAMES)
HEADERS = tuple(Path(__file__).with_name(n) for n in ("blocks.h", "internal.h", "gemm.h"))
ABI_VERSION = 6
BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fno-strict-aliasing")
# AMD's family 25 (Zen 3 and Zen 4; only Zen 4 has AVX-512) runs the VNNI kernels of the types with one sum
# per (row, token) faster in tiles of 1 row x 8 tokens than in the 2 x 4 chosen on Zen 5 (bench/RESULTS.md,
# "The tile shape on Zen 4")
WIDE_TILE_FAMILIES = {("AuthenticAMD", 25)}

_lock = threading.RLock()  # int4_block() holds it while calling lib()
_libs: dict[tuple[str, ...], ctypes.CDLL | None] = {}
_warned = False
_int4_checked = False
_int4_rows: int | None = None  # int4_block(), once checked
_lane_ok: bool | None = None


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (Linux; empty elsewhere)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block ends
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def _cpu_fingerprint() -> str:
    """What -march=native depends on: the CPU's feature flags (Linux), else the processor name."""
    info = _cpuinfo()
    return info.get("flags") or info.get("Features") or platform.machine() + platform.processor()


def cpu_tuning() -> tuple[str, ...]:
    """Macros that tune the kernels' shapes to this CPU (never their bits), from /proc/cpuinfo (Linux)."""
    info = _cpuinfo()
    try:
        cpu = (info.get("vendor_id", ""), int(info.get("cpu family", "-1")))
    except ValueError:
        return ()
    return ("-DMS_ONE_SUM_TOKENS=8",) if cpu in WIDE_TILE_FAMILIES else ()


def cpu_flags() -> tuple[str, ...]:
    """The CPU-tuned build's flags beside BASE_FLAGS."""
    return ("-march=native", *cpu_tuning())


def _compiler() -> str | None:
    cc = os.environ.get("CC", "cc")
    return shutil.which(cc)


def build_library(flags: Sequence[str], out_dir: Path, cc: str | None = None, source_dir: Path | None = None) -> Path:
    """Compile the C sources with exactly `flags` into out_dir and return the shared library's path.

    The file name is a hash of the sources, flags, compiler and CPU, so an existing build is reused. Tests
    use this for variant builds (a sanitized one); source_dir compiles another checkout's C files instead of
    this package's (bench/micro.py kernel). Raises RuntimeError without a compiler or on a failed build.
    """
    cc = cc or _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC or install gcc/clang)")
    flags = tuple(flags)
    sources = SOURCES if source_dir is None else tuple(sorted(source_dir.glob("*.c")))
    headers = HEADERS if source_dir is None else tuple(sorted(source_dir.glob("*.h")))
    src = b"\0".join(p.read_bytes() for p in (*sources, *headers))
    key = hashlib.sha256(
        b"\0".join([src, " ".join(flags).encode(), cc.encode(), _cpu_fingerprint().encode(), sys.platform.encode()])
    ).hexdigest()[:20]
    target = out_dir / f"moestream_pack_{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # the first run waits on the compiler with nothing else on screen: say why (a cached build says nothing)
    print(f"moestream: compiling the native kernels for this CPU into {out_dir} (once)", file=sys.stderr, flush=True)
    # compile to a private name, then rename: parallel processes never load a half-written file
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=out_dir)
    os.close(fd)
    try:
        cmd = [cc, *flags, "-o", tmp, *map(str, sources), "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load_library(path: Path, only: Sequence[str] | None = None) -> ctypes.CDLL:
    """Load a library made by build_library, its entry points declared (every return code checked). only:
    declare just these entry points (and ms_abi_version), for an older checkout's build that lacks later ones."""
    library = ctypes.CDLL(str(path))
    _declare(library, None if only is None else {"ms_abi_version", *only})
    if library.ms_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{path}: ABI {library.ms_abi_version()} != {ABI_VERSION}")
    return library


# Return codes of the entry points (enum in blocks.h)
BAD_TYPE, BAD_SHAPE, NO_SIMD, NO_MEM, BAD_PTR, NOT_FINITE = -1, -2, -3, -4, -5, -6
_REASONS = {
    BAD_TYPE: "unsupported weight type",
    BAD_SHAPE: "sizes or counts out of range or inconsistent",
    NO_SIMD: "this build has no lane kernels (they need AVX-512 VNNI, or AVX2 + FMA + F16C)",
    NO_MEM: "out of memory",
    BAD_PTR: "a null or misaligned buffer",
    NOT_FINITE: "non-finite values (NaN/inf) in its input",
}


def _check(result: int, func: Any, args: tuple) -> int:
    """ctypes errcheck of each entry point that returns a status or a size: a negative result raises."""
    if result >= 0:
        return result
    shown = ", ".join("*" if t is ctypes.c_void_p else repr(a) for t, a in zip(func.argtypes, args, strict=False))
    reason = _REASONS.get(result, "unknown error")
    raise ComputeError(f"native kernel {func.__name__}({shown}) refused: {reason} (code {result})", result)


def _declare(lib: ctypes.CDLL, only: set[str] | None = None) -> None:
    vp, i64, c_int, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    checked = {  # these return 0 (or a size) and a negative code on error: ctypes raises through _check
        "ms_dequant": ([c_int, vp, i64, vp, c_int], c_int),
        "ms_fp8_block_decode": ([vp, i64, i64, vp, i64, i64, vp, c_int], c_int),
        "ms_fp8_pack": ([vp, i64, i64, vp, i64, vp], c_int),
        "ms_fp8_unpack": ([vp, i64, i64, vp, c_int], c_int),
        "ms_fp8_mm": ([vp, i64, i64, vp, i64, vp], c_int),
        "ms_pack_int4": ([c_int, vp, i64, i64, vp, vp, c_int], c_int),
        "ms_int4_to_bf16": ([vp, vp, i64, i64, i64, i64, vp, c_int], c_int),
        "ms_lane_row_bytes": ([c_int, i64], i64),
        "ms_lane_pack": ([c_int, vp, i64, i64, vp], c_int),
        "ms_lane_pack_many": ([c_int, vp, vp, vp, vp, vp], c_int),
        "ms_lane_unpack": ([c_int, vp, i64, i64, vp], c_int),
        "ms_qmm": ([c_int, vp, i64, i64, vp, i64, i64, vp, i64], c_int),
        "ms_qmm_groups": ([c_int, vp, i64, i64, i64, vp, i64, vp], c_int),
        "ms_qmm_scratch_bytes": ([i64, i64], i64),
        "ms_moe_scratch_bytes": ([i64, i64, i64], i64),
        "ms_moe_ffn": ([c_int, vp, vp, vp, vp, i64, i64, vp, vp, vp], c_int),
        "ms_moe_ffn_clamped": ([c_int, vp, vp, vp, vp, i64, i64, vp, vp, vp, vp, vp, vp, f32, f32, f32], c_int),
        "ms_moe_ffn_gather": ([c_int, vp, vp, vp, vp, i64, i64, vp, i64, vp, vp, vp, vp, vp, vp, f32, f32, f32], c_int),
        "ms_prep_rows": ([vp, i64, i64, vp], c_int),
        "ms_rms_norm": ([vp, vp, i64, i64, f32, vp], c_int),
        "ms_rms_norm_rows": ([vp, vp, i64, i64, f32, vp], c_int),
        "ms_add_weighted_rows": ([vp, i64, i64, vp, vp, vp, i64], c_int),
        "ms_gemv_f32": ([vp, i64, i64, vp, i64, vp], c_int),
        "ms_causal_conv": ([vp, i64, i64, i64, vp, vp], c_int),
        "ms_delta_rule": ([i64, i64, i64, i64, i64, vp, vp, i64, vp, vp, vp, vp, vp], c_int),
        "ms_gemv_bf16": ([vp, i64, i64, vp, i64, vp], c_int),
        "ms_rope_neox": ([vp, i64, i64, i64, i64, vp, vp], c_int),
        "ms_attn_decode": ([vp, vp, vp, i64, i64, i64, i64, c_int, f32, vp], c_int),
        "ms_attn_decode_sinks": ([vp, vp, vp, i64, i64, i64, i64, c_int, f32, vp, vp], c_int),
        "ms_attn_prefill": ([vp, vp, vp, i64, i64, i64, i64, i64, i64, c_int, f32, vp], c_int),
        "ms_route_topk": ([vp, i64, i64, i64, c_int, vp, vp], c_int),
        "ms_mla_decode": (
            [vp, vp, vp, vp, c_int, vp, vp, c_int, vp, i64, i64, i64, i64, i64, i64, i64, f32, vp],
            c_int,
        ),
        "ms_mla_sparse": ([vp, vp, vp, vp, c_int, vp, vp, i64, i64, i64, i64, i64, i64, f32, vp], c_int),
        "ms_topk_positions": ([vp, i64, i64, vp], c_int),
        "ms_index_scores": ([vp, vp, i64, i64, vp, c_int, i64, f32, vp], c_int),
        "ms_attn_block_decode": (
            [vp, vp, i64, f32, c_int, vp, vp, vp, i64, i64, i64, vp, vp, i64, vp, vp, c_int, i64, c_int, vp, vp],
            c_int,
        ),
        "ms_attn_block_decode_rows": (
            [i64, vp, vp, i64, f32, c_int, vp, vp, vp, i64, i64, i64, vp, vp, i64, vp, vp, c_int, vp, c_int, vp, vp],
            c_int,
        ),
    }
    plain = {  # queries and settings that cannot fail
        "ms_abi_version": ([], c_int),
        "ms_has_simd": ([], c_int),
        "ms_lane_supported": ([], c_int),
        "ms_set_threads": ([c_int], c_int),
        "ms_set_spin_us": ([ctypes.c_double], None),
    }
    for table, errcheck in ((checked, _check), (plain, None)):
        for name, (argtypes, restype) in table.items():
            if only is not None and name not in only:
                continue
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = restype
            if errcheck is not None:
                fn.errcheck = errcheck


def _load(extra_flags: tuple[str, ...]) -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC or install gcc/clang)")
    errors = []
    # a CPU-tuned build, then a generic one (some compilers reject -march=native)
    for march in (cpu_flags(), ()):
        flags = (*BASE_FLAGS, *march, *extra_flags)
        for out_dir in (cache_dir(), Path(tempfile.gettempdir()) / f"moestream-{os.getuid()}"):
            try:
                path = build_library(flags, out_dir, cc)
                library = load_library(path)
                log.debug("loaded %s", path)
                return library
            except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
                errors.append(str(exc))
    raise RuntimeError("; ".join(errors))


def lib(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled library, or None when it cannot be built (warns once).

    extra_flags selects a variant build (tests use ("-DMS_SCALAR",) for the portable C path).
    """
    global _warned
    key = tuple(extra_flags)
    if key in _libs:
        return _libs[key]
    with _lock:
        if key in _libs:
            return _libs[key]
        result = None
        override = os.environ.get("MOESTREAM_NATIVE_LIB", "")
        if os.environ.get("MOESTREAM_NO_NATIVE", "") not in ("", "0"):
            reason = "MOESTREAM_NO_NATIVE is set"
        elif override and not key:
            # a variant build_library made (the sanitized build the fuzz tests run the whole engine on)
            result, reason = load_library(Path(override)), ""
        else:
            try:
                result = _load(key)
                reason = ""
            except RuntimeError as exc:
                reason = str(exc)
        if result is None and not _warned:
            _warned = True
            warnings.warn(
                f"moestream: native weight conversion unavailable ({reason}); using the slower torch path",
                RuntimeWarning,
                stacklevel=2,
            )
        _libs[key] = result
        return result


def lane_ok() -> bool:
    """True when the lane-layout kernels run here (see lane_isa); MOESTREAM_NO_LANE=1 turns them off (A/B)."""
    global _lane_ok
    library = lib()
    if library is None:
        return False
    if _lane_ok is None:
        off = os.environ.get("MOESTREAM_NO_LANE", "") not in ("", "0")
        _lane_ok = not off and bool(library.ms_lane_supported())
    return _lane_ok


def lane_isa(library: ctypes.CDLL | None = None) -> str | None:
    """Which lane kernels a library (default: lib()) holds: "avx512-vnni" (qmm_vnni.c), "avx2" (qmm_avx2.c,
    the same results on CPUs without AVX-512) or None."""
    library = library if library is not None else lib()
    if library is None:
        return None
    return {2: "avx512-vnni", 1: "avx2"}.get(library.ms_lane_supported())


def set_threads(n: int) -> int:
    """Threads the native kernels use (the caller plus n - 1 pool workers); returns the count in effect."""
    library = lib()
    return library.ms_set_threads(max(1, n)) if library is not None else 1


def set_spin_us(us: float) -> None:
    """How long idle pool workers spin before sleeping (see pool.c)."""
    library = lib()
    if library is not None:
        library.ms_set_spin_us(us)


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def int4_layout_ok() -> bool:
    """True when our int4 packing matches torch's own packer on this machine (checked once).

    torch's CPU int4 layout depends on the kernels it runs here: blocks of 64 rows with AVX-512, of 32 with
    AVX2 (int4_block), so the C packer is only trusted after it agrees byte for byte at that block.
    """
    return int4_block() is not None


def int4_block() -> int | None:
    """Rows per block of torch's CPU int4 layout here (64 or 32), which ms_pack_int4 and ms_int4_to_bf16
    take; None when the C packer matches neither (the torch packing path is used then)."""
    global _int4_checked, _int4_rows
    if _int4_checked:
        return _int4_rows
    with _lock:
        if not _int4_checked:
            _int4_rows = _check_int4_layout()
            _int4_checked = True
        return _int4_rows


def _check_int4_layout() -> int | None:
    library = lib()
    if library is None:
        return None
    import torch

    n, k = 128, 64
    rng = np.random.default_rng(1234)
    q = rng.integers(0, 16, (n, k), dtype=np.uint8)
    # Q4_0 blocks with d = 1.0: column j of a block is the low nibble of qs[j], j + 16 the high one
    blocks = np.empty((n, k // 32, 18), np.uint8)
    blocks[:, :, 0:2] = np.array([1.0], np.float16).view(np.uint8)
    qb = q.reshape(n, k // 32, 32)
    blocks[:, :, 2:] = qb[:, :, :16] | (qb[:, :, 16:] << 4)
    try:
        ref = torch._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q.astype(np.int32)), 1).numpy()
    except Exception as exc:  # a torch without this op: the int4 path is not usable at all
        log.warning("torch int4 packer unavailable: %s", exc)
        return None
    for rows in (64, 32):
        packed = np.zeros(n * k // 2, np.uint8)
        sz = np.zeros(k // 32 * n * 2, np.uint16)
        if library.ms_pack_int4(2, _ptr(blocks), n, k, _ptr(packed), _ptr(sz), rows) != 0:
            continue
        if not np.array_equal(ref.reshape(-1), packed):
            continue
        # and the kernel reads it back as w = (q - 8) * scale + zero (here scale 1, zero 0)
        w_t = torch.ops.aten._weight_int4pack_mm_for_cpu(
            torch.eye(k, dtype=torch.bfloat16),
            torch.from_numpy(packed).view(n, k // 2),
            32,
            torch.from_numpy(sz).view(torch.bfloat16).view(k // 32, n, 2),
        )
        if torch.equal(w_t.float().T, torch.from_numpy(q).float() - 8):
            return rows
    warnings.warn(
        "moestream: this torch's int4 weight layout differs from the native packer's (blocks of 64 or 32 "
        "rows); using the slower torch packing path",
        RuntimeWarning,
        stacklevel=4,
    )
    return None
