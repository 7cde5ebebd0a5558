"""The C library's own calls, typed, in one place: mlock/munlock (the dense weights), madvise (committing the
expert cache's memory), malloc_trim/mallopt (the heap), and the address of a buffer handed to the kernel.
Nothing else outside compute/ touches ctypes."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap

import numpy as np
import torch


@functools.cache
def libc() -> ctypes.CDLL:
    """The C library, errno kept for callers that read it. OSError where there is none to load."""
    lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    for name, args, res in (
        ("mlock", [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int),
        ("munlock", [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int),
        ("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int),
        ("malloc_trim", [ctypes.c_size_t], ctypes.c_int),
        ("mallopt", [ctypes.c_int, ctypes.c_int], ctypes.c_int),
    ):
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
    return lib


def has(name: str) -> bool:
    """Whether the C library loads and has this call."""
    try:
        return hasattr(libc(), name)
    except OSError:
        return False


def _errno_of(rc: int) -> int:
    return ctypes.get_errno() if rc != 0 else 0


def mlock(addr: int, n: int) -> int:
    """Lock [addr, addr + n) in RAM: 0, or the errno. OSError/AttributeError where there is no mlock."""
    return _errno_of(libc().mlock(addr, n))


def munlock(addr: int, n: int) -> None:
    libc().munlock(addr, n)


def madvise(addr: int, n: int, advice: int) -> int:
    """madvise [addr, addr + n): 0, or the errno."""
    return _errno_of(libc().madvise(addr, n, advice))


def malloc_trim(pad: int = 0) -> None:
    """Give the heap's free pages back to the OS, where the C library can."""
    if has("malloc_trim"):
        libc().malloc_trim(pad)


def mallopt(param: int, value: int) -> None:
    libc().mallopt(param, value)


def buffer_address(mem: mmap.mmap) -> int:
    """The address of a writable mapping's first byte (for O_DIRECT reads into it)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(mem))


def memory_of(obj: torch.Tensor | np.ndarray) -> tuple[int, int]:
    """(address, nbytes) of the whole memory behind a tensor (its storage) or an array (the array owning its
    memory): what mlock and madvise act on."""
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        return st.data_ptr(), st.nbytes()
    base = obj
    while isinstance(base.base, np.ndarray):
        base = base.base
    return base.ctypes.data, base.nbytes
