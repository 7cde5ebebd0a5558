"""Lock the dense weights in RAM so the OS cannot evict them (mlock), and say what happened in one line.

Every decode step reads every dense weight (attention, norms, routers, shared experts, the output head), so
a skeleton the kernel may page out under memory pressure turns each token into disk reads, several times
slower. The routed experts are never locked: they live in the budgeted expert cache, which must stay free
to shrink and give RAM back.

The model lists the tensors and numpy arrays it holds (`resident_tensors()`: the dense weights are ours,
allocated while loading, never a mapping of the file); we dedupe them by the memory they sit in and mlock
page-aligned ranges. Locking does not change RSS (the pages are already resident), so the budget counts them once.
A failure to lock never stops the engine: we stop locking, report the bytes that stayed unlocked and which
limit to raise.
"""

from __future__ import annotations

import errno
import mmap
import os
import resource
import weakref
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from moestream.formats.gguf_model import GGUFModel
from moestream.streaming import libc
from moestream.streaming.expert_store import is_routed_expert_tensor
from moestream.units import fmt_bytes

PAGE = mmap.PAGESIZE
CAP_IPC_LOCK = 14  # with it the kernel ignores RLIMIT_MEMLOCK
HINT = "raise `ulimit -l` (memlock in /etc/security/limits.conf, LimitMEMLOCK= for systemd) or run with --no-mlock"


class Resident(Protocol):
    """A model: what it keeps in RAM for the whole run (its weights and tables, not the expert cache)."""

    def resident_tensors(self) -> list[torch.Tensor | np.ndarray]: ...


@dataclass
class LockReport:
    locked_bytes: int = 0
    failed_bytes: int = 0  # dense bytes left unlocked (the limit was too low, or mlock failed)
    skipped_bytes: int = 0  # routed expert bytes in the file: streamed through the cache, never locked
    error: str | None = None  # why some bytes were not locked, and what to raise
    enabled: bool = True  # False: --no-mlock
    _ranges: list[tuple[int, int]] = field(default_factory=list, repr=False)  # page-aligned, locked
    _finalizer: weakref.finalize | None = field(default=None, repr=False)

    def line(self) -> str:
        # routed experts are left out by design: say so, lest their bytes read as a failure to lock
        routed = f"routed experts ({fmt_bytes(self.skipped_bytes)}) stream from disk, deliberately not locked"
        if not self.skipped_bytes:
            routed = "no routed experts (a dense model: every weight is resident)"
        failed = fmt_bytes(self.failed_bytes)
        if not self.enabled:
            return f"mlock: off (--no-mlock); {failed} of dense weights can be evicted; {routed}"
        s = f"mlock: locked {fmt_bytes(self.locked_bytes)} of dense weights, {failed} failed; {routed}"
        return f"{s}; {self.error}" if self.error else s

    def unlock(self) -> None:
        """munlock what we locked (engine close). Also runs by itself when the model is collected, so an
        engine that fails after locking leaves no locked pages behind in the heap."""
        if self._finalizer is not None:
            self._finalizer()
        self._ranges = []


def routed_nbytes(f: GGUFModel) -> int:
    """Bytes of the routed expert tensors in the file (the part streamed, never locked)."""
    return sum(t.nbytes for t in f.tensors.values() if is_routed_expert_tensor(t.name))


def resident_ranges(model: Resident) -> list[tuple[int, int]]:
    """(address, nbytes) of the memory behind every tensor and array the model holds, merged where they overlap.

    A tensor counts with its whole storage (a QLinear's weight and scales share one aligned buffer; a numpy
    view counts with the array that owns its memory).
    """
    spans: list[tuple[int, int]] = []
    for obj in model.resident_tensors():
        if isinstance(obj, torch.Tensor) and (obj.device.type != "cpu" or not obj.numel()):
            continue
        addr, nbytes = libc.memory_of(obj)
        if nbytes:
            spans.append((addr, nbytes))
    return _merge(spans)


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, n in sorted(spans):
        if out and start <= out[-1][0] + out[-1][1]:
            s0, n0 = out[-1]
            out[-1] = (s0, max(n0, start + n - s0))
        else:
            out.append((start, n))
    return out


def _page_range(addr: int, n: int) -> tuple[int, int]:
    start = addr // PAGE * PAGE
    end = (addr + n + PAGE - 1) // PAGE * PAGE
    return start, end - start


def has_cap_ipc_lock() -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    except OSError:
        pass
    return False


def _locked_now() -> int:
    """VmLck: what this process has locked already (it counts against the same limit)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmLck:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _limit_allows(need: int) -> str | None:
    """None if `need` more bytes may be locked (raising the soft limit to the hard one if that is enough),
    else the reason, naming the limit."""
    if has_cap_ipc_lock():
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    want = _locked_now() + need
    if soft == resource.RLIM_INFINITY or soft >= want:
        return None
    if hard == resource.RLIM_INFINITY or hard >= want:
        try:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
            return None
        except (ValueError, OSError):
            pass
    return f"RLIMIT_MEMLOCK is {fmt_bytes(soft)} and the dense weights need {fmt_bytes(need)}: {HINT}"


def lock_dense(model: Resident, routed: int = 0, enabled: bool = True) -> LockReport:
    """mlock every resident tensor of `model`; never raises. `routed`: routed expert bytes (reported as skipped)."""
    ranges = resident_ranges(model)
    total = sum(n for _, n in ranges)
    report = LockReport(skipped_bytes=routed, enabled=enabled)
    if not enabled:
        report.failed_bytes = total  # shown as "can be evicted" in the line
        return report
    if not libc.has("mlock"):  # no C library with mlock (Windows)
        report.failed_bytes, report.error = total, "mlock is not available on this system"
        return report
    pages = sum(_page_range(a, n)[1] for a, n in ranges)
    why = _limit_allows(pages)
    if why is not None:  # do not lock part of it and then fail: say which limit to raise
        report.failed_bytes, report.error = total, why
        return report
    for i, (addr, n) in enumerate(ranges):
        start, length = _page_range(addr, n)
        err = libc.mlock(start, length)
        if err:
            report.failed_bytes = sum(m for _, m in ranges[i:])
            report.error = _mlock_error(err)
            break
        report._ranges.append((start, length))
        report.locked_bytes += n
    if report._ranges:
        report._finalizer = weakref.finalize(model, _munlock, list(report._ranges))
    return report


def _munlock(ranges: list[tuple[int, int]]) -> None:
    for addr, n in ranges:
        libc.munlock(addr, n)


def _mlock_error(err: int) -> str:
    name = errno.errorcode.get(err, str(err))
    if err == errno.EPERM:
        return f"mlock not permitted ({name}; RLIMIT_MEMLOCK is 0 and no CAP_IPC_LOCK): {HINT}"
    if err in (errno.ENOMEM, errno.EAGAIN):
        soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
        limit = "unlimited" if soft == resource.RLIM_INFINITY else fmt_bytes(soft)
        return f"mlock failed ({name}: RLIMIT_MEMLOCK is {limit}, or not enough free RAM): {HINT}"
    return f"mlock failed ({name}: {os.strerror(err)}); run with --no-mlock"
